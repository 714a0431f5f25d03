"""Cross-lowering of the paged / decode attention kernels on CPU: Triton for sm_90, Mosaic TPU.

`jax.jit(f).trace(...).lower(lowering_platforms=(...))` compiles each Triton kernel to PTX (a
`triton_kernel_call`) and runs Pallas' TPU lowering to a `tpu_custom_call`: a kernel that does not
compile fails here; numerics are tests/paged_attention_test.py's job.

Run: JAX_PLATFORMS=cpu pytest tests/lowering_paged_attention_test.py   (WITHOUT TRITON_INTERPRET)
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import pytest

import conformance
from forgeax.kernels.common.paged import PagedSpec

_needs_triton = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET", "").strip().lower() in ("1", "true", "yes", "on"),
                                   reason="cross-lowering needs compiled Triton kernels: unset TRITON_INTERPRET")

# (B, N, KV, H, page, max_pages, dtype, spec): the benchmark shape (B64, context 8192, N32/KV8,
# H128, page 16, bf16), then MQA with a window and soft cap, an odd group and head dim in f32,
# and one kv head for 64 query heads.
CASES = [
    (64, 32, 8, 128, 16, 512, jnp.bfloat16, PagedSpec(scale=128 ** -0.5)),
    (3, 8, 1, 64, 16, 7, jnp.bfloat16, PagedSpec(scale=0.125, window_left=100, window_right=0, logit_soft_cap=30.0)),
    (2, 6, 2, 80, 64, 3, jnp.float32, PagedSpec(scale=0.1, return_lse=True)),
    (4, 64, 1, 128, 16, 9, jnp.bfloat16, PagedSpec(scale=0.1)),  # a group of 64 heads: 8 warps
]


def _paged_args(B, N, KV, H, page, max_pages, dtype):
    P = B * max_pages
    return (jax.ShapeDtypeStruct((B, N, H), dtype), jax.ShapeDtypeStruct((P, page, KV, H), dtype),
            jax.ShapeDtypeStruct((P, page, KV, H), dtype), jax.ShapeDtypeStruct((B,), jnp.int32),
            jax.ShapeDtypeStruct((B, max_pages), jnp.int32))


def _decode_args(B, N, KV, H, page, max_pages, dtype):
    S = page * max_pages - 3
    return (jax.ShapeDtypeStruct((B, N, H), dtype), jax.ShapeDtypeStruct((B, S, KV, H), dtype),
            jax.ShapeDtypeStruct((B, S, KV, H), dtype), jax.ShapeDtypeStruct((B,), jnp.int32))


@_needs_triton
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}x{c[1]}x{c[2]}x{c[3]}" if isinstance(c, tuple) else None)
def test_triton_paged_and_decode_lower_for_sm90(case):
    from forgeax.kernels.triton import paged_attention as tp

    *shape, spec = case
    for impl, args in ((tp.PAGED_ATTENTION, _paged_args(*shape)), (tp.DECODE_ATTENTION, _decode_args(*shape))):
        config = impl.heuristic_config(*args, spec=spec)
        text = conformance.lowered_text(lambda *a: impl.fn(*a, spec=spec, config=config), *args, platform="cuda")
        assert text.count("triton_kernel_call") == 1


@_needs_triton
def test_triton_candidate_configs_lower():
    from forgeax.kernels.triton import paged_attention as tp

    *shape, spec = CASES[0]
    args = _paged_args(*shape)
    for config in tp.PAGED_ATTENTION.candidate_configs(*args, spec=spec):
        text = conformance.lowered_text(lambda *a, config=config: tp.PAGED_ATTENTION.fn(*a, spec=spec, config=config),
                                        *args, platform="cuda")
        assert text.count("triton_kernel_call") == 1, config


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}x{c[1]}x{c[2]}x{c[3]}" if isinstance(c, tuple) else None)
def test_pallas_tpu_paged_and_decode_lower_for_tpu(case):
    from forgeax.kernels.pallas.tpu import paged_attention as tpu

    *shape, spec = case
    for impl, args in ((tpu.PAGED_ATTENTION, _paged_args(*shape)), (tpu.DECODE_ATTENTION, _decode_args(*shape))):
        text = conformance.lowered_text(lambda *a: impl.fn(*a, spec=spec), *args, platform="tpu")
        assert text.count("tpu_custom_call") == 1
