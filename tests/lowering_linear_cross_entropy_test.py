"""Cross-lowering of the Triton linear_cross_entropy for cuda on CPU (no GPU needed).

At the benchmark shape (x [8192, 4096], W [4096, 128256], bf16) the chunk loop
must lower to a while loop around one Triton kernel per chunk, never build the
[8192, 128256] logits, and write the gradient over the chunk's logits in place
(an operand-output alias on the kernel call). Numerics are checked by the
interpret-mode and GPU conformance runs, not here.

Run: JAX_PLATFORMS=cpu pytest tests/lowering_linear_cross_entropy_test.py
(WITHOUT TRITON_INTERPRET).
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import pytest

import conformance

if os.environ.get("TRITON_INTERPRET", "").strip().lower() in ("1", "true", "yes", "on"):
    pytest.skip("cross-lowering needs compiled Triton kernels: unset TRITON_INTERPRET", allow_module_level=True)

import jax
import jax.numpy as jnp

from forgeax.kernels.common.losses import LossSpec
from forgeax.kernels.triton import linear_cross_entropy as triton_lce

CUSTOM_CALL = "triton_kernel_call"
N, H, V = 8192, 4096, 128256


def _lower_cuda(fn, *args) -> str:
    return conformance.lowered_text(fn, *args, platform="cuda")


def _args(dtype=jnp.bfloat16, bias=False):
    return (jax.ShapeDtypeStruct((N, H), dtype), jax.ShapeDtypeStruct((H, V), dtype),
            jax.ShapeDtypeStruct((N,), jnp.int32)) + ((jax.ShapeDtypeStruct((V,), dtype),) if bias else ())


@pytest.mark.parametrize("options", [{}, dict(label_smoothing=0.1, z_loss=1e-4, logit_soft_cap=30.0)], ids=str)
def test_forward_and_backward_lower_to_a_chunk_loop_for_cuda(options):
    loss = lambda x, w, t: triton_lce.LINEAR_CROSS_ENTROPY.fn(x, w, t, spec=LossSpec(**options))  # noqa: E731

    forward = _lower_cuda(loss, *_args())
    assert forward.count(CUSTOM_CALL) == 1 and "stablehlo.while" in forward, forward[:2000]

    # mean: the loss-and-gradient kernel, in place, inside one loop; no [N, V] array anywhere.
    module = _lower_cuda(jax.value_and_grad(loss, argnums=(0, 1)), *_args())
    assert module.count(CUSTOM_CALL) == 1 and "stablehlo.while" in module
    assert "output_operand_aliases" in module
    assert f"{N}x{V}" not in module
    assert "2048x128256xbf16" in module  # the default chunk: 2048 tokens of bf16 logits


def test_per_token_loss_with_bias_lowers_two_kernels():
    def fn(x, w, t, b):
        out, pull = jax.vjp(lambda *a: triton_lce.LINEAR_CROSS_ENTROPY.fn(a[0], a[1], t, a[2], spec=LossSpec(reduction="none")), x, w, b)
        return pull(out)

    module = _lower_cuda(fn, *_args(bias=True))
    # The loss kernel (forward, keeps lse) and the gradient kernel (the backward's rerun).
    assert module.count(CUSTOM_CALL) == 2, module[:2000]
    assert f"{N}x{V}" not in module
