"""Cross-lowering of the Triton norm kernels for cuda on CPU (no GPU needed).

`jax.jit(f).trace(...).lower(lowering_platforms=("cuda",))` makes jax-triton
compile each @triton.jit kernel to PTX for sm_90 (launch.py passes
compute_capability=90 when there is no GPU) and embed it in a
`triton_kernel_call` custom call. A kernel that does not compile fails here.
It proves nothing about numerics: interpret mode and the GPU conformance run do.

Run: JAX_PLATFORMS=cpu pytest tests/lowering_triton_test.py   (WITHOUT TRITON_INTERPRET:
with it, @triton.jit builds interpreter objects that jax-triton cannot compile).
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import pytest

import conformance

if os.environ.get("TRITON_INTERPRET", "").strip().lower() in ("1", "true", "yes", "on"):
    pytest.skip("cross-lowering needs compiled Triton kernels: unset TRITON_INTERPRET", allow_module_level=True)

import jax
import jax.numpy as jnp

from forgeax.kernels.triton import norms as triton_norms

CUSTOM_CALL = "triton_kernel_call"

# (norm, x shape, x dtype): the large training shape for all three variants,
# then rows that are not a multiple of any tile, D not a power of two (and not
# a multiple of 8 elements), tiny inputs, the largest supported D.
CASES = [
    ("rms", (32768, 4096), jnp.bfloat16),
    ("layer", (32768, 4096), jnp.bfloat16),
    ("layer_offset", (32768, 4096), jnp.bfloat16),
    ("layer_offset", (257, 1000), jnp.float32),
    ("rms", (3, 5, 7), jnp.float16),
    ("layer", (2, 3, 128), jnp.bfloat16),
    ("rms", (4097, 96), jnp.float32),
    ("layer_offset", (64, 16384), jnp.bfloat16),
]


def _norm(kind):
    if kind == "rms":
        return lambda x, s, o: triton_norms.rms_norm(x, s, eps=1e-6)
    if kind == "layer":
        return lambda x, s, o: triton_norms.layer_norm(x, s, None, eps=1e-5)
    return lambda x, s, o: triton_norms.layer_norm(x, s, o, eps=1e-5)


def _lower_cuda(fn, *args) -> str:
    return conformance.lowered_text(fn, *args, platform='cuda')


@pytest.mark.parametrize("kind,shape,dtype", CASES, ids=lambda v: str(v))
def test_forward_and_backward_lower_to_triton_kernels_for_cuda(kind, shape, dtype):
    d = shape[-1]
    x = jax.ShapeDtypeStruct(shape, dtype)
    p = jax.ShapeDtypeStruct((d,), dtype)
    norm = _norm(kind)

    forward = _lower_cuda(norm, x, p, p)
    assert forward.count(CUSTOM_CALL) == 1, forward[:2000]

    def backward(x, s, o, ct):
        return jax.vjp(norm, x, s, o)[1](ct)

    module = _lower_cuda(backward, x, p, p, x)
    # The forward kernel (residuals) and the backward kernel.
    assert module.count(CUSTOM_CALL) == 2, module[:2000]


def test_explicit_configs_lower():
    x = jax.ShapeDtypeStruct((32768, 4096), jnp.bfloat16)
    p = jax.ShapeDtypeStruct((4096,), jnp.bfloat16)
    for name, config in triton_norms.candidate_configs(32768, 4096, jnp.bfloat16).items():
        def loss(x, s, o, config=config):
            return jnp.sum(triton_norms.layer_norm(x, s, o, eps=1e-5, config=config).astype(jnp.float32))

        module = _lower_cuda(jax.grad(loss, argnums=(0, 1, 2)), x, p, p)
        assert module.count(CUSTOM_CALL) == 2, name


def test_supports_refuses_what_the_kernels_cannot_do():
    ok = jax.ShapeDtypeStruct((8, 4096), jnp.bfloat16)
    p = jax.ShapeDtypeStruct((4096,), jnp.bfloat16)
    assert triton_norms.RMS_NORM.supports(ok, p, eps=1e-6) is None
    assert triton_norms.LAYER_NORM.supports(ok, p, p, eps=1e-6) is None
    too_wide = jax.ShapeDtypeStruct((8, triton_norms.MAX_D + 1), jnp.float32)
    wide_p = jax.ShapeDtypeStruct((triton_norms.MAX_D + 1,), jnp.float32)
    reason = triton_norms.LAYER_NORM.supports(too_wide, wide_p, None, eps=1e-6)
    assert reason is not None and str(triton_norms.MAX_D + 1) in reason
    f64 = jax.ShapeDtypeStruct((8, 128), jnp.float64)
    assert triton_norms.RMS_NORM.supports(f64, jax.ShapeDtypeStruct((128,), jnp.float32), eps=1e-6) is not None
