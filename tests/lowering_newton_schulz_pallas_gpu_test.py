"""Cross-lowering of the Mosaic GPU newton_schulz kernels for sm_90a on CPU (no GPU needed).

`jax.jit(f).trace(...).lower(lowering_platforms=("cuda",))` runs the whole Python side of each
kernel's compilation (Pallas -> Mosaic GPU dialect -> layout inference -> lowering): unsupported
primitives, layout-inference failures, TMA boxes over 256 per dimension and shared-memory
overflow fail here, at the benchmark shapes. Numerics are the conformance suite's job
(tests/newton_schulz_test.py: interpreter on CPU, the GPU run).

Run: JAX_PLATFORMS=cpu pytest tests/lowering_newton_schulz_pallas_gpu_test.py
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import pytest

import conformance
from forgeax.kernels.common.newton_schulz import NewtonSchulzSpec

MOSAIC_GPU_CALL = "custom_call @mosaic_gpu_v2("
# One step: the three kernels (Gram, Gram with the b A epilogue, update); more steps repeat them.
SPEC = NewtonSchulzSpec(steps=1)
# The benchmark shapes (tools/bench_specs/), a tall one (transposed first), a batch of 64-wide tiles.
SHAPES = [(4096, 4096), (4096, 14336), (14336, 4096), (2, 192, 320)]


def _module():
    from forgeax.kernels.pallas.gpu import newton_schulz

    return newton_schulz


def _lowered(config, shape, dtype=jnp.bfloat16):
    impl = _module().NEWTON_SCHULZ
    g = jax.ShapeDtypeStruct(shape, dtype)
    config = impl.heuristic_config(g, spec=SPEC) if config is None else config
    return conformance.lowered_text(lambda g: impl.fn(g, spec=SPEC, config=config), g, platform="cuda")


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_heuristic_config_lowers_for_sm90(shape):
    assert _lowered(None, shape).count(MOSAIC_GPU_CALL) == 3


def test_candidate_configs_lower_at_the_largest_shape():
    impl = _module().NEWTON_SCHULZ
    g = jax.ShapeDtypeStruct((4096, 14336), jnp.float32)
    seen = set()
    for config in impl.candidate_configs(g, spec=SPEC):
        tiles = (config.block, config.update_block_m, config.update_block_n, config.stages, config.pallas_update)
        if tiles in seen:  # group_m only reorders the CTAs
            continue
        seen.add(tiles)
        assert _lowered(config, g.shape, g.dtype).count(MOSAIC_GPU_CALL) == (3 if config.pallas_update else 2), config


def test_config_refuses_what_does_not_fit():
    module = _module()
    with pytest.raises(ValueError, match="stages"):
        module.NewtonSchulzPallasGpuConfig(stages=6)  # 6 x 32 KiB ring + 96 KiB of epilogue tiles
    with pytest.raises(ValueError, match="block"):
        module.NewtonSchulzPallasGpuConfig(block=256)
    with pytest.raises(ValueError, match="update_block_n"):
        module.NewtonSchulzPallasGpuConfig(update_block_n=96)
    with pytest.raises(ValueError, match="config.block"):  # a tile that does not divide the side
        _lowered(module.NewtonSchulzPallasGpuConfig(block=128), (192, 320))


def test_supports_refuses_sides_off_the_tile():
    impl = _module().NEWTON_SCHULZ
    assert "multiples of 64" in impl.supports(jax.ShapeDtypeStruct((100, 256), jnp.float32), spec=SPEC)
    assert impl.supports(jax.ShapeDtypeStruct((3, 256, 64), jnp.float16), spec=SPEC) is None
