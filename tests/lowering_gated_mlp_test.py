"""Cross-lowering of the gated MLP kernels on CPU (no accelerator needed).

`jax.jit(f).trace(...).lower(lowering_platforms=(...))` runs the whole Python side of each
kernel's compilation: Triton to PTX for sm_90 (a `triton_kernel_call` custom call) and the
Mosaic TPU lowering (a `tpu_custom_call`). A kernel that does not compile fails here; numerics
are the conformance suites' job.

Run: JAX_PLATFORMS=cpu pytest tests/lowering_gated_mlp_test.py   (WITHOUT TRITON_INTERPRET)
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import pytest

import conformance
from forgeax.kernels.common.gated_mlp import ACTIVATIONS, GatedMLPSpec

_TRITON_INTERPRET = os.environ.get("TRITON_INTERPRET", "").strip().lower() in ("1", "true", "yes", "on")

# (leading axes of x, K, N, K_out or None, dtype, fused): the benchmark shape with and without
# the down projection, then rows/K/N off every block size, f32 and f16, the fused weight.
CASES = [
    ((16384,), 4096, 14336, None, jnp.bfloat16, False),
    ((16384,), 4096, 14336, 4096, jnp.bfloat16, True),
    ((3, 100), 96, 200, 72, jnp.float32, False),
    ((17,), 40, 24, None, jnp.float16, True),
    ((1,), 64, 128, 64, jnp.bfloat16, False),
]
_IDS = lambda c: f"{c[0]}-K{c[1]}-N{c[2]}-down{c[3]}-{jnp.dtype(c[4]).name}-{'fused' if c[5] else 'separate'}"  # noqa: E731


def _args(lead, k, n, k_out, dtype, fused):
    x = jax.ShapeDtypeStruct((*lead, k), dtype)
    w = jax.ShapeDtypeStruct((k, 2, n) if fused else (k, n), dtype)
    down = None if k_out is None else jax.ShapeDtypeStruct((n, k_out), dtype)
    return x, w, None if fused else w, down


def _fwd_bwd(impl, spec):
    def forward(x, wg, wu, wd):
        return impl.fn(x, wg, wu, wd, spec=spec, config=impl.heuristic_config(x, wg, wu, wd, spec=spec))

    def backward(x, wg, wu, wd, ct):
        out, pullback = jax.vjp(forward, x, wg, wu, wd)
        return out, pullback(ct)

    return forward, backward


def _cotangent(x, wd, n):
    return jax.ShapeDtypeStruct((*x.shape[:-1], n if wd is None else wd.shape[1]), x.dtype)


def _check(impl, platform, custom_call, case, activation="silu"):
    x, wg, wu, wd = _args(*case)
    spec = GatedMLPSpec(activation=activation)
    forward, backward = _fwd_bwd(impl, spec)
    text = conformance.lowered_text(forward, x, wg, wu, wd, platform=platform)
    assert text.count(custom_call) == 1, text[:2000]
    text = conformance.lowered_text(backward, x, wg, wu, wd, _cotangent(x, wd, case[2]), platform=platform)
    # The forward kernel (under vjp) and the backward's recompute kernel.
    assert text.count(custom_call) == 2, text[:2000]


@pytest.mark.skipif(_TRITON_INTERPRET, reason="cross-lowering needs compiled Triton kernels: unset TRITON_INTERPRET")
@pytest.mark.parametrize("case", CASES, ids=_IDS)
def test_triton_forward_and_backward_lower_for_sm90(case):
    from forgeax.kernels.triton import gated_mlp as triton_gated_mlp

    _check(triton_gated_mlp.GATED_MLP, "cuda", "triton_kernel_call", case)


@pytest.mark.skipif(_TRITON_INTERPRET, reason="cross-lowering needs compiled Triton kernels: unset TRITON_INTERPRET")
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_triton_each_activation_lowers(activation):
    from forgeax.kernels.triton import gated_mlp as triton_gated_mlp

    _check(triton_gated_mlp.GATED_MLP, "cuda", "triton_kernel_call", ((300,), 96, 200, None, jnp.bfloat16, False), activation)


@pytest.mark.skipif(_TRITON_INTERPRET, reason="cross-lowering needs compiled Triton kernels: unset TRITON_INTERPRET")
def test_triton_candidate_configs_lower():
    from forgeax.kernels.triton import gated_mlp as triton_gated_mlp

    impl = triton_gated_mlp.GATED_MLP
    x, wg, wu, wd = _args(*CASES[0])
    spec = GatedMLPSpec()
    for config in impl.candidate_configs(x, wg, wu, wd, spec=spec):
        text = conformance.lowered_text(lambda *a, config=config: impl.fn(*a, spec=spec, config=config), x, wg, wu, wd, platform="cuda")
        assert text.count("triton_kernel_call") == 1, config


@pytest.mark.skipif(_TRITON_INTERPRET, reason="cross-lowering needs compiled Triton kernels: unset TRITON_INTERPRET")
def test_triton_saved_preactivations_lower():
    from forgeax.kernels.triton import gated_mlp as triton_gated_mlp

    impl = triton_gated_mlp.GATED_MLP
    x, wg, wu, wd = _args(*CASES[1])
    spec = GatedMLPSpec()
    config = impl.heuristic_config(x, wg, wu, wd, spec=spec).replace(save_preactivations=True)

    def fwd_bwd(x, wg, wu, wd, ct):
        out, pullback = jax.vjp(lambda *a: impl.fn(*a, spec=spec, config=config), x, wg, wu, wd)
        return out, pullback(ct)

    text = conformance.lowered_text(fwd_bwd, x, wg, wu, wd, _cotangent(x, wd, CASES[1][2]), platform="cuda")
    assert text.count("triton_kernel_call") == 1  # the saving forward only: no recompute kernel


@pytest.mark.parametrize("case", CASES, ids=_IDS)
def test_pallas_tpu_forward_and_backward_lower_for_tpu(case):
    from forgeax.kernels.pallas.tpu import gated_mlp as tpu_gated_mlp

    _check(tpu_gated_mlp.GATED_MLP, "tpu", "tpu_custom_call", case)


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_pallas_tpu_each_activation_lowers(activation):
    from forgeax.kernels.pallas.tpu import gated_mlp as tpu_gated_mlp

    _check(tpu_gated_mlp.GATED_MLP, "tpu", "tpu_custom_call", ((300,), 96, 200, None, jnp.float32, False), activation)


MOSAIC_GPU_CALL = "custom_call @mosaic_gpu_v2("
# The Mosaic GPU kernel takes K and N in multiples of 64 (its supports() refuses the rest).
GPU_CASES = [c for c in CASES if c[1] % 64 == 0 and c[2] % 64 == 0 and c[4] != jnp.float32] + [
    ((3, 100), 128, 192, 72, jnp.bfloat16, True),
]


@pytest.mark.parametrize("case", GPU_CASES, ids=_IDS)
def test_pallas_gpu_forward_and_backward_lower_for_cuda(case):
    from forgeax.kernels.pallas.gpu import gated_mlp as gpu_gated_mlp

    _check(gpu_gated_mlp.GATED_MLP, "cuda", MOSAIC_GPU_CALL, case)


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_pallas_gpu_each_activation_lowers(activation):
    from forgeax.kernels.pallas.gpu import gated_mlp as gpu_gated_mlp

    _check(gpu_gated_mlp.GATED_MLP, "cuda", MOSAIC_GPU_CALL, ((300,), 128, 192, 64, jnp.bfloat16, False), activation)


def test_pallas_gpu_candidate_configs_lower():
    from forgeax.kernels.pallas.gpu import gated_mlp as gpu_gated_mlp

    impl = gpu_gated_mlp.GATED_MLP
    x, wg, wu, wd = _args(*CASES[0])
    spec = GatedMLPSpec()
    default = impl.heuristic_config(x, wg, wu, wd, spec=spec)
    variants = [default.replace(named_barriers=True), default.replace(cluster_m=2)]
    for config in [*impl.candidate_configs(x, wg, wu, wd, spec=spec), *variants]:
        def fwd_bwd(x, wg, wu, ct, config=config):
            out, pullback = jax.vjp(lambda *a: impl.fn(*a, None, spec=spec, config=config), x, wg, wu)
            return out, pullback(ct)

        text = conformance.lowered_text(fwd_bwd, x, wg, wu, jax.ShapeDtypeStruct((16384, 14336), jnp.bfloat16), platform="cuda")
        assert text.count(MOSAIC_GPU_CALL) == 2, config
