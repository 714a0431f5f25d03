"""Cross-lowering of the pallas_tpu linear_cross_entropy for TPU on CPU (no TPU needed).

At the benchmark shape (x [8192, 4096], W [4096, 128256], bf16) the chunk loop
must lower to a while loop around the Mosaic TPU cross-entropy kernels
(`tpu_custom_call`s), never build the [8192, 128256] logits, and keep one
chunk of f32 logits (1024 tokens by default). This runs Pallas' TPU lowering
(block legality, Mosaic dialect), not libtpu's compiler. Numerics are checked
in the TPU interpreter by tests/linear_cross_entropy_test.py (FORGEAX_INTERPRET=1).

Run: JAX_PLATFORMS=cpu pytest tests/lowering_pallas_tpu_linear_cross_entropy_test.py
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import re

import jax
import jax.numpy as jnp
import pytest

import conformance
from forgeax.kernels.common.losses import LossSpec
from forgeax.kernels.pallas.tpu import linear_cross_entropy as tpu_lce

CUSTOM_CALL = "@tpu_custom_call"
N, H, V = 8192, 4096, 128256


def _lower_tpu(fn, *args) -> str:
    return conformance.lowered_text(fn, *args, platform="tpu")


def _kernel_names(text: str) -> list[str]:
    return sorted(re.findall(r'kernel_name = "(\w+)"', text))


def _args(n, h, v, dtype=jnp.bfloat16, bias=False):
    return (jax.ShapeDtypeStruct((n, h), dtype), jax.ShapeDtypeStruct((h, v), dtype),
            jax.ShapeDtypeStruct((n,), jnp.int32)) + ((jax.ShapeDtypeStruct((v,), dtype),) if bias else ())


@pytest.mark.parametrize("options", [{}, dict(label_smoothing=0.1, z_loss=1e-4, logit_soft_cap=30.0)], ids=str)
def test_forward_and_backward_lower_to_a_chunk_loop_for_tpu(options):
    loss = lambda x, w, t: tpu_lce.LINEAR_CROSS_ENTROPY.fn(x, w, t, spec=LossSpec(**options))  # noqa: E731

    # Forward only: the loss kernel, once, inside the loop.
    forward = _lower_tpu(loss, *_args(N, H, V))
    assert forward.count(CUSTOM_CALL) == 1 and "stablehlo.while" in forward, forward[:2000]
    assert _kernel_names(forward) == ["_fwd_kernel"]

    # mean, forward+backward: the loss and the gradient kernels in one loop; no [N, V] array.
    module = _lower_tpu(jax.value_and_grad(loss, argnums=(0, 1)), *_args(N, H, V))
    assert module.count(CUSTOM_CALL) == 2 and "stablehlo.while" in module, module[:2000]
    assert _kernel_names(module) == ["_bwd_kernel", "_fwd_kernel"]
    assert f"{N}x{V}" not in module
    assert "1024x128256xf32" in module  # the default chunk: 1024 tokens of f32 logits
    assert "1024x128256xbf16" in module  # ...and its gradient in the matmul dtype


def test_odd_shape_per_token_loss_with_bias_lowers():
    """Tokens that the chunk does not divide (300 = 2 x 128 + 44, padded), V not a multiple of 128."""
    n, h, v = 300, 96, 50257

    def fn(x, w, t, b):
        out, pull = jax.vjp(
            lambda *a: tpu_lce.LINEAR_CROSS_ENTROPY.fn(a[0], a[1], t, a[2], spec=LossSpec(reduction="none", label_smoothing=0.1),
                                                       chunk_size=128), x, w, b)
        return pull(out)

    module = _lower_tpu(fn, *_args(n, h, v, jnp.float16, bias=True))
    # The loss kernel (forward, keeps lse) and the gradient kernel (the backward's rerun).
    assert module.count(CUSTOM_CALL) == 2, module[:2000]
    assert _kernel_names(module) == ["_bwd_kernel", "_fwd_kernel"]
    assert f"128x{v}xf32" in module and f"{n}x{v}" not in module


def test_supports_refuses_with_reasons():
    x, w, t = _args(8, 64, 1000)
    assert tpu_lce.LINEAR_CROSS_ENTROPY.supports(x, w, t, None, spec=LossSpec()) is None
    assert tpu_lce.LINEAR_CROSS_ENTROPY.supports(x, w, t, None, spec=LossSpec(axis_name="vocab")) is None  # vocabulary-parallel
    f64 = tpu_lce.LINEAR_CROSS_ENTROPY.supports(x, jax.ShapeDtypeStruct((64, 1000), jnp.float64), t, None, spec=LossSpec())
    assert f64 is not None and "float64" in f64
