"""Vocabulary-parallel linear_cross_entropy (axis_name) inside shard_map over 8 devices.

The weight [H, V] and bias [V] are split over the vocabulary (each device a
contiguous V/8 slice); x and the targets (global ids) are replicated. Loss and
gradients (x, W, b) must equal the single-device reference for every
reduction, with label smoothing, z-loss, soft cap and ignored / out-of-range
targets, for the xla and xla_chunked backends (the kernel backends: vocab_parallel_kernels_parallel_test.py),
with shard_map's vma checking on (x's gradient is psum-ed inside the op) and
off (shard_map's transpose psums it).

Needs 8 devices: on CPU, XLA_FLAGS=--xla_force_host_platform_device_count=8
before JAX initialises. This file sets it when it is the first to import jax
(run it in its own process/target); otherwise it skips.
"""

from __future__ import annotations

import parallel_env  # noqa: F401  (first: XLA_FLAGS before jax starts)

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import conformance
from forgeax import ops
from forgeax.kernels.common.losses import LossSpec
from forgeax.kernels.xla import linear_cross_entropy as reference

DEVICES = 8
IGNORE = -100
BACKENDS = ["xla", "xla_chunked"]

parallel_env.skip_unless_devices(cpu=DEVICES)


def _mesh(shape, names):
    return jax.make_mesh(shape, names, axis_types=(jax.sharding.AxisType.Auto,) * len(names))


def _inputs(tokens, hidden, vocab, dtype, seed):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((tokens, hidden), np.float32).astype(jnp.dtype(dtype)))
    w = jnp.asarray((3.0 / np.sqrt(hidden) * rng.standard_normal((hidden, vocab), np.float32)).astype(jnp.dtype(dtype)))
    b = jnp.asarray(rng.standard_normal((vocab,), np.float32).astype(jnp.dtype(dtype)))
    t = rng.integers(0, vocab, (tokens,), dtype=np.int32)
    t[::5] = IGNORE
    t[1] = vocab + 3  # out of range: treated like ignore_index
    t[2] = vocab - 1  # the last id lives on the last shard
    t[3] = 0
    return x, w, b, jnp.asarray(t)


def _vocab_parallel(mesh, backend, tokens_axis=None, check_vma=True, **kwargs):
    """loss(x, w, b, t) with W and b split over mesh axis "v"."""
    batch = P(tokens_axis) if tokens_axis else P()
    out = batch if kwargs.get("reduction", "mean") == "none" else P()
    fn = lambda x, w, b, t: ops.linear_cross_entropy(x, w, t, bias=b, axis_name="v", backend=backend, **kwargs)  # noqa: E731
    specs = (batch, P(None, "v"), P("v"), batch)
    return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=specs, out_specs=out, check_vma=check_vma))


def _loss_and_grads(fn, x, w, b, t, cot):
    return jax.jit(lambda x, w, b: (lambda o, pull: (o, pull(cot)))(*jax.vjp(lambda *a: fn(*a, t), x, w, b)))(x, w, b)


def _assert_equal_to_reference(got, x, w, b, t, cot, tol, **kwargs):
    ref = lambda x, w, b, t: reference.linear_cross_entropy(x, w, t, b, spec=LossSpec(**kwargs))  # noqa: E731
    up = lambda a: a.astype(jnp.float32)  # noqa: E731
    out, grads = got
    want, want_grads = _loss_and_grads(ref, up(x), up(w), up(b), t, cot)
    assert out.dtype == jnp.float32 and out.shape == want.shape
    assert conformance.relative_error(out, want) < 1e-5, (out, want)
    for name, g, r, a in zip("xwb", grads, want_grads, (x, w, b)):
        assert g.dtype == a.dtype and g.shape == a.shape, name
        err = conformance.relative_error(g, r)
        assert err < tol, (name, err)


OPTIONS = {
    "plain": {},
    "all": dict(label_smoothing=0.1, z_loss=1e-3, logit_soft_cap=5.0),
    "custom_ignore": dict(label_smoothing=0.2, z_loss=1e-4, ignore_index=4),
}


@pytest.mark.parametrize("option", OPTIONS)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_vocab_parallel_equals_single_device(backend, reduction, option):
    mesh = _mesh((DEVICES,), ("v",))
    kwargs = dict(OPTIONS[option], reduction=reduction)
    x, w, b, t = _inputs(13, 32, 1000, jnp.float32, seed=len(option) + len(reduction))
    if "ignore_index" in kwargs:
        t = t.at[4].set(kwargs["ignore_index"])
    cot = jnp.asarray(np.random.default_rng(1).standard_normal((13,) if reduction == "none" else (), np.float32))
    sharded = _vocab_parallel(mesh, backend, chunk_size=4, **kwargs)
    _assert_equal_to_reference(_loss_and_grads(sharded, x, w, b, t, cot), x, w, b, t, cot, 1e-5, **kwargs)


