"""attention: every runnable backend against the materialised XLA reference.

On CPU the Pallas backends run in their interpreters (FORGEAX_INTERPRET=1) and Triton in Triton's
interpreter (its own target, attention_triton_interpret_test); shapes stay small there. On a GPU
the same file runs the real kernels at the long shapes too (T, S = 1000 and 4096).

A backend that does not implement a feature refuses it through supports(): the test then skips
with that reason (visible in the report), it never compares wrong numbers.
"""

from __future__ import annotations

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import conformance
from forgeax import ops
from forgeax import core as interface

BACKENDS = [b for b in conformance.runnable_backends("attention") if b != "xla"]
ON_CPU = interface.current_platform() == "cpu"
DTYPES = {"f32": jnp.float32, "bf16": jnp.bfloat16, "f16": jnp.float16}
# Attention sums over S keys; a kernel rounds p to the input dtype for the second matmul (as
# FlashAttention does), so half precision gets the looser bound used across the literature.
TOLERANCE = {jnp.dtype(jnp.float32): 1e-4, jnp.dtype(jnp.bfloat16): 2e-2, jnp.dtype(jnp.float16): 5e-3}


def _rng(seed):
    return np.random.default_rng(seed)


def _qkv(B, T, S, N, K, H, dtype, seed, Hv=None):
    rng = _rng(seed)
    cast = lambda a: jnp.asarray(a.astype(np.float32)).astype(dtype)
    return (
        cast(rng.standard_normal((B, T, N, H))),
        cast(rng.standard_normal((B, S, K, H))),
        cast(rng.standard_normal((B, S, K, Hv or H))),
    )


def _attention_with_bias(q, k, v, bias, *, backend, **kwargs):
    return ops.attention(q, k, v, bias=bias, backend=backend, **kwargs)


def _gpu_config(args, kwargs, **changes):
    """pallas_gpu's heuristic AttentionConfig for this call with `changes` (the schedule a test
    forces), so a test runs a kernel variant the defaults would not pick here."""
    from forgeax.kernels.common.attention import AttentionSpec
    from forgeax.kernels.pallas.gpu import attention as pallas_gpu_attention

    left, right = kwargs.get("window") or (None, None)
    spec = AttentionSpec(causal=kwargs.get("causal", False), window_left=left, window_right=right)
    segments = kwargs.get("segment_ids") or (None, None)
    q, k, v = args[:3]
    return pallas_gpu_attention.heuristic_config(q, k, v, None, None, *segments, None, spec=spec).replace(**changes)


def _check(backend, args, kwargs, *, seed=0, config=None):
    """conformance.assert_conforms (which skips, with the backend's reason, what it refuses);
    `config`: the backend's kernel config (the reference takes none)."""
    with_bias = len(args) == 4
    public = _attention_with_bias if with_bias else ops.attention
    run = public if config is None else functools.partial(public, config=config)
    case = conformance.Case(
        f"attention{tuple(args[0].shape)}x{tuple(args[1].shape)}", run,
        functools.partial(public, backend="xla"), tuple(args), kwargs, diff_argnums=tuple(range(len(args))),
        reproducible_backward=kwargs.get("deterministic") is True,
    )
    return conformance.assert_conforms(case, backend, tolerance=TOLERANCE[case.dtype], seed=seed)


# ---------------------------------------------------------------- shapes, masks, dtypes

SHAPES = [(1, 1), (17, 17), (128, 128), (17, 128), (128, 17), (1000, 1000), (4096, 4096), (1000, 4096)]


def _too_big_here(backend, T, S):
    """The interpreters cannot afford T * S of a few million on a 2-core CPU; the GPU runs them all."""
    return ON_CPU and T * S > (1000 * 1000 if backend == "xla_chunked" else 128 * 128)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("T,S", SHAPES, ids=lambda x: str(x))
@pytest.mark.parametrize("backend", BACKENDS)
def test_shapes_match_reference(backend, T, S, causal):
    if _too_big_here(backend, T, S):
        pytest.skip(f"T={T} S={S}: GPU only (interpreter on CPU)")
    args = _qkv(1 if T * S > 10**6 or ON_CPU else 2, T, S, 4, 2, 64, jnp.bfloat16, seed=T + 3 * S + causal)
    _check(backend, args, dict(causal=causal))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("H", [64, 96, 128, 192, 256])
@pytest.mark.parametrize("backend", BACKENDS)
def test_dtypes_and_head_dims(backend, H, dtype):
    if ON_CPU and H > 128 and dtype != "bf16":
        pytest.skip(f"head_dim {H} in bf16 only on CPU (interpreter time)")
    if ON_CPU and backend == "pallas_gpu" and H >= 128:
        # Mosaic GPU's CPU interpreter deadlocks on this kernel when its K/V ring has 2 stages
        # (H >= 128 at the SMEM budget); the same cases pass on the H200 (GPU run of this file).
        pytest.skip("pallas_gpu head_dim >= 128: GPU only (the Mosaic GPU interpreter hangs on a 2-stage ring)")
    args = _qkv(1, 128, 128, 2, 1, H, DTYPES[dtype], seed=H)
    _check(backend, args, dict(causal=True))


@pytest.mark.parametrize("backend", BACKENDS)
def test_deterministic_backward_is_bitwise_reproducible(backend):
    """deterministic=True: every backend's second backward equals the first bit for bit."""
    H, T = (64, 128) if ON_CPU else (128, 1024)
    _check(backend, _qkv(1, T, T, 4, 2, H, jnp.bfloat16, seed=23), dict(causal=True, deterministic=True))


