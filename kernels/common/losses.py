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
from jax import lax

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


# ----------------------------------------------------------------------------- rows of logits
# For backends that differentiate a chunk of logits [C, V_local] (f32) in closed form, targets
# int32 [C] with -1 marking an ignored token. With spec.axis_name, V_local is this device's
# contiguous slice of the vocabulary.


def vocab_range(spec: LossSpec, local: int):
    """(first global id of this shard, global vocabulary size)."""
    if spec.axis_name is None:
        return 0, local
    return lax.axis_index(spec.axis_name) * local, local * lax.axis_size(spec.axis_name)


def soft_capped(logits: jax.Array, spec: LossSpec):
    """(z, tanh(l / cap) or None): the capped logits and what their derivative needs."""
    if not spec.soft_cap:
        return logits, None
    th = jnp.tanh(logits / spec.soft_cap)
    return spec.soft_cap * th, th


def logits_grad(logits: jax.Array, t: jax.Array, lse: jax.Array, scale: jax.Array, spec: LossSpec, dtype) -> jax.Array:
    """scale[:, None] * d loss_row / d logits in `dtype`, given each row's (global) lse:

        (p_v (1 + 2 z_loss lse) - (1 - ls) [v == t] - ls / V) * (1 - (z_v / cap)^2),  p = exp(z - lse)

    exact zeros on ignored rows, even for infinite logits."""
    z, th = soft_capped(logits, spec)
    local = z.shape[-1]
    first, vocab = vocab_range(spec, local)
    valid = (t >= 0)[:, None]
    scale = jnp.where(t >= 0, scale, 0.0)[:, None]
    hit = jnp.arange(local)[None, :] == (t - first)[:, None]
    g = jnp.exp(z - lse[:, None]) * (scale * (1.0 + 2.0 * spec.z_loss * lse[:, None]))
    g = g - jnp.where(hit, scale * (1.0 - spec.label_smoothing), 0.0)
    if spec.label_smoothing:
        g = g - scale * (spec.label_smoothing / vocab)
    if th is not None:
        g = g * (1.0 - th * th)
    return jnp.where(valid, g, 0.0).astype(dtype)
