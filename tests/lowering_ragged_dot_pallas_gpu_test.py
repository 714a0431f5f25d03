"""Cross-lowering of the Mosaic GPU ragged_dot kernels for sm_90a on CPU (no GPU needed).

`jax.jit(f).trace(...).lower(lowering_platforms=("cuda",))` runs the whole Python side of each
kernel's compilation (Pallas -> Mosaic GPU dialect -> layout inference -> lowering): unsupported
primitives, layout-inference failures, TMA boxes over 256 per dimension and shared-memory
overflow fail here. Numerics are the conformance suite's job (interpreter on CPU, the GPU run).

Run: JAX_PLATFORMS=cpu pytest tests/lowering_ragged_dot_pallas_gpu_test.py
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import pytest

import conformance
from forgeax.kernels.common.ragged_dot import RaggedDotSpec

MOSAIC_GPU_CALL = "custom_call @mosaic_gpu_v2("

# (M, K, N, G, dtype, output dtype): the benchmark shapes (G8 balanced, Mixtral's expert products
# with f32 gate/up outputs, DeepSeek-V3-like routed experts), then M off every block, N a
# multiple of 64 but not 128, f16.
CASES = [
    (16384, 4096, 4096, 8, jnp.bfloat16, jnp.bfloat16),
    (16384, 4096, 14336, 8, jnp.bfloat16, jnp.float32),
    (16384, 14336, 4096, 8, jnp.bfloat16, jnp.bfloat16),
    (32768, 7168, 2048, 256, jnp.bfloat16, jnp.bfloat16),
    (300, 128, 192, 5, jnp.float16, jnp.float16),
    (77, 64, 64, 3, jnp.bfloat16, jnp.float32),
]
_IDS = lambda c: f"M{c[0]}-K{c[1]}-N{c[2]}-G{c[3]}-{jnp.dtype(c[4]).name}-out-{jnp.dtype(c[5]).name}"  # noqa: E731


def _args(m, k, n, g, dtype, out_dtype):
    del out_dtype
    return (jax.ShapeDtypeStruct((m, k), dtype), jax.ShapeDtypeStruct((g, k, n), dtype),
            jax.ShapeDtypeStruct((g,), jnp.int32))


def _impl():
    from forgeax.kernels.pallas.gpu import ragged_dot as gpu_ragged_dot

    return gpu_ragged_dot


def _fwd_bwd_text(impl, spec, config, case):
    lhs, rhs, sizes = _args(*case)

    def forward(lhs, rhs, sizes):
        return impl.fn(lhs, rhs, sizes, spec=spec, config=config)

    def fwd_bwd(lhs, rhs, sizes, ct):
        out, pullback = jax.vjp(lambda a, b: forward(a, b, sizes), lhs, rhs)
        return out, pullback(ct)

    ct = jax.ShapeDtypeStruct((case[0], case[2]), case[5])
    return (conformance.lowered_text(forward, lhs, rhs, sizes, platform="cuda"),
            conformance.lowered_text(fwd_bwd, lhs, rhs, sizes, ct, platform="cuda"))


@pytest.mark.parametrize("case", CASES, ids=_IDS)
def test_forward_and_backward_lower_for_sm90(case):
    impl = _impl().RAGGED_DOT
    spec = RaggedDotSpec(out_dtype=jnp.dtype(case[5]).name)
    lhs, rhs, sizes = _args(*case)
    config = impl.heuristic_config(lhs, rhs, sizes, spec=spec)
    forward, fwd_bwd = _fwd_bwd_text(impl, spec, config, case)
    assert forward.count(MOSAIC_GPU_CALL) == 1
    # forward, d lhs (the grouped kernel on rhs^T), d rhs (the transposed kernel)
    assert fwd_bwd.count(MOSAIC_GPU_CALL) == 3


@pytest.mark.parametrize("case", [CASES[0], CASES[4]], ids=_IDS)
def test_transposed_op_lowers_with_its_own_config(case):
    module = _impl()
    impl = module.RAGGED_DOT_TRANSPOSED
    m, k, n, g, dtype, out_dtype = case
    lhs, dout = jax.ShapeDtypeStruct((m, k), dtype), jax.ShapeDtypeStruct((m, n), dtype)
    sizes = jax.ShapeDtypeStruct((g,), jnp.int32)
    spec = RaggedDotSpec(out_dtype=jnp.dtype(out_dtype).name)
    config = impl.heuristic_config(lhs, dout, sizes, spec=spec)
    text = conformance.lowered_text(lambda *a: impl.fn(*a, spec=spec, config=config), lhs, dout, sizes, platform="cuda")
    assert text.count(MOSAIC_GPU_CALL) == 1


def test_candidate_configs_lower():
    impl = _impl().RAGGED_DOT
    case = CASES[1]  # f32 output: the largest epilogue tile
    spec = RaggedDotSpec(out_dtype="float32")
    lhs, rhs, sizes = _args(*case)
    seen = set()
    for config in impl.candidate_configs(lhs, rhs, sizes, spec=spec):
        tiles = (config.block_m, config.block_n, config.stages)  # group_m only reorders the CTAs
        if tiles in seen:
            continue
        seen.add(tiles)
        forward, fwd_bwd = _fwd_bwd_text(impl, spec, config, case)
        assert forward.count(MOSAIC_GPU_CALL) == 1, config
        assert fwd_bwd.count(MOSAIC_GPU_CALL) == 3, config


def test_too_many_stages_are_refused_by_the_config():
    module = _impl()
    with pytest.raises(ValueError, match="stages"):
        module.RaggedDotPallasGpuConfig(stages=8)
    with pytest.raises(ValueError, match="block_m"):
        module.RaggedDotPallasGpuConfig(block_m=256)
