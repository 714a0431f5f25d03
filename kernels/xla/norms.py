"""RMSNorm and LayerNorm references: plain jax.numpy, statistics in f32.

    rms_norm(x)   = x * rsqrt(mean(x^2) + eps) * scale
    layer_norm(x) = (x - mean(x)) * rsqrt(var(x) + eps) * scale + offset

over the last axis; output in x's dtype. Their gradients are JAX autodiff: the
oracle for every backward kernel.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from forgeax.core.registry import Implementation


def rms_norm(x: Float[Array, "*B D"], scale: Float[Array, " D"], *, eps: float) -> Float[Array, "*B D"]:
    x32 = x.astype(jnp.float32)
    inv_rms = jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (x32 * inv_rms * scale.astype(jnp.float32)).astype(x.dtype)


def layer_norm(
    x: Float[Array, "*B D"], scale: Float[Array, " D"], offset: Float[Array, " D"] | None, *, eps: float
) -> Float[Array, "*B D"]:
    x32 = x.astype(jnp.float32)
    mean = jnp.mean(x32, axis=-1, keepdims=True)
    centred = x32 - mean
    inv_std = jax.lax.rsqrt(jnp.mean(centred * centred, axis=-1, keepdims=True) + eps)
    y = centred * inv_std * scale.astype(jnp.float32)
    if offset is not None:
        y = y + offset.astype(jnp.float32)
    return y.astype(x.dtype)


RMS_NORM = Implementation(fn=rms_norm)
LAYER_NORM = Implementation(fn=layer_norm)
