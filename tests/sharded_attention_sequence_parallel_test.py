"""Sequence-sharded `ops.attention` under plain jax.jit (no shard_map) runs as ring attention.

q, k, v placed with NamedSharding over the sequence axis (alone, or with the batch or heads axis
over another mesh axis): each device keeps its query block, key / value blocks travel by
collective-permute (kernels/common/attention.py `_ring_launch`, the ring of kernels/common/ring.py).
Checked on 8 CPU devices with xla_chunked (the shared attention shell, like the kernel backends):
forward, lse and gradients equal the unsharded call (causal, not, windows, segment ids, GQA, soft
cap), outputs stay sequence-sharded, and the compiled program permutes blocks and all-gathers no
activation. The Triton kernels' window handling (boolean mask blocks where a shifted bound would be
negative) is checked with the chunk loop behind the same shell. Calls the ring does not serve
(a bias, query and key lengths that differ) stay gathered and correct. On >= 2 GPUs the same tests
run the Triton and Mosaic GPU kernels natively (interpreted kernels are not partitioned on CPU).
"""

from __future__ import annotations

import parallel_env  # first: XLA_FLAGS before jax starts

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import conformance
from forgeax import ops
from forgeax.core.runtime import interpret_mode
from forgeax.kernels.common.attention import AttentionKernels, AttentionSpec, differentiable_attention
from forgeax.kernels.xla.attention import chunked_backward, chunked_forward

ON_GPU = parallel_env.skip_unless_devices(cpu=8, gpu=2)
BACKENDS = ["xla_chunked", "triton", "pallas_gpu"]
_ALL_GATHER = re.compile(r"= (\(.*?\)|\S+) all-gather(?:-start)?\(")


def _mesh():
    n = len(jax.devices())
    shape = (n // 2, 2) if n >= 4 else (n, 1)  # (sequence, other): 4 x 2 on 8 CPU devices
    return jax.make_mesh(shape, ("seq", "other"), axis_types=(jax.sharding.AxisType.Auto,) * 2)


def _backend(backend):
    if backend != "xla_chunked" and not ON_GPU:
        pytest.skip("the GPU kernels are partitioned only natively (interpreted kernels are gathered)")
    return backend


def _sizes(backend):
    """(T, H, dtype, tolerance): small f32 on CPU; bf16 (what the Mosaic GPU kernels take) on GPUs."""
    if backend == "xla_chunked" and not ON_GPU:
        return 32, 16, jnp.float32, 1e-5
    return 128 * _mesh().shape["seq"], 64, jnp.bfloat16, 2e-2


def _inputs(B, T, N, K, H, dtype, seed):
    keys = jax.random.split(jax.random.key(seed), 4)
    q, k, v = (jax.random.normal(kk, (B, T, n, H), jnp.float32).astype(dtype) for kk, n in zip(keys, (N, K, K)))
    cot = jax.random.normal(keys[3], (B, T, N, H), jnp.float32)
    return q, k, v, cot


def _check(fn, arrays, spec, *, tol, ringed=True, seg_spec=None):
    """fn(q, k, v, cot, *rest) -> (loss, aux): sharded under jit equals unsharded, value and grads."""
    mesh = _mesh()
    put = lambda a, s: jax.device_put(a, NamedSharding(mesh, s))  # noqa: E731
    sharded = tuple(put(a, spec) for a in arrays[:4]) + tuple(put(a, seg_spec) for a in arrays[4:])
    grad = jax.value_and_grad(fn, argnums=(0, 1, 2), has_aux=True)
    with interpret_mode(False):  # the launches are partitioned only outside the interpreters
        want = jax.jit(grad)(*arrays)
        step = jax.jit(grad)
        got = step(*sharded)
        hlo = step.lower(*sharded).compile().as_text()
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert g.shape == w.shape
        assert conformance.relative_error(g, w) < (max(tol, 1e-4) if g.ndim == 0 else tol)
    if not ringed:
        return
    assert got[1][0].sharding.is_equivalent_to(sharded[0].sharding, 4)  # dq keeps q's sharding
    assert got[0][1][0].sharding.is_equivalent_to(sharded[0].sharding, 4)  # so does out
    assert "collective-permute" in hlo
    smallest = min(a.size for a in arrays[:3])  # a whole k / v / q activation
    gathered = [s for s in _ALL_GATHER.findall(hlo) if parallel_env.elements(s) >= smallest]
    assert not gathered, f"all-gathers of whole activations in the compiled program: {gathered}"


def _loss(backend, **kwargs):
    def fn(q, k, v, cot, *seg):
        out, lse = ops.attention(q, k, v, backend=backend, return_lse=True,
                                 segment_ids=tuple(seg) if seg else None, **kwargs)
        return jnp.sum(out.astype(jnp.float32) * cot) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0)), (out, lse)
    return fn


