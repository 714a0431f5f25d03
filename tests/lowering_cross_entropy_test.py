"""Cross-lowering of the Triton cross-entropy kernels for cuda on CPU (no GPU needed).

`jax.jit(f).trace(...).lower(lowering_platforms=("cuda",))` makes jax-triton
compile each @triton.jit kernel to PTX for sm_90 (launch.py passes
compute_capability=90 when there is no GPU) and embed it in a
`triton_kernel_call` custom call. A kernel that does not compile fails here.
It proves nothing about numerics: interpret mode and the GPU conformance run do.

Run: JAX_PLATFORMS=cpu pytest tests/lowering_cross_entropy_test.py   (WITHOUT
TRITON_INTERPRET: with it, @triton.jit builds interpreter objects that
jax-triton cannot compile).
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
from forgeax.kernels.triton import cross_entropy as triton_ce

CUSTOM_CALL = "triton_kernel_call"

# (logits shape, dtype, options): the llama-3 training shape (8k tokens x 128k
# vocabulary, bf16) with and without every option, an odd vocabulary, a short
# row, and a shape whose element offsets need int64 (rows * V >= 2^31).
CASES = [
    ((8192, 128256), jnp.bfloat16, {}),
    ((8192, 128256), jnp.bfloat16, dict(label_smoothing=0.1, z_loss=1e-4, logit_soft_cap=30.0)),
    ((4, 1024, 50257), jnp.float32, dict(reduction="none")),
    ((7, 1000), jnp.float16, dict(reduction="sum", label_smoothing=0.2)),
    ((32768, 128256), jnp.bfloat16, {}),
]


def _lower_cuda(fn, *args) -> str:
    return conformance.lowered_text(fn, *args, platform="cuda")


@pytest.mark.parametrize("shape,dtype,options", CASES, ids=str)
def test_forward_and_backward_lower_to_triton_kernels_for_cuda(shape, dtype, options):
    logits = jax.ShapeDtypeStruct(shape, dtype)
    targets = jax.ShapeDtypeStruct(shape[:-1], jnp.int32)
    loss = lambda x, t: triton_ce.cross_entropy(x, t, spec=LossSpec(**options))  # noqa: E731

    forward = _lower_cuda(loss, logits, targets)
    assert forward.count(CUSTOM_CALL) == 1, forward[:2000]

    def backward(x, t):
        out, pull = jax.vjp(lambda y: loss(y, t), x)
        return pull(jnp.ones_like(out))

    # The loss kernel (keeps lse) and the gradient kernel.
    module = _lower_cuda(backward, logits, targets)
    assert module.count(CUSTOM_CALL) == 2, module[:2000]


def test_gradient_in_forward_variant_and_explicit_configs_lower():
    logits = jax.ShapeDtypeStruct((8192, 128256), jnp.bfloat16)
    targets = jax.ShapeDtypeStruct((8192,), jnp.int32)
    for config, kernels in (
        (triton_ce.CrossEntropyTritonConfig(grad_in_forward=True), 1),  # loss + gradient in one kernel
        (triton_ce.CrossEntropyTritonConfig(block_v=4096, num_warps=8), 2),
        (triton_ce.CrossEntropyTritonConfig(block_v=16384, num_warps=16), 2),
    ):
        fn = jax.value_and_grad(lambda x, t: triton_ce.cross_entropy(x, t, spec=LossSpec(label_smoothing=0.1), config=config))
        module = _lower_cuda(fn, logits, targets)
        assert module.count(CUSTOM_CALL) == kernels, config
