"""Cross-lowering of the ragged_dot kernels on CPU: Triton for sm_90, Mosaic TPU (no accelerator needed).

`jax.jit(f).trace(...).lower(lowering_platforms=("cuda",))` compiles each Triton kernel to PTX
(a `triton_kernel_call` custom call): a kernel that does not compile fails here; numerics are
the conformance suites' job.

Run: JAX_PLATFORMS=cpu pytest tests/lowering_ragged_dot_test.py   (WITHOUT TRITON_INTERPRET)
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import pytest

import conformance
from forgeax.kernels.common.ragged_dot import RaggedDotSpec

_needs_triton = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET", "").strip().lower() in ("1", "true", "yes", "on"),
                                   reason="cross-lowering needs compiled Triton kernels: unset TRITON_INTERPRET")

# (M, K, N, G, dtype): the benchmark shapes (G8 balanced, DeepSeek-V3-like routed experts), then
# M, K, N off every tile in f32 and f16.
CASES = [
    (16384, 4096, 4096, 8, jnp.bfloat16),
    (65536, 7168, 2048, 256, jnp.bfloat16),
    (300, 100, 72, 5, jnp.float32),
    (77, 40, 24, 3, jnp.float16),
]


def _args(m, k, n, g, dtype):
    return (jax.ShapeDtypeStruct((m, k), dtype), jax.ShapeDtypeStruct((g, k, n), dtype),
            jax.ShapeDtypeStruct((g,), jnp.int32))



def _forward_and_fwd_bwd(impl, spec, config):
    """The kernel's forward, and its forward with the vjp of (lhs, rhs) pulled back from `ct`."""

    def forward(lhs, rhs, sizes):
        return impl.fn(lhs, rhs, sizes, spec=spec, config=config)

    def fwd_bwd(lhs, rhs, sizes, ct):
        out, pullback = jax.vjp(lambda a, b: forward(a, b, sizes), lhs, rhs)
        return out, pullback(ct)

    return forward, fwd_bwd

@_needs_triton
@pytest.mark.parametrize("case", CASES, ids=str)
def test_triton_forward_and_backward_lower_for_sm90(case):
    from forgeax.kernels.triton import ragged_dot as triton_ragged_dot

    impl = triton_ragged_dot.RAGGED_DOT
    spec = RaggedDotSpec(out_dtype=jnp.dtype(case[4]).name)
    lhs, rhs, sizes = _args(*case)
    config = impl.heuristic_config(lhs, rhs, sizes, spec=spec)

    forward, fwd_bwd = _forward_and_fwd_bwd(impl, spec, config)

    assert conformance.lowered_text(forward, lhs, rhs, sizes, platform="cuda").count("triton_kernel_call") == 1
    ct = jax.ShapeDtypeStruct((case[0], case[2]), case[4])
    # forward, d lhs (the grouped kernel on rhs^T), d rhs (the transposed kernel)
    assert conformance.lowered_text(fwd_bwd, lhs, rhs, sizes, ct, platform="cuda").count("triton_kernel_call") == 3


@_needs_triton
def test_triton_candidate_configs_lower():
    from forgeax.kernels.triton import ragged_dot as triton_ragged_dot

    impl = triton_ragged_dot.RAGGED_DOT
    spec = RaggedDotSpec(out_dtype="bfloat16")
    lhs, rhs, sizes = _args(*CASES[0])
    for config in impl.candidate_configs(lhs, rhs, sizes, spec=spec):
        text = conformance.lowered_text(lambda *a, config=config: impl.fn(*a, spec=spec, config=config), lhs, rhs, sizes,
                                        platform="cuda")
        assert text.count("triton_kernel_call") == 1, config


# The Mosaic TPU kernel: bf16 / f32 with K and N multiples of its 512 blocks, and whole-dimension blocks.
TPU_CASES = [(16384, 4096, 4096, 8, jnp.bfloat16), (300, 256, 384, 5, jnp.float32), (77, 40, 24, 3, jnp.bfloat16)]


@pytest.mark.parametrize("case", TPU_CASES, ids=str)
def test_pallas_tpu_forward_and_backward_lower_for_tpu(case):
    from forgeax.kernels.pallas.tpu import ragged_dot as tpu_ragged_dot

    impl = tpu_ragged_dot.RAGGED_DOT
    spec = RaggedDotSpec(out_dtype=jnp.dtype(case[4]).name)
    lhs, rhs, sizes = _args(*case)
    config = tpu_ragged_dot.RaggedDotTpuConfig()

    forward, fwd_bwd = _forward_and_fwd_bwd(impl, spec, config)

    assert conformance.lowered_text(forward, lhs, rhs, sizes, platform="tpu").count("tpu_custom_call") == 1
    ct = jax.ShapeDtypeStruct((case[0], case[2]), case[4])
    assert conformance.lowered_text(fwd_bwd, lhs, rhs, sizes, ct, platform="tpu").count("tpu_custom_call") == 3