CASES = {
    # name: (spec of [B, T, N, H], attention options)
    "seq_causal": (P(None, "seq"), dict(causal=True)),
    "seq_batch": (P("other", "seq"), dict()),
    "seq_heads_window": (P(None, "seq", "other"), dict(window=(5, 3), logit_soft_cap=4.0)),
    "seq_causal_window": (P(None, ("seq", "other")), dict(causal=True, window=(11, None))),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", CASES)
def test_sequence_sharded_attention_runs_the_ring(backend, case):
    backend = _backend(backend)
    spec, kwargs = CASES[case]
    T, H, dtype, tol = _sizes(backend)
    window = "window" in kwargs
    # pallas_gpu does not ring windows (its kernels take no negative shifted bounds): gathered.
    _check(_loss(backend, **kwargs), _inputs(2, T, 4, 2, H, dtype, seed=len(case)), spec, tol=tol,
           ringed=not (window and backend == "pallas_gpu"))


@pytest.mark.skipif(ON_GPU, reason="on GPUs the test above runs bf16")
def test_bf16_ring_returns_the_kernels_dtypes():
    # xla_chunked's backward returns f32 dq, dk, dv for bf16 inputs: the ring launch must return
    # the kernel's types too (custom_partitioning rejects bf16 where the unsplit launch gives f32).
    _check(_loss("xla_chunked", causal=True), _inputs(2, 32, 4, 2, 16, jnp.bfloat16, seed=3), P(None, "seq"), tol=2e-2)


@pytest.mark.parametrize("backend", BACKENDS)
def test_segments_across_shard_boundaries(backend):
    backend = _backend(backend)
    T, H, dtype, tol = _sizes(backend)
    lengths = np.diff(np.round(np.linspace(0, T, 6)).astype(int)) + np.array([3, -3, 5, -2, -3])
    ids = jnp.asarray(np.repeat(np.arange(5), lengths)[None].repeat(2, 0), jnp.int32)
    _check(_loss(backend, causal=True), _inputs(2, T, 4, 1, H, dtype, seed=7) + (ids, ids), P("other", "seq"),
           tol=tol, seg_spec=P("other", "seq"))


def test_triton_window_blocks_as_masks():
    # The Triton kernels read a negative window bound as "none": where a block's shifted bound is
    # negative the shell passes a boolean mask block instead (ring="mask"). Checked with the chunk
    # loop behind that same shell, called as a backend's fn is (normalised arguments).
    masked = differentiable_attention(AttentionKernels(chunked_forward, chunked_backward, ring="mask"))
    shifted = differentiable_attention(AttentionKernels(chunked_forward, chunked_backward, ring="shift"))
    spec = AttentionSpec(causal=True, scale=0.25, window_left=9, window_right=0, return_lse=True)

    def loss(impl):
        def fn(q, k, v, cot):
            out, lse = impl(q, k, v, None, None, None, None, None, spec=spec)
            return jnp.sum(out * cot) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0)), (out, lse)
        return fn

    arrays = _inputs(1, 32, 2, 2, 16, jnp.float32, seed=9)
    _check(loss(masked), arrays, P(None, ("seq", "other")), tol=1e-5)
    _check(loss(shifted), arrays, P(None, ("seq", "other")), tol=1e-5)


@pytest.mark.skipif(ON_GPU, reason="CPU: the shell's fallbacks")
def test_calls_the_ring_does_not_serve_stay_gathered_and_correct():
    # Query and key lengths that differ (chunked prefill over a cache); a bias array: gathered.
    q, _, _, cot = _inputs(1, 32, 2, 2, 8, jnp.float32, seed=11)
    _, k, v, _ = _inputs(1, 48, 2, 2, 8, jnp.float32, seed=12)
    _check(_loss("xla_chunked", causal=True), (q, k, v, cot), P(None, "seq"), tol=1e-5, ringed=False)
    bias = jax.random.normal(jax.random.key(12), (1, 1, 32, 32))
    q, k, v, cot = _inputs(1, 32, 2, 2, 8, jnp.float32, seed=13)

    def fn(q, k, v, cot):
        out = ops.attention(q, k, v, bias=bias, causal=True, backend="xla_chunked")
        return jnp.sum(out * cot), out
    _check(fn, (q, k, v, cot), P(None, "seq"), tol=1e-5, ringed=False)
