"""moe_mlp against a dense per-token reference: every token, the weighted sum over its top-k
experts of that expert's gated MLP, with capacity drops and the aux loss computed independently
(numpy loops), forward and gradients.
"""

from __future__ import annotations

import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import conformance
from forgeax import ops
from forgeax.kernels.common.gated_mlp import activate

BACKENDS = [b for b in conformance.runnable_backends("ragged_dot") if b != "xla"]
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def _routing(logits, top_k, capacity_factor):
    """(experts [T, k], keep [T, k]) by the documented rule, with plain loops."""
    logits = np.asarray(logits, np.float64)
    t, e = logits.shape
    experts = np.argsort(-logits, axis=1, kind="stable")[:, :top_k]
    keep = np.ones((t, top_k), bool)
    if capacity_factor is not None:
        capacity = math.ceil(capacity_factor * t * top_k / e)
        taken = np.zeros(e, int)
        for i in range(t):
            for j in range(top_k):
                keep[i, j] = taken[experts[i, j]] < capacity
                taken[experts[i, j]] += 1
    return experts, keep


def dense_reference(x, logits, w_gate, w_up, w_down, *, top_k, activation="silu", renormalize=True,
                    capacity_factor=None, routing=None):
    """(y [T, D], aux loss): every expert on every token in f32, combined with a [T, E] weight matrix.
    `routing`: (experts, keep) from `_routing` on concrete logits (when logits are traced)."""
    experts, keep = routing if routing is not None else _routing(logits, top_k, capacity_factor)
    t, e = logits.shape
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    chosen = jnp.take_along_axis(probs, jnp.asarray(experts), axis=1)
    if renormalize:
        chosen = chosen / jnp.sum(chosen, axis=1, keepdims=True)
    chosen = jnp.where(jnp.asarray(keep), chosen, 0.0)
    dense_w = jnp.zeros((t, e), jnp.float32).at[jnp.arange(t)[:, None], jnp.asarray(experts)].add(chosen)
    x32 = x.astype(jnp.float32)
    hi = jax.lax.Precision.HIGHEST
    outs = []
    for i in range(e):
        g = jnp.matmul(x32, w_gate[i].astype(jnp.float32), precision=hi)
        u = jnp.matmul(x32, w_up[i].astype(jnp.float32), precision=hi)
        h = (activate(g, activation) * u).astype(x.dtype).astype(jnp.float32)
        outs.append(jnp.matmul(h, w_down[i].astype(jnp.float32), precision=hi))
    y = jnp.einsum("te,ted->td", dense_w, jnp.stack(outs, axis=1), precision=hi)
    counts = np.bincount(experts.reshape(-1), minlength=e)
    aux = e * jnp.sum(counts / (t * top_k) * jnp.mean(probs, axis=0))
    return y.astype(x.dtype), aux


def _inputs(t, d, f, e, dtype, seed):
    ks = jax.random.split(jax.random.key(seed), 5)
    x = conformance.random_array(ks[0], (t, d), dtype)
    logits = conformance.random_array(ks[1], (t, e), jnp.float32, scale=2.0)
    w_gate = conformance.random_array(ks[2], (e, d, f), dtype, scale=d ** -0.5)
    w_up = conformance.random_array(ks[3], (e, d, f), dtype, scale=d ** -0.5)
    w_down = conformance.random_array(ks[4], (e, f, d), dtype, scale=f ** -0.5)
    return x, logits, w_gate, w_up, w_down


# (T, D, F, E, top_k, capacity_factor, renormalize)
CASES = [(19, 16, 24, 4, 2, None, True), (33, 20, 16, 8, 2, 1.0, True), (16, 16, 16, 8, 1, None, False),
         (24, 16, 20, 4, 3, 0.5, True)]


