"""Softmax cross-entropy over the last axis of logits: `cross_entropy`."""

from __future__ import annotations

import math
from collections.abc import Hashable
from typing import Any

import jax.numpy as jnp
from jaxtyping import Array, Float, Integer

from forgeax.core import KernelConfig, Selection, define_op
from forgeax.kernels.common.losses import REDUCTIONS, LossSpec
from forgeax.ops import checks

CROSS_ENTROPY = define_op(
    "cross_entropy",
    {
        "xla": "forgeax.kernels.xla.cross_entropy:CROSS_ENTROPY",
        "triton": "forgeax.kernels.triton.cross_entropy:CROSS_ENTROPY",
        "pallas_tpu": "forgeax.kernels.pallas.tpu.cross_entropy:CROSS_ENTROPY",
    },
    selection=Selection.load("forgeax.ops", "rules/cross_entropy.json"),
)


def _number(name: str, value: Any) -> float:
    if isinstance(value, bool):
        raise TypeError(f"{name}: expected a number, got {value!r}")
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise TypeError(f"{name}: expected a number, got {value!r}") from None
    if not math.isfinite(number):
        raise ValueError(f"{name}: expected a finite number, got {value!r}")
    return number


def check_targets(targets, batch_shape: tuple, source: str) -> None:
    """`targets` is an integer array of shape `batch_shape` (`source`, possessive: "logits'", without its last axis)."""
    if not (hasattr(targets, "shape") and hasattr(targets, "dtype")):
        raise TypeError(f"targets: expected a JAX or NumPy integer array, got {type(targets).__name__}")
    if not jnp.issubdtype(targets.dtype, jnp.integer):
        raise TypeError(f"targets: expected an integer dtype (class ids), got {jnp.dtype(targets.dtype).name}")
    if tuple(targets.shape) != tuple(batch_shape):
        raise ValueError(
            f"targets: expected shape {tuple(batch_shape)} ({source} shape without its last axis), got {tuple(targets.shape)}"
        )


def loss_spec(label_smoothing, ignore_index, reduction, z_loss, logit_soft_cap, axis_name) -> LossSpec:
    """Validates the loss options shared by cross_entropy and linear_cross_entropy (errors name
    the argument); returns them normalised, once, as the LossSpec every backend receives."""
    ls = _number("label_smoothing", label_smoothing)
    if not 0.0 <= ls <= 1.0:
        raise ValueError(f"label_smoothing: expected a number in [0, 1], got {label_smoothing!r}")
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, (int, jnp.integer)):
        raise TypeError(f"ignore_index: expected a Python int, got {ignore_index!r}")
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction: expected one of {REDUCTIONS}, got {reduction!r}")
    zl = _number("z_loss", z_loss)
    if zl < 0:
        raise ValueError(f"z_loss: expected a number >= 0, got {z_loss!r}")
    if logit_soft_cap is not None:
        checks.positive_float("logit_soft_cap", logit_soft_cap)
        logit_soft_cap = float(logit_soft_cap)
    if axis_name is not None and not isinstance(axis_name, Hashable):
        raise TypeError(f"axis_name: expected None or a mesh axis name (str or tuple of str), got {axis_name!r}")
    return LossSpec(
        label_smoothing=ls,
        ignore_index=int(ignore_index),
        reduction=reduction,
        z_loss=zl,
        logit_soft_cap=logit_soft_cap,
        axis_name=axis_name,
    )


def _check(logits, targets, label_smoothing, ignore_index, reduction, z_loss, logit_soft_cap, axis_name) -> LossSpec:
    checks.floating_array("logits", logits, min_rank=1)
    if logits.shape[-1] == 0:
        raise ValueError(f"logits: expected a non-empty last (vocabulary) axis, got shape {tuple(logits.shape)}")
    check_targets(targets, tuple(logits.shape[:-1]), "logits'")
    return loss_spec(label_smoothing, ignore_index, reduction, z_loss, logit_soft_cap, axis_name)


def cross_entropy(
    logits: Float[Array, "*B V"],
    targets: Integer[Array, "*B"],
    *,
    label_smoothing: float = 0.0,
    ignore_index: int = -100,
    reduction: str = "mean",
    z_loss: float = 0.0,
    logit_soft_cap: float | None = None,
    axis_name: Hashable | None = None,
    backend: str | None = None,
    config: KernelConfig | None = None,
) -> Float[Array, "..."]:
    """Softmax cross-entropy between logits and integer class targets.

    Per token, with z = cap * tanh(logits / cap) when `logit_soft_cap` is set
    (else z = logits), computed in f32:

        loss = lse(z) - (1 - ls) * z[target] - ls * mean_v(z_v) + z_loss * lse(z)^2

    where lse is log-sum-exp over the vocabulary and ls = `label_smoothing`
    (the target distribution is (1 - ls) * onehot + ls / V, spread over the
    whole vocabulary, and the z-loss is PaLM's auxiliary log(Z)^2 term).

    Semantics:
      * Ignored tokens (target == `ignore_index`) contribute 0 to the loss and
        get a zero gradient. Targets outside [0, V) that are not `ignore_index`
        are treated exactly like `ignore_index`: targets may be traced values,
        which cannot raise an error.
      * reduction="mean" divides by the number of non-ignored tokens; when every
        token is ignored the loss is 0 with a zero gradient (not NaN).
      * `axis_name`: vocabulary-parallel inside `shard_map`. Each device holds
        `[..., V / n]` logits (its contiguous slice of the vocabulary, in mesh
        order along `axis_name`), `targets` holds global class ids; V above is
        the global vocabulary. The per-shard max, sum of exponentials, target
        logit and sum of logits are combined with collectives, so loss and
        gradient equal the unsharded ones. Every device gets the full loss.

    Args:
      logits: `[..., V]`, f32/bf16/f16.
      targets: `[...]` (logits' shape without the last axis), any integer dtype
        (compared as int32).
      label_smoothing: in [0, 1].
      ignore_index: target value that marks a token to ignore.
      reduction: "mean" (over non-ignored tokens), "sum", or "none".
      z_loss: weight of lse(z)^2, >= 0.
      logit_soft_cap: None, or > 0 to apply cap * tanh(logits / cap) first.
      axis_name: None, or the `shard_map` mesh axis the vocabulary is split over.
      backend: None (best for this device), "xla", "triton", "pallas_tpu"
        ("pallas" on a TPU), or a user-registered name.
      config: None (a tuned or heuristic config for the call), or a kernel config
        of the chosen backend: `CrossEntropyTritonConfig` (kernels/triton/cross_entropy.py:
        block_v, num_warps, grad_in_forward) or `CrossEntropyPallasTpuConfig`
        (kernels/pallas/tpu/cross_entropy.py: block_rows, block_v). With backend=None
        only backends taking that config type are considered; "xla" takes none.
        `forgeax.explain` shows the config a call runs with and where it came from.

    Returns:
      f32: a scalar for "mean"/"sum"; for "none" an array of targets' shape
      (0 at ignored tokens). Differentiable with respect to logits (the
      gradient has logits' dtype); targets get no gradient.
    """
    spec = _check(logits, targets, label_smoothing, ignore_index, reduction, z_loss, logit_soft_cap, axis_name)
    return CROSS_ENTROPY(logits, targets, spec=spec, backend=backend, config=config)
