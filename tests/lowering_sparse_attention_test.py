"""Cross-lowering of the sparse_attention kernels on CPU: Triton for sm_90, Mosaic TPU.

`jax.jit(f).trace(...).lower(lowering_platforms=(...))` runs each kernel's whole Python-side
compilation (Triton to PTX, Mosaic TPU dialect lowering) without the hardware; numerics are the
conformance suites' job. The Triton cases also check each kernel's shared memory against what
an sm_90 launch may ask for (a launch above it fails only on the GPU).

Run: JAX_PLATFORMS=cpu pytest tests/lowering_sparse_attention_test.py   (WITHOUT TRITON_INTERPRET)
"""

from __future__ import annotations

import math
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import pytest

import conformance
from forgeax.kernels.common.sparse_attention import SparseAttentionSpec

_needs_triton = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET", "").strip().lower() in ("1", "true", "yes", "on"),
                                   reason="cross-lowering needs compiled Triton kernels: unset TRITON_INTERPRET")

# (B, T, N, K, H, block_size, W, dtype, causal, cap): the benchmark shape (Llama-3 GQA at 32k, 1/8
# of the causal blocks), then odd lengths, head dims and dtypes.
CASES = [
    (1, 32768, 32, 8, 128, 64, 64, jnp.bfloat16, True, None),
    (2, 1000, 8, 2, 96, 32, 5, jnp.float32, True, 20.0),
    (1, 77, 4, 4, 64, 16, 3, jnp.float16, False, None),
    (1, 300, 16, 1, 128, 128, 2, jnp.bfloat16, True, None),
    (1, 777, 16, 2, 128, 128, 4, jnp.float16, True, 30.0),  # T not a multiple of block 128, head dim 128
]


def _args(B, T, N, K, H, bs, W, dtype):
    return (jax.ShapeDtypeStruct((B, T, N, H), dtype), jax.ShapeDtypeStruct((B, T, K, H), dtype),
            jax.ShapeDtypeStruct((B, T, K, H), dtype), jax.ShapeDtypeStruct((B, K, -(-T // bs), W), jnp.int32))


def _forward_and_fwd_bwd(impl, spec, config):
    def forward(q, k, v, idx):
        return impl.fn(q, k, v, idx, spec=spec, config=config)[0]

    def fwd_bwd(q, k, v, idx, ct):
        out, pullback = jax.vjp(lambda *a: forward(*a, idx), q, k, v)
        return out, pullback(ct)

    return forward, fwd_bwd


def _lowered_counts(module, case, platform, custom_call, config=None):
    B, T, N, K, H, bs, W, dtype, causal, cap = case
    impl = module.SPARSE_ATTENTION
    spec = SparseAttentionSpec(block_size=bs, causal=causal, scale=1 / math.sqrt(H), logit_soft_cap=cap)
    args = _args(B, T, N, K, H, bs, W, dtype)
    config = config or impl.heuristic_config(*args, spec=spec)
    forward, fwd_bwd = _forward_and_fwd_bwd(impl, spec, config)
    ct = jax.ShapeDtypeStruct((B, T, N, H), dtype)
    return (conformance.lowered_text(forward, *args, platform=platform).count(custom_call),
            conformance.lowered_text(fwd_bwd, *args, ct, platform=platform).count(custom_call))


@pytest.fixture
def shared_memory(monkeypatch):
    """The shared-memory bytes of every Triton kernel compiled while the test runs."""
    from jax_triton import triton_lib

    seen = []
    compile_ttir = triton_lib.compile_ttir_inplace

    def recording(*args, **kwargs):
        result = compile_ttir(*args, **kwargs)
        seen.append(result.shared_mem_bytes)
        return result

    monkeypatch.setattr(triton_lib, "compile_ttir_inplace", recording)
    return seen


@_needs_triton
@pytest.mark.parametrize("case", CASES, ids=str)
def test_triton_forward_and_backward_lower_for_sm90(case, shared_memory):
    from forgeax.kernels.triton import sparse_attention as module

    # forward; forward + one fused dQ / dK/dV backward launch
    assert _lowered_counts(module, case, "cuda", "triton_kernel_call") == (1, 2)
    assert shared_memory and max(shared_memory) <= module.SHARED_MEMORY_BYTES, shared_memory


@_needs_triton
def test_triton_candidate_configs_lower(shared_memory):
    from forgeax.kernels.triton import sparse_attention as module

    case = CASES[0]
    B, T, N, K, H, bs, W, dtype, causal, cap = case
    spec = SparseAttentionSpec(block_size=bs, causal=causal, scale=1 / math.sqrt(H))
    args = _args(B, T, N, K, H, bs, W, dtype)
    configs = module.candidate_configs(*args, spec=spec)
    base = configs[0]
    unfused = base.replace(fused_backward=False)
    wide = [c for c in configs if c.heads > base.heads and c.fwd_warps == 16]
    assert unfused in configs and wide
    # the two-launch backward; 256 forward rows on 16 warps; the most dK/dV rows that fit
    for config in (unfused, wide[0], max(configs, key=lambda c: c.bwd_heads)):
        launches = 3 if not config.fused_backward else 2
        assert _lowered_counts(module, case, "cuda", "triton_kernel_call", config) == (1, launches), config
    assert max(shared_memory) <= module.SHARED_MEMORY_BYTES, shared_memory


TPU_CASES = [
    (1, 4096, 8, 2, 128, 64, 8, jnp.bfloat16, True, None),
    (2, 200, 4, 4, 64, 16, 3, jnp.float32, False, 30.0),
    (1, 77, 4, 1, 128, 32, 2, jnp.float16, True, None),
]


@pytest.mark.parametrize("case", TPU_CASES, ids=str)
def test_pallas_tpu_forward_and_backward_lower_for_tpu(case):
    from forgeax.kernels.pallas.tpu import sparse_attention as module

    # forward; forward + dQ + dK/dV
    assert _lowered_counts(module, case, "tpu", "tpu_custom_call") == (1, 3)
