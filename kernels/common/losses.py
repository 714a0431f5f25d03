"""The options of the cross-entropy losses (`LossSpec`) and what every backend shares about them.

`forgeax.ops.cross_entropy` and `forgeax.ops.linear_cross_entropy` validate their options once
into a `LossSpec` and pass it, unchanged, to every backend. Per token, with z = cap * tanh(l / cap)
when `logit_soft_cap` is set (else z = l), V the (global) vocabulary and ls the label smoothing:

    loss = lse(z) - (1 - ls) * z[target] - ls * mean_v(z_v) + z_loss * lse(z)^2

A token is valid when its target is not `ignore_index` and lies in [0, V) (`valid_targets`);
invalid tokens give 0 and a zero gradient. Reductions (`reduce_loss`): "none" (per token),
"sum", "mean" (the sum over the number of valid tokens; 0 when there are none).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable

import jax
import jax.numpy as jnp

REDUCTIONS = ("mean", "sum", "none")


@dataclasses.dataclass(frozen=True, kw_only=True)
class LossSpec:
    """The static options of one loss call (hashable: a jit / custom_vjp static argument).

    axis_name: None, or the shard_map mesh axis the vocabulary is split over (each device holds
    a contiguous slice of V, in mesh order; targets are global class ids).
    """

    label_smoothing: float = 0.0
    ignore_index: int = -100
    reduction: str = "mean"
    z_loss: float = 0.0
    logit_soft_cap: float | None = None
    axis_name: Hashable | None = None

    @property
    def soft_cap(self) -> float:
        """The cap as a number, 0.0 without one (what kernels branch on statically)."""
        return self.logit_soft_cap or 0.0


def valid_targets(targets: jax.Array, vocab, spec: LossSpec) -> jax.Array:
    """True where a token counts: its target is not `ignore_index` and lies in [0, vocab)."""
    return (targets != spec.ignore_index) & (targets >= 0) & (targets < vocab)


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
