"""Cross-lowering of the linear_recurrence and mean_pool kernels on CPU (no GPU or TPU needed).

Triton: `lower(lowering_platforms=("cuda",))` makes jax-triton compile each @triton.jit kernel to
PTX for sm_90 (a `triton_kernel_call` custom call); Mosaic TPU: Pallas' TPU lowering to a
`tpu_custom_call` (BlockSpec legality, kernel tracing; not libtpu's layout passes). Forward and
backward both; the backward must be kernels (custom_vjp), not autodiff through the forward.
Numerics are the conformance suites' job.

Run: JAX_PLATFORMS=cpu pytest tests/lowering_linear_recurrence_test.py   (WITHOUT TRITON_INTERPRET)
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import pytest

import conformance

TRITON = "triton_kernel_call"
TPU = "@tpu_custom_call"
_INTERPRETED_TRITON = os.environ.get("TRITON_INTERPRET", "").strip().lower() in ("1", "true", "yes", "on")
needs_compiled_triton = pytest.mark.skipif(_INTERPRETED_TRITON,
                                           reason="cross-lowering needs compiled Triton: unset TRITON_INTERPRET")

# ([B, T, D], dtype, reverse, with initial_state): the benchmark shape, odd T and D, one step.
RECURRENCE_CASES = [
    ((8, 16384, 4096), jnp.bfloat16, False, False),
    ((2, 65, 1000), jnp.float32, True, True),
    ((1, 1, 7), jnp.float16, False, True),
    ((3, 1000, 130), jnp.bfloat16, True, False),
]


def _recurrence_lowerings(module, shape, dtype, reverse, with_h0, platform):
    impl = module.LINEAR_RECURRENCE
    x = jax.ShapeDtypeStruct(shape, dtype)
    h0 = jax.ShapeDtypeStruct((shape[0], shape[2]), jnp.float32) if with_h0 else None
    config = impl.heuristic_config(x, x, h0, reverse=reverse)

    def forward(x, a, h0):
        return impl.fn(x, a, h0, reverse=reverse, config=config)

    def backward(x, a, h0, g):
        return jax.vjp(forward, x, a, h0)[1](g)

    return (conformance.lowered_text(forward, x, x, h0, platform=platform),
            conformance.lowered_text(backward, x, x, h0, x, platform=platform))


@needs_compiled_triton
@pytest.mark.parametrize("shape,dtype,reverse,with_h0", RECURRENCE_CASES, ids=str)
def test_triton_linear_recurrence_lowers_for_sm90(shape, dtype, reverse, with_h0):
    from forgeax.kernels.triton import linear_recurrence as module

    forward, backward = _recurrence_lowerings(module, shape, dtype, reverse, with_h0, "cuda")
    assert forward.count(TRITON) == 1
    assert backward.count(TRITON) == 2  # the forward (residual h) and the fused backward


@needs_compiled_triton
@pytest.mark.parametrize("fields", [dict(schedule="walk", block_t=32, block_d=64, vector=2, num_warps=1),
                                    dict(chunk_tiles=2), dict(vector=8, num_warps=4)], ids=str)
def test_triton_linear_recurrence_schedules_lower_for_sm90(fields):
    """The schedules and layouts beside the default (candidate configs) at the benchmark shape."""
    from forgeax.kernels.triton import linear_recurrence as module

    x = jax.ShapeDtypeStruct((8, 16384, 4096), jnp.bfloat16)
    config = module.heuristic_config(x, x, None, reverse=True).replace(**fields)

    def forward(x, a):
        return module.LINEAR_RECURRENCE.fn(x, a, None, reverse=True, config=config)

    backward = lambda x, a, g: jax.vjp(forward, x, a)[1](g)  # noqa: E731
    assert conformance.lowered_text(forward, x, x, platform="cuda").count(TRITON) == 1
    assert conformance.lowered_text(backward, x, x, x, platform="cuda").count(TRITON) == 2


@pytest.mark.parametrize("shape,dtype,reverse,with_h0", RECURRENCE_CASES, ids=str)
def test_pallas_tpu_linear_recurrence_lowers_for_tpu(shape, dtype, reverse, with_h0):
    from forgeax.kernels.pallas.tpu import linear_recurrence as module

    forward, backward = _recurrence_lowerings(module, shape, dtype, reverse, with_h0, "tpu")
    assert forward.count(TPU) == 1
    assert backward.count(TPU) == 2  # the forward and the backward recurrence


# ([B, T, D], dtype, num segments or None for lengths): a Llama-like shape, odd shapes, f32's
# IEEE products, the most segments the kernel takes.
MEAN_POOL_CASES = [
    ((8, 4096, 4096), jnp.bfloat16, None),
    ((8, 4096, 4096), jnp.bfloat16, 16),
    ((3, 1000, 130), jnp.float32, 5),
    ((2, 65, 24), jnp.float16, 128),
    ((1, 1, 7), jnp.float32, None),
]


@needs_compiled_triton
@pytest.mark.parametrize("shape,dtype,segments", MEAN_POOL_CASES, ids=str)
def test_triton_mean_pool_lowers_for_sm90(shape, dtype, segments):
    from forgeax.kernels.triton import mean_pool as module

    impl = module.MEAN_POOL
    x = jax.ShapeDtypeStruct(shape, dtype)
    lengths = None if segments else jax.ShapeDtypeStruct(shape[:1], jnp.int32)
    ids = jax.ShapeDtypeStruct(shape[:2], jnp.int32) if segments else None
    config = impl.heuristic_config(x, lengths, ids, num_segments=segments)

    def forward(x, lengths, ids):
        return impl.fn(x, lengths, ids, num_segments=segments, config=config)

    def backward(x, lengths, ids):
        out, pull = jax.vjp(lambda x: forward(x, lengths, ids), x)
        return pull(out)

    assert conformance.lowered_text(forward, x, lengths, ids, platform="cuda").count(TRITON) == 1
    assert conformance.lowered_text(backward, x, lengths, ids, platform="cuda").count(TRITON) == 2


@needs_compiled_triton
def test_triton_kernels_lower_with_int64_offsets():
    """B * T * D >= 2^31 (one long row: T * D alone overflows int32) takes the int64 offsets."""
    from forgeax.kernels.triton import linear_recurrence as recurrence
    from forgeax.kernels.triton import mean_pool as pool

    forward, backward = _recurrence_lowerings(recurrence, (1, 2**20, 4096), jnp.bfloat16, True, True, "cuda")
    assert forward.count(TRITON) == 1 and backward.count(TRITON) == 2
    x = jax.ShapeDtypeStruct((1, 2**20, 4096), jnp.bfloat16)
    ids = jax.ShapeDtypeStruct((1, 2**20), jnp.int32)
    config = pool.MEAN_POOL.heuristic_config(x, None, ids, num_segments=4)

    def pooled(x, ids):
        out, pull = jax.vjp(lambda x: pool.MEAN_POOL.fn(x, None, ids, num_segments=4, config=config), x)
        return pull(out)

    assert conformance.lowered_text(pooled, x, ids, platform="cuda").count(TRITON) == 2
