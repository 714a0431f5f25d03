"""Cross-lowering of the Mosaic GPU norm kernels (and every candidate attention config) for cuda on
CPU (no GPU needed).

`jax.jit(f).trace(...).lower(lowering_platforms=("cuda",))` runs the whole
Python side of Pallas Mosaic GPU: kernel tracing, the Mosaic GPU dialect, the
Lane-semantics register layouts (row reductions, broadcasts, GMEM loads and
stores in the explicit layouts) and the lowering to LLVM, serialised into a
`mosaic_gpu_v2` custom call. It does not run ptxas and proves nothing about
numerics (interpret mode and the GPU conformance run do that: a kernel has passed both
interpret mode and lowering and still given wrong numbers on a GPU).

Run: JAX_PLATFORMS=cpu pytest tests/lowering_pallas_gpu_test.py
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import pytest

import conformance

from forgeax.kernels.pallas.gpu import norms as gpu_norms

CUSTOM_CALL = "stablehlo.custom_call @mosaic_gpu_v2("

# (x shape, x dtype): the large training shape, D = 8192 (column loops instead
# of register caching), rows that are not a multiple of the row block or of 4,
# D a multiple of 128 but not of 256, tiny inputs (padded rows).
CASES = [
    ((32768, 4096), jnp.bfloat16),
    ((8192, 8192), jnp.bfloat16),
    ((16384, 4096), jnp.float32),
    ((257, 4096), jnp.bfloat16),
    ((3, 5, 512), jnp.float16),
    ((1000, 384), jnp.bfloat16),
    ((2, 3, 128), jnp.float32),
    ((1, 128), jnp.bfloat16),
]

NORMS = {
    "rms": lambda x, s, o: gpu_norms.RMS_NORM.fn(x, s, eps=1e-6),
    "layer": lambda x, s, o: gpu_norms.LAYER_NORM.fn(x, s, o, eps=1e-6),
    "layer_nobias": lambda x, s, o: gpu_norms.LAYER_NORM.fn(x, s, None, eps=1e-6),
}

_IDS = lambda c: str(c) if isinstance(c, tuple) else jnp.dtype(c).name  # noqa: E731


def _lower_cuda(fn, *args) -> str:
    return conformance.lowered_text(fn, *args, platform='cuda')


def _specs(shape, dtype):
    d = shape[-1]
    return (
        jax.ShapeDtypeStruct(shape, dtype),
        jax.ShapeDtypeStruct((d,), jnp.float32),
        jax.ShapeDtypeStruct((d,), jnp.bfloat16),
    )


@pytest.mark.parametrize("norm", sorted(NORMS))
@pytest.mark.parametrize("shape,dtype", CASES, ids=_IDS)
def test_forward_lowers_to_one_mosaic_gpu_kernel(norm, shape, dtype):
    x, s, o = _specs(shape, dtype)
    assert gpu_norms.LAYER_NORM.supports(x, s, o, eps=1e-6) is None
    text = _lower_cuda(NORMS[norm], x, s, o)
    assert text.count(CUSTOM_CALL) == 1


@pytest.mark.parametrize("norm", sorted(NORMS))
@pytest.mark.parametrize("shape,dtype", CASES, ids=_IDS)
def test_backward_lowers_to_mosaic_gpu_kernels(norm, shape, dtype):
    fn = NORMS[norm]

    def loss(x, s, o):
        return jnp.sum(fn(x, s, o).astype(jnp.float32) ** 2)

    text = _lower_cuda(jax.grad(loss, argnums=(0, 1, 2)), *_specs(shape, dtype))
    # The forward kernel (residuals) and the backward kernel; no autodiff
    # through a kernel and no fallback to XLA.
    assert text.count(CUSTOM_CALL) == 2


@pytest.mark.parametrize("d", [7, 96, 1000, 4100])
def test_supports_refuses_d_not_a_multiple_of_128(d):
    x = jax.ShapeDtypeStruct((4, d), jnp.bfloat16)
    s = jax.ShapeDtypeStruct((d,), jnp.float32)
    reason = gpu_norms.RMS_NORM.supports(x, s, eps=1e-6)
    assert reason is not None and "128" in reason
    assert gpu_norms.LAYER_NORM.supports(x, s, None, eps=1e-6) == reason


def test_supports_refuses_integer_x():
    x = jax.ShapeDtypeStruct((4, 256), jnp.int32)
    s = jax.ShapeDtypeStruct((256,), jnp.float32)
    assert gpu_norms.RMS_NORM.supports(x, s, eps=1e-6) is not None


# (compute capability, refusal expected for the norms (no wgmma), for attention and linear CE (wgmma))
GPU_GENERATIONS = [("8.0", True, True), ("8.9", True, True), ("9.0", False, False), ("10.0", False, True)]


@pytest.mark.parametrize("capability, norms_refused, wgmma_refused", GPU_GENERATIONS)
def test_mosaic_gpu_ops_refuse_gpus_that_cannot_run_them(capability, norms_refused, wgmma_refused, monkeypatch):
    """Mosaic GPU emits sm_90a code and wgmma is Hopper-only: on other GPUs every pallas_gpu
    op says so through supports(), so the selection falls back instead of failing to compile."""
    import forgeax.kernels.pallas.gpu as pallas_gpu
    from forgeax.kernels.common.attention import AttentionSpec
    from forgeax.kernels.pallas.gpu import attention as gpu_attention
    from forgeax.kernels.pallas.gpu import linear_cross_entropy as gpu_lce

    from forgeax.core import runtime as interface

    monkeypatch.setattr(pallas_gpu, "current_platform", lambda: "gpu")
    for module in (interface, pallas_gpu):  # the major version is read through interface
        monkeypatch.setattr(module, "current_compute_capability", lambda: capability)
    x = jax.ShapeDtypeStruct((256, 512), jnp.bfloat16)
    scale = jax.ShapeDtypeStruct((512,), jnp.bfloat16)
    q = jax.ShapeDtypeStruct((1, 128, 2, 64), jnp.bfloat16)
    weight = jax.ShapeDtypeStruct((512, 1024), jnp.bfloat16)
    targets = jax.ShapeDtypeStruct((256,), jnp.int32)
    reasons = {
        "rms_norm": gpu_norms.RMS_NORM.supports(x, scale, eps=1e-6),
        "attention": gpu_attention.ATTENTION.supports(q, q, q, None, None, None, None, None, spec=AttentionSpec(causal=True, scale=0.125)),
        "linear_cross_entropy": gpu_lce.LINEAR_CROSS_ENTROPY.supports(x, weight, targets),
    }
    expected = {"rms_norm": norms_refused, "attention": wgmma_refused, "linear_cross_entropy": wgmma_refused}
    for op, reason in reasons.items():
        assert (reason is not None) == expected[op], (op, reason)
        if reason is not None:
            assert capability in reason


# (q shape, v head dim, causal, window left, segment ids): calls whose candidate configs differ.
CONFIG_CALLS = {
    "H128 causal": ((1, 1024, 8, 128), 128, True, None, False),
    "H64 GQA window": ((1, 1024, 8, 64), 64, True, 256, False),
    "H256 causal": ((1, 512, 4, 256), 256, True, None, False),
    "MLA 192/128 segments": ((1, 512, 4, 192), 128, True, None, True),
}


@pytest.mark.parametrize("call", CONFIG_CALLS)
def test_every_candidate_attention_config_lowers(call):
    """Every config `candidate_configs` offers for a call (what tune_attention.py times) is a
    kernel Mosaic GPU lowers, forward and backward: no schedule switch builds an invalid kernel."""
    from forgeax.kernels.common.attention import AttentionSpec
    from forgeax.kernels.pallas.gpu import attention as gpu_attention

    shape, Hv, causal, left, segmented = CONFIG_CALLS[call]
    B, T, N, H = shape
    spec = AttentionSpec(causal=causal, scale=H ** -0.5, window_left=left, window_right=0 if causal else None)
    q = jax.ShapeDtypeStruct(shape, jnp.bfloat16)
    k = jax.ShapeDtypeStruct((B, T, 2, H), jnp.bfloat16)
    v = jax.ShapeDtypeStruct((B, T, 2, Hv), jnp.bfloat16)
    ids = (jax.ShapeDtypeStruct((B, T), jnp.int32),) * 2 if segmented else ()
    args = (q, k, v, None, None, *(ids or (None, None)), None)
    configs = gpu_attention.candidate_configs(*args, spec=spec)
    assert configs[0] == gpu_attention.heuristic_config(*args, spec=spec) and len(configs) >= 4
    for config in configs:
        def loss(q, k, v, *ids, config=config):
            out, _ = gpu_attention.ATTENTION.fn(q, k, v, None, None, *(ids or (None, None)), None, spec=spec,
                                                config=config)
            return jnp.sum(out.astype(jnp.float32))

        text = _lower_cuda(jax.grad(loss, argnums=(0, 1, 2)), q, k, v, *ids)
        assert text.count(CUSTOM_CALL) >= 3, config  # forward, dq (or dq from dz^T), dK/dV
