"""Muon (MomentUm Orthogonalized by Newton-Schulz) for matrices, AdamW for the rest, as optax transforms.

For each Muon parameter W of shape [..., fan_in, fan_out] (JAX's layout: y = x @ W), per step:

    m   = momentum * m + (1 - momentum) * g
    u   = (1 - momentum) * g + momentum * m      (nesterov; else u = m)
    o   = newton_schulz(u) * scale               (ops.newton_schulz, any backend)
    W  <- W - lr * (o + weight_decay * W)

which is Keller Jordan's reference `muon_update` (github.com/KellerJordan/Muon). `scale` is
"width": sqrt(max(1, fan_out / fan_in)), the reference's rule (its PyTorch weights are
[fan_out, fan_in]: sqrt(max(1, rows / cols))), with learning rates around 0.02; or
"adamw_rms": 0.2 * sqrt(max(fan_in, fan_out)) (Liu et al. 2025, "Muon is Scalable for LLM
Training"), which gives updates the RMS of AdamW's so that both share one learning rate and
weight decay. Leading axes of a >2-D parameter are a batch of independent matrices (stacked
layers); reshape other layouts (conv kernels) to [..., fan_in, fan_out] or label them AdamW.

Parameters outside the Muon mask (by default those with fewer than 2 axes) get AdamW with
b1 0.9, b2 0.95 (the reference's auxiliary Adam). Muon's authors give embeddings and the output
head AdamW too: pass `muon_mask=exclude_names("embed", "head")` or a mask of your own.
optax is imported when `muon` is called, so importing forgeax.optim needs only jax.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from forgeax import ops
from forgeax.kernels.common.newton_schulz import COEFFICIENTS

SCALES = ("width", "adamw_rms")


class ScaleByMuonState(NamedTuple):
    momentum: Any  # a pytree like the params (the Muon ones; optax masks the rest)


def _shape_scale(shape: tuple[int, ...], scale: str) -> float:
    fan_in, fan_out = shape[-2], shape[-1]
    if scale == "width":
        return max(1.0, fan_out / fan_in) ** 0.5
    return 0.2 * max(fan_in, fan_out) ** 0.5


def scale_by_muon(*, momentum: float = 0.95, nesterov: bool = True, ns_steps: int = 5,
                  ns_coefficients: tuple[float, float, float] = COEFFICIENTS, scale: str = "width",
                  momentum_dtype: Any = None, backend: str | None = None):
    """The Muon direction (momentum, Newton-Schulz, shape scale) of >= 2-D updates; an optax
    GradientTransformation without learning rate or weight decay (see the module docstring)."""
    import optax  # noqa: PLC0415 - optional dependency

    _check(momentum=momentum, ns_steps=ns_steps, scale=scale)

    def init(params):
        dtype = None if momentum_dtype is None else jnp.dtype(momentum_dtype)
        return ScaleByMuonState(jax.tree.map(lambda p: jnp.zeros_like(p, dtype=dtype), params))

    def update(updates, state, params=None):
        del params
        for leaf in jax.tree.leaves(updates):
            if leaf.ndim < 2:
                raise ValueError(f"muon_mask: Muon needs parameters with >= 2 axes, got one of shape {leaf.shape}; "
                                 "give it AdamW through the mask")
        mom = jax.tree.map(lambda m, g: (momentum * m + (1 - momentum) * g).astype(m.dtype), state.momentum, updates)
        if nesterov:
            direction = jax.tree.map(lambda g, m: (1 - momentum) * g + momentum * m, updates, mom)
        else:
            direction = mom

        def orthogonalise(d, g):
            o = ops.newton_schulz(d, steps=ns_steps, coefficients=ns_coefficients, backend=backend)
            return (o.astype(jnp.float32) * _shape_scale(d.shape, scale)).astype(g.dtype)

        return jax.tree.map(orthogonalise, direction, updates), ScaleByMuonState(mom)

    return optax.GradientTransformation(init, update)


def exclude_names(*names: str) -> Callable[[Any], Any]:
    """A `muon_mask`: True for >= 2-D parameters whose path (dict keys, attribute names, indices)
    mentions none of `names` (case-insensitive substrings), e.g. exclude_names("embed", "head")."""
    lowered = tuple(n.lower() for n in names)

    def mask(params):
        def leaf(path, p):
            text = jax.tree_util.keystr(path).lower()
            return p.ndim >= 2 and not any(n in text for n in lowered)

        return jax.tree_util.tree_map_with_path(leaf, params)

    return mask


def _default_mask(params):
    return jax.tree.map(lambda p: p.ndim >= 2, params)


def _check(*, momentum, ns_steps, scale) -> None:
    if not 0.0 <= float(momentum) < 1.0:
        raise ValueError(f"momentum: expected a number in [0, 1), got {momentum!r}")
    if isinstance(ns_steps, bool) or not isinstance(ns_steps, int) or ns_steps < 1:
        raise ValueError(f"ns_steps: expected an int >= 1, got {ns_steps!r}")
    if scale not in SCALES:
        raise ValueError(f"scale: expected one of {SCALES}, got {scale!r}")


def muon(
    learning_rate: Any,
    *,
    momentum: float = 0.95,
    nesterov: bool = True,
    ns_steps: int = 5,
    ns_coefficients: tuple[float, float, float] = COEFFICIENTS,
    scale: str = "width",
    weight_decay: float = 0.0,
    adam_learning_rate: Any = None,
    adam_b1: float = 0.9,
    adam_b2: float = 0.95,
    adam_eps: float = 1e-8,
    adam_weight_decay: float | None = None,
    muon_mask: Any = None,
    momentum_dtype: Any = None,
    backend: str | None = None,
):
    """Muon for the parameters `muon_mask` selects, AdamW for the rest: an optax GradientTransformation.

    Args:
      learning_rate: Muon's learning rate (a float or an optax schedule); about 0.02 with
        scale="width", an AdamW-sized one with scale="adamw_rms".
      momentum, nesterov: Muon's momentum (reference: 0.95, Nesterov).
      ns_steps, ns_coefficients: the Newton-Schulz iteration (`ops.newton_schulz`).
      scale: "width" or "adamw_rms", the update's shape rule (module docstring).
      weight_decay: decoupled weight decay of Muon parameters (W -= lr * weight_decay * W).
      adam_learning_rate: AdamW's learning rate; None: `learning_rate`.
      adam_b1, adam_b2, adam_eps: AdamW's moments and epsilon.
      adam_weight_decay: AdamW's decoupled weight decay; None: `weight_decay`.
      muon_mask: which parameters get Muon: None (every parameter with >= 2 axes), a pytree of
        bools like the params, or a function params -> such a pytree (see `exclude_names`).
      momentum_dtype: dtype of Muon's momentum buffer; None: the parameter's.
      backend: `ops.newton_schulz`'s backend (None: the best for this device).
    """
    import optax  # noqa: PLC0415 - optional dependency

    _check(momentum=momentum, ns_steps=ns_steps, scale=scale)
    mask_fn = _default_mask if muon_mask is None else (muon_mask if callable(muon_mask) else (lambda params: muon_mask))

    def labels(params):
        return jax.tree.map(lambda use_muon: "muon" if use_muon else "adam", mask_fn(params))

    muon_part = optax.chain(
        scale_by_muon(momentum=momentum, nesterov=nesterov, ns_steps=ns_steps, ns_coefficients=ns_coefficients,
                      scale=scale, momentum_dtype=momentum_dtype, backend=backend),
        optax.add_decayed_weights(weight_decay),
        optax.scale_by_learning_rate(learning_rate),
    )
    adam_part = optax.adamw(learning_rate if adam_learning_rate is None else adam_learning_rate, b1=adam_b1, b2=adam_b2,
                            eps=adam_eps, weight_decay=weight_decay if adam_weight_decay is None else adam_weight_decay)
    return optax.partition({"muon": muon_part, "adam": adam_part}, labels)
