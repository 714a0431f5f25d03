"""The public `softcap` op: argument checks, then the op registered with forgeax.

`backend=None` tries the Triton kernel on GPUs and falls back to the XLA reference
elsewhere (or when the kernel's `supports` refuses a call); `backend="triton"` or
`backend="xla"` asks for one. The Triton backend is named by module path, so importing
this module needs no Triton.
"""

from __future__ import annotations

import forgeax
from forgeax import KernelConfig
from forgeax.core import OPS
from jaxtyping import Array, Float

__all__ = ["SOFTCAP", "softcap"]

_HERE = "forgeax.examples.custom_kernel"

SOFTCAP = OPS.get("softcap") or forgeax.define_op(
    "softcap",
    {"xla": f"{_HERE}.reference:SOFTCAP", "triton": f"{_HERE}.softcap_triton:SOFTCAP"},
    priority={"gpu": ["triton"], "tpu": [], "cpu": []},
)


def softcap(x: Float[Array, "*shape"], cap: float = 30.0, *, backend: str | None = None,
            config: KernelConfig | None = None) -> Float[Array, "*shape"]:
    """cap * tanh(x / cap): squashes x smoothly into (-cap, cap); differentiable.

    Args:
      x: any shape, float32 / bfloat16 / float16.
      cap: the bound, a positive float.
      backend: None (the best for this device), "triton" or "xla".
      config: a `SoftcapConfig` for the Triton backend (None: tuned or heuristic).
    """
    if not (hasattr(x, "shape") and hasattr(x, "dtype")):
        raise TypeError(f"x: expected a JAX or NumPy array, got {type(x).__name__}")
    if isinstance(cap, bool) or not isinstance(cap, (int, float)) or not cap > 0:
        raise ValueError(f"cap: expected a positive float, got {cap!r}")
    return SOFTCAP(x, cap=float(cap), backend=backend, config=config)
