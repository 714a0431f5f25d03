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
import functools
from collections.abc import Callable, Hashable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from forgeax.kernels.common.batching import ManualAxes, fold_vmap_into_rows
from forgeax.kernels.common.partitioning import ROWS, VOCAB, vocab_rowwise

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


def logits_grad(logits: jax.Array, t: jax.Array, lse: jax.Array, scale: jax.Array, spec: LossSpec, dtype, vocab=None) -> jax.Array:
    """scale[:, None] * d loss_row / d logits in `dtype`, given each row's (global) lse:

        (p_v (1 + 2 z_loss lse) - (1 - ls) [v == t] - ls / V) * (1 - (z_v / cap)^2),  p = exp(z - lse)

    exact zeros on ignored rows, even for infinite logits. vocab: None (t global, V from
    spec.axis_name), or the global V with t already `local_targets` (a kernel's convention)."""
    z, th = soft_capped(logits, spec)
    local = z.shape[-1]
    first, vocab = vocab_range(spec, local) if vocab is None else (0, vocab)
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


# ----------------------------------------------------------------------------- vocabulary-parallel kernels
# A kernel backend runs vocabulary-parallel (spec.axis_name, inside shard_map) with two kernels of
# its own: `stats` over its [N, V_local] slice -> per-row partial statistics, combined here with
# collectives, and its gradient kernel, given the combined (global) lse, the global vocabulary
# (for ls / V) and the shard-local targets of `local_targets`.

ELSEWHERE = 2**31 - 1  # a local target: the token counts, its class lives on another shard


def local_targets(t: jax.Array, spec: LossSpec, local: int) -> jax.Array:
    """Global int32 targets (-1 = ignored) -> this shard's column: t - first when the class is in
    this shard's slice, -1 for an ignored token, ELSEWHERE for a counted token whose class is not
    here (it matches no column and is not ignored). Without axis_name: t."""
    if spec.axis_name is None:
        return t
    first, _ = vocab_range(spec, local)
    here = t - first
    return jnp.where(t < 0, -1, jnp.where((here >= 0) & (here < local), here, ELSEWHERE))


def combine_partials(lse_local, z_target, z_sum, t: jax.Array, spec: LossSpec, vocab):
    """(loss [N] (0 where t < 0), lse [N]) f32 from each shard's per-row partials over its slice:
    lse_local = log sum_v exp(z_v), z_target = z[t] on the shard that holds t (else 0), z_sum =
    sum_v z_v (None without label smoothing). One pmax and one psum over spec.axis_name:

        lse = M + log psum(exp(lse_local - M)),  M = pmax(lse_local)
        loss = lse - (1 - ls) psum(z_target) - ls / V psum(z_sum) + z_loss lse^2"""
    lse = lse_local
    if spec.axis_name is not None:
        m = lax.pmax(lse_local, spec.axis_name)
        m = jnp.where(jnp.isfinite(m), m, 0.0)  # all -inf (masked rows): no inf - inf
        sums = (jnp.exp(lse_local - m), z_target) + ((z_sum,) if spec.label_smoothing else ())
        sums = lax.psum(sums, spec.axis_name)
        lse, z_target = m + jnp.log(sums[0]), sums[1]
        z_sum = sums[2] if spec.label_smoothing else None
    loss = lse - (1.0 - spec.label_smoothing) * z_target
    if spec.label_smoothing:
        loss = loss - spec.label_smoothing / vocab * z_sum
    if spec.z_loss:
        loss = loss + spec.z_loss * lse * lse
    return jnp.where(t >= 0, loss, 0.0), lse


def vocab_parallel_loss(stats, logits: jax.Array, t: jax.Array, spec: LossSpec, t_local=None):
    """(loss, lse) [N] f32, global, of [N, V_local] logits and global targets t (-1 = ignored):
    `stats(logits, local_targets) -> (lse_local, z_target, z_sum)` is the backend's kernel;
    t_local: `local_targets(t, ...)` when the caller has it."""
    local = logits.shape[-1]
    axes = ManualAxes.of(logits, t)
    t_local = local_targets(t, spec, local) if t_local is None else t_local
    lse_local, z_target, z_sum = stats(logits, t_local)
    # Kernel outputs drop shard_map's varying type; the collectives need it (an invariant psum
    # would multiply by the axis size).
    lse_local, z_target, z_sum = (axes.apply(a) for a in (lse_local, z_target, z_sum))
    return combine_partials(lse_local, z_target, z_sum, t, spec, vocab_range(spec, local)[1])


