"""Masked mean over the sequence axis: the reference (plain jax.numpy, f32 math).

x: [B, T, D]. Exactly one of:
  lengths [B] (int): out[b] = mean of x[b, :n_b], n_b = clip(lengths[b], 0, T); n_b = 0 gives 0.
    Output [B, D].
  segment_ids [B, T] (int), num_segments S (static): out[b, s] = mean of the rows t with
    segment_ids[b, t] == s; ids outside [0, S) (padding: -1) belong to no segment; an empty
    segment gives 0. Output [B, S, D].
Output in x's dtype; sums in f32. The gradient is JAX autodiff: the oracle (each row gets its
segment's cotangent over the segment's count, padding rows 0).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Integer

from forgeax.core.registry import Implementation

_F32 = jnp.float32


def mean_pool(x: Float[Array, "B T D"], lengths: Integer[Array, " B"] | None, segment_ids: Integer[Array, "B T"] | None,
              *, num_segments: int | None) -> Float[Array, "B D"] | Float[Array, "B S D"]:
    x32 = x.astype(_F32)
    t = x.shape[1]
    if segment_ids is None:
        count = jnp.clip(lengths, 0, t).astype(_F32)  # [B]
        mask = jnp.arange(t)[None, :] < lengths[:, None]
        total = jnp.sum(jnp.where(mask[..., None], x32, 0.0), axis=1)
        return (total / jnp.maximum(count, 1.0)[:, None]).astype(x.dtype)
    member = (segment_ids[..., None] == jnp.arange(num_segments)).astype(_F32)  # [B, T, S]
    total = jnp.einsum("bts,btd->bsd", member, x32, precision=jax.lax.Precision.HIGHEST)
    count = jnp.sum(member, axis=1)  # [B, S]
    return (total / jnp.maximum(count, 1.0)[..., None]).astype(x.dtype)


MEAN_POOL = Implementation(fn=mean_pool)