def _documents(B, L, lengths, seed):
    """Packed layout: per row, documents of random lengths around `lengths` (sorted ids)."""
    rng = _rng(seed)
    rows = []
    for _ in range(B):
        cuts = np.sort(rng.choice(np.arange(1, L), size=L // lengths - 1, replace=False))
        rows.append(np.searchsorted(cuts, np.arange(L), side="right"))
    return jnp.asarray(np.stack(rows).astype(np.int32))


# head_dim 128 (the kernels' main tile shapes) at multi-block sizes, on each masking pattern the
# GPU kernels run, with deterministic True and False (cudnn refuses True without the XLA flag).
H128_CASES = {
    "full": (1024, 1024, dict()),
    "causal": (1024, 1024, dict(causal=True)),
    "causal_T<S": (512, 1280, dict(causal=True)),
    "causal_T>S": (1280, 512, dict(causal=True)),  # the first query blocks see no key at all
    "window": (1024, 1024, dict(causal=True, window=(300, 0))),
    "soft_cap": (768, 768, dict(causal=True, logit_soft_cap=20.0)),
    "packed": (1024, 1024, dict(causal=True, segment_ids=(_documents(2, 1024, 200, 1),) * 2)),
}


@pytest.mark.skipif(ON_CPU, reason="GPU only: T*S of a million per head is beyond the interpreters here")
@pytest.mark.parametrize("deterministic", [False, True], ids=["any_order", "deterministic"])
@pytest.mark.parametrize("case", H128_CASES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_head_dim_128_multi_block(backend, case, deterministic):
    T, S, kwargs = H128_CASES[case]
    args = _qkv(2, T, S, 8, 2, 128, jnp.bfloat16, seed=T + S)
    _check(backend, args, dict(kwargs, deterministic=deterministic))


# head_dim 256: pallas_gpu's backward launches dK and dV separately (32- and 64-query blocks) and
# streams 32-key blocks in dQ, each its own tiling; multi-block on the GPU, one CPU case (interpreted).
H256_CASES = {
    "causal": (1024, 1024, dict(causal=True)),
    "full_T<S_unaligned": (520, 1000, dict()),
    "soft_cap": (768, 768, dict(causal=True, logit_soft_cap=30.0)),
    "window": (1024, 1024, dict(causal=True, window=(300, 0))),
    "packed": (1024, 1024, dict(causal=True, segment_ids=(_documents(2, 1024, 200, 1),) * 2)),
    # A per-head bias shared by the batch: Triton's dbias kernel, with its own query block at 256.
    "bias": (1024, 1024, dict(causal=True)),
}


@pytest.mark.parametrize("case", H256_CASES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_head_dim_256_multi_block(backend, case):
    T, S, kwargs = H256_CASES[case]
    if ON_CPU:
        if case != "soft_cap" or backend != "pallas_gpu":
            pytest.skip("GPU only: the interpreters run one small head_dim-256 case (pallas_gpu)")
        T = S = 256
    N = 4 if ON_CPU else 8
    args = _qkv(1 if ON_CPU else 2, T, S, N, 2, 256, jnp.bfloat16, seed=T + 7 * S)
    if case == "bias":
        args += (jnp.asarray(_rng(T).standard_normal((1, N, T, S)).astype(np.float32)),)
    _check(backend, args, kwargs)


# pallas_gpu's persistent kernels (the forward at head_dim 64, 96 and 128, and 192 with v's 128, dK/dV
# without a left window, dQ at head_dim 192 and 256; see heuristic_config in
# kernels/pallas/gpu/attention.py):
# more tiles than the GPU has SMs (16 x 8 kv heads x 2 batches of 128 keys at S = 2048), so CTAs
# run several tiles each from the balanced table (the interpreter runs them with 2 CTAs on small
# shapes). The check covers dq, dk, dv.
PERSISTENT_CASES = {
    "causal": (2048, 2048, dict(causal=True)),
    "full_T<S": (1024, 2048, dict()),
    "causal_T>S": (2048, 1024, dict(causal=True)),
    "window": (2048, 2048, dict(causal=True, window=(300, 0))),
}


@pytest.mark.skipif(ON_CPU or "pallas_gpu" not in BACKENDS, reason="GPU only: hundreds of tiles")
@pytest.mark.parametrize("H,Hv", [(64, 64), (96, 96), (192, 192), (192, 128), (256, 256)],
                         ids=["64", "96", "192", "mla_192_v128", "256"])
@pytest.mark.parametrize("case", PERSISTENT_CASES)
def test_pallas_gpu_persistent(case, H, Hv):
    T, S, kwargs = PERSISTENT_CASES[case]
    _check("pallas_gpu", _qkv(2, T, S, 16, 8, H, jnp.bfloat16, seed=T + 5 * S + H + Hv, Hv=Hv), kwargs)


@pytest.mark.skipif("pallas_gpu" not in BACKENDS, reason="pallas_gpu's persistent kernels with segment ids")
@pytest.mark.parametrize("H,grouped", [(64, True), (64, False), (128, False)], ids=["h64-gqa", "h64-mha", "h128-mha"])
def test_pallas_gpu_persistent_packed(H, grouped):
    """With segment ids the head_dim-64 forward and, without GQA, the head_dim-64/128 dK/dV
    kernel run persistent, tiles dealt in tile order, each tile's blocks read from the data, when
    there are at least 32 heads on the GPU; in the interpreter (2 CTAs) a config forces both
    persistent on a small call (head_dim 64 only: the interpreter cannot afford 128)."""
    config = None
    if ON_CPU:
        if H != 64:
            pytest.skip("the Mosaic GPU interpreter cannot afford head_dim 128 here")
        B, T, N, K, docs = 1, 384, 2, 1 if grouped else 2, 90
    else:
        B, T, N, K, docs = 2, 2048, 32, 8 if grouped else 32, 300
    ids = _documents(B, T, docs, 7)
    args, kwargs = _qkv(B, T, T, N, K, H, jnp.bfloat16, seed=T + N + H), dict(causal=True, segment_ids=(ids, ids))
    if ON_CPU:
        config = _gpu_config(args, kwargs, persistent=True, persistent_dkv=True)
    _check("pallas_gpu", args, kwargs, config=config)


# pallas_gpu runs lengths that are not multiples of 128 over whole tiles of the arrays in place:
# TMA (and the interpreter) zero-fill the rows of a box past the array's end and drop them on
# stores; keys past S are cut by the causal band or, without one, by a column limit (`Tails`).
# Both lengths here exceed one tile, so both the query and the key boxes run past the end; 140 is
# not a multiple of 8, so those arrays are padded to 144 first.
UNALIGNED_CASES = {
    "full_soft_cap": (136, 200, dict(logit_soft_cap=5.0)),
    "causal_T>S_gqa": (200, 136, dict(causal=True)),
    "window_both_sides": (140, 140, dict(window=(40, 30))),
    "packed": (136, 200, dict(segment_ids=(_documents(1, 136, 50, 12), _documents(1, 200, 70, 13)))),
}


@pytest.mark.skipif("pallas_gpu" not in BACKENDS, reason="pallas_gpu's tails")
@pytest.mark.parametrize("case", UNALIGNED_CASES)
def test_pallas_gpu_unaligned_lengths_past_one_tile(case):
    T, S, kwargs = UNALIGNED_CASES[case]
    _check("pallas_gpu", _qkv(1, T, S, 2, 1 if "gqa" in case else 2, 64, jnp.bfloat16, seed=T + 3 * S), kwargs)


# pallas_gpu's forward runs FA3's overlapped schedule at head_dim 128 only, which the Mosaic GPU
# interpreter cannot afford here (see test_dtypes_and_head_dims): on CPU these cases run both
# schedules at head_dim 64 (the GPU runs the overlapped one at 128 in test_head_dim_128_multi_block).
SCHEDULE_CASES = {
    "full_T<S": (128, 256, dict()),
    "causal_T>S": (384, 128, dict(causal=True)),
    "window": (256, 256, dict(causal=True, window=(100, 0))),
    "soft_cap": (256, 256, dict(causal=True, logit_soft_cap=5.0)),
}


# Pairwise, not the full product (16 interpreter runs of about a minute each): every case runs
# both schedules and both grids, every (schedule, grid) pair runs on two cases.
FORWARD_VARIANTS = [
    ("full_T<S", "overlapped", "per_tile"), ("full_T<S", "sequential", "persistent"),
    ("causal_T>S", "sequential", "per_tile"), ("causal_T>S", "overlapped", "persistent"),
    ("window", "overlapped", "persistent"), ("window", "sequential", "per_tile"),
    ("soft_cap", "sequential", "persistent"), ("soft_cap", "overlapped", "per_tile"),
    # The overlapped schedule as one pipeline across each CTA's tiles (flat_forward).
    ("full_T<S", "overlapped", "flat"), ("causal_T>S", "overlapped", "flat"), ("window", "overlapped", "flat"),
]


@pytest.mark.skipif(not ON_CPU or "pallas_gpu" not in BACKENDS, reason="pallas_gpu in its CPU interpreter")
@pytest.mark.parametrize("case,schedule,grid", FORWARD_VARIANTS)
def test_pallas_gpu_forward_schedules_in_interpreter(case, schedule, grid):
    T, S, kwargs = SCHEDULE_CASES[case]
    # K = N in {3, 1, 5, 2, 4}, one per (schedule, grid): shapes no other test traces, so no cached
    # trace of another variant is reused. The interpreter's persistent grid has 2 CTAs.
    heads = {("overlapped", "per_tile"): 3, ("sequential", "per_tile"): 1,
             ("overlapped", "persistent"): 5, ("sequential", "persistent"): 2,
             ("overlapped", "flat"): 4}[schedule, grid]
    args = _qkv(1, T, S, heads, heads, 64, jnp.bfloat16, seed=T + 7 * S)
    config = _gpu_config(args, kwargs, overlap=schedule == "overlapped", persistent=grid != "per_tile",
                         flat_forward=grid == "flat")
    _check("pallas_gpu", args, kwargs, config=config)


# pallas_gpu with segment ids: sorted documents (tiles inside one document skip the segment
# compare: `within_reach`), ids only one side has (fully masked rows and keys), unsorted ids (the
# reach is a superset); both forward schedules; GQA; causal, window and T != S.
SEGMENT_CASES = {
    "causal_documents": (256, 256, dict(causal=True), lambda: (_documents(1, 256, 70, 2),) * 2),
    "q_only_ids_T<S": (128, 384, {}, lambda: (_documents(1, 128, 40, 3) + 10 * (jnp.arange(128) >= 96),
                                              _documents(1, 384, 100, 4))),
    "unsorted_window": (256, 256, dict(causal=True, window=(100, 0)),
                        lambda: tuple(jnp.asarray(_rng(s).integers(0, 3, (1, 256)).astype(np.int32)) for s in (5, 6))),
}


# One schedule per case, not both (6 interpreter runs of about a minute): the overlapped schedule
# meets sorted documents, the sequential one ids only one side has and unsorted ids.
SEGMENT_VARIANTS = [("causal_documents", "overlapped"), ("q_only_ids_T<S", "sequential"),
                    ("unsorted_window", "sequential")]


@pytest.mark.skipif(not ON_CPU or "pallas_gpu" not in BACKENDS, reason="pallas_gpu in its CPU interpreter")
@pytest.mark.parametrize("case,schedule", SEGMENT_VARIANTS)
def test_pallas_gpu_segments_in_interpreter(case, schedule):
    T, S, kwargs, segment_ids = SEGMENT_CASES[case]
    N, K = 4, 2  # each case runs once (no other test traces these shapes and ids)
    args, kwargs = _qkv(1, T, S, N, K, 64, jnp.bfloat16, seed=T + S + N), dict(kwargs, segment_ids=segment_ids())
    _check("pallas_gpu", args, kwargs, config=_gpu_config(args, kwargs, overlap=schedule == "overlapped"))


# pallas_gpu's dK/dV kernel has two step orders (FA3's at head_dim 64, the other at 128:
# dkv_fa3_order), and both backward kernels a persistent and a per-tile grid (persistent_dkv,
# persistent_dq; forced here by a config); the interpreter runs each at
# head_dim 64, with GQA (dK/dV summed over the group), a window and a soft cap.
BACKWARD_ORDER_CASES = {
    "causal_gqa": (256, 256, dict(causal=True)),
    "window_soft_cap_T<S": (128, 384, dict(causal=True, window=(100, 0), logit_soft_cap=5.0)),
}


# Pairwise: each (order, grid) pair once, each case with both orders and both grids.
BACKWARD_VARIANTS = [
    ("causal_gqa", "fa3", "persistent"), ("causal_gqa", "three_waits", "per_tile"),
    ("window_soft_cap_T<S", "fa3", "per_tile"), ("window_soft_cap_T<S", "three_waits", "persistent"),
]


@pytest.mark.skipif(not ON_CPU or "pallas_gpu" not in BACKENDS, reason="pallas_gpu in its CPU interpreter")
@pytest.mark.parametrize("case,order,grid", BACKWARD_VARIANTS)
def test_pallas_gpu_backward_orders_in_interpreter(case, order, grid):
    T, S, kwargs = BACKWARD_ORDER_CASES[case]
    # Head counts no other test of the same case traces (so no cached trace of another variant is
    # reused), groups of 2 and 3. The interpreter's persistent grid has 2 CTAs.
    N, K = {("fa3", "persistent"): (6, 2), ("three_waits", "persistent"): (6, 3),
            ("fa3", "per_tile"): (4, 2), ("three_waits", "per_tile"): (4, 2)}[order, grid]
    args = _qkv(1, T, S, N, K, 64, jnp.bfloat16, seed=T + 3 * S + N)
    persistent = grid == "persistent"
    # Under a left window the dK/dV grid stays per tile (as the heuristic keeps it).
    config = _gpu_config(args, kwargs, dkv_fa3_order=order == "fa3", persistent_dq=persistent,
                         persistent_dkv=persistent and "window" not in kwargs)
    _check("pallas_gpu", args, kwargs, config=config)


@pytest.mark.skipif(not ON_CPU or "pallas_gpu" not in BACKENDS, reason="pallas_gpu in its CPU interpreter")
def test_pallas_gpu_backward_with_xla_delta_in_interpreter():
    """delta_in_dq_kernel off: delta from an XLA reduction, the dQ kernel reads it. Without a
    left window (with one, delta always comes from XLA: the window cases cover that)."""
    T, S, kwargs = BACKWARD_ORDER_CASES["causal_gqa"]
    args = _qkv(1, T, S, 2, 1, 64, jnp.bfloat16, seed=T + 5 * S)
    _check("pallas_gpu", args, kwargs, config=_gpu_config(args, kwargs, delta_in_dq_kernel=False))


@pytest.mark.skipif(not ON_CPU or "pallas_gpu" not in BACKENDS, reason="pallas_gpu in its CPU interpreter")
@pytest.mark.parametrize("case,order,grid", [("causal_gqa", "fa3", "persistent"),
                                             ("window_soft_cap_T<S", "three_waits", "per_tile"),
                                             ("segments", "three_waits", "persistent"), ("unaligned", "fa3", "per_tile")])
def test_pallas_gpu_dq_from_dz_tiles_in_interpreter(case, order, grid):
    """dq from the dz^T tiles of the dK/dV kernel (`_dq_from_dz`), at head_dim 64 here (the GPU
    takes it at 128, where every other test there covers it), with the dz^T store after either
    dK/dV step order. T != S and windows give key blocks whose tiles one warpgroup never wrote
    (under a window the heuristic takes no tiles: slower there, kept correct)."""
    if case == "segments":
        T, S = 200, 300
        kwargs = dict(causal=True, segment_ids=(_segments(1, T, 5, empty_id=1), _segments(1, S, 6)))
    elif case == "unaligned":
        T, S, kwargs = 300, 136, dict(causal=True)
    else:
        T, S, kwargs = BACKWARD_ORDER_CASES[case]
    # Head counts (3 over 1, 6 over 3) no other test traces: no cached trace of the other path.
    N, K = (6, 3) if order == "fa3" else (3, 1)
    args = _qkv(1, T, S, N, K, 64, jnp.bfloat16, seed=T + 11 * S)
    # With segment ids the dq-from-dz^T grid stays per tile.
    config = _gpu_config(args, kwargs, dz_tiles=True, dkv_fa3_order=order == "fa3",
                         persistent_dq_from_dz=grid == "persistent" and case != "segments")
    _check("pallas_gpu", args, kwargs, config=config)


@pytest.mark.skipif("pallas_gpu" not in BACKENDS, reason="pallas_gpu not runnable here")
def test_pallas_gpu_dz_tiles_in_head_chunks():
    """The dz^T backward one chunk of query heads at a time (`dz_chunk_bytes`), here one query
    head per chunk (2 kv heads x groups of 2: kv offsets and a group split across chunks, which
    carries its f32 dk/dv sums): every gradient equals the unchunked one bit for bit. Causal
    T = 200, S = 300 with a soft cap: the carries cover whole key tiles past S."""
    from forgeax.kernels.common.attention import AttentionSpec
    from forgeax.kernels.pallas.gpu import attention_backward
    from forgeax.kernels.pallas.gpu.attention_tiles import tails_of

    kwargs = dict(causal=True, logit_soft_cap=5.0)
    spec = AttentionSpec(causal=True, logit_soft_cap=5.0)
    args = _qkv(1, 200, 300, 4, 2, 64, jnp.bfloat16, seed=29)
    whole = _gpu_config(args, kwargs, dz_tiles=True)
    layout, _ = attention_backward._dz_tiles(spec, tails_of(*args), 1, 4, 2, jnp.bfloat16, whole)
    chunked = whole.replace(dz_chunk_bytes=layout.entries * 128 * 64 * 2, dz_chunk_min_tiles=1)  # one head's tiles
    _, plan = attention_backward._dz_tiles(spec, tails_of(*args), 1, 4, 2, jnp.bfloat16, chunked)
    assert [(c.k0, c.g0) for c in plan] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    ct = jnp.asarray(_rng(3).standard_normal(args[0].shape), jnp.bfloat16)
    grads = lambda config: jax.grad(lambda *a: jnp.sum(ops.attention(*a, backend="pallas_gpu", config=config, **kwargs)
                                                      .astype(jnp.float32) * ct), argnums=(0, 1, 2))(*args)
    for name, a, b in zip("qkv", grads(whole), grads(chunked)):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32), err_msg=f"d{name}")


def _triton_config(args, kwargs, **changes):
    """Triton's heuristic TritonAttentionConfig for this call with `changes` (the tiles or
    schedule a test forces)."""
    from forgeax.kernels.common.attention import AttentionSpec
    from forgeax.kernels.triton.attention import heuristic_config

    left, right = kwargs.get("window") or (None, None)
    spec = AttentionSpec(causal=kwargs.get("causal", False), window_left=left, window_right=right)
    segments = kwargs.get("segment_ids") or (None, None)
    q, k, v = args[:3]
    return heuristic_config(q, k, v, None, None, *segments, None, spec=spec).replace(**changes)


@pytest.mark.skipif("triton" not in BACKENDS, reason="triton not runnable here")
@pytest.mark.parametrize("path", ["dz_tiles", "dq_programs"])
@pytest.mark.parametrize("case", ["causal_gqa", "window_soft_cap_T<S", "segments"])
def test_triton_backward_dq_from_dz_tiles_and_from_its_dq_programs(case, path):
    """Both ways the Triton backward computes dq at head_dim 64: from the dz^T tiles the dK/dV
    programs store (`_dq_kernel`; the default at head_dim 128 while they fit) and from the fused
    kernel's own dQ programs (the default at 64, and past the tiles' budget)."""
    if case == "segments":
        T, S = 40, 130
        kwargs = dict(causal=True, segment_ids=(_segments(1, T, 3, empty_id=1), _segments(1, S, 4)))
    else:
        T, S, kwargs = BACKWARD_ORDER_CASES[case]
    N, K = (5, 1) if path == "dz_tiles" else (6, 3)
    args = _qkv(1, T, S, N, K, 64, jnp.bfloat16, seed=T + 7 * S)
    _check("triton", args, kwargs, config=_triton_config(args, kwargs, dq_from_dz_tiles=path == "dz_tiles"))


@pytest.mark.skipif("triton" not in BACKENDS, reason="triton not runnable here")
def test_triton_dz_tiles_in_head_chunks_equal_one_launch():
    """The dz^T backward one chunk of query heads at a time (`dz_chunk_bytes`), here one query
    head per chunk of 2 kv heads x groups of 2 (kv offsets, and a group split across chunks that
    carries its f32 dk/dv sums): every gradient equals the one-launch backward's bit for bit.
    Causal T = S = 64 at head_dim 64."""
    from forgeax.kernels.triton.attention_backward import dz_tiles_extent

    kwargs = dict(causal=True)
    args = _qkv(1, 64, 64, 4, 2, 64, jnp.bfloat16, seed=31)
    whole = _triton_config(args, kwargs, dq_from_dz_tiles=True)
    rows, cols = dz_tiles_extent(1, 4, 64, 64, jnp.bfloat16, whole)
    chunked = whole.replace(dz_chunk_bytes=rows * cols * 2, dz_chunk_min_programs=1)  # one head's tiles
    ct = jnp.asarray(_rng(4).standard_normal(args[0].shape), jnp.bfloat16)
    grads = lambda config: jax.grad(lambda *a: jnp.sum(ops.attention(*a, backend="triton", config=config, **kwargs)
                                                      .astype(jnp.float32) * ct), argnums=(0, 1, 2))(*args)
    text = jax.jit(grads, static_argnums=0).lower(chunked).as_text()
    assert text.count("optimization_barrier") == 3, "4 chunks, each after the last one's dq"
    for name, a, b in zip("qkv", grads(whole), grads(chunked)):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32), err_msg=f"d{name}")


