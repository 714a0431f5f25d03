"""forgeax.export: serialise functions that call forgeax ops with `jax.export`.

`jax.export` refuses custom calls whose target it does not know to be stable. forgeax's
kernels lower to these custom calls:

  * "triton_kernel_call": Triton kernels through jax-triton (the compiled kernel, PTX for one
    compute capability, is embedded in the call's backend config);
  * "mosaic_gpu_v2": Pallas Mosaic GPU kernels; "tpu_custom_call": Pallas Mosaic TPU kernels
    (both already on JAX's list of stable targets);
  * "__cudnn$fmhaSoftmax[Backward]": cuDNN attention (the "cudnn" backend, through jax.nn.dot_product_attention).

    exported = forgeax.export.export(jax.jit(loss), platforms=("cuda",))(params, batch)
    blob = exported.serialize()                     # bytes
    jax.export.deserialize(blob).call(params, batch)

or pass `disabled_checks=forgeax.export.disabled_checks()` to `jax.export.export` yourself.
What cannot be exported: calls traced in interpret mode (the Triton, Mosaic GPU and Mosaic TPU
interpreters run as host callbacks, which `jax.export` refuses); `export` below therefore traces
with interpret mode off. An exported Triton or Mosaic GPU kernel runs only on the GPU
generation it was compiled for (sm_90 when lowered without a GPU) and with a jaxlib whose
custom-call ABI matches (no cross-version guarantee: why JAX does not list them as stable).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax

from forgeax.core.runtime import interpret_mode

__all__ = ["CUSTOM_CALL_TARGETS", "disabled_checks", "export"]

# Every custom-call target a forgeax kernel emits (tests/export_test.py checks that lowering
# forgeax's kernels produces no other unstable target).
CUSTOM_CALL_TARGETS: tuple[str, ...] = (
    "triton_kernel_call",
    "mosaic_gpu_v2",
    "tpu_custom_call",
    # The "cudnn" attention backend refuses bias and dropout, so only these two (lowering them
    # needs cuDNN: checked on a GPU).
    "__cudnn$fmhaSoftmax",
    "__cudnn$fmhaSoftmaxBackward",
)


def disabled_checks() -> list[jax.export.DisabledSafetyCheck]:
    """`jax.export` safety checks to disable so that forgeax's custom calls may be serialised."""
    return [jax.export.DisabledSafetyCheck.custom_call(t) for t in CUSTOM_CALL_TARGETS]


def export(fn: Callable[..., Any], *, platforms: Sequence[str] | None = None,
           disabled_checks: Sequence[jax.export.DisabledSafetyCheck] = ()) -> Callable[..., jax.export.Exported]:
    """`jax.export.export(fn, ...)` with forgeax's custom calls allowed and its kernels traced
    natively (never their interpreters). `fn` should be jitted; returns a function of the
    arguments (arrays or ShapeDtypeStructs) that gives the `jax.export.Exported`."""
    checks = [*globals()["disabled_checks"](), *disabled_checks]
    exporter = jax.export.export(fn if hasattr(fn, "trace") else jax.jit(fn), platforms=platforms,
                                 disabled_checks=checks)

    def run(*args: Any, **kwargs: Any) -> jax.export.Exported:
        with interpret_mode(False):
            return exporter(*args, **kwargs)

    return run
