"""Cross-lowering of the mla_decode kernels on CPU: Triton for sm_90, Mosaic TPU for TPU.

`conformance.lowered_text` lowers for "cuda" (jax-triton compiles the @triton.jit kernel to PTX
for sm_90) or "tpu" (Pallas' Mosaic TPU lowering into a `tpu_custom_call`), at DeepSeek-V3's
shapes (128 heads, latent 512 + rope 64), contiguous and paged. A kernel that does not compile
fails here; numerics are checked by tests/mla_decode_test.py in the interpreters and on the GPU.

Run: JAX_PLATFORMS=cpu pytest tests/lowering_mla_decode_test.py (WITHOUT TRITON_INTERPRET).
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import pytest

import conformance

from forgeax.kernels.common.paged import PagedSpec

SPEC = PagedSpec(scale=192 ** -0.5)
TRITON_INTERPRET = os.environ.get("TRITON_INTERPRET", "").strip().lower() in ("1", "true", "yes", "on")
B, N, L, R, S, PAGE = 2, 128, 512, 64, 1000, 64


def _args(paged: bool, dtype=jnp.bfloat16, *, N=N, PAGE=PAGE):
    g = jax.ShapeDtypeStruct
    pages = B * (-(-S // PAGE))
    cache = (pages, PAGE) if paged else (B, S)
    table = g((B, -(-S // PAGE)), jnp.int32) if paged else None
    return (g((B, N, L), dtype), g((B, N, R), dtype), g(cache + (L,), dtype), g(cache + (R,), dtype),
            g((B,), jnp.int32), table)


@pytest.mark.skipif(TRITON_INTERPRET, reason="cross-lowering needs compiled Triton kernels: unset TRITON_INTERPRET")
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("splits", [1, 4])
def test_triton_kernel_lowers_for_sm90(paged, splits):
    from forgeax.kernels.triton import mla_decode as triton_mla  # noqa: PLC0415

    args = _args(paged)
    config = triton_mla.heuristic_config(*args, spec=SPEC).replace(num_splits=splits)
    text = conformance.lowered_text(lambda *a: triton_mla.MLA_DECODE.fn(*a, spec=SPEC, config=config), *args, platform="cuda")
    assert text.count("triton_kernel_call") == 1


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "f32"])
def test_pallas_tpu_kernel_lowers_for_tpu(paged, dtype):
    from forgeax.kernels.pallas.tpu import mla_decode as tpu_mla  # noqa: PLC0415

    args = _args(paged, dtype)
    config = tpu_mla.MlaDecodeTpuConfig()
    text = conformance.lowered_text(lambda *a: tpu_mla.MLA_DECODE.fn(*a, spec=SPEC, config=config), *args, platform="tpu")
    assert text.count("@tpu_custom_call") == 1


def test_pallas_tpu_kernel_lowers_for_deepseek_v2_lite_pages():
    """16 heads (a single head tile), pages of 16 rows: one grid step per page."""
    from forgeax.kernels.pallas.tpu import mla_decode as tpu_mla  # noqa: PLC0415

    args = _args(True, N=16, PAGE=16)
    text = conformance.lowered_text(lambda *a: tpu_mla.MLA_DECODE.fn(*a, spec=SPEC, config=tpu_mla.MlaDecodeTpuConfig()),
                                    *args, platform="tpu")
    assert text.count("@tpu_custom_call") == 1