def vocab_parallel_grad(grad, logits: jax.Array, t: jax.Array, lse: jax.Array, scale: jax.Array, spec: LossSpec):
    """scale[:, None] * d loss_row / d logits of [N, V_local] logits, global targets t (-1 = ignored)
    and the global lse: `grad(logits, local_targets, lse, scale)` is the backend's kernel."""
    dx = grad(logits, local_targets(t, spec, logits.shape[-1]), lse, scale)
    return ManualAxes.of(logits, t, lse).apply(dx)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 4))
def vocab_parallel_per_token(stats, grad, logits, t, spec):
    """Per-token loss [N] of [..., V_local] logits for the cross_entropy kernel backends with
    spec.axis_name. `stats` as in `vocab_parallel_loss`; `grad(logits, local_targets, lse, scale)`
    -> scale * d loss / d logits (the kernel takes the global lse; the global vocabulary is bound
    in `grad`). Both static (hashable)."""
    return _vp_fwd(stats, grad, logits, t, spec)[0]


def _vp_fwd(stats, grad, logits, t, spec):
    lead = logits.shape[:-1]
    x2, t1 = logits.reshape(-1, logits.shape[-1]), t.reshape(-1)
    t_local = local_targets(t1, spec, x2.shape[-1])
    loss, lse = vocab_parallel_loss(stats, x2, t1, spec, t_local)
    # The backward queries no axis (traced without vmap's axis environment): t_local is kept.
    return loss.reshape(lead), (x2, t_local, lse, ManualAxes.of(logits))


def _vp_bwd(stats, grad, spec, residuals, ct):
    del stats
    x2, t_local, lse, axes = residuals
    dx = grad(x2, t_local, lse, ct.reshape(-1).astype(jnp.float32))
    return axes.apply(dx).reshape(ct.shape + x2.shape[-1:]), None


vocab_parallel_per_token.defvjp(_vp_fwd, _vp_bwd)


# ----------------------------------------------------------------------------- under plain jit


@dataclasses.dataclass(frozen=True)
class RowKernels:
    """A backend's raw cross-entropy row kernels on 2-D logits [N, V_local] (no wrappers), for
    `split_per_token`; `spec` and the config are bound in:

      loss(x2, t) -> (loss [N], lse [N])            t: int32 [N], -1 = ignored
      stats(x2, t_local) -> (lse_local, z_target, z_sum) [N] over the slice (`local_targets`)
      grad(x2, t, lse, scale, vocab) -> scale[:, None] * d loss_row / d logits, in x2's dtype;
          vocab: None, or the global vocabulary (then t is `local_targets` and lse the global one)
    """

    loss: Callable[..., Any]
    stats: Callable[..., Any]
    grad: Callable[..., Any]


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 3))
def split_per_token(kernels: RowKernels, logits, t, spec: LossSpec):
    """Per-token loss of [..., V] logits (targets t: global ids, -1 = ignored) for a kernel backend
    under plain jit: the launches split over the rows and, when the logits' vocabulary axis is
    sharded, over the vocabulary (kernels/common/partitioning.py `vocab_rowwise`), each device then
    running the vocabulary-parallel path over the mesh axes that split it."""
    if t.ndim == 0:  # one token: a row axis for the launch (its partitioning rule needs rank >= 1)
        return split_per_token(kernels, logits[None], t[None], spec)[0]
    return _split_fwd(kernels, logits, t, spec)[0]


def _split_fwd(kernels, logits, t, spec):
    def local(x2, t, axis_name):
        if axis_name is None:
            return kernels.loss(x2, t)
        return vocab_parallel_loss(kernels.stats, x2, t, dataclasses.replace(spec, axis_name=axis_name))

    launch = vocab_rowwise(local, (VOCAB, ROWS), (ROWS, ROWS), row_ndim=t.ndim)
    loss, lse = fold_vmap_into_rows(launch, row_args=(0, 1))(logits, t)
    return loss, (logits, t, lse)


def _split_bwd(kernels, spec, residuals, ct):
    logits, t, lse = residuals

    def local(x2, t, lse, ct, axis_name):
        if axis_name is None:
            return (kernels.grad(x2, t, lse, ct, None),)
        s = dataclasses.replace(spec, axis_name=axis_name)
        vocab = vocab_range(s, x2.shape[-1])[1]
        return (kernels.grad(x2, local_targets(t, s, x2.shape[-1]), lse, ct, vocab),)

    launch = vocab_rowwise(local, (VOCAB, ROWS, ROWS, ROWS), (VOCAB,), row_ndim=t.ndim)
    dx = fold_vmap_into_rows(launch, row_args=(0, 1, 2, 3))(logits, t, lse, ct.astype(jnp.float32))[0]
    return dx, None


split_per_token.defvjp(_split_fwd, _split_bwd)
