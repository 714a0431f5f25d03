"""Fused residual add + RMSNorm: `add_rms_norm` (the pre-norm residual pattern)."""

from __future__ import annotations

import jax.numpy as jnp
from jaxtyping import Array, Float

from forgeax.core import KernelConfig, Selection, define_op
from forgeax.ops import checks

__all__ = ["add_rms_norm"]


def _features(args, kwargs) -> dict:
    """What the selection rules (rules/add_rms_norm.json) read of a call."""
    del kwargs
    x = args[0]
    return {"dim": int(x.shape[-1]), "rows": int(x.size // max(x.shape[-1], 1)), "dtype": x.dtype.name}


_MODULES = {"xla": "xla", "triton": "triton", "pallas_tpu": "pallas.tpu"}
ADD_RMS_NORM = define_op("add_rms_norm", {b: f"forgeax.kernels.{m}.add_rms_norm:ADD_RMS_NORM" for b, m in _MODULES.items()},
                         selection=Selection.load("forgeax.ops", "rules/add_rms_norm.json"), features=_features)


def add_rms_norm(
    x: Float[Array, "*B D"],
    residual: Float[Array, "*B D"],
    scale: Float[Array, " D"],
    *,
    eps: float = 1e-6,
    backend: str | None = None,
    config: KernelConfig | None = None,
) -> tuple[Float[Array, "*B D"], Float[Array, "*B D"]]:
    """`s = x + residual` and `rms_norm(s) * scale` in one pass over the rows.

        s = x + residual                                (x's dtype, as a plain add)
        normed = s / sqrt(mean(s^2, axis=-1) + eps) * scale

    Args:
      x: `[..., D]`, f32/bf16/f16 (e.g. a sublayer's output).
      residual: the residual stream, x's shape and dtype.
      scale: `[D]` learnable gain (used in f32).
      eps: added to the mean square; > 0.
      backend: None (best for this device), "xla", "triton", "pallas_tpu", or a registered name.
      config: a kernel config of the chosen backend (None: tuned or heuristic).

    Returns:
      (normed, s), both `[..., D]` in x's dtype; statistics in f32. Differentiable with respect
      to x, residual and scale (the gradient of s flows to both x and residual).
    """
    checks.floating_array("x", x, min_rank=1)
    checks.floating_array("residual", residual, min_rank=1)
    if residual.shape != x.shape:
        raise ValueError(f"residual: expected x's shape {tuple(x.shape)}, got {tuple(residual.shape)}")
    if residual.dtype != x.dtype:
        raise TypeError(f"residual: expected x's dtype {jnp.dtype(x.dtype).name}, got {jnp.dtype(residual.dtype).name}")
    checks.floating_array("scale", scale, min_rank=1)
    if scale.shape != (x.shape[-1],):
        raise ValueError(f"scale: expected shape ({x.shape[-1]},) (the last axis of x {tuple(x.shape)}), got {tuple(scale.shape)}")
    checks.positive_float("eps", eps)
    return ADD_RMS_NORM(x, residual, scale, eps=float(eps), backend=backend, config=config)