@pytest.mark.skipif("triton" not in BACKENDS, reason="triton not runnable here")
@pytest.mark.parametrize("tiles", ["small", "wide"])
def test_triton_explicit_config_tiles_match_reference(tiles):
    """An explicit config reaches the kernels (`resolve_config` returns it as is) and other
    tiles than the heuristic's still match the reference: the block bounds, tails and the
    segment ranges per block size follow the config."""
    from forgeax.kernels.triton.attention import ATTENTION

    changes = dict(small=dict(block_m=16, block_n=32, block_m1=32, block_n1=16, block_m2=16, block_n2=32,
                              delta_block_m=16, fwd_stages=2),
                   wide=dict(block_m=64, block_n=64, block_m1=64, block_n1=64, block_m2=64, block_n2=64,
                             fwd_warps=8, bwd_warps=8))[tiles]
    T, S = 70, 100
    kwargs = dict(causal=True, segment_ids=(_segments(1, T, 2), _segments(1, S, 3)))
    args = _qkv(1, T, S, 4, 2, 32, jnp.float32, seed=11)
    config = _triton_config(args, kwargs, **changes)
    assert ATTENTION.resolve_config(args, {}, config, "cpu") == (config, "explicit")
    _check("triton", args, kwargs, config=config)


def test_triton_dz_tiles_extent_rounds_to_blocks_and_keeps_the_budget():
    from forgeax.kernels.triton.attention import TritonAttentionConfig
    from forgeax.kernels.triton.attention_backward import dz_tiles_extent

    config = TritonAttentionConfig(block_m=128, block_n=64, fwd_warps=8, fwd_stages=3, block_m1=64, block_n1=128,
                                   block_m2=128, block_n2=64, bwd_warps=8, bwd_stages=3, delta_block_m=64,
                                   dq_from_dz_tiles=True)
    extent = functools.partial(dz_tiles_extent, config=config)
    assert extent(1, 1, 1000, 130, jnp.bfloat16) == (256, 1024)  # keys to 128s, queries to 128s
    assert extent(4, 32, 4096, 4096, jnp.bfloat16) == (4096, 4096)  # exactly 4 GiB
    assert extent(4, 32, 4096, 4096, jnp.float32) is None
    assert extent(4, 32, 4097, 4096, jnp.bfloat16) is None
    assert extent(1, 1, 65536, 65536, jnp.bfloat16) is None  # int32 offsets inside a head