@pytest.mark.parametrize("case", CASES, ids=str)
@pytest.mark.parametrize("backend", BACKENDS)
def test_moe_mlp_matches_dense_reference_f32(backend, case):
    t, d, f, e, k, cf, renorm = case
    if backend in ("triton", "pallas_tpu") and case != CASES[1]:
        pytest.skip("interpreter time: one case (with capacity) in Triton's interpreter")
    if backend == "pallas_gpu":
        pytest.skip("pallas_gpu multiplies bf16/f16 only: test_moe_mlp_bf16_aligned_matches_dense_reference")
    args = _inputs(t, d, f, e, jnp.float32, seed=t + e)
    kw = dict(top_k=k, capacity_factor=cf, renormalize=renorm)
    fn = jax.jit(lambda *a: ops.moe_mlp(*a, return_aux_loss=True, backend=backend, **kw))
    (y, aux) = fn(*args)
    routing = _routing(args[1], k, cf)
    y_ref, aux_ref = jax.jit(lambda *a: dense_reference(*a, routing=routing, **kw))(*args)
    assert conformance.relative_error(y, y_ref) < 1e-5
    assert abs(float(aux) - float(aux_ref)) < 1e-5 * max(1.0, abs(float(aux_ref)))
    # Gradients of x, the router and every weight, through a random cotangent and the aux loss.
    ct = conformance.random_array(jax.random.key(7), y.shape, jnp.float32)
    loss = lambda o, a: jnp.sum(o.astype(jnp.float32) * ct) + 0.3 * a  # noqa: E731
    grads = jax.jit(jax.grad(lambda *a: loss(*ops.moe_mlp(*a, return_aux_loss=True, backend=backend, **kw)),
                             argnums=(0, 1, 2, 3, 4)))(*args)
    ref_grads = jax.jit(jax.grad(lambda *a: loss(*dense_reference(*a, routing=routing, **kw)), argnums=(0, 1, 2, 3, 4)))(*args)
    for i, (g, r) in enumerate(zip(grads, ref_grads)):
        assert np.isfinite(np.asarray(g)).all(), f"grad {i}"
        assert conformance.relative_error(g, r) < 1e-4, f"grad {i}: {conformance.relative_error(g, r)}"


@pytest.mark.parametrize("backend", BACKENDS)
def test_moe_mlp_bf16_gelu_matches_dense_reference(backend):
    args = _inputs(21, 32, 24, 4, jnp.bfloat16, seed=3)
    if backend == "pallas_gpu":
        pytest.skip("pallas_gpu needs D and F multiples of 64: test_moe_mlp_bf16_aligned_matches_dense_reference")
    y = jax.jit(lambda *a: ops.moe_mlp(*a, top_k=2, activation="gelu", backend=backend))(*args)
    y_ref, _ = dense_reference(*(a.astype(jnp.float32) for a in args), top_k=2, activation="gelu")
    assert y.dtype == jnp.bfloat16
    assert conformance.relative_error(y, y_ref) < 2e-2


@pytest.mark.parametrize("backend", [b for b in BACKENDS if b == "pallas_gpu" or jax.default_backend() == "gpu"])
def test_moe_mlp_bf16_aligned_matches_dense_reference(backend):
    # D and F multiples of 64 (the Mosaic GPU kernel's tiles), capacity drops, forward and gradients.
    kw = dict(top_k=2, capacity_factor=1.0)
    args = _inputs(37, 64, 128, 4, jnp.bfloat16, seed=11)
    up = [a.astype(jnp.float32) for a in args]
    routing = _routing(args[1], 2, 1.0)
    y = jax.jit(lambda *a: ops.moe_mlp(*a, backend=backend, **kw))(*args)
    y_ref, _ = dense_reference(*up, routing=routing, **kw)
    assert y.dtype == jnp.bfloat16
    assert conformance.relative_error(y, y_ref) < 2e-2
    ct = conformance.random_array(jax.random.key(13), y.shape, jnp.float32)
    grads = jax.jit(jax.grad(lambda *a: jnp.sum(ops.moe_mlp(*a, backend=backend, **kw).astype(jnp.float32) * ct),
                             argnums=(0, 2, 3, 4)))(*args)
    ref_grads = jax.grad(lambda *a: jnp.sum(dense_reference(*a, routing=routing, **kw)[0] * ct), argnums=(0, 2, 3, 4))(*up)
    for i, (g, r) in enumerate(zip(grads, ref_grads)):
        assert g.dtype == jnp.bfloat16 and np.isfinite(np.asarray(g, np.float32)).all(), f"grad {i}"
        assert conformance.relative_error(g, r) < 3e-2, f"grad {i}: {conformance.relative_error(g, r)}"


