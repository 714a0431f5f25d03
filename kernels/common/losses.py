"""Loss reductions shared by every backend (one definition of "mean over valid tokens")."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def reduce_loss(loss: jax.Array, valid: jax.Array, reduction: str) -> jax.Array:
    """Per-token losses (0 where not valid) -> "none" (as is), "sum", or "mean" over valid tokens.

    The mean divides by max(count, 1): with no valid token the sum is 0, so the
    mean is 0 and so is its gradient (not NaN). The count stays on the device.
    """
    if reduction == "none":
        return loss
    total = jnp.sum(loss)
    if reduction == "sum":
        return total
    return total / jnp.maximum(jnp.sum(valid), 1).astype(jnp.float32)
