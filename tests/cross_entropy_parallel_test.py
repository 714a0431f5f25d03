"""Vocabulary-parallel cross_entropy (axis_name) inside shard_map over 8 devices.

Each device holds a contiguous V/8 slice of the logits' vocabulary; targets are
global ids. The loss and the gradient must equal the single-device ones for
every reduction, with label smoothing, z-loss, soft cap and ignored /
out-of-range targets.

Needs 8 devices: on CPU, XLA_FLAGS=--xla_force_host_platform_device_count=8
before JAX initialises. This file sets it when it is the first to import jax
(run it in its own process/target); otherwise it skips.
"""

from __future__ import annotations

import parallel_env  # noqa: F401  (first: XLA_FLAGS before jax starts)

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import conformance
from forgeax import ops
from forgeax.kernels.common.losses import LossSpec
from forgeax.kernels.xla import cross_entropy as reference

DEVICES = 8
IGNORE = -100

parallel_env.skip_unless_devices(cpu=DEVICES)


def _mesh(shape, names):
    # Auto axes: shard_map takes unsharded inputs and splits them by in_specs.
    return jax.make_mesh(shape, names, axis_types=(jax.sharding.AxisType.Auto,) * len(names))


def _inputs(shape, vocab, dtype, seed):
    rng = np.random.default_rng(seed)
    logits = jnp.asarray((3.0 * rng.standard_normal(shape + (vocab,), np.float32)).astype(jnp.dtype(dtype)))
    targets = rng.integers(0, vocab, shape, dtype=np.int32)
    flat = targets.reshape(-1)
    flat[::5] = IGNORE
    flat[1] = vocab + 3  # out of range: treated like ignore_index
    flat[2] = vocab - 1  # the last id lives on the last shard
    flat[3] = 0
    return logits, jnp.asarray(targets)


def _vocab_parallel(mesh, tokens_axis=None, **kwargs):
    """loss(logits, targets) with the vocabulary split over mesh axis "v"."""
    batch = P(tokens_axis) if tokens_axis else P()
    reduced = kwargs.get("reduction", "mean") != "none"
    out = P() if reduced else batch
    fn = functools.partial(ops.cross_entropy, axis_name="v", **kwargs)
    return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=(P(tokens_axis, "v"), batch), out_specs=out))


OPTIONS = {
    "plain": {},
    "all": dict(label_smoothing=0.1, z_loss=1e-3, logit_soft_cap=5.0),
    "custom_ignore": dict(label_smoothing=0.2, z_loss=1e-4, ignore_index=4),
}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("option", OPTIONS)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_vocab_parallel_equals_single_device(reduction, option, dtype):
    mesh = _mesh((DEVICES,), ("v",))
    kwargs = dict(OPTIONS[option], reduction=reduction)
    logits, targets = _inputs((12,), 1000, dtype, seed=len(option) + len(reduction))
    if "ignore_index" in kwargs:
        targets = targets.at[4].set(kwargs["ignore_index"])
    sharded = _vocab_parallel(mesh, **kwargs)
    single = jax.jit(functools.partial(ops.cross_entropy, **kwargs))

    out = sharded(logits, targets)
    want = single(logits, targets)
    assert out.dtype == jnp.float32 and out.shape == want.shape
    assert conformance.relative_error(out, want) < 1e-5, (out, want)

    cot = jnp.asarray(np.random.default_rng(1).standard_normal(want.shape, np.float32))
    grad = jax.jit(lambda x: jax.vjp(lambda y: sharded(y, targets), x)[1](cot)[0])(logits)
    want_grad = jax.jit(lambda x: jax.vjp(lambda y: single(y, targets), x)[1](cot)[0])(logits)
    assert grad.dtype == logits.dtype
    tol = 1e-5 if dtype == "float32" else 1e-2
    assert conformance.relative_error(grad, want_grad) < tol
    # Against the f32 reference too (the single-device op is checked against it elsewhere).
    ref = reference.cross_entropy(logits.astype(jnp.float32), targets, spec=LossSpec(**kwargs))
    assert conformance.relative_error(out, ref) < 1e-5


def test_vocab_parallel_with_data_parallel_tokens():
    mesh = _mesh((2, 4), ("data", "v"))
    logits, targets = _inputs((6,), 1000, jnp.float32, seed=3)
    kwargs = dict(reduction="none", label_smoothing=0.1, z_loss=1e-3)
    sharded = _vocab_parallel(mesh, tokens_axis="data", **kwargs)
    out = sharded(logits, targets)
    want = reference.cross_entropy(logits, targets, spec=LossSpec(**kwargs))
    assert conformance.relative_error(out, want) < 1e-5
    grad = jax.jit(jax.grad(lambda x: jnp.sum(sharded(x, targets) * jnp.arange(6.0))))(logits)
    want_grad = jax.grad(lambda x: jnp.sum(reference.cross_entropy(x, targets, spec=LossSpec(**kwargs)) * jnp.arange(6.0)))(logits)
    assert conformance.relative_error(grad, want_grad) < 1e-5


def test_all_ignored_vocab_parallel_mean_is_zero_with_zero_gradient():
    mesh = _mesh((DEVICES,), ("v",))
    logits, _ = _inputs((4,), 1000, jnp.float32, seed=4)
    targets = jnp.full((4,), IGNORE, jnp.int32)
    sharded = _vocab_parallel(mesh, reduction="mean", label_smoothing=0.1)
    loss, grad = jax.jit(jax.value_and_grad(lambda x: sharded(x, targets)))(logits)
    assert float(loss) == 0.0 and bool(jnp.all(grad == 0))


def test_backend_selection_for_vocab_parallel():
    # The kernel backends run vocabulary-parallel too (tests/vocab_parallel_kernels_parallel_test.py).
    mesh = _mesh((DEVICES,), ("v",))
    logits, targets = _inputs((4,), 1000, jnp.float32, seed=5)
    fn = jax.shard_map(lambda x, t: ops.cross_entropy(x, t, axis_name="v"), mesh=mesh, in_specs=(P(None, "v"), P()), out_specs=P())
    expected = {"cpu": "xla", "tpu": "pallas_tpu"}.get(jax.default_backend(), "triton")
    assert ops.explain(fn, logits, targets).backends() == (expected,)
