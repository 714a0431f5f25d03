"""Rotary position embedding reference: plain jax.numpy, f32 math.

x: [B, T, N, H]; positions: [B, T] integers. Per head vector, the pairs (a_i, b_i)
(half-split: a = x[:R/2], b = x[R/2:R]; interleaved: a = x[0:R:2], b = x[1:R:2]) rotate by angle = f32(p) * inv_freq[i]:

    a' = a cos - b sin,   b' = b cos + a sin

and elements rotary_dim..H-1 pass through. Output in x's dtype. `rope_qk` rotates q and k
(k may have fewer heads) with the same angles. The gradient is JAX autodiff: the oracle.
"""

from __future__ import annotations

import jax.numpy as jnp
from jaxtyping import Array, Float, Integer

from forgeax.core.registry import Implementation
from forgeax.kernels.common.rope import RopeSpec, inverse_frequencies


def cos_sin(positions: Integer[Array, "B T"], spec: RopeSpec) -> tuple[Array, Array]:
    """cos, sin of the angles, [B, T, 1, R/2] f32."""
    angle = positions.astype(jnp.float32)[..., None] * jnp.asarray(inverse_frequencies(spec))
    return jnp.cos(angle)[:, :, None, :], jnp.sin(angle)[:, :, None, :]


def _rotate(x: Array, cos: Array, sin: Array, spec: RopeSpec) -> Array:
    r, half = spec.rotary_dim, spec.half
    x32 = x.astype(jnp.float32)
    if spec.interleaved:
        a, b = x32[..., 0:r:2], x32[..., 1:r:2]
    else:
        a, b = x32[..., :half], x32[..., half:r]
    a, b = a * cos - b * sin, b * cos + a * sin
    if spec.interleaved:
        rotated = jnp.stack([a, b], axis=-1).reshape(*x.shape[:-1], r)
    else:
        rotated = jnp.concatenate([a, b], axis=-1)
    return jnp.concatenate([rotated, x32[..., r:]], axis=-1).astype(x.dtype)


def rope(x: Float[Array, "B T N H"], positions: Integer[Array, "B T"], *, spec: RopeSpec) -> Float[Array, "B T N H"]:
    cos, sin = cos_sin(jnp.broadcast_to(positions, x.shape[:2]), spec)
    return _rotate(x, cos, sin, spec)


def rope_qk(q: Float[Array, "B T N H"], k: Float[Array, "B T K H"], positions: Integer[Array, "B T"], *,
            spec: RopeSpec) -> tuple[Array, Array]:
    cos, sin = cos_sin(jnp.broadcast_to(positions, q.shape[:2]), spec)
    return _rotate(q, cos, sin, spec), _rotate(k, cos, sin, spec)


ROPE = Implementation(fn=rope)
ROPE_QK = Implementation(fn=rope_qk)
