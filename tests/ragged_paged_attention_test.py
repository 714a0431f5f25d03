"""ragged_paged_attention: the reference against ops.attention per sequence, every backend against
the reference, all-decode batches against ops.paged_attention, bad input, forward-only.

Forward only (serving), so the conformance cases have no differentiable arguments. On CPU this
runs the reference and the Mosaic TPU interpreter; the Triton interpreter runs the same tests in
ragged_paged_attention_triton_interpret_test.py (TRITON_INTERPRET=1); on a GPU the real kernels:
`pytest tests/ragged_paged_attention_test.py` against the installed wheel.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import conformance
from forgeax import core as interface
from forgeax import ops
from forgeax.kernels.common.attention import AttentionSpec
from forgeax.kernels.xla import ragged_paged_attention as reference
from forgeax.testing import _upcast

BACKENDS = [b for b in conformance.runnable_backends("ragged_paged_attention") if b != "xla"]
_TRITON_INTERPRETED = interface.current_platform() == "cpu" and os.environ.get("TRITON_INTERPRET") == "1"
_ON_GPU = interface.current_platform() == "gpu"
_ON_TPU = interface.current_platform() == "tpu"

# (q_len, kv_len) per sequence: a fresh prefill of 63, a decode, a chunked prefill of 65 over 100
# keys, a decode over an empty cache (kv_len 0: gives 0), a sequence with no queries this step,
# a prefill of 1, a decode at a page boundary, more queries than keys (the first query sits at
# key position -1: no key, gives 0). Then `pad` rows past cu_q_lens[-1] (give 0).
MIXED = ((63, 63), (1, 37), (65, 100), (1, 0), (0, 20), (1, 1), (1, 64), (3, 2))
DECODES = ((1, 5), (1, 16), (1, 17), (1, 0), (1, 90))


def _make(seqs, *, heads=4, kv_heads=2, head_dim=32, page=16, dtype=jnp.float32, pad=5, seed=0, spare_pages=3):
    """(q, k_pages, v_pages, cu_q_lens, kv_lens, page_table) with each sequence's pages at shuffled
    page ids; unused table entries hold -1 (never read)."""
    rng = np.random.default_rng(seed)
    q_lens = np.array([s[0] for s in seqs], np.int32)
    kv_lens = np.array([s[1] for s in seqs], np.int32)
    need = -(-kv_lens // page)
    max_pages = max(1, int(need.max()))
    num_pages = int(need.sum()) + spare_pages
    ids = rng.permutation(num_pages)
    table = np.full((len(seqs), max_pages), -1, np.int32)
    used = 0
    for i, n in enumerate(need):
        table[i, :n] = ids[used:used + n]
        used += n
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    T = int(cu[-1]) + pad
    kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
    q = conformance.random_array(kq, (T, heads, head_dim), dtype)
    k_pages = conformance.random_array(kk, (num_pages, page, kv_heads, head_dim), dtype)
    v_pages = conformance.random_array(kv, (num_pages, page, kv_heads, head_dim), dtype)
    return q, k_pages, v_pages, jnp.asarray(cu), jnp.asarray(kv_lens), jnp.asarray(table)


def _reference(q, k_pages, v_pages, cu_q_lens, kv_lens, page_table, *, causal=True, scale=None, window=None,
               logit_soft_cap=None):
    left, right = (None, None) if window is None else (window[0], 0 if causal else window[1])
    spec = AttentionSpec(causal=causal, scale=scale or q.shape[-1] ** -0.5, window_left=left, window_right=right,
                         logit_soft_cap=logit_soft_cap)
    return reference.ragged_paged_attention(q, k_pages, v_pages, cu_q_lens, kv_lens, page_table, spec=spec)


@jax.jit(static_argnames=("causal", "scale", "window", "logit_soft_cap"))
def _attention(q, k, v, **options):
    return ops.attention(q, k, v, backend="xla", **options)


def _per_sequence(args, **options):
    """ops.attention (xla) on each sequence's queries and its contiguous keys; 0 elsewhere."""
    q, k_pages, v_pages, cu, kv_lens, table = (np.asarray(a) for a in args)
    out = np.zeros(q.shape[:2] + (v_pages.shape[-1],), np.float32)
    page = k_pages.shape[1]
    for i in range(len(kv_lens)):
        lo, hi, L = int(cu[i]), int(cu[i + 1]), int(kv_lens[i])
        if hi == lo or L == 0:
            continue
        s = np.arange(L)
        k = k_pages[table[i, s // page], s % page]
        v = v_pages[table[i, s // page], s % page]
        f32 = lambda a: jnp.asarray(a, jnp.float32)[None]  # noqa: E731
        out[lo:hi] = np.asarray(_attention(f32(q[lo:hi]), f32(k), f32(v), **options)[0])
    return out


OPTIONS = {
    "causal": dict(causal=True),
    "full": dict(causal=False),
    "window": dict(causal=True, window=(20, 0)),
    "window_full": dict(causal=False, window=(9, 5)),
    "soft_cap": dict(causal=True, logit_soft_cap=3.0),
    "window_soft_cap": dict(causal=True, window=(40, None), logit_soft_cap=2.0, scale=0.3),
}
# (heads, kv_heads, page): GQA group 1, 4, 8 (and MQA), a group of 3, page sizes 16 and 64.
HEADS = [(4, 4, 16), (8, 2, 16), (8, 1, 64), (16, 2, 16), (12, 4, 16)]


@pytest.mark.skipif(_TRITON_INTERPRETED, reason="the reference is checked in the XLA target")
@pytest.mark.parametrize("option,heads", [(o, (8, 2, 16)) for o in OPTIONS] + [("window", h) for h in HEADS if h != (8, 2, 16)],
                         ids=str)
def test_reference_equals_attention_per_sequence(option, heads):
    N, KV, page = heads
    args = _make(MIXED, heads=N, kv_heads=KV, page=page, seed=hash((option, heads)) % 1000)
    options = OPTIONS[option]
    out = jax.jit(lambda *a: _reference(*a, **options))(*args)
    expect = _per_sequence(args, **options)
    assert conformance.relative_error(out, expect) < 1e-6
    T = int(args[3][-1])
    assert np.all(np.asarray(out[T:]) == 0), "rows past cu_q_lens[-1] must be 0"
    zero_kv = int(args[3][3])  # the decode over an empty cache
    assert np.all(np.asarray(out[zero_kv]) == 0), "a sequence with kv_len 0 must give 0"


def _case(seqs, option, heads, dtype=jnp.float32, seed=0, head_dim=32):
    N, KV, page = heads
    args = _make(seqs, heads=N, kv_heads=KV, page=page, dtype=dtype, head_dim=head_dim, seed=seed)
    return conformance.Case(f"ragged_paged_attention({len(seqs)} seqs, N={N}, KV={KV}, page={page})",
                            ops.ragged_paged_attention, _reference, args, OPTIONS[option], ())


# The interpreters run one mixed batch per option (GQA 4 at page 16) and the other head layouts
# causally; a GPU runs the whole matrix.
def _cases():
    cases = [(option, (8, 2, 16)) for option in OPTIONS]
    cases += [("causal", h) for h in HEADS if h != (8, 2, 16)]
    if _ON_GPU:
        cases += [(o, h) for o in OPTIONS for h in HEADS if (o, h) not in cases]
    return cases


# The Mosaic TPU interpreter costs seconds per call: two cases there (GQA 4 at page 16 causal,
# MQA at page 64 with a two-sided window).
_TPU_INTERPRETED = [("causal", (8, 2, 16)), ("window_full", (8, 1, 64))]


@pytest.mark.parametrize("option,heads", _cases(), ids=str)
@pytest.mark.parametrize("backend", BACKENDS)
def test_mixed_batch_matches_reference(backend, option, heads):
    if backend == "pallas_tpu" and not _ON_TPU and (option, heads) not in _TPU_INTERPRETED:
        pytest.skip("interpreter time: the Mosaic TPU interpreter runs two of these cases")
    conformance.assert_conforms(_case(MIXED, option, heads, seed=hash((option, heads)) % 1000), backend)


@pytest.mark.parametrize("dtype", ["bf16", "f16"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_half_precision_matches_reference(backend, dtype):
    if backend == "pallas_tpu" and dtype == "f16":
        pytest.skip("the Mosaic TPU kernel takes float32/bfloat16")
    dt = {"bf16": jnp.bfloat16, "f16": jnp.float16}[dtype]
    conformance.assert_conforms(_case(MIXED, "window_soft_cap", (8, 2, 16), dtype=dt, seed=7, head_dim=80), backend)


@pytest.mark.parametrize("backend", BACKENDS + (["xla"] if not _TRITON_INTERPRETED else []))
def test_all_decodes_equal_paged_attention(backend):
    q, k_pages, v_pages, cu, kv_lens, table = _make(DECODES, heads=8, kv_heads=2, pad=0, seed=11)
    options = dict(window=(6, 0), logit_soft_cap=4.0)
    out = jax.jit(lambda *a: ops.ragged_paged_attention(*a, backend=backend, **options))(q, k_pages, v_pages, cu, kv_lens, table)
    expect = jax.jit(lambda *a: ops.paged_attention(*a, backend="xla", **options))(q, k_pages, v_pages, kv_lens, table)
    assert conformance.relative_error(out, expect) < 1e-5


@pytest.mark.skipif(_TRITON_INTERPRETED, reason="argument checks run in the XLA target")
def test_bad_input_errors_name_the_argument():
    q, k_pages, v_pages, cu, kv_lens, table = _make(MIXED, pad=0)
    call = ops.ragged_paged_attention
    with pytest.raises(ValueError, match="cu_q_lens: must be nondecreasing"):
        call(q, k_pages, v_pages, cu.at[2].set(0), kv_lens, table)
    with pytest.raises(ValueError, match="cu_q_lens"):
        call(q, k_pages, v_pages, cu.at[-1].set(q.shape[0] + 1), kv_lens, table)
    with pytest.raises(ValueError, match="cu_q_lens: expected shape"):
        call(q, k_pages, v_pages, cu[:1], kv_lens[:0], table[:0])
    with pytest.raises(TypeError, match="cu_q_lens"):
        call(q, k_pages, v_pages, cu.astype(jnp.float32), kv_lens, table)
    with pytest.raises(ValueError, match="kv_lens: expected shape"):
        call(q, k_pages, v_pages, cu, kv_lens[1:], table)
    with pytest.raises(ValueError, match="page_table: expected shape"):
        call(q, k_pages, v_pages, cu, kv_lens, table[1:])
    with pytest.raises(ValueError, match="kv_lens"):
        call(q, k_pages, v_pages, cu, kv_lens.at[0].set(10_000), table)
    with pytest.raises(ValueError, match="page_table"):
        call(q, k_pages, v_pages, cu, kv_lens, table.at[0, 0].set(k_pages.shape[0]))
    with pytest.raises(ValueError, match="q: expected"):
        call(q[None], k_pages, v_pages, cu, kv_lens, table)
    with pytest.raises(ValueError, match="k_pages"):
        call(q, k_pages[..., :16], v_pages, cu, kv_lens, table)
    with pytest.raises(ValueError, match="v_pages"):
        call(q, k_pages, v_pages[:, :8], cu, kv_lens, table)
    with pytest.raises(TypeError, match="k_pages"):
        call(q, k_pages.astype(jnp.bfloat16), v_pages.astype(jnp.bfloat16), cu, kv_lens, table)
    with pytest.raises(ValueError, match="k_pages: query heads"):
        call(q[:, :3], k_pages, v_pages, cu, kv_lens, table)
    with pytest.raises(TypeError, match="window"):
        call(q, k_pages, v_pages, cu, kv_lens, table, window=5)
    with pytest.raises(ValueError, match="logit_soft_cap"):
        call(q, k_pages, v_pages, cu, kv_lens, table, logit_soft_cap=-1.0)
    with pytest.raises(ValueError, match="backend"):
        call(q, k_pages, v_pages, cu, kv_lens, table, backend="nope")


@pytest.mark.skipif(_TRITON_INTERPRETED, reason="runs in the XLA target")
def test_gradient_raises_forward_only():
    args = _make(MIXED, pad=0)
    loss = lambda q: ops.ragged_paged_attention(q, *args[1:]).sum()  # noqa: E731
    with pytest.raises(TypeError, match="forward-only"):
        jax.grad(loss)(args[0])


@pytest.mark.skipif(_TRITON_INTERPRETED, reason="runs in the XLA target")
def test_jit_with_changing_lengths_does_not_recompile():
    q, k_pages, v_pages, cu, kv_lens, table = _make(MIXED, pad=0)
    traces = []

    @jax.jit
    def run(*a):
        traces.append(1)
        return ops.ragged_paged_attention(*a, backend="xla")

    first = run(q, k_pages, v_pages, cu, kv_lens, table)
    second = run(q, k_pages, v_pages, cu.at[1].set(30), jnp.maximum(kv_lens - 1, 0), table)
    assert len(traces) == 1
    assert not np.array_equal(np.asarray(first), np.asarray(second))


# The Triton backend routes sequences with 1 <= q_len <= decode_max_q to split decode runs (lse
# merged) and cuts the others into tiles. At decode_max_q = 2: q_len 2 (the boundary, also over
# one key, its first query at position -1) and 1 take the split path, 3 the tiles, 0 neither;
# kv_len 0 on both sides. More runs than a short decode has key blocks leaves runs empty. Then,
# under the same trace, new values: the 3-query chunk becomes a decode, a decode becomes a
# 3-query chunk, the 5-query prefill a decode, lengths move.
BOUNDARY = ((2, 20), (3, 21), (1, 17), (0, 9), (2, 0), (1, 0), (2, 1), (5, 18))
BOUNDARY_NEXT = ((2, 20), (2, 21), (3, 17), (0, 9), (2, 0), (1, 0), (2, 1), (1, 18))


def _triton_config(args, **fields):
    from forgeax.kernels.triton import ragged_paged_attention as triton_rpa  # noqa: PLC0415

    spec = AttentionSpec(causal=True, scale=args[0].shape[-1] ** -0.5, window_right=0)
    return triton_rpa.RAGGED_PAGED_ATTENTION.heuristic_config(*args, spec=spec).replace(**fields)


@pytest.mark.skipif("triton" not in BACKENDS, reason="the Triton backend's decode/tile routing")
@pytest.mark.parametrize("fields", [dict(decode_max_q=2, decode_splits=3), dict(split_decodes=False)],
                         ids=["max_q2_splits3", "tiles_only"])
def test_triton_decode_threshold_boundary_and_changing_lengths(fields):
    args = _make(BOUNDARY, heads=8, kv_heads=2, pad=3, seed=5)
    q, k_pages, v_pages, cu, kv_lens, table = args
    options = dict(window=(24, 0), logit_soft_cap=5.0)
    config = _triton_config(args, decode_block_k=16, **fields)
    traces = []

    @jax.jit
    def run(*a):
        traces.append(1)
        return ops.ragged_paged_attention(*a, backend="triton", config=config, **options)

    q_lens = np.array([s[0] for s in BOUNDARY_NEXT], np.int32)
    cu_next = jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32))
    lens_next = jnp.asarray([s[1] for s in BOUNDARY_NEXT], jnp.int32)
    for a in (args, (q, k_pages, v_pages, cu_next, lens_next, table)):
        out = run(*a)
        assert np.isfinite(np.asarray(out)).all()
        assert conformance.relative_error(out, _reference(*_upcast(a), **options)) < 1e-5
        T = int(a[3][-1])
        assert np.all(np.asarray(out[T:]) == 0), "rows past cu_q_lens[-1] must be 0"
    assert len(traces) == 1


@pytest.mark.skipif(_TRITON_INTERPRETED, reason="pure XLA: runs in the XLA target")
def test_triton_item_order_is_a_permutation_busy_first():
    """The Triton backend's item order (arithmetic merge of heaviest-first tiles with the decode
    runs): a permutation, busy items first, tiles heaviest first, runs in order, the two kinds
    interleaved in proportion."""
    pytest.importorskip("triton")
    from forgeax.kernels.triton.ragged_paged_attention import _interleaved_positions  # noqa: PLC0415

    rng = np.random.default_rng(0)
    positions = jax.jit(_interleaved_positions)
    for wa, wb in ((1, 1), (7, 30), (33, 4), (20, 20), (5, 12), (40, 9)):
        for density in (0.0, 0.4, 1.0):
            ca = (rng.integers(1, 9, wa) * (rng.random(wa) < density)).astype(np.int32)
            cb = (rng.integers(1, 9, wb) * (rng.random(wb) < density)).astype(np.int32)
            pa, pb = (np.asarray(p) for p in positions(jnp.asarray(ca), jnp.asarray(cb)))
            every = np.concatenate([pa, pb])
            assert sorted(every.tolist()) == list(range(wa + wb))
            na, nb = int((ca > 0).sum()), int((cb > 0).sum())
            assert set(every[np.concatenate([ca > 0, cb > 0])].tolist()) == set(range(na + nb))
            assert np.all(np.diff(ca[ca > 0][np.argsort(pa[ca > 0])]) <= 0)
            assert np.all(np.diff(pb[cb > 0]) > 0)
            if na and nb:
                is_tile = np.zeros(na + nb, int)
                is_tile[pa[ca > 0]] = 1
                k = np.arange(1, na + nb + 1)
                assert np.abs(np.cumsum(is_tile) - k * na / (na + nb)).max() <= 1.0 + 1e-9