@pytest.mark.parametrize("ctas", [1, 3, 132])
def test_pallas_gpu_persistent_balance(ctas):
    """The persistent kernels' tile table: every tile exactly once, the first `ctas` tiles on
    distinct CTAs, each CTA's tiles in tile order, and (greedy list scheduling) no CTA more than
    one tile's cost above the lightest."""
    from forgeax.kernels.pallas.gpu.warpgroups import balance

    rng = np.random.default_rng(ctas)
    steps = np.concatenate([np.repeat(np.arange(32, 0, -1), 128), rng.integers(0, 40, 77)])
    table = balance(steps, ctas)
    counts, ids = table[:, 0], table[:, 1:]
    assigned = np.concatenate([ids[c, :n] for c, n in enumerate(counts)])
    np.testing.assert_array_equal(np.sort(assigned), np.arange(len(steps)))
    work = np.array([(steps[ids[c, :n]] + 1).sum() for c, n in enumerate(counts)])
    assert work.max() - work.min() <= steps.max() + 1
    np.testing.assert_array_equal(np.sort(ids[counts > 0, 0]), np.arange(min(ctas, len(steps))))
    for c, n in enumerate(counts):
        assert np.all(np.diff(ids[c, :n]) > 0)


# pallas_tpu runs tiles that every (t, s) passes without the position/tail/segment masks. In the
# interpreter (64 x 128 blocks) these bands and documents span several blocks, so each case has
# full tiles, partial tiles at the band's or documents' edges and skipped tiles; f32, so a tile
# classed full that is not shows up well above the tolerance.
TPU_TILE_CASES = {
    "window_causal": (512, 512, dict(causal=True, window=(300, 0))),
    "window_both_sides_T<S": (384, 512, dict(window=(200, 150))),
    "window_left_only_unaligned": (300, 400, dict(window=(150, None))),
    "packed_causal": (512, 512, dict(causal=True, segment_ids=(_documents(1, 512, 200, 3),) * 2)),
    "packed_T<S_unaligned": (256, 390, dict(segment_ids=(_documents(1, 256, 100, 4), _documents(1, 390, 150, 4)))),
}


@pytest.mark.skipif("pallas_tpu" not in BACKENDS, reason="pallas_tpu runs on CPU in its interpreter")
@pytest.mark.parametrize("case", TPU_TILE_CASES)
def test_pallas_tpu_full_and_partial_tiles(case):
    T, S, kwargs = TPU_TILE_CASES[case]
    _check("pallas_tpu", _qkv(1, T, S, 2, 1, 64, jnp.float32, seed=T + S), kwargs)


@pytest.mark.skipif("pallas_tpu" not in BACKENDS, reason="pallas_tpu runs on CPU in its interpreter")
def test_pallas_tpu_explicit_config_blocks_match_reference():
    """Blocks other than the heuristic's (forward 32 x 256, backward 16 x 128 caps) still match the
    reference: the padding, block skipping and segment reach follow the config's blocks."""
    from forgeax.kernels.pallas.tpu.attention import ATTENTION, PallasTpuAttentionConfig

    config = PallasTpuAttentionConfig(block_q=32, block_k=256, bwd_block_q=16, bwd_block_k=128)
    T, S = 100, 300
    kwargs = dict(causal=True, window=(200, 0), segment_ids=(_segments(1, T, 5), _segments(1, S, 6)))
    args = _qkv(1, T, S, 2, 1, 64, jnp.float32, seed=17)
    assert ATTENTION.resolve_config(args, {}, config, "cpu") == (config, "explicit")
    _check("pallas_tpu", args, kwargs, config=config)


@pytest.mark.parametrize("Hv", [32, 128])
@pytest.mark.parametrize("backend", BACKENDS)
def test_value_head_dim_may_differ(backend, Hv):
    if ON_CPU and backend == "pallas_gpu" and Hv > 64:
        pytest.skip("pallas_gpu pads to head_dim 128 here: GPU only (see test_dtypes_and_head_dims)")
    _check(backend, _qkv(1, 64, 80, 4, 2, 64, jnp.bfloat16, seed=Hv, Hv=Hv), dict(causal=True))


# Head dims the pallas_gpu kernels lack run zero-padded to the next kernel head dim (`Tails` in
# kernels/pallas/gpu/attention_tiles.py), in one copy with any row padding: 80 (96), 160 (192); and on CPU
# the same padding into the head_dim-64 and -96 kernels the interpreter affords, with lengths that
# also pad rows (T 100: a copy; 136: whole tiles in place). 96 has kernels of its own: checked
# padding-free here too. A v narrower than q/k runs at its own (padded) head dim
# (`_kernel_head_dims`): MLA's q/k 192 with v 128, and 128 / 64 (the overlapped forward); on CPU
# 96 / 64, and 96 / 40 (v padded to 64).
PADDED_HEAD_DIMS = ({"H40_v32": (40, 32, 100, dict(causal=True)), "H48": (48, 48, 136, dict(causal=True)),
                     "H56_v64_segments": (56, 64, 136, dict(causal=True, segments=True)),
                     "H80_v72": (80, 72, 136, dict(causal=True)), "H96_segments": (96, 96, 136, dict(causal=True, segments=True)),
                     "H96_v64": (96, 64, 136, dict(causal=True)),
                     "H96_v40_segments": (96, 40, 100, dict(causal=True, segments=True))}
                    if ON_CPU else
                    {"mla_H192_v128": (192, 128, 1000, dict(causal=True)), "H96": (96, 96, 1000, dict(causal=True)),
                     "H96_segments": (96, 96, 1000, dict(causal=True, segments=True)),
                     "H80_segments": (80, 80, 1000, dict(causal=True, segments=True)),
                     "H160": (160, 160, 1000, dict(causal=True)),
                     "mla_gqa_window": (192, 128, 1000, dict(causal=True, window=(300, 0))),
                     "mla_segments": (192, 128, 1000, dict(causal=True, segments=True)),
                     "H128_v64": (128, 64, 1000, dict(causal=True)),
                     "H128_v96_full": (128, 96, 1000, dict()),
                     "H192_v64_soft_cap": (192, 64, 1000, dict(causal=True, logit_soft_cap=30.0))})


