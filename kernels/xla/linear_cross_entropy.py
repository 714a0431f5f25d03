"""Linear + cross-entropy in XLA: the reference, and a chunked memory-efficient variant.

    loss = cross_entropy(x @ W + b, targets)      x [..., H], W [H, V], b [V]

with the logits computed in f32 (`preferred_element_type=float32`) and the
cross-entropy of kernels/xla/cross_entropy.py (its docstring has the math).

  * `LINEAR_CROSS_ENTROPY` ("xla"): the reference and the oracle. It
    materialises the [N, V] f32 logits (6.3 GB of temporaries at N=8192,
    H=4096, V=128256 in bf16); the gradient is autodiff.
  * `LINEAR_CROSS_ENTROPY_CHUNKED` ("xla_chunked"): the chunk loop of
    kernels/common/linear_cross_entropy.py (the per-chunk memory is the f32
    logits [C, V] and their gradient [C, V]) with the per-chunk cross-entropy
    below and `losses.logits_grad`, in closed form. Per row, z = cap * tanh(l / cap) (or l), t the
    target, p = softmax(z), ls the label smoothing, V the global vocabulary:

        loss   = lse - (1 - ls) z_t - ls * mean_v(z_v) + z_loss * lse^2
        dl/dl_v = (p_v (1 + 2 z_loss lse) - (1 - ls) [v == t] - ls / V) * (1 - (z_v / cap)^2)

    With `axis_name` each device holds a slice of V; the row max is pmax-ed and
    the sum of exponentials, target logit and sum of logits are psum-ed (as in
    the cross-entropy reference), so lse and the loss are global.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, Float, Integer

from forgeax.kernels.common import linear_cross_entropy as chunked
from forgeax.kernels.common.losses import LossSpec, logits_grad, soft_capped, vocab_range
from forgeax.kernels.xla import cross_entropy as ce_reference
from forgeax.core.registry import Implementation


def linear_cross_entropy(
    x: Float[Array, "*B H"],
    weight: Float[Array, "H V"],
    targets: Integer[Array, "*B"],
    bias: Float[Array, "V"] | None = None,
    *,
    spec: LossSpec = LossSpec(),
    chunk_size: int | None = None,
) -> Float[Array, "..."]:
    del chunk_size  # the reference materialises every logit at once
    dtype = jnp.promote_types(x.dtype, weight.dtype)
    logits = jnp.matmul(x.astype(dtype), weight.astype(dtype), preferred_element_type=jnp.float32)
    if bias is not None:
        logits = logits + bias.astype(jnp.float32)
    return ce_reference.cross_entropy(logits, targets, spec=spec)


LINEAR_CROSS_ENTROPY = Implementation(fn=linear_cross_entropy)


# ----------------------------------------------------------------------------- the chunked variant


def _loss(logits, t, spec: LossSpec, config=None):
    del config  # the XLA chunk kernels take none
    z, _ = soft_capped(logits, spec)
    local = z.shape[-1]
    first, vocab = vocab_range(spec, local)
    m = jnp.max(z, axis=-1)
    if spec.axis_name is not None:
        m = lax.pmax(m, spec.axis_name)
    here_t = t - first
    here = (here_t >= 0) & (here_t < local)  # t = -1 (ignored) is on no shard
    picked = jnp.take_along_axis(z, jnp.clip(here_t, 0, local - 1)[:, None], axis=-1)[:, 0]
    sums = [jnp.sum(jnp.exp(z - m[:, None]), axis=-1), jnp.where(here, picked, 0.0)]
    if spec.label_smoothing:
        sums.append(jnp.sum(z, axis=-1))
    if spec.axis_name is not None:
        sums = lax.psum(sums, spec.axis_name)
    lse = m + jnp.log(sums[0])
    loss = lse - (1.0 - spec.label_smoothing) * sums[1]
    if spec.label_smoothing:
        loss = loss - spec.label_smoothing / vocab * sums[2]
    if spec.z_loss:
        loss = loss + spec.z_loss * lse * lse
    return jnp.where(t >= 0, loss, 0.0), lse


def _grad(logits, t, lse, scale, spec: LossSpec, config, dtype):
    del config
    return logits_grad(logits, t, lse, scale, spec, dtype)


def _loss_and_grad(logits, t, spec: LossSpec, config, dtype):
    loss, lse = _loss(logits, t, spec)
    return loss, lse, _grad(logits, t, lse, jnp.ones_like(lse), spec, config, dtype)


CHUNK_KERNELS = chunked.ChunkKernels(loss=_loss, loss_and_grad=_loss_and_grad, grad=_grad)


def _supports_chunked(x, weight, targets, bias=None, **options):
    del weight, targets, bias, options
    if x.size == 0:
        return "no tokens"
    return None


LINEAR_CROSS_ENTROPY_CHUNKED = Implementation(
    fn=chunked.linear_cross_entropy_with(CHUNK_KERNELS), supports=_supports_chunked,
)