@pytest.mark.parametrize("backend", BACKENDS)
def test_vocab_parallel_bf16_and_without_vma_checks(backend):
    mesh = _mesh((DEVICES,), ("v",))
    kwargs = dict(reduction="mean", label_smoothing=0.1, z_loss=1e-3)
    x, w, b, t = _inputs(11, 32, 1000, jnp.bfloat16, seed=2)
    cot = jnp.float32(0.7)
    sharded = _vocab_parallel(mesh, backend, chunk_size=4, **kwargs)
    _assert_equal_to_reference(_loss_and_grads(sharded, x, w, b, t, cot), x, w, b, t, cot, 1e-2, **kwargs)
    x, w, b, t = _inputs(11, 32, 1000, jnp.float32, seed=3)
    for reduction in ("sum", "none"):
        kwargs["reduction"] = reduction
        cot = jnp.asarray(np.random.default_rng(2).standard_normal((11,) if reduction == "none" else (), np.float32))
        unchecked = _vocab_parallel(mesh, backend, check_vma=False, chunk_size=4, **kwargs)
        _assert_equal_to_reference(_loss_and_grads(unchecked, x, w, b, t, cot), x, w, b, t, cot, 1e-5, **kwargs)


@pytest.mark.parametrize("backend", BACKENDS)
def test_vocab_parallel_with_data_parallel_tokens(backend):
    mesh = _mesh((2, 4), ("data", "v"))
    x, w, b, t = _inputs(6, 32, 1000, jnp.float32, seed=3)
    kwargs = dict(reduction="none", label_smoothing=0.1, z_loss=1e-3)
    sharded = _vocab_parallel(mesh, backend, tokens_axis="data", chunk_size=2, **kwargs)
    cot = jnp.arange(6.0)
    _assert_equal_to_reference(_loss_and_grads(sharded, x, w, b, t, cot), x, w, b, t, cot, 1e-5, **kwargs)


@pytest.mark.parametrize("backend", BACKENDS)
def test_all_ignored_vocab_parallel_mean_is_zero_with_zero_gradients(backend):
    mesh = _mesh((DEVICES,), ("v",))
    x, w, b, _ = _inputs(4, 32, 1000, jnp.float32, seed=4)
    t = jnp.full((4,), IGNORE, jnp.int32)
    sharded = _vocab_parallel(mesh, backend, reduction="mean", label_smoothing=0.1)
    loss, grads = jax.jit(jax.value_and_grad(lambda x, w, b: sharded(x, w, b, t), argnums=(0, 1, 2)))(x, w, b)
    assert float(loss) == 0.0 and all(bool(jnp.all(g == 0)) for g in grads)


def test_backend_selection_keeps_the_kernels_for_vocab_parallel():
    # The kernel backends run vocabulary-parallel (tests/vocab_parallel_kernels_parallel_test.py).
    mesh = _mesh((DEVICES,), ("v",))
    x, w, b, t = _inputs(4, 32, 1000, jnp.float32, seed=5)
    fn = jax.shard_map(lambda x, w, t: ops.linear_cross_entropy(x, w, t, axis_name="v"), mesh=mesh, in_specs=(P(), P(None, "v"), P()), out_specs=P())
    expected = {"gpu": "triton", "tpu": "pallas_tpu", "cpu": "xla"}[jax.default_backend() if jax.default_backend() in ("tpu", "cpu") else "gpu"]
    assert ops.explain(fn, x, w, t).backends() == (expected,)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_chunked_data_parallel_in_shard_map_with_a_replicated_weight(reduction):
    # Tokens split over "data", W replicated: dW is typed invariant like W (the per-device sums,
    # scaled by each device's cotangent, are psum-ed in the backward), and equals the reference.
    mesh = _mesh((DEVICES,), ("data",))
    x, w, b, t = _inputs(16, 32, 100, jnp.float32, seed=6)
    kwargs = dict(reduction=reduction, label_smoothing=0.1)

    def body(x, w, b, t):
        loss = ops.linear_cross_entropy(x, w, t, bias=b, backend="xla_chunked", chunk_size=4, **kwargs)
        return jax.lax.psum(jnp.sum(loss * (1.0 + jnp.arange(loss.size).reshape(loss.shape))), "data")

    sharded = jax.shard_map(body, mesh=mesh, in_specs=(P("data"), P(), P(), P("data")), out_specs=P())
    got = jax.jit(jax.value_and_grad(sharded, argnums=(0, 1, 2)))(x, w, b, t)

    def ref(x, w, b):
        parts = [reference.linear_cross_entropy(x[i:i + 2], w, t[i:i + 2], b, spec=LossSpec(**kwargs)) for i in range(0, 16, 2)]
        return sum(jnp.sum(p * (1.0 + jnp.arange(p.size).reshape(p.shape))) for p in parts)

    want = jax.value_and_grad(ref, argnums=(0, 1, 2))(x, w, b)
    for g, r in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert conformance.relative_error(g, r) < 1e-5
