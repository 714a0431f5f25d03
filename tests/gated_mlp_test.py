"""gated_mlp: every runnable backend against the XLA reference, forward and gradients.

On CPU this runs under FORGEAX_INTERPRET=1 (the Pallas TPU interpreter; the Triton interpreter
in its own target, gated_mlp_triton_interpret_test.py, with TRITON_INTERPRET=1); on a GPU it
runs the real kernels: `pytest tests/gated_mlp_test.py` against the installed wheel.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import conformance
from forgeax import core as interface
from forgeax import ops
from forgeax.kernels.common.gated_mlp import ACTIVATIONS, GatedMLPSpec
from forgeax.kernels.xla import gated_mlp as reference

DTYPES = {"f32": jnp.float32, "bf16": jnp.bfloat16}
# (leading axes of x, K, N, K_out or None): M = 1, 17, 300; K and N off every block size.
SHAPES = [((1,), 96, 200, None), ((17,), 260, 48, 40), ((2, 150), 96, 200, 72), ((3, 5), 40, 24, None)]
BACKENDS = conformance.runnable_backends("gated_mlp")


def _reference(x, w_gate, w_up, w_down, *, activation):
    return reference.gated_mlp(x, w_gate, w_up, w_down, spec=GatedMLPSpec(activation=activation))


def _case(lead, k, n, k_out, dtype, *, activation="silu", fused=False, seed=0):
    kx, kg, ku, kd = jax.random.split(jax.random.key(seed), 4)
    x = conformance.random_array(kx, (*lead, k), dtype)
    # Weights scaled by 1/sqrt(fan-in): gate/up pre-activations ~ N(0, 1), where every
    # activation is non-linear (both relu sides, silu's curve, gelu's bend).
    w_gate = conformance.random_array(kg, (k, n), dtype, scale=k ** -0.5)
    w_up = conformance.random_array(ku, (k, n), dtype, scale=k ** -0.5)
    w_down = None if k_out is None else conformance.random_array(kd, (n, k_out), dtype, scale=n ** -0.5)
    if fused:
        args = (jnp.stack([w_gate, w_up], axis=1),)
        args = (x, args[0], None, w_down)
        diff = (0, 1) if w_down is None else (0, 1, 3)
    else:
        args = (x, w_gate, w_up, w_down)
        diff = (0, 1, 2) if w_down is None else (0, 1, 2, 3)
    name = f"gated_mlp(x{(*lead, k)}, N={n}, down={k_out}, {'fused' if fused else 'separate'})"
    return conformance.Case(name, ops.gated_mlp, _reference, args, {"activation": activation}, diff)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("backend", BACKENDS)
def test_gated_mlp_matches_reference(backend, shape, dtype):
    conformance.assert_conforms(_case(*shape, DTYPES[dtype], seed=hash((shape, dtype)) % 1000), backend)


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_each_activation_matches_reference_f32(backend, activation):
    # f32 (tolerance 1e-5): a wrong activation derivative cannot hide in bf16 rounding.
    conformance.assert_conforms(_case((33,), 48, 40, 24, jnp.float32, activation=activation, seed=7), backend)


@pytest.mark.parametrize("down", [None, 56], ids=["no_down", "down"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("backend", BACKENDS)
def test_fused_weight_matches_reference(backend, dtype, down):
    conformance.assert_conforms(_case((19,), 72, 40, down, DTYPES[dtype], fused=True, seed=11), backend)


# K and N multiples of 64 (what the Mosaic GPU wgmma kernel takes), bf16, one activation and weight
# form each: rows off the 128-row tile, several K steps, several column tiles, one tiny case.
ALIGNED = [((17,), 128, 192, 64, "silu", False), ((2, 150), 64, 128, None, "gelu", True),
           ((5,), 320, 64, 64, "gelu_tanh", True), ((130,), 64, 64, None, "relu", False)]


@pytest.mark.parametrize("case", ALIGNED, ids=str)
@pytest.mark.parametrize("backend", BACKENDS)
def test_wgmma_aligned_shapes_match_reference_bf16(backend, case):
    *shape, activation, fused = case
    conformance.assert_conforms(_case(*shape, jnp.bfloat16, activation=activation, fused=fused, seed=13), backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_f16_gelu_tanh_matches_reference(backend):
    conformance.assert_conforms(_case((9,), 32, 24, 16, jnp.float16, activation="gelu_tanh", seed=5), backend)


@pytest.mark.parametrize("fused", [False, True], ids=["separate", "fused"])
@pytest.mark.parametrize("backend", [b for b in BACKENDS if b == "triton"])
def test_saved_preactivations_match_reference(backend, fused):
    # The other residual trade: the forward writes [gate | up], the backward skips its recompute.
    from forgeax.kernels.triton.gated_mlp import GatedMLPConfig

    case = _case((2, 21), 80, 72, 40, jnp.bfloat16, activation="gelu", fused=fused, seed=17)
    config = GatedMLPConfig(block_m=32, block_n=32, block_k=32, group_m=2, num_warps=4, num_stages=1, save_preactivations=True)
    case = dataclasses.replace(case, public=functools.partial(ops.gated_mlp, config=config))
    conformance.assert_conforms(case, backend)


# The pallas_gpu forward's two kernels and both accumulator widths, where they differ: several
# tiles per persistent CTA (interpret mode runs 2 CTAs), a K loop longer than the TMA ring (5
# steps, 3 slots) and ring uses carried from tile to tile, rows off the 128-row tile.
# named_barriers: hardware named barriers on the GPU (the interpreter runs them as mbarriers);
# cluster_m=2: CTA pairs sharing the weight tiles by multicast.
PALLAS_GPU_FORWARDS = {"warp_specialized_128": dict(block_n=128), "warp_specialized_64": dict(block_n=64),
                       "warp_specialized_named": dict(named_barriers=True),
                       "warp_specialized_cluster": dict(cluster_m=2), "one_warpgroup": dict(warp_specialized=False)}


@pytest.mark.parametrize("form", PALLAS_GPU_FORWARDS)
@pytest.mark.parametrize("backend", [b for b in BACKENDS if b == "pallas_gpu"])
def test_pallas_gpu_forward_forms_match_reference(backend, form):
    from forgeax.kernels.pallas.gpu.gated_mlp import GatedMLPPallasGpuConfig

    config = GatedMLPPallasGpuConfig(stages=3, group_m=2, **PALLAS_GPU_FORWARDS[form])
    case = _case((300,), 320, 256, None, jnp.bfloat16, activation="silu", fused=form == "warp_specialized_64", seed=23)
    case = dataclasses.replace(case, public=functools.partial(ops.gated_mlp, config=config))
    conformance.assert_conforms(case, backend)


def _avals(jaxpr):
    """Every value a jaxpr (and the jaxprs inside its equations) produces."""
    for eqn in jaxpr.eqns:
        yield from (v.aval for v in eqn.outvars)
        for param in eqn.params.values():
            for sub in param if isinstance(param, (tuple, list)) else (param,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    yield from _avals(inner)


# The XLA backends are not fused kernels (xla_dot leaves the fusion to XLA's compiler).
@pytest.mark.parametrize("backend", [b for b in BACKENDS if b not in ("xla", "xla_dot")])
def test_kernel_forward_writes_no_preactivations(backend):
    # The point of the fusion: the forward produces h [M, N] and nothing of width 2N, and no f32
    # [M, N] (the unfused gate and up products).
    m, n = 256, 128
    case = _case((m,), 64, n, None, jnp.bfloat16, seed=3)
    for fused in (False, True):
        args = case.args if not fused else (case.args[0], jnp.stack(case.args[1:3], axis=1), None, None)
        jaxpr = jax.make_jaxpr(lambda *a: ops.gated_mlp(*a, backend=backend))(*args).jaxpr
        shapes = [(tuple(a.shape), jnp.dtype(a.dtype)) for a in _avals(jaxpr) if hasattr(a, "shape")]
        assert ((m, n), jnp.dtype(jnp.bfloat16)) in shapes, shapes
        for shape, dtype in shapes:
            assert shape not in ((m, 2 * n), (m, 2, n)), f"{backend}: a [M, 2N] value {shape} in the forward"
            assert not (shape == (m, n) and dtype == jnp.float32), f"{backend}: an f32 [M, N] value in the forward"


@pytest.mark.parametrize("backend", BACKENDS)
def test_vmap_and_checkpoint_match_reference(backend):
    # vmap over x (folded into the rows) and over x and w_down (per batch element), under
    # jax.checkpoint and grad: the kernels have no batching rule of their own.
    case = _case((3, 64), 64, 64, 64, jnp.bfloat16, seed=23)
    x, w_gate, w_up, w_down = case.args
    downs = jnp.stack([w_down, -w_down, 0.5 * w_down])
    cot = conformance.random_array(jax.random.key(29), (3, 64, 64), jnp.float32)

    def loss(fn, x, wg, wu, wd, c):
        return jnp.sum(fn(x, wg, wu, wd).astype(jnp.float32) * c)

    ours = functools.partial(ops.gated_mlp, backend=backend)
    if not (backend in ("pallas_gpu", "pallas_tpu") and interface.current_platform() == "cpu"):
        ours = jax.checkpoint(ours)  # the Mosaic interpreters' effects cannot be rematerialised
    ref = functools.partial(_reference, activation="silu")
    up = lambda a: a.astype(jnp.float32)  # noqa: E731
    for in_axes, wd in (((0, None, None, None, 0), w_down), ((0, None, None, 0, 0), downs)):
        got = jax.jit(jax.vmap(jax.grad(functools.partial(loss, ours), argnums=(0, 1, 3)), in_axes=in_axes))(x, w_gate, w_up, wd, cot)
        want = jax.vmap(jax.grad(functools.partial(loss, ref), argnums=(0, 1, 3)), in_axes=in_axes)(up(x), up(w_gate), up(w_up), up(wd), cot)
        for g, w in zip(got, want):
            assert conformance.relative_error(g, w) < 1e-2, in_axes


def test_fused_weight_equals_separate_weights():
    case = _case((6,), 32, 16, None, jnp.float32, seed=2)
    x, w_gate, w_up, _ = case.args
    separate = ops.gated_mlp(x, w_gate, w_up, backend="xla")
    fused = ops.gated_mlp(x, jnp.stack([w_gate, w_up], axis=1), None, backend="xla")
    np.testing.assert_array_equal(np.asarray(separate), np.asarray(fused))


# ---------------------------------------------------------------- bad input: each error names the argument


def test_bad_inputs_raise_errors_that_name_the_argument():
    x = jnp.ones((4, 8), jnp.float32)
    wg = jnp.ones((8, 6), jnp.float32)
    wd = jnp.ones((6, 5), jnp.float32)
    cases = [
        (lambda: ops.gated_mlp(x, jnp.ones((7, 6)), wg), ValueError, "w_gate"),
        (lambda: ops.gated_mlp(x, wg, jnp.ones((8, 5))), ValueError, "w_up"),
        (lambda: ops.gated_mlp(x, wg, wg, jnp.ones((5, 5))), ValueError, "w_down"),
        (lambda: ops.gated_mlp(x, wg, wg, jnp.ones((6,))), ValueError, "w_down"),
        (lambda: ops.gated_mlp(x, wg, None), ValueError, "w_gate"),
        (lambda: ops.gated_mlp(x, jnp.ones((8, 3, 6)), None), ValueError, "w_gate"),
        (lambda: ops.gated_mlp(x, wg, wg.astype(jnp.bfloat16)), TypeError, "w_up"),
        (lambda: ops.gated_mlp(x, wg, wg, wd.astype(jnp.float16)), TypeError, "w_down"),
        (lambda: ops.gated_mlp(x.astype(jnp.int32), wg, wg), TypeError, "x"),
        (lambda: ops.gated_mlp(jnp.ones((4, 0)), wg, wg), ValueError, "x"),
        (lambda: ops.gated_mlp(x, wg, wg, activation="swish"), ValueError, "activation"),
        (lambda: ops.gated_mlp(x, wg, wg, activation=None), ValueError, "activation"),
        (lambda: ops.gated_mlp(x, wg, wg, backend="cuda"), ValueError, "backend"),
        (lambda: ops.gated_mlp(x, wg, wg, wd), None, None),
    ]
    for call, error, name in cases:
        if error is None:
            assert call().shape == (4, 5)
            continue
        with pytest.raises(error, match=rf"^{name}:"):
            call()


def test_explicit_backend_that_cannot_run_raises_unsupported_with_reason():
    x = jnp.ones((4, 8))
    conformance.assert_pallas_tpu_unsupported(
        lambda: ops.gated_mlp(x, jnp.ones((8, 6)), jnp.ones((8, 6)), backend="pallas_tpu"))
