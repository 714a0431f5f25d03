"""Cross-entropy reference: plain jax.numpy in f32, gradient by autodiff.

Per token, z = cap * tanh(logits / cap) (or z = logits), target t, V the
(global) vocabulary size, ls the label smoothing:

    lse  = log(sum_v exp(z_v))
    loss = lse - (1 - ls) * z_t - ls * mean_v(z_v) + z_loss * lse^2

Tokens whose target is ignore_index or outside [0, V) give 0. Reductions:
"none" (per token, f32), "sum", "mean" (sum / number of valid tokens, 0 when
there are none). The options arrive as one `LossSpec` (kernels/common/losses.py).

With `axis_name` (inside `shard_map`) the vocabulary axis is split across the
devices of that mesh axis: each holds a contiguous slice of V / n columns, and
the four per-row quantities (max, sum of exp, target logit, sum of logits) are
combined with pmax/psum. The max only shifts the exponentials for stability,
so no gradient flows through it; the psums' transposes give each shard its
slice of the full gradient.

This is the oracle every kernel backend is tested against.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, Float, Integer

from forgeax.kernels.common.losses import LossSpec, reduce_loss, valid_targets
from forgeax.core.registry import Implementation


def cross_entropy(
    logits: Float[Array, "*B V"],
    targets: Integer[Array, "*B"],
    *,
    spec: LossSpec = LossSpec(),
) -> Float[Array, "..."]:
    cap, ls, axis_name = spec.logit_soft_cap, spec.label_smoothing, spec.axis_name
    z = logits.astype(jnp.float32)
    if cap is not None:
        z = cap * jnp.tanh(z / cap)
    local_vocab = z.shape[-1]
    if axis_name is None:
        first, vocab = 0, local_vocab
        combine = lambda a: a  # noqa: E731
    else:
        first = lax.axis_index(axis_name) * local_vocab
        vocab = local_vocab * lax.axis_size(axis_name)
        combine = lambda a: lax.psum(a, axis_name)  # noqa: E731

    t = targets.astype(jnp.int32)
    valid = valid_targets(t, vocab, spec)

    shift = lax.stop_gradient(jnp.max(z, axis=-1))
    if axis_name is not None:
        shift = lax.pmax(shift, axis_name)
    lse = shift + jnp.log(combine(jnp.sum(jnp.exp(z - shift[..., None]), axis=-1)))

    # The target logit lives on exactly one shard; the others contribute 0.
    local_t = t - first
    here = (local_t >= 0) & (local_t < local_vocab)
    picked = jnp.take_along_axis(z, jnp.clip(local_t, 0, local_vocab - 1)[..., None], axis=-1)[..., 0]
    z_target = combine(jnp.where(here, picked, 0.0))

    loss = lse - (1.0 - ls) * z_target
    if ls:
        loss = loss - ls * combine(jnp.sum(z, axis=-1)) / vocab
    if spec.z_loss:
        loss = loss + spec.z_loss * lse * lse
    loss = jnp.where(valid, loss, 0.0)
    return reduce_loss(loss, valid, spec.reduction)


CROSS_ENTROPY = Implementation(fn=cross_entropy)
