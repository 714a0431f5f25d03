"""sparse_attention: every runnable backend against the XLA reference (forward, gradients of q, k,
v, lse), the reference against ops.attention and a brute-force mask, edge rows, bad input.

On CPU this runs the XLA reference and the Mosaic TPU interpreter (the Triton interpreter in its
own target, sparse_attention_triton_interpret_test.py, with TRITON_INTERPRET=1); on a GPU the real
kernels: `pytest tests/sparse_attention_test.py` against the installed wheel.
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
from forgeax.kernels.common.sparse_attention import SparseAttentionSpec, block_mask

BACKENDS = [b for b in conformance.runnable_backends("sparse_attention") if b != "xla"]
ALL_BACKENDS = conformance.runnable_backends("sparse_attention")
_ON_GPU = jax.default_backend() == "gpu"
# The Triton interpreter's target re-exports this file: the reference-only tests run in the other.
# The Mosaic TPU interpreter pays per grid step (one per selected block and head): on CPU it runs
# one conformance case, the empty rows and the lse gradient.
_SLOW_INTERPRETER = {"pallas_tpu"} if interface.current_platform() == "cpu" else set()
_reference_only = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="runs in sparse_attention_test")


def _indices(B, K, T, S, bs, W, seed, *, empty_block=True):
    """Random key-block ids with -1 padding, a repeated id and (empty_block) query block 0 of kv
    head 0 selecting nothing."""
    rng = np.random.default_rng(seed)
    nq, nk = -(-T // bs), -(-S // bs)
    idx = rng.integers(-1, nk, (B, K, nq, W)).astype(np.int32)
    if W >= 2:
        idx[..., -1] = idx[..., 0]  # a block named twice counts once
    if W >= 3:
        idx[..., 1] = -1
    # The last query block reads its diagonal block, so causal rows are not all empty.
    idx[:, :, -1, 0] = min(nk - 1, (T - 1 + S - T) // bs)
    if empty_block and nq > 1:
        idx[0, 0, 0, :] = -1
    return jnp.asarray(idx)


def _qkv(B, T, S, N, K, H, dtype, seed, Hv=None):
    kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
    return (conformance.random_array(kq, (B, T, N, H), dtype), conformance.random_array(kk, (B, S, K, H), dtype),
            conformance.random_array(kv, (B, S, K, Hv or H), dtype))


def _case(B, T, S, N, K, H, bs, W, dtype, *, causal=False, cap=None, seed=0, idx=None, Hv=None):
    idx = _indices(B, K, T, S, bs, W, seed) if idx is None else idx
    kwargs = dict(block_indices=idx, block_size=bs, causal=causal, logit_soft_cap=cap)
    reference = lambda q, k, v, **kw: ops.sparse_attention(q, k, v, backend="xla", **kw)  # noqa: E731
    name = f"sparse_attention(B={B}, T={T}, S={S}, N={N}, K={K}, H={H}, bs={bs}, W={W})"
    return conformance.Case(name, ops.sparse_attention, reference, _qkv(B, T, S, N, K, H, dtype, seed, Hv), kwargs,
                            (0, 1, 2))


# (B, T, S, N, K, H, block_size, W, dtype, options): lengths 1, 63, 65, T != S, GQA, padded and
# repeated slots, an empty query block, both block sizes, every dtype.
CASES = [
    (1, 1, 1, 2, 1, 16, 16, 2, jnp.float32, dict(causal=True)),
    (1, 63, 63, 4, 2, 32, 16, 3, jnp.float32, dict()),
    (2, 65, 65, 2, 1, 16, 16, 4, jnp.float32, dict(causal=True, cap=5.0)),
    (1, 65, 65, 2, 1, 64, 64, 2, jnp.bfloat16, dict(causal=True)),
    (1, 63, 130, 4, 1, 32, 64, 2, jnp.float16, dict(causal=True)),
]
if _ON_GPU:
    CASES += [
        (2, 1000, 1000, 8, 2, 128, 64, 6, jnp.bfloat16, dict(causal=True)),
        (1, 1000, 1000, 8, 8, 64, 32, 8, jnp.bfloat16, dict()),
        (1, 777, 1000, 16, 2, 128, 128, 4, jnp.float16, dict(causal=True, cap=30.0)),
        (1, 500, 500, 4, 2, 96, 16, 5, jnp.float32, dict(causal=True)),
    ]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"T{c[1]}-S{c[2]}-N{c[3]}-K{c[4]}-bs{c[6]}-{jnp.dtype(c[8]).name}")
@pytest.mark.parametrize("backend", BACKENDS)
def test_matches_reference(backend, case):
    *shape, dtype, options = case
    if backend in _SLOW_INTERPRETER and shape[2] != 130:
        pytest.skip("interpreter time: the Mosaic TPU interpreter runs the T != S case (GQA, causal, f16)")
    conformance.assert_conforms(_case(*shape, dtype, seed=sum(shape), **options), backend)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_every_block_selected_equals_dense_attention(backend, causal):
    if backend != "xla" and interface.current_platform() == "cpu":
        pytest.skip("interpreter time: implied by test_matches_reference and the reference's own check here")
    B, T, N, K, H, bs = 1, 48, 4, 2, 16, 16  # whole blocks: the kernels' unmasked loads
    q, k, v = _qkv(B, T, T, N, K, H, jnp.float32, 7)
    nq = -(-T // bs)
    idx = jnp.broadcast_to(jnp.arange(nq, dtype=jnp.int32)[::-1], (B, K, nq, nq))
    ct = conformance.random_array(jax.random.key(3), (B, T, N, H), jnp.float32)

    def loss(fn):
        return jax.value_and_grad(lambda q, k, v: jnp.sum(fn(q, k, v) * ct), argnums=(0, 1, 2))(q, k, v)

    got = loss(lambda q, k, v: ops.sparse_attention(q, k, v, block_indices=idx, block_size=bs, causal=causal,
                                                    backend=backend))
    want = loss(lambda q, k, v: ops.attention(q, k, v, causal=causal, backend="xla"))
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert conformance.relative_error(g, w) < 1e-5


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_empty_rows_give_zero_and_lse_minus_inf(backend):
    # Query block 0 of kv head 0 selects nothing; under causal, rows 0..S-T-1 of block 0 ... with
    # T > S the first T - S queries see no key at all.
    B, T, S, N, K, H, bs = 1, 40, 33, 4, 2, 16, 16
    q, k, v = _qkv(B, T, S, N, K, H, jnp.float32, 11)
    idx = _indices(B, K, T, S, bs, 3, 11)
    f = lambda q, k, v: ops.sparse_attention(q, k, v, block_indices=idx, block_size=bs, causal=True,  # noqa: E731
                                             return_lse=True, backend=backend)
    out, lse = jax.jit(f)(q, k, v)
    out, lse = np.asarray(out), np.asarray(lse)
    assert np.all(out[:, :bs, :2] == 0) and np.all(lse[:, :bs, :2] == -np.inf)  # heads of kv head 0
    assert np.all(out[:, :T - S] == 0) and np.all(lse[:, :T - S] == -np.inf)  # before the first key
    assert np.isfinite(lse[:, -1]).all()
    grads = jax.grad(lambda *a: jnp.sum(f(*a)[0]), argnums=(0, 1, 2))(q, k, v)
    assert all(np.isfinite(np.asarray(g)).all() for g in grads)
    assert np.all(np.asarray(grads[0])[:, :bs, :2] == 0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_lse_and_its_gradient_match_reference(backend):
    B, T, N, K, H, bs = 1, 33, 4, 2, 16, 16
    q, k, v = _qkv(B, T, T, N, K, H, jnp.float32, 5)
    idx = _indices(B, K, T, T, bs, 3, 5)
    c1 = conformance.random_array(jax.random.key(1), (B, T, N, H), jnp.float32)
    c2 = conformance.random_array(jax.random.key(2), (B, T, N), jnp.float32)

    def loss(backend, q, k, v):
        out, lse = ops.sparse_attention(q, k, v, block_indices=idx, block_size=bs, causal=True, return_lse=True,
                                        backend=backend)
        return jnp.sum(out * c1) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0) * c2), lse

    (_, lse), grads = jax.jit(jax.value_and_grad(lambda *a: loss(backend, *a), argnums=(0, 1, 2), has_aux=True))(q, k, v)
    (_, ref_lse), ref_grads = jax.value_and_grad(lambda *a: loss("xla", *a), argnums=(0, 1, 2), has_aux=True)(q, k, v)
    finite = np.isfinite(np.asarray(ref_lse))
    assert np.array_equal(np.isfinite(np.asarray(lse)), finite)
    assert conformance.relative_error(np.asarray(lse)[finite], np.asarray(ref_lse)[finite]) < 1e-5
    for g, r in zip(grads, ref_grads):
        assert conformance.relative_error(g, r) < 1e-5


@pytest.mark.parametrize("backend", [b for b in BACKENDS if b == "triton"])
def test_triton_launch_shapes_match_reference(backend):
    # The two-launch backward, and one query head per program / dK/dV tile (G = 4 head tiles in
    # the dK/dV loop), against the reference: the default config's tiling is not the only one.
    B, T, N, K, H, bs = 1, 40, 4, 1, 16, 16
    q, k, v = _qkv(B, T, T, N, K, H, jnp.float32, 9)
    idx = _indices(B, K, T, T, bs, 3, 9)
    ct = conformance.random_array(jax.random.key(4), (B, T, N, H), jnp.float32)
    base = ops.OPS["sparse_attention"].implementation(backend).heuristic_config(
        q, k, v, idx, spec=SparseAttentionSpec(block_size=bs, causal=True))

    def grads(**kw):
        f = lambda q, k, v: jnp.sum(ops.sparse_attention(q, k, v, block_indices=idx, block_size=bs,  # noqa: E731
                                                         causal=True, **kw) * ct)
        return jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2)))(q, k, v)

    want = grads(backend="xla")
    for config in (base.replace(fused_backward=False), base.replace(heads=1, dq_heads=1, bwd_heads=1)):
        got = grads(backend=backend, config=config)
        for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            assert conformance.relative_error(g, w) < 1e-5, config


@_reference_only
def test_block_mask_matches_brute_force():
    # The contract's allowed(t, s), written out element by element, against the reference's mask.
    B, K, T, S, bs = 2, 2, 37, 50, 8
    idx = np.asarray(_indices(B, K, T, S, bs, 4, 3))
    for causal in (False, True):
        spec = SparseAttentionSpec(block_size=bs, causal=causal)
        blocks = np.asarray(block_mask(jnp.asarray(idx), spec, T, S))
        for b in range(B):
            for h in range(K):
                for t in range(T):
                    chosen = {int(j) for j in idx[b, h, t // bs] if j >= 0}
                    for s in range(S):
                        allowed = s // bs in chosen and (not causal or s <= t + S - T)
                        # the block mask keeps every block holding an allowed pair
                        if allowed:
                            assert blocks[b, h, t // bs, s // bs], (b, h, t, s)
                    if not causal:
                        assert {int(j) for j in np.flatnonzero(blocks[b, h, t // bs])} == chosen


@_reference_only
def test_reference_matches_brute_force_numpy():
    B, T, S, N, K, H, bs = 1, 21, 30, 4, 2, 8, 8
    q, k, v = (np.asarray(a, np.float64) for a in _qkv(B, T, S, N, K, H, jnp.float32, 2))
    idx = np.asarray(_indices(B, K, T, S, bs, 3, 2))
    out = np.asarray(ops.sparse_attention(jnp.asarray(q, jnp.float32), jnp.asarray(k, jnp.float32),
                                          jnp.asarray(v, jnp.float32), block_indices=idx, block_size=bs,
                                          causal=True, backend="xla"))
    expect = np.zeros_like(out, np.float64)
    for n in range(N):
        h = n // (N // K)
        for t in range(T):
            keys = [s for s in range(S) if s // bs in set(idx[0, h, t // bs].tolist()) and s <= t + S - T]
            if not keys:
                continue
            z = np.array([q[0, t, n] @ k[0, s, h] for s in keys]) / np.sqrt(H)
            p = np.exp(z - z.max())
            expect[0, t, n] = (p / p.sum()) @ v[0, keys, h]
    assert conformance.relative_error(out, expect) < 1e-5


@_reference_only
def test_bad_inputs_name_the_argument():
    q, k, v = _qkv(1, 32, 32, 4, 2, 16, jnp.float32, 0)
    idx = jnp.zeros((1, 2, 2, 2), jnp.int32)
    call = lambda **kw: ops.sparse_attention(**{**dict(q=q, k=k, v=v, block_indices=idx, block_size=16), **kw})  # noqa: E731
    with pytest.raises(ValueError, match="block_indices"):
        call(block_indices=idx.at[0, 0, 0, 0].set(2))  # key blocks are 0 and 1
    with pytest.raises(ValueError, match="block_indices"):
        call(block_indices=idx.at[0, 0, 0, 0].set(-2))
    with pytest.raises(ValueError, match="block_indices"):
        call(block_indices=jnp.zeros((1, 4, 2, 2), jnp.int32))  # kv heads, not query heads
    with pytest.raises(ValueError, match="block_indices"):
        call(block_indices=jnp.zeros((1, 2, 3, 2), jnp.int32))  # cdiv(32, 16) = 2 query blocks
    with pytest.raises(TypeError, match="block_indices"):
        call(block_indices=idx.astype(jnp.float32))
    with pytest.raises(ValueError, match="block_size"):
        call(block_size=0)
    with pytest.raises(ValueError, match="block_size"):
        call(block_size=16.0)
    with pytest.raises(TypeError, match="q, k, v"):
        call(k=k.astype(jnp.bfloat16))
    with pytest.raises(TypeError, match="q"):
        call(q=q.astype(jnp.int32))
    with pytest.raises(ValueError, match="k"):
        call(k=jnp.zeros((1, 32, 3, 16), jnp.float32), v=jnp.zeros((1, 32, 3, 16), jnp.float32))
    with pytest.raises(ValueError, match="v"):
        call(v=v[:, :31])
    with pytest.raises(ValueError, match="q"):
        call(q=q[0])
    with pytest.raises(ValueError, match="scale"):
        call(scale=-1.0)
    with pytest.raises(ValueError, match="logit_soft_cap"):
        call(logit_soft_cap=0.0)
    for backend, block_size in (("triton", 10), ("triton", 256), ("pallas_tpu", 24)):
        impl = ops.OPS["sparse_attention"].implementation(backend)
        if not isinstance(impl, str):  # the kernels' own limits, as supports() reports them
            assert "block_size" in impl.supports(q, k, v, idx, spec=SparseAttentionSpec(block_size=block_size))


@pytest.mark.parametrize("backend", [b for b in ALL_BACKENDS if b not in _SLOW_INTERPRETER])
def test_vmap_equals_the_batched_call(backend):
    q, k, v = _qkv(2, 17, 17, 2, 1, 16, jnp.float32, 6)
    idx = _indices(2, 1, 17, 17, 16, 2, 6)
    f = lambda q, k, v, idx: ops.sparse_attention(q, k, v, block_indices=idx, block_size=16, causal=True,  # noqa: E731
                                                  backend=backend)
    batched = f(q, k, v, idx)
    mapped = jax.vmap(lambda *a: f(*(x[None] for x in a))[0])(q, k, v, idx)
    assert conformance.relative_error(mapped, batched) < 1e-6


@_reference_only
def test_traced_out_of_range_ids_select_nothing():
    # Under jit the ids cannot be checked; ids outside [0, nk) then select nothing, like -1.
    q, k, v = _qkv(1, 32, 32, 2, 1, 16, jnp.float32, 4)
    f = jax.jit(lambda idx: ops.sparse_attention(q, k, v, block_indices=idx, block_size=16, backend="xla"))
    bad = jnp.asarray([[[[0, 7], [1, -5]]]], jnp.int32)
    good = jnp.asarray([[[[0, -1], [1, -1]]]], jnp.int32)
    assert np.array_equal(np.asarray(f(bad)), np.asarray(f(good)))
