"""Fused residual add + RMSNorm reference: plain jax.numpy, statistics in f32.

    s = x + residual                       (x's dtype, a plain add)
    normed = s * rsqrt(mean(s^2) + eps) * scale

over the last axis; returns (normed, s), both in x's dtype. The gradient is JAX
autodiff: the oracle for every backward kernel.
"""

from __future__ import annotations

from jaxtyping import Array, Float

from forgeax.core.registry import Implementation
from forgeax.kernels.xla.norms import rms_norm


def add_rms_norm(x: Float[Array, "*B D"], residual: Float[Array, "*B D"], scale: Float[Array, " D"], *,
                 eps: float) -> tuple[Float[Array, "*B D"], Float[Array, "*B D"]]:
    s = x + residual
    return rms_norm(s, scale, eps=eps), s


ADD_RMS_NORM = Implementation(fn=add_rms_norm)