@pytest.mark.parametrize("case", PADDED_HEAD_DIMS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_padded_head_dims(backend, case):
    H, Hv, T, kwargs = PADDED_HEAD_DIMS[case]
    kwargs = dict(kwargs)
    N, K = (4, 2) if "gqa" in case or ON_CPU else (4, 4)
    if kwargs.pop("segments", False):
        ids = _documents(1, T, 40, seed=H)
        kwargs["segment_ids"] = (ids, ids)
    _check(backend, _qkv(1, T, T, N, K, H, jnp.bfloat16, seed=H + Hv, Hv=Hv), kwargs)


@pytest.mark.parametrize("N,K", [(8, 8), (8, 2), (8, 1)], ids=["mha", "gqa4", "mqa8"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_grouped_query_attention(backend, N, K):
    _check(backend, _qkv(BATCH, 64, 96, N, K, 64, jnp.bfloat16, seed=N * K), dict(causal=True))


def _segments(B, L, seed, *, empty_id=None):
    """Random packed layout: sorted runs of ids, some segments absent from the other side."""
    rng = _rng(seed)
    ids = np.sort(rng.integers(0, 4, (B, L)), axis=1).astype(np.int32)
    if empty_id is not None:
        ids[ids == empty_id] = 9  # q side has segment 9 that kv never has -> fully masked rows
    return jnp.asarray(ids)


def _features(B, T, S, N, seed):
    rng = _rng(seed)
    return {
        "causal": dict(causal=True),
        "window": dict(window=(13, 5)),
        "window_causal": dict(window=(20, 0), causal=True),
        "window_left_only": dict(window=(7, None)),
        "soft_cap": dict(logit_soft_cap=5.0, scale=0.5),
        "segments": dict(segment_ids=(_segments(B, T, seed, empty_id=1), _segments(B, S, seed + 1))),
        "mask": dict(mask=jnp.asarray(rng.random((B, 1, T, S)) < 0.7)),
        "mask_per_head": dict(mask=jnp.asarray(rng.random((1, N, T, S)) < 0.5)),
        "dropout": dict(dropout_rate=0.25, dropout_key=jax.random.key(seed)),
        "combined": dict(
            causal=True, window=(40, 0), logit_soft_cap=8.0,
            segment_ids=(_segments(B, T, seed), _segments(B, S, seed + 2)),
            mask=jnp.asarray(rng.random((B, N, T, S)) < 0.9),
            dropout_rate=0.1, dropout_key=jax.random.key(seed + 1),
        ),
    }


FEATURES = list(_features(1, 2, 2, 1, 0))


# T < S exercises the causal/window alignment and the key tail; the GPU also runs a square case.
FEATURE_SHAPES = {"T<S": (40, 130)} if ON_CPU else {"square": (96, 96), "T<S": (40, 130)}
# The interpreters pay per element: batch 1 on CPU.
BATCH = 1 if ON_CPU else 2


@pytest.mark.parametrize("feature", FEATURES)
@pytest.mark.parametrize("shape", FEATURE_SHAPES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_features_match_reference(backend, shape, feature):
    (T, S), B, N, K = FEATURE_SHAPES[shape], BATCH, 4, 2
    _check(backend, _qkv(B, T, S, N, K, 64, jnp.bfloat16, seed=T + S), _features(B, T, S, N, seed=T * S)[feature])


def test_segment_ranges_cover_every_shared_column_and_only_the_span_of_sorted_ids():
    from forgeax.kernels.common.attention import segment_ranges

    rng = _rng(21)
    uniform_blocks = 0
    cases = [(100, 130, 32, 6, True), (64, 64, 16, 6, True), (50, 70, 16, 6, False), (7, 5, 32, 6, True),
             (256, 200, 16, 3, True)]  # the last: long runs, many blocks inside one segment
    for R, C, block, ids_, sort in cases:
        rows = rng.integers(0, ids_, (3, R)).astype(np.int32)
        cols = rng.integers(0, ids_, (3, C)).astype(np.int32)
        if sort:
            rows, cols = np.sort(rows, 1), np.sort(cols, 1)
        got = np.asarray(segment_ranges(jnp.asarray(rows), jnp.asarray(cols), block))
        assert got.shape == (3, -(-R // block), 3)
        for b in range(3):
            for i in range(got.shape[1]):
                ids = rows[b, i * block:(i + 1) * block]
                shared = np.flatnonzero(np.isin(cols[b], ids))  # columns some row of the block attends
                lo, hi, uniform = got[b, i]
                assert np.all((shared >= lo) & (shared < hi)), (b, i, lo, hi, shared)
                one_id = ids.min() == ids.max()
                assert uniform == (one_id and hi > lo and np.all(cols[b, lo:hi] == ids[0]) and
                                   np.sum(cols[b] == ids[0]) == hi - lo)
                reach = np.flatnonzero((cols[b] >= ids.min()) & (cols[b] <= ids.max()))
                assert (lo, hi) == ((reach[0], reach[-1] + 1) if reach.size else (C, 0))
                if sort:  # sorted ids: the range holds nothing but columns in the ids' span
                    assert hi <= lo or np.all(np.isin(np.arange(lo, hi), reach))
                uniform_blocks += int(uniform)
    assert uniform_blocks > 10  # the uniform flag was exercised


# Backends whose loops skip the key/query blocks that no segment of a block reaches.
SEGMENT_SKIPPING = {"triton", "pallas_gpu", "pallas_tpu"}


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("backend", [b for b in BACKENDS if b in SEGMENT_SKIPPING])
def test_packed_segments_never_visit_blocks_between_documents(backend, causal):
    # Keys of segment 5 (no query has it) are NaN: one visit of their blocks, masked or not,
    # makes NaN (0 * NaN) in out, dq, dk or dv. The reference sees zeros there instead.
    B, T, S, N, K = 1, 256, 384, 2, 1
    q, k, v = _qkv(B, T, S, N, K, 64, jnp.bfloat16, seed=31)
    q_seg = jnp.asarray(np.repeat(np.arange(4), 64)[None].astype(np.int32))
    # Documents 0..3, then keys of segment 5: past the reach of every query block of any size.
    kv_seg = jnp.asarray(np.concatenate([np.repeat(np.arange(4), 64), np.full(128, 5)])[None].astype(np.int32))
    dead = np.asarray(kv_seg[0] == 5)
    poison = lambda x: x.at[:, dead].set(jnp.nan)
    kwargs = dict(segment_ids=(q_seg, kv_seg), causal=causal)

    def loss(q, k, v, backend):
        out = ops.attention(q, k, v, backend=backend, **kwargs).astype(jnp.float32)
        return jnp.sum(out * jnp.cos(out)), out

    try:
        (_, out), grads = jax.value_and_grad(loss, (0, 1, 2), has_aux=True)(q, poison(k), poison(v), backend)
    except interface.UnsupportedError as e:
        pytest.skip(str(e))
    clean = lambda x: x.at[:, dead].set(0.0)
    (_, want), want_grads = jax.value_and_grad(loss, (0, 1, 2), has_aux=True)(q, clean(k), clean(v), "xla")
    for name, got, ref in zip(("out", "dq", "dk", "dv"), (out, *grads), (want, *want_grads)):
        assert bool(jnp.all(jnp.isfinite(got))), f"{name}: a skipped block was visited"
        assert conformance.relative_error(got, ref) < TOLERANCE[jnp.dtype(jnp.bfloat16)], name


@pytest.mark.parametrize("backend", BACKENDS)
def test_segment_ids_at_the_int32_extremes_with_unaligned_lengths(backend):
    # pallas_gpu pads unaligned lengths at the end, the padded ids copying the last one (here the
    # int32 extremes; an earlier front padding needed an id outside the query ids' range).
    B, T, S, N, K = 1, 40, 130, 2, 1
    lo, hi = np.iinfo(np.int32).min, np.iinfo(np.int32).max
    q_seg = jnp.asarray(np.where(np.arange(T) < 25, lo, 7)[None].astype(np.int32))
    kv_seg = jnp.asarray(np.where(np.arange(S) < 60, lo, np.where(np.arange(S) < 100, 7, hi))[None].astype(np.int32))
    _check(backend, _qkv(B, T, S, N, K, 64, jnp.bfloat16, seed=29), dict(causal=True, segment_ids=(q_seg, kv_seg)))


@pytest.mark.parametrize("backend", BACKENDS)
def test_unsorted_segment_ids_match_reference(backend):
    # Ids that are not sorted runs: the segment ranges of a block are then a superset, never a cut.
    B, T, S, N, K = 1, 128, 256, 2, 2  # multiples of 128: pallas_gpu runs it too
    rng = _rng(17)
    q_seg = jnp.asarray(rng.integers(0, 3, (B, T)).astype(np.int32))
    kv_seg = jnp.asarray(rng.integers(0, 3, (B, S)).astype(np.int32)).at[:, :40].set(1)
    _check(backend, _qkv(B, T, S, N, K, 64, jnp.bfloat16, seed=19), dict(segment_ids=(q_seg, kv_seg)))


BIAS_SHAPES = {
    "full": lambda B, N, T, S: (B, N, T, S),
    "shared_batch": lambda B, N, T, S: (1, N, T, S),
    "shared_heads": lambda B, N, T, S: (B, 1, T, S),
    "shared": lambda B, N, T, S: (1, 1, T, S),
}


def _bias(shape, seed):
    return jnp.asarray(_rng(seed).standard_normal(shape).astype(np.float32)).astype(jnp.bfloat16)


@pytest.mark.parametrize("bias_shape", BIAS_SHAPES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_bias_and_its_gradient(backend, bias_shape):
    B, T, S, N, K = 2, 48, 72, 4, 2
    bias = _bias(BIAS_SHAPES[bias_shape](B, N, T, S), seed=5)
    _check(backend, (*_qkv(B, T, S, N, K, 64, jnp.bfloat16, seed=7), bias), dict(causal=True))


@pytest.mark.parametrize("bias_shape", ["full", "shared"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_bias_gradient_with_every_other_feature(backend, bias_shape):
    # Several query and key blocks (skipped, partial and full tiles), documents, a window, the
    # soft cap (dbias takes dz before its factor) and dropout, under GQA; "shared" sums over
    # both batch and heads. Small: the interpreters pay per grid step.
    B, T, S, N, K = 2, 160, 260, 2, 1
    q_seg, kv_seg = _documents(B, T, 70, 8), _documents(B, S, 110, 9)
    kwargs = dict(causal=True, window=(150, 0), logit_soft_cap=8.0, segment_ids=(q_seg, kv_seg),
                  dropout_rate=0.1, dropout_key=jax.random.key(3))
    bias = _bias(BIAS_SHAPES[bias_shape](B, N, T, S), seed=6)
    _check(backend, (*_qkv(B, T, S, N, K, 64, jnp.bfloat16, seed=11), bias), kwargs)


@pytest.mark.parametrize("backend", BACKENDS)
def test_t_greater_than_s_aligns_last_query_to_last_key(backend):
    # T > S with causal: the first T - S queries see no key at all (fully masked rows).
    args = _qkv(1, 40, 24, 2, 2, 64, jnp.float32, seed=3)
    out, _ = _check(backend, args, dict(causal=True))
    assert float(jnp.abs(out[:, :16]).max()) == 0.0


# ---------------------------------------------------------------- semantics every backend shares


def _all_backends():
    return ["xla", *BACKENDS]


@pytest.mark.parametrize("backend", _all_backends())
def test_fully_masked_rows_give_zero_output_zero_gradient_and_minus_inf_lse(backend):
    B, T, S, N = 1, 32, 48, 2
    q, k, v = _qkv(B, T, S, N, N, 64, jnp.float32, seed=11)
    q_seg = jnp.zeros((B, T), jnp.int32).at[:, ::3].set(7)  # segment 7 exists only on the q side
    kv_seg = jnp.zeros((B, S), jnp.int32)
    kwargs = dict(segment_ids=(q_seg, kv_seg), return_lse=True, backend=backend)
    try:
        out, lse = ops.attention(q, k, v, **kwargs)
    except interface.UnsupportedError as e:
        pytest.skip(str(e))
    dead = np.asarray(q_seg[0] == 7)
    assert float(jnp.abs(out[:, dead]).max()) == 0.0
    assert bool(jnp.all(lse[:, dead] == -jnp.inf)) and bool(jnp.all(jnp.isfinite(lse[:, ~dead])))
    grads = jax.grad(lambda q, k, v: jnp.sum(ops.attention(q, k, v, **{**kwargs, "return_lse": False}) ** 2), (0, 1, 2))(q, k, v)
    assert all(bool(jnp.all(jnp.isfinite(g))) for g in grads)
    assert float(jnp.abs(grads[0][:, dead]).max()) == 0.0


@pytest.mark.parametrize("backend", _all_backends())
def test_lse_and_its_gradient_match_reference(backend):
    q, k, v = _qkv(2, 33, 65, 4, 1, 64, jnp.float32, seed=13)
    w = jnp.asarray(_rng(1).standard_normal((2, 33, 4)).astype(np.float32))

    def loss(q, k, v, backend):
        out, lse = ops.attention(q, k, v, causal=True, return_lse=True, backend=backend)
        return jnp.sum(out) * 0.1 + jnp.sum(lse * w)

    try:
        got = jax.jit(jax.value_and_grad(functools.partial(loss, backend=backend), (0, 1, 2)))(q, k, v)
    except interface.UnsupportedError as e:
        pytest.skip(str(e))
    want = jax.value_and_grad(functools.partial(loss, backend="xla"), (0, 1, 2))(q, k, v)
    assert conformance.relative_error(got[0], want[0]) < 1e-4
    for g, r in zip(got[1], want[1]):
        assert conformance.relative_error(g, r) < 1e-3


@pytest.mark.parametrize("backend", _all_backends())
def test_lse_gradient_at_kernel_tile_sizes(backend):
    """As above in bf16 at multiples of 128 with GQA, where pallas_gpu runs (its dQ kernel folds
    the lse cotangent into delta = rowsum(dout * out) - dlse)."""
    q, k, v = _qkv(1, 256, 384, 4, 2, 64, jnp.bfloat16, seed=19)
    w = jnp.asarray(_rng(2).standard_normal((1, 256, 4)).astype(np.float32))

    def loss(q, k, v, backend):
        out, lse = ops.attention(q, k, v, causal=True, return_lse=True, backend=backend)
        return jnp.sum(out.astype(jnp.float32)) * 0.1 + jnp.sum(lse * w)

    try:
        got = jax.jit(jax.grad(functools.partial(loss, backend=backend), (0, 1, 2)))(q, k, v)
    except interface.UnsupportedError as e:
        pytest.skip(str(e))
    up = lambda a: a.astype(jnp.float32)
    want = jax.grad(lambda q, k, v: loss(q, k, v, "xla"), (0, 1, 2))(up(q), up(k), up(v))
    for g, r in zip(got, want):
        assert conformance.relative_error(g, r) < TOLERANCE[jnp.dtype(jnp.bfloat16)]


@pytest.mark.parametrize("backend", _all_backends())
def test_dropout_is_deterministic_given_the_key_and_drops_the_right_fraction(backend):
    q, k, v = _qkv(1, 64, 64, 2, 2, 64, jnp.float32, seed=17)
    run = lambda key: ops.attention(q, k, v, dropout_rate=0.5, dropout_key=key, backend=backend)
    try:
        a, b, c = run(jax.random.key(1)), run(jax.random.key(1)), run(jax.random.key(2))
    except interface.UnsupportedError as e:
        pytest.skip(str(e))
    assert bool(jnp.all(a == b)) and not bool(jnp.all(a == c))
    # The keep-mask is the contract's hash: compare its keep fraction (1 - rate) on this shape.
    from forgeax.kernels.common.attention import dropout_keep_numpy
    idx = np.meshgrid(np.arange(1), np.arange(2), np.arange(64), np.arange(64), indexing="ij")
    assert abs(dropout_keep_numpy(12345, *idx, 2, 1 << 23).mean() - 0.5) < 0.02


def _assert_transformations_match_xla(backend, args, in_axes, tolerance):
    """jit(vmap(value_and_grad(checkpoint(loss)))) of causal ops.attention on `backend` equals it on xla.

    args = (q, k, v[, bias]); the vmapped ones carry a leading batch axis and each call sees one
    element as a batch of 1 (q[None]). Skips with the backend's reason if it refuses the call.
    """

    def loss(backend, q, k, v, *bias):
        out = ops.attention(q[None], k[None], v[None], bias=bias[0] if bias else None, causal=True, backend=backend)
        return jnp.sum(jnp.sin(out.astype(jnp.float32)))

    def batched(backend):
        fn = jax.checkpoint(functools.partial(loss, backend))
        return jax.jit(jax.vmap(jax.value_and_grad(fn, tuple(range(len(args)))), in_axes=in_axes))(*args)

    try:
        got = batched(backend)
    except interface.UnsupportedError as e:
        pytest.skip(str(e))
    want = batched("xla")
    for g, r in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert conformance.relative_error(g, r) < tolerance


@pytest.mark.parametrize("backend", _all_backends())
def test_jit_grad_vmap_checkpoint(backend):
    B, T, S, N, K = 3, 40, 56, 4, 2
    q, k, v = _qkv(B, T, S, N, K, 64, jnp.float32, seed=19)
    bias = jnp.asarray(_rng(2).standard_normal((1, N, T, S)).astype(np.float32))
    _assert_transformations_match_xla(backend, (q, k, v, bias), (0, 0, 0, None), 1e-4)
    # Extra leading batch dims go through the op directly too.
    q5, k5, v5 = (a.reshape((1,) + a.shape) for a in (q, k, v))
    got = ops.attention(q5, k5, v5, causal=True, backend=backend)
    assert conformance.relative_error(got[0], ops.attention(q, k, v, causal=True)) < 1e-4


@pytest.mark.skipif(ON_CPU, reason="GPU only: the 16-bit kernel paths at sizes beyond the interpreters here")
@pytest.mark.parametrize("backend", BACKENDS)
def test_jit_grad_vmap_checkpoint_bf16(backend):
    """The same transformations on the bf16, T == S, no-bias path (the one cudnn and pallas_gpu take)."""
    B, T, N, K = 2, 256, 4, 2
    q, k, v = _qkv(B, T, T, N, K, 128, jnp.bfloat16, seed=29)
    _assert_transformations_match_xla(backend, (q, k, v), 0, TOLERANCE[jnp.dtype(jnp.bfloat16)])


# backend=None on a Hopper GPU: (N, K, H, options) -> (backend of a call that is not differentiated,
# backend of its forward and backward under a gradient; None = the same one). See
# ops/rules/attention.json for the measurements behind the split.
DEFAULT_SPLIT_CASES = {
    # rule causal-gqa-head-dim-128: pallas_gpu for both under GQA at causal head_dim 128 (its dz^T tiles fit).
    "gqa": (8, 2, 128, dict(causal=True), ("pallas_gpu", None)),
    "window": (4, 4, 128, dict(causal=True, window=(100, 0)), ("pallas_gpu", "cudnn")),
    "head_dim_256": (4, 4, 256, dict(causal=True), ("cudnn", None)),
    # rule causal-mha-head-dim-128: the same for MHA up to 4 GiB of scores.
    "causal_mha": (4, 4, 128, dict(causal=True), ("pallas_gpu", None)),
    "full_gqa": (8, 2, 128, dict(), ("cudnn", None)),
    # rule causal-head-dim-64: pallas_gpu for both at causal head_dim 64 without a window.
    "causal_head_dim_64": (4, 4, 64, dict(causal=True), ("pallas_gpu", None)),
    "window_head_dim_64": (4, 4, 64, dict(causal=True, window=(100, 0)), ("pallas_gpu", "cudnn")),
    "full_head_dim_64": (4, 4, 64, dict(), ("cudnn", None)),
    "causal_head_dim_192": (4, 4, 192, dict(causal=True), ("pallas_gpu", None)),
    # MLA's unequal head dims, which cuDNN cannot compute: pallas_gpu (v padded to 192).
    "mla": (4, 4, (192, 128), dict(causal=True), ("pallas_gpu", None)),
    # the rule forward-padded-head-dim: Triton's forward, then pallas_gpu's (padded)
    # under a gradient, where cuDNN cannot (segment ids); cuDNN where it can.
    "packed_head_dim_80": (4, 4, 80, dict(causal=True, segment_ids=(_documents(2, 256, 64, 5),) * 2),
                           ("triton", "pallas_gpu")),
    "head_dim_80": (4, 4, 80, dict(causal=True), ("cudnn", None)),
    "head_dim_96": (4, 4, 96, dict(causal=True), ("pallas_gpu", None)),
    "packed_head_dim_96": (4, 4, 96, dict(causal=True, segment_ids=(_documents(2, 256, 64, 5),) * 2),
                           ("pallas_gpu", None)),
}


def _rule_prefer(platform, args, spec, calls, device_kind="NVIDIA H100 80GB HBM3"):
    """The backends the first attention rule of kind `calls` ("all" or "forward_only") that fires
    for this call puts first (ops/rules/attention.json), or ()."""
    op = interface.OPS["attention"]
    args = tuple(args) + (None,) * (8 - len(args))
    fired = op.selection.fired(platform, device_kind, lambda: op.features(args, {"spec": spec}))
    return fired[calls].prefer if calls in fired else ()


def test_training_order_rule():
    """Which calls the "all" rules send to pallas_gpu first (the GPU test above runs them)."""
    from forgeax.kernels.common.attention import AttentionSpec

    def order(H, platform="gpu", T=256, B=1, N=4, K=4, **spec):
        q = jax.ShapeDtypeStruct((B, T, N, H), jnp.bfloat16)
        kv = jax.ShapeDtypeStruct((B, T, K, H), jnp.bfloat16)
        return _rule_prefer(platform, (q, kv, kv), AttentionSpec(**spec), "all")

    assert order(64, causal=True) == ("pallas_gpu",)
    assert order(192, causal=True) == order(96, causal=True) == ("pallas_gpu",)
    assert order(96) == ()
    assert order(64, T=1000, causal=True) == ("pallas_gpu",)  # in place (`Tails`)
    assert order(64, T=1001, causal=True) == ()  # copied padded: cuDNN first
    assert order(64, T=120, causal=True) == ()
    assert order(64, platform="tpu", causal=True) == ()
    # head_dim 128, MHA or GQA, up to 4 GiB of 16-bit scores (B4 T4096 N32; Llama-3-8B's T8192 under
    # GQA), where pallas_gpu was measured faster fwd+bwd; past it (the ring's 32k blocks) cuDNN
    assert order(128, causal=True) == ("pallas_gpu",)
    assert order(128, T=4096, B=4, N=32, K=32, causal=True) == ("pallas_gpu",)
    assert order(128, T=8192, B=2, N=32, K=32, causal=True) == ()
    assert order(128, causal=True, K=1) == ("pallas_gpu",)
    assert order(128, T=8192, N=32, K=8, causal=True) == ("pallas_gpu",)
    assert order(128, T=8192, B=2, N=32, K=8, causal=True) == ()
    assert order(128, T=11264, N=32, K=8, causal=True) == ()  # its dz^T tiles fit, but cuDNN was faster
    assert order(128, K=1) == ()
    assert order(64) == ()
    assert order(64, causal=True, window_left=100, window_right=0) == ()


@pytest.mark.parametrize("B,T,S,N", [(1, 8192, 8192, 32), (2, 8192, 8192, 32), (4, 4096, 4096, 32),
                                     (4, 4000, 4096, 32), (4, 4097, 4096, 32), (1, 16384, 16384, 32),
                                     (4, 5632, 5632, 32), (4, 5760, 5760, 32), (8, 4096, 8192, 32),
                                     (3, 8192, 4096, 32), (1, 11264, 11264, 32), (1, 11600, 11600, 32)])
def test_pallas_gpu_gqa_first_only_where_its_dz_tiles_fit(B, T, S, N):
    """The rules try pallas_gpu first for causal GQA training at head_dim 128 only on calls whose
    backward takes the dz^T tiles (`_dz_tiles`), the backward its measurements were of; the
    tiles (packed, `_dz_layout`) also fit some longer calls, which stay on cuDNN."""
    from forgeax.kernels.common.attention import AttentionSpec
    from forgeax.kernels.pallas.gpu import attention_backward
    from forgeax.kernels.pallas.gpu.attention import heuristic_config
    from forgeax.kernels.pallas.gpu.attention_tiles import tails_of

    q = jax.ShapeDtypeStruct((B, T, N, 128), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((B, S, 8, 128), jnp.bfloat16)
    spec = AttentionSpec(causal=True)
    config = heuristic_config(q, kv, kv, spec=spec)
    kernels = attention_backward._dz_tiles(spec, tails_of(q, kv, kv), B, N, kv.shape[2], q.dtype, config) is not None
    first = _rule_prefer("gpu", (q, kv, kv), spec, "all") == ("pallas_gpu",)
    if first:
        assert kernels
    aligned = all(n >= 128 and n % 8 == 0 for n in (T, S))
    assert first == (aligned and B * N * -(-T // 128) * -(-S // 128) <= 4 * 2**30 // (2 * 128 * 128))


@pytest.mark.parametrize("T,S,window", [(4096, 4096, None), (4000, 4096, None), (4096, 1000, None),
                                        (1000, 4096, None), (16384, 16384, 4096), (300, 136, 50)])
def test_pallas_gpu_dz_tiles_are_packed(T, S, window):
    """pallas_gpu's dz^T tiles hold only the (128 keys, 64 queries) pairs the band lets meet, each
    once: entries [base[r] + lo, base[r] + hi) of key tile r are consecutive and disjoint, and
    they cover exactly the pairs with a visible (query, key) inside the padded lengths (a causal
    call stores about half of [S, T])."""
    from forgeax.kernels.common.attention import AttentionSpec
    from forgeax.kernels.pallas.gpu import attention_backward
    from forgeax.kernels.pallas.gpu.attention import heuristic_config
    from forgeax.kernels.pallas.gpu.attention_tiles import tails_of

    q = jax.ShapeDtypeStruct((1, T, 1, 128), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((1, S, 1, 128), jnp.bfloat16)
    spec = AttentionSpec(causal=True, window_left=window)
    tails = tails_of(q, kv, kv)
    layout = attention_backward._dz_layout(spec, tails)
    Tp, Sp = tails.T_padded, tails.S_padded
    t, s = np.arange(Tp)[None, :], np.arange(Sp)[:, None]
    d = t + (S - T) - s  # key s is d keys left of query t's aligned position
    sees = (d >= 0) & (d <= (window if window is not None else Tp + Sp))
    pairs = sees.reshape(Sp // 128, 128, Tp // 64, 64).any(axis=(1, 3))  # [key tiles, query blocks]
    entries = [layout.base[r] + j for r in range(Sp // 128) for j in np.flatnonzero(pairs[r])]
    spans = [(layout.base[r] + np.flatnonzero(pairs[r])) for r in range(Sp // 128) if pairs[r].any()]
    assert all(np.all(np.diff(e) == 1) for e in spans)  # each key tile's blocks are one run
    assert sorted(entries) == list(range(layout.count))  # every entry used exactly once
    if window is None and T == S:
        assert layout.count / pairs.size < 0.52
    B, N = 1, 32  # small enough to fit: only the window decides (the heuristic takes no tiles under one)
    config = heuristic_config(q, kv, kv, spec=spec)
    assert (attention_backward._dz_tiles(spec, tails, B, N, kv.shape[2], jnp.bfloat16, config) is not None) == (window is None)


def test_pallas_gpu_kernel_head_dims():
    """The (q/k, v) head dims pallas_gpu computes with: each padded to the next kernel head dim, v
    narrower than q/k kept narrower (MLA) except beside 256; v wider pads q/k with it."""
    from forgeax.kernels.pallas.gpu.attention_tiles import kernel_head_dims as _kernel_head_dims

    assert _kernel_head_dims(128, 128) == (128, 128)
    assert _kernel_head_dims(192, 128) == (192, 128)
    assert _kernel_head_dims(96, 40) == (96, 64)
    assert _kernel_head_dims(80, 72) == (96, 96)
    assert _kernel_head_dims(64, 128) == (128, 128)
    assert _kernel_head_dims(256, 128) == (256, 256)
    assert _kernel_head_dims(200, 64) == (256, 256)
    assert _kernel_head_dims(64, 300) is None and _kernel_head_dims(320, 64) is None


def _gpu_heuristic(H, Hv=None, N=32, K=32, T=4096, window=None, segments=False):
    from forgeax.kernels.common.attention import AttentionSpec
    from forgeax.kernels.pallas.gpu.attention import heuristic_config

    q = jax.ShapeDtypeStruct((1, T, N, H), jnp.bfloat16)
    k, v = (jax.ShapeDtypeStruct((1, T, K, d), jnp.bfloat16) for d in (H, Hv or H))
    ids = jax.ShapeDtypeStruct((1, T), jnp.int32) if segments else None
    return heuristic_config(q, k, v, None, None, ids, ids, None, spec=AttentionSpec(causal=True, window_left=window))


def test_pallas_gpu_heuristic_config():
    """pallas_gpu's default schedules per call (the measured choices heuristic_config documents)."""
    h128, h64, h192, h256, mla = (_gpu_heuristic(128), _gpu_heuristic(64, K=8), _gpu_heuristic(192),
                                  _gpu_heuristic(256), _gpu_heuristic(192, 128))
    assert h128.overlap and h128.persistent and h128.flat_forward and h128.dz_tiles and h128.one_dkv_launch
    assert not h64.overlap and h64.persistent and h64.dkv_fa3_order and not h64.dz_tiles and h64.delta_in_dq_kernel
    assert not h192.persistent and h192.persistent_dq and h192.dq_block_kv == 64 and not h192.one_dkv_launch
    assert h192.dk_query_block == 64 and h256.dk_query_block == 32 and h256.dq_block_kv == 32
    assert mla.persistent and mla.one_dkv_launch
    windowed = _gpu_heuristic(128, window=100)
    assert not (windowed.dz_tiles or windowed.delta_in_dq_kernel or windowed.persistent_dkv)
    packed = _gpu_heuristic(64, segments=True)
    assert packed.persistent and packed.persistent_dkv and not packed.persistent_dq
    few_heads = _gpu_heuristic(64, N=16, K=16, segments=True)
    assert not few_heads.persistent and not few_heads.persistent_dkv
    assert not _gpu_heuristic(128, segments=True).flat_forward


def test_pallas_gpu_config_is_validated_and_candidates_are_valid():
    from forgeax.kernels.common.attention import AttentionSpec
    from forgeax.kernels.pallas.gpu.attention import AttentionConfig, candidate_configs

    base = _gpu_heuristic(128)
    for field, value in (("dq_block_kv", 96), ("dk_query_block", 128), ("dz_tiles_max_bytes", 0)):
        with pytest.raises(ValueError, match=field):
            base.replace(**{field: value})
    with pytest.raises(ValueError, match="flat_forward"):
        base.replace(overlap=False)
    assert AttentionConfig.from_dict(base.to_dict()) == base
    for H in (64, 128, 256):
        q = jax.ShapeDtypeStruct((1, 256, 2, H), jnp.bfloat16)
        configs = candidate_configs(q, q, q, None, None, None, None, None, spec=AttentionSpec(causal=True))
        assert configs[0] == _gpu_heuristic(H, N=2, K=2, T=256) and len(set(configs)) == len(configs) >= 4
    with pytest.raises(NotImplementedError, match="takes no config"):  # UnsupportedError
        q = jnp.zeros((1, 128, 2, 64), jnp.bfloat16)
        ops.attention(q, q, q, backend="xla", config=base)


def test_inference_order_rule():
    """Which forward-only calls the "forward_only" rules send to pallas_gpu first: GQA, a window,
    or any position mask at the head dim of its flat forward (128, v's too), at lengths pallas_gpu
    runs in place (`aligned`); other lengths keep the platform priority."""
    from forgeax.kernels.common.attention import AttentionSpec

    def order(H, N=4, K=4, T=256, platform="gpu", Hv=None, **spec):
        q, kv = jax.ShapeDtypeStruct((1, T, N, H), jnp.bfloat16), jax.ShapeDtypeStruct((1, T, K, H), jnp.bfloat16)
        v = jax.ShapeDtypeStruct((1, T, K, Hv or H), jnp.bfloat16)
        return _rule_prefer(platform, (q, kv, v), AttentionSpec(**spec), "forward_only")

    assert order(128, N=8, K=2, causal=True) == ("pallas_gpu",)
    assert order(128, causal=True, window_left=100, window_right=0) == ("pallas_gpu",)
    assert order(64, causal=True, window_left=100, window_right=0) == ("pallas_gpu",)
    assert order(256, causal=True) == ()  # measured even or slower than cuDNN
    assert order(128, causal=True) == ("pallas_gpu",)  # the flat forward
    assert order(128, T=1001, causal=True) == ()
    assert order(64, causal=True) == () and order(128, Hv=64, causal=True) == ()
    assert order(128, N=8, K=2) == () and order(128) == ()  # no position mask
    assert order(128, N=8, K=2, platform="tpu", causal=True) == ()
    for T, want in ((1000, ("pallas_gpu",)), (1001, ()), (120, ())):  # in place / copied padded
        assert order(128, T=T, causal=True, window_left=100, window_right=0) == want
    # Head dims pallas_gpu pads (feature `pallas_gpu_pads_head_dim`): cuDNN, then Triton, for any mask.
    for H, Hv in ((80, None), (80, 128), (160, None), (32, None)):
        assert order(H, Hv=Hv, causal=True) == ("cudnn", "triton")
        assert order(H, Hv=Hv, N=8, K=2, causal=True, window_left=100, window_right=0) == ("cudnn", "triton")
    for H, Hv in ((192, 128), (192, None), (128, 64), (96, None)):  # kernel head dims; v alone padded
        assert order(H, Hv=Hv, causal=True) == ()
    assert order(96, platform="tpu", causal=True) == ()


@pytest.mark.skipif(ON_CPU, reason="GPU only: the split involves cudnn and pallas_gpu")
@pytest.mark.parametrize("case", DEFAULT_SPLIT_CASES)
def test_default_selection_forward_only_and_under_gradient(case):
    """The default runs pallas_gpu's forward for calls that are not differentiated where it was
    measured faster, and cuDNN's forward and backward under a gradient; both equal the reference."""
    if not interface.current_compute_capability().startswith("9."):
        pytest.skip("the split is measured for Hopper (sm_90)")
    N, K, H, kwargs, (forward_only, under_gradient) = DEFAULT_SPLIT_CASES[case]
    H, Hv = H if isinstance(H, tuple) else (H, H)
    q, k, v = _qkv(2, 256, 256, N, K, H, jnp.bfloat16, seed=31 + N + H, Hv=Hv)
    decision = ops.explain(lambda q, k, v: ops.attention(q, k, v, **kwargs), q, k, v).decisions[0]
    assert (decision.backend, decision.gradient_backend) == (forward_only, under_gradient)
    out = ops.attention(q, k, v, **kwargs)
    assert bool(jnp.all(out == ops.attention(q, k, v, backend=forward_only, **kwargs)))
    loss = lambda q, k, v, backend: jnp.sum(jnp.sin(ops.attention(q, k, v, backend=backend, **kwargs).astype(jnp.float32)))  # noqa: E731
    value, grads = jax.jit(jax.value_and_grad(functools.partial(loss, backend=None), (0, 1, 2)))(q, k, v)
    trained, _ = jax.jit(jax.value_and_grad(functools.partial(loss, backend=under_gradient or forward_only)))(q, k, v)
    assert float(value) == float(trained)  # under a gradient the value is the training backend's forward
    want_out = ops.attention(q, k, v, backend="xla", **kwargs)
    want_value, want_grads = jax.value_and_grad(functools.partial(loss, backend="xla"), (0, 1, 2))(q, k, v)
    tolerance = TOLERANCE[jnp.dtype(jnp.bfloat16)]
    assert conformance.relative_error(out, want_out) < tolerance
    assert abs(float(value) - float(want_value)) <= tolerance * max(1.0, abs(float(want_value)))
    for g, r in zip(grads, want_grads):
        assert conformance.relative_error(g, r) < tolerance


def test_selection_on_this_platform():
    q, k, v = _qkv(1, 16, 16, 2, 2, 64, jnp.float32, seed=0)
    chosen = ops.explain(lambda q, k, v: ops.attention(q, k, v, causal=True), q, k, v).backends()
    if ON_CPU:
        assert chosen == ("xla",)
    else:
        assert chosen[0] in ("cudnn", "pallas_gpu", "triton", "xla")


def test_deterministic_default_follows_xla_flag(monkeypatch):
    from forgeax.core import xla_gpu_deterministic_ops

    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=1")
    assert not xla_gpu_deterministic_ops()
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_deterministic_ops=true --foo")
    assert xla_gpu_deterministic_ops()
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_deterministic_ops=false")
    assert not xla_gpu_deterministic_ops()


def test_bad_inputs_raise_errors_that_name_the_argument():
    q, k, v = _qkv(2, 16, 24, 4, 2, 64, jnp.float32, seed=0)
    bad = [
        ("k", dict(k=k[:1])),  # batch mismatch
        ("k", dict(k=k[..., :32])),  # head_dim mismatch
        ("k", dict(k=_qkv(2, 16, 24, 4, 3, 64, jnp.float32, 0)[1], v=_qkv(2, 16, 24, 4, 3, 64, jnp.float32, 0)[2])),
        ("v", dict(v=v[:, :20])),
        ("q, k, v", dict(q=q.astype(jnp.bfloat16))),
        ("window", dict(window=(-1, 0))),
        ("window", dict(window=3)),
        ("dropout_key", dict(dropout_rate=0.1)),
        ("dropout_rate", dict(dropout_rate=1.0, dropout_key=jax.random.key(0))),
        ("scale", dict(scale=-1.0)),
        ("logit_soft_cap", dict(logit_soft_cap=0.0)),
        ("bias", dict(bias=jnp.zeros((2, 4, 16, 23)))),
        ("mask", dict(mask=jnp.ones((2, 4, 16, 24), jnp.float32))),
        ("segment_ids[1]", dict(segment_ids=(jnp.zeros((2, 16), jnp.int32), jnp.zeros((2, 16), jnp.int32)))),
        ("segment_ids[0]", dict(segment_ids=(jnp.zeros((2, 16)), jnp.zeros((2, 24), jnp.int32)))),
        ("deterministic", dict(deterministic="yes")),
    ]
    for name, change in bad:
        args = dict(q=q, k=k, v=v)
        args.update({key: change.pop(key) for key in ("q", "k", "v") if key in change})
        with pytest.raises((ValueError, TypeError), match="^" + re.escape(name)):
            ops.attention(args["q"], args["k"], args["v"], **change)
    with pytest.raises(ValueError, match="^backend: unknown backend"):
        ops.attention(q, k, v, backend="no_such_backend")


def test_cudnn_backend_refuses_what_it_would_compute_differently():
    """The cudnn backend's supports() names every semantic gap (checked on any platform)."""
    from forgeax.kernels.common.attention import AttentionSpec
    from forgeax.kernels.xla.attention import ATTENTION_CUDNN

    def why(T=256, S=256, H=128, dtype=jnp.bfloat16, Hv=None, extra=(), **spec):
        q = jax.ShapeDtypeStruct((1, T, 4, H), dtype)
        k = jax.ShapeDtypeStruct((1, S, 2, H), dtype)
        v = jax.ShapeDtypeStruct((1, S, 2, Hv or H), dtype)
        args = [None] * 5
        for i, value in extra:
            args[i] = value
        return ATTENTION_CUDNN.supports(q, k, v, *args, spec=AttentionSpec(**spec))

    cases = {
        "dtype": why(dtype=jnp.float32),
        "bias": why(extra=((0, jnp.zeros((1, 1, 256, 256))),)),
        "segment": why(extra=((2, jnp.zeros((1, 256), jnp.int32)), (3, jnp.zeros((1, 256), jnp.int32)))),
        "dropout": why(dropout_rate=0.1),
        "soft cap": why(logit_soft_cap=30.0),
        "return_lse": why(return_lse=True),
        "deterministic": why(deterministic=True),
        "window without causal": why(window_left=16, window_right=0),
        "T=128 != S=256": why(T=128, causal=True),
        "T=20": why(T=20, S=24),
        "head_dim 128 (v 64)": why(Hv=64),
    }
    for expected, reason in cases.items():
        assert reason is not None and expected in reason, (expected, reason)
    if ON_CPU:
        assert "compute capability" in why(causal=True)
        assert "compute capability" in why(causal=True, return_lse=True, lse_gradient=False)
    else:
        assert why(causal=True) is None and why(causal=True, window_left=64) is None
        # lse out but no cotangent into it (ring attention's blocks): cuDNN's statistics serve.
        assert why(causal=True, return_lse=True, lse_gradient=False) is None


@pytest.mark.parametrize("backend", ["xla_chunked", "cudnn"])
@pytest.mark.parametrize("causal", [False, True])
def test_raw_kernels_give_lse_and_take_any_statistics(backend, causal):
    """A backend's raw kernels (what ring attention runs per block): the forward's lse is the
    reference's, and the backward given the out and lse of a LONGER key sequence is the gradient
    share of the keys it sees (p = exp(z - lse) with the whole sequence's lse), as the ring needs."""
    from forgeax.kernels.common.attention import AttentionSpec
    from forgeax.ops.attention import ATTENTION

    if backend == "cudnn" and ON_CPU:
        pytest.skip("cuDNN runs on GPUs only")
    kernels = ATTENTION.implementation(backend).kernels(None)

    B, T, N, K, H = 1, 256, 4, 2, 128
    rng = _rng(11)
    # Two blocks of T keys; the block under test is the second.
    q, k, v = (jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)
               for shape in ((B, T, N, H), (B, 2 * T, K, H), (B, 2 * T, K, H)))
    d_out = jnp.asarray(_rng(12).standard_normal((B, T, N, H)), jnp.bfloat16)
    spec = AttentionSpec(causal=False, scale=H ** -0.5, return_lse=True, lse_gradient=False)
    block_spec = dataclasses.replace(spec, causal=causal)
    if causal:  # the queries see every key of the first block and the second causally (T == S per block)
        mask = jnp.concatenate([jnp.ones((T, T), bool), jnp.tril(jnp.ones((T, T), bool))], axis=1)[None, None]
    else:
        mask = jnp.ones((1, 1, T, 2 * T), bool)
    whole = lambda q, k, v: ops.attention(q, k, v, mask=mask, return_lse=True, backend="xla")  # noqa: E731
    (out, lse), pull = jax.vjp(whole, q, k, v)
    dq, dk, dv = pull((d_out, jnp.zeros_like(lse)))

    block_out, block_lse = kernels.forward(q, k[:, T:], v[:, T:], None, None, None, None, None, spec=block_spec)
    ref_out, ref_lse = ops.attention(q, k[:, T:], v[:, T:], causal=causal, return_lse=True, backend="xla")
    np.testing.assert_allclose(np.float32(block_out), np.float32(ref_out), atol=2e-2, rtol=2e-2)
    np.testing.assert_allclose(np.swapaxes(block_lse, 1, 2), ref_lse, atol=1e-3, rtol=1e-3)

    lse_bnt = jnp.swapaxes(lse, 1, 2)
    parts = [kernels.backward(q, k[:, keys], v[:, keys], None, None, None, None, None, out, lse_bnt, d_out,
                              jnp.zeros_like(lse_bnt), spec=keys_spec)
             for keys, keys_spec in ((slice(0, T), spec), (slice(T, 2 * T), block_spec))]
    got_dq = np.float32(parts[0][0]) + np.float32(parts[1][0])
    got_dk = np.concatenate([np.float32(parts[0][1]), np.float32(parts[1][1])], axis=1)
    got_dv = np.concatenate([np.float32(parts[0][2]), np.float32(parts[1][2])], axis=1)
    for got, want, name in ((got_dq, dq, "dq"), (got_dk, dk, "dk"), (got_dv, dv, "dv")):
        scale = float(np.max(np.abs(np.float32(want))))
        np.testing.assert_allclose(got, np.float32(want), atol=1.5e-2 * scale, rtol=1.5e-2, err_msg=name)
