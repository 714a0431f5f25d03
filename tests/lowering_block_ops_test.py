"""Cross-lowering of the rope / rope_qk / add_rms_norm kernels on CPU (no GPU or TPU needed).

Triton: `lower(lowering_platforms=("cuda",))` makes jax-triton compile each @triton.jit kernel to
PTX for sm_90 (a `triton_kernel_call` custom call); Mosaic TPU: Pallas' TPU lowering to a
`tpu_custom_call` (BlockSpec legality, kernel tracing; not libtpu's layout passes). Forward and
backward both; the backward must be kernels (custom_vjp), not autodiff through the forward.
Numerics are the conformance suites' job.

Run: JAX_PLATFORMS=cpu pytest tests/lowering_block_ops_test.py   (WITHOUT TRITON_INTERPRET)
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import pytest

import conformance
from forgeax.kernels.common.rope import Llama3Scaling, RopeSpec

TRITON = "triton_kernel_call"
TPU = "@tpu_custom_call"
_INTERPRETED_TRITON = os.environ.get("TRITON_INTERPRET", "").strip().lower() in ("1", "true", "yes", "on")
needs_compiled_triton = pytest.mark.skipif(_INTERPRETED_TRITON, reason="cross-lowering needs compiled Triton: unset TRITON_INTERPRET")

# (q shape, k heads, dtype, spec): the benchmark shapes (MHA and GQA), partial + interleaved +
# scaled, H = 80, one token, a k with one head.
ROPE_CASES = [
    ((8, 4096, 32, 128), 32, jnp.bfloat16, RopeSpec(rotary_dim=128)),
    ((8, 4096, 32, 128), 8, jnp.bfloat16, RopeSpec(rotary_dim=128)),
    ((2, 17, 5, 80), 1, jnp.float32, RopeSpec(rotary_dim=48, interleaved=True, scaling=Llama3Scaling())),
    ((1, 1, 3, 64), 3, jnp.float16, RopeSpec(rotary_dim=64, theta=500000.0)),
    ((2, 4097, 3, 128), 1, jnp.bfloat16, RopeSpec(rotary_dim=64)),
]
NORM_CASES = [((32768, 4096), jnp.bfloat16), ((257, 1000), jnp.float32), ((3, 5, 7), jnp.float16), ((4, 17, 80), jnp.bfloat16),
              ((64, 16384), jnp.bfloat16)]


def _specs(shape, k_heads, dtype):
    b, t, _, h = shape
    return (jax.ShapeDtypeStruct(shape, dtype), jax.ShapeDtypeStruct((b, t, k_heads, h), dtype),
            jax.ShapeDtypeStruct((b, t), jnp.int32))


def _rope_qk_lowerings(module, shape, k_heads, dtype, spec, platform):
    impl = module.ROPE_QK
    q, k, pos = _specs(shape, k_heads, dtype)
    config = impl.heuristic_config(q, k, pos, spec=spec)

    def forward(q, k, pos):
        return impl.fn(q, k, pos, spec=spec, config=config)

    def backward(q, k, pos, dq, dk):
        return jax.vjp(lambda q, k: forward(q, k, pos), q, k)[1]((dq, dk))

    return (conformance.lowered_text(forward, q, k, pos, platform=platform),
            conformance.lowered_text(backward, q, k, pos, q, k, platform=platform))


@needs_compiled_triton
@pytest.mark.parametrize("shape,k_heads,dtype,spec", ROPE_CASES, ids=str)
def test_triton_rope_qk_lowers_for_cuda(shape, k_heads, dtype, spec):
    from forgeax.kernels.triton import rope

    forward, backward = _rope_qk_lowerings(rope, shape, k_heads, dtype, spec, "cuda")
    assert forward.count(TRITON) == 1
    # Only the inverse rotation: the backward saves just the positions, so the unused forward is dropped.
    assert backward.count(TRITON) == 1


@needs_compiled_triton
def test_triton_rope_candidate_configs_lower():
    from forgeax.kernels.triton import rope

    q, k, pos = _specs((8, 4096, 32, 128), 8, jnp.bfloat16)
    spec = RopeSpec(rotary_dim=128)
    for config in rope.candidate_configs(q, k, pos, spec=spec):
        text = conformance.lowered_text(lambda q, k, p, c=config: rope.rope_qk(q, k, p, spec=spec, config=c), q, k, pos, platform="cuda")
        assert text.count(TRITON) == 1, config
    x = jax.ShapeDtypeStruct((2, 17, 4, 64), jnp.float32)
    text = conformance.lowered_text(lambda x, p: rope.rope(x, p, spec=RopeSpec(rotary_dim=64), config=rope.RopeConfig(block_tokens=2, block_heads=1)),
                                    x, jax.ShapeDtypeStruct((2, 17), jnp.int32), platform="cuda")
    assert text.count(TRITON) == 1


@pytest.mark.parametrize("shape,k_heads,dtype,spec", ROPE_CASES, ids=str)
def test_tpu_rope_qk_lowers(shape, k_heads, dtype, spec):
    from forgeax.kernels.pallas.tpu import rope

    forward, backward = _rope_qk_lowerings(rope, shape, k_heads, dtype, spec, "tpu")
    assert forward.count(TPU) == 1
    assert backward.count(TPU) == 1  # the inverse rotation alone (as for Triton)


def _add_rms_norm_lowerings(module, shape, dtype, platform):
    impl = module.ADD_RMS_NORM
    x = jax.ShapeDtypeStruct(shape, dtype)
    scale = jax.ShapeDtypeStruct(shape[-1:], jnp.float32)
    config = impl.heuristic_config(x, x, scale, eps=1e-6)

    def forward(x, r, s):
        return impl.fn(x, r, s, eps=1e-6, config=config)

    def backward(x, r, s, dn, ds):
        return jax.vjp(forward, x, r, s)[1]((dn, ds))

    return (conformance.lowered_text(forward, x, x, scale, platform=platform),
            conformance.lowered_text(backward, x, x, scale, x, x, platform=platform))


@needs_compiled_triton
@pytest.mark.parametrize("shape,dtype", NORM_CASES, ids=str)
def test_triton_add_rms_norm_lowers_for_cuda(shape, dtype):
    from forgeax.kernels.triton import add_rms_norm

    forward, backward = _add_rms_norm_lowerings(add_rms_norm, shape, dtype, "cuda")
    assert forward.count(TRITON) == 1
    assert backward.count(TRITON) == 2


@needs_compiled_triton
def test_triton_add_rms_norm_candidate_configs_lower():
    from forgeax.kernels.triton import add_rms_norm

    x = jax.ShapeDtypeStruct((32768, 4096), jnp.bfloat16)
    s = jax.ShapeDtypeStruct((4096,), jnp.float32)
    for config in add_rms_norm.candidate_configs(x, x, s, eps=1e-6):
        def loss(x, r, s, c=config):
            normed, total = add_rms_norm.add_rms_norm(x, r, s, eps=1e-6, config=c)
            return jnp.sum(normed.astype(jnp.float32)) + jnp.sum(total.astype(jnp.float32))

        text = conformance.lowered_text(jax.grad(loss, argnums=(0, 1, 2)), x, x, s, platform="cuda")
        assert text.count(TRITON) == 2, config


@pytest.mark.parametrize("shape,dtype", NORM_CASES[:4], ids=str)
def test_tpu_add_rms_norm_lowers(shape, dtype):
    from forgeax.kernels.pallas.tpu import add_rms_norm

    forward, backward = _add_rms_norm_lowerings(add_rms_norm, shape, dtype, "tpu")
    assert forward.count(TPU) == 1
    assert backward.count(TPU) == 2


def test_supports_refuse_with_reasons():
    from forgeax.kernels.pallas.tpu import add_rms_norm as tpu_arn

    f64 = jax.ShapeDtypeStruct((8, 128), jnp.float64)
    s = jax.ShapeDtypeStruct((128,), jnp.float32)
    assert "float64" in tpu_arn.ADD_RMS_NORM.supports(f64, f64, s, eps=1e-6)
    wide = jax.ShapeDtypeStruct((8, 1 << 20), jnp.float32)
    assert "VMEM" in tpu_arn.ADD_RMS_NORM.supports(wide, wide, jax.ShapeDtypeStruct((1 << 20,), jnp.float32), eps=1e-6)
    if not _INTERPRETED_TRITON:
        from forgeax.kernels.triton import add_rms_norm as triton_arn
        from forgeax.kernels.triton import rope as triton_rope

        too_wide = jax.ShapeDtypeStruct((8, triton_arn.MAX_D + 1), jnp.float32)
        assert str(triton_arn.MAX_D + 1) in triton_arn.ADD_RMS_NORM.supports(too_wide, too_wide, too_wide, eps=1e-6)
        q = jax.ShapeDtypeStruct((1, 2, 3, 64), jnp.float64)
        assert "float64" in triton_rope.ROPE.supports(q, jax.ShapeDtypeStruct((1, 2), jnp.int32), spec=RopeSpec(rotary_dim=64))