def test_capacity_drops_later_tokens():
    # Every token prefers expert 0; capacity 1.0 * T * 1 / E: only the first C tokens reach it.
    t, e = 8, 4
    x, _, w_gate, w_up, w_down = _inputs(t, 8, 8, e, jnp.float32, seed=1)
    logits = jnp.tile(jnp.asarray([[5.0, 0.0, 0.0, 0.0]]), (t, 1))
    y = ops.moe_mlp(x, logits, w_gate, w_up, w_down, top_k=1, capacity_factor=1.0)
    capacity = math.ceil(t / e)
    assert np.all(np.asarray(y[capacity:]) == 0)
    assert np.all(np.abs(np.asarray(y[:capacity])).sum(axis=1) > 0)


def test_aux_loss_is_one_when_balanced():
    t, e = 8, 4
    x, _, w_gate, w_up, w_down = _inputs(t, 8, 8, e, jnp.float32, seed=2)
    logits = jnp.where(jnp.arange(e)[None, :] == (jnp.arange(t) % e)[:, None], 0.0, -1e4)
    _, aux = ops.moe_mlp(x, logits, w_gate, w_up, w_down, top_k=1, return_aux_loss=True)
    assert abs(float(aux) - 1.0) < 1e-5


def test_leading_axes_fold():
    x, logits, w_gate, w_up, w_down = _inputs(12, 8, 8, 4, jnp.float32, seed=4)
    flat = ops.moe_mlp(x, logits, w_gate, w_up, w_down)
    folded = ops.moe_mlp(x.reshape(3, 4, 8), logits.reshape(3, 4, 4), w_gate, w_up, w_down)
    np.testing.assert_array_equal(np.asarray(folded.reshape(12, 8)), np.asarray(flat))


def test_bad_inputs_name_the_argument():
    x, logits, w_gate, w_up, w_down = _inputs(6, 8, 8, 4, jnp.float32, seed=5)
    with pytest.raises(ValueError, match="top_k"):
        ops.moe_mlp(x, logits, w_gate, w_up, w_down, top_k=5)
    with pytest.raises(ValueError, match="top_k"):
        ops.moe_mlp(x, logits, w_gate, w_up, w_down, top_k=0)
    with pytest.raises(ValueError, match="router_logits"):
        ops.moe_mlp(x, logits[:, :3], w_gate, w_up, w_down)
    with pytest.raises(ValueError, match="router_logits"):
        ops.moe_mlp(x, logits[:5], w_gate, w_up, w_down)
    with pytest.raises(ValueError, match="w_up"):
        ops.moe_mlp(x, logits, w_gate, w_up[:, :, :4], w_down)
    with pytest.raises(ValueError, match="w_down"):
        ops.moe_mlp(x, logits, w_gate, w_up, w_down[:, :4])
    with pytest.raises(ValueError, match="w_gate"):
        ops.moe_mlp(x, logits, w_gate[0], w_up, w_down)
    with pytest.raises(TypeError, match="w_gate"):
        ops.moe_mlp(x, logits, w_gate.astype(jnp.bfloat16), w_up, w_down)
    with pytest.raises(ValueError, match="activation"):
        ops.moe_mlp(x, logits, w_gate, w_up, w_down, activation="tanh")
    with pytest.raises(ValueError, match="capacity_factor"):
        ops.moe_mlp(x, logits, w_gate, w_up, w_down, capacity_factor=0.0)
