"""Expert-parallel moe_mlp inside shard_map over 8 CPU devices equals the single-device call:
outputs, the aux loss and the gradients of x, the router logits and every expert weight, with
and without capacity drops (capacity uses global token order across shards)."""

from __future__ import annotations

import parallel_env  # noqa: F401  (8 CPU devices, before jax starts)

parallel_env.interpret_triton_on_cpu()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from forgeax import ops  # noqa: E402

if len(jax.devices()) < 8:
    pytest.skip("needs 8 devices (XLA_FLAGS=--xla_force_host_platform_device_count=8 before jax starts)", allow_module_level=True)


def _inputs(t, d, f, e, seed):
    ks = jax.random.split(jax.random.key(seed), 6)
    x = jax.random.normal(ks[0], (t, d), jnp.float32)
    logits = 2.0 * jax.random.normal(ks[1], (t, e), jnp.float32)
    w_gate = jax.random.normal(ks[2], (e, d, f), jnp.float32) * d ** -0.5
    w_up = jax.random.normal(ks[3], (e, d, f), jnp.float32) * d ** -0.5
    w_down = jax.random.normal(ks[4], (e, f, d), jnp.float32) * f ** -0.5
    cot = jax.random.normal(ks[5], (t, d), jnp.float32)
    return (x, logits, w_gate, w_up, w_down), cot


def _loss(out, aux, cot):
    return jnp.sum(out * cot) + 0.5 * aux


@pytest.mark.parametrize("devices,experts,top_k,capacity_factor,backend", [
    (8, 8, 2, None, "xla_ragged"), (8, 16, 2, 1.0, "xla_ragged"), (4, 8, 3, 0.75, "xla_ragged"),
    # A kernel backend (Triton's interpreter on CPU): its outputs and gradients must come back
    # typed like the shard_map values they stand for (expert weights varying over "ep").
    (4, 8, 2, None, "triton")])
def test_expert_parallel_equals_single_device(devices, experts, top_k, capacity_factor, backend, monkeypatch):
    if backend != "xla_ragged" and jax.default_backend() == "cpu":
        monkeypatch.setenv("FORGEAX_INTERPRET", "1")
    t, d, f = 48, 16, 24
    args, cot = _inputs(t, d, f, experts, seed=experts + top_k)
    kw = dict(top_k=top_k, capacity_factor=capacity_factor, return_aux_loss=True, backend=backend)

    def single(*a):
        out, aux = ops.moe_mlp(*a, **kw)
        return _loss(out, aux, cot), (out, aux)

    (ref_loss, (ref_out, ref_aux)), ref_grads = jax.jit(jax.value_and_grad(single, argnums=(0, 1, 2, 3, 4), has_aux=True))(*args)

    mesh = jax.make_mesh((devices,), ("ep",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:devices])
    shard = P("ep")

    def local(x, logits, wg, wu, wd, c):
        out, aux = ops.moe_mlp(x, logits, wg, wu, wd, expert_axis="ep", **kw)
        return out, aux, jax.lax.psum(jnp.sum(out * c), "ep") + 0.5 * aux

    parallel = jax.shard_map(local, mesh=mesh, in_specs=(shard,) * 6, out_specs=(shard, P(), P()))

    def loss(*a):
        out, aux, value = parallel(*a, cot)
        return value, (out, aux)

    (loss_value, (out, aux)), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4), has_aux=True))(*args)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref_out), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(float(aux), float(ref_aux), rtol=1e-5)
    np.testing.assert_allclose(float(loss_value), float(ref_loss), rtol=1e-5)
    for i, (g, r) in enumerate(zip(grads, ref_grads)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-4, atol=1e-5, err_msg=f"grad {i}")


def test_expert_axis_checks_the_global_expert_count():
    args, _ = _inputs(16, 8, 8, 8, seed=0)
    mesh = jax.make_mesh((8,), ("ep",), axis_types=(jax.sharding.AxisType.Auto,))
    bad = jax.shard_map(lambda x, l, a, b, c: ops.moe_mlp(x, l[:, :4], a, b, c, expert_axis="ep"), mesh=mesh,
                        in_specs=(P("ep"),) * 5, out_specs=P("ep"))
    with pytest.raises(ValueError, match="router_logits"):
        jax.jit(bad)(*args)
