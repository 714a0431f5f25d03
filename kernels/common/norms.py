"""The differentiable shell every norm kernel backend shares.

A backend supplies two row kernels over 2-D arrays (rows x D):

    forward(x, scale, offset, eps)        -> (y, stats)
    backward(x, scale, stats, dy, eps)    -> (dx, dscale, doffset)

`stats` is whatever per-row f32 residuals the kernel keeps (e.g. 1/rms, or
mean and 1/std); `offset` and `doffset` are None for RMSNorm or a LayerNorm
without bias; `dscale`/`doffset` are f32 sums over all rows. This module turns
them into `fn(x, scale, offset, *, eps)` for `x` of any leading shape with a
`custom_vjp` (backward kernels, not autodiff through the kernels) and vmap
support (a vmapped batch axis is folded into the rows).

The gradient math both kernels implement, with xhat the normalised x, g = dy * scale:
    RMSNorm:   dx = rstd * (g - xhat * mean(g * xhat))
    LayerNorm: dx = rstd * (g - mean(g) - xhat * mean(g * xhat))
    dscale = sum_rows(dy * xhat),  doffset = sum_rows(dy)
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax

from forgeax.kernels.common.batching import fold_vmap_into_rows
from forgeax.kernels.common.partitioning import ROWS, SUM, WHOLE, rowwise

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class NormKernels:
    """A backend's forward and backward row kernels (see module docstring)."""

    forward: Callable[[Array, Array, Array | None, float], tuple[Array, Any]]
    backward: Callable[[Array, Array, Any, Array, float], tuple[Array, Array, Array | None]]


def differentiable_norm(kernels: NormKernels) -> Callable[..., Array]:
    """`norm(x, scale, offset, *, eps)` over the last axis of x, from row kernels."""

    # x keeps its leading axes down to the launches, which the SPMD partitioner splits
    # by rows (kernels/common/partitioning.py): batch- or token-sharded x stays sharded.
    def forward_rows(x, scale, offset, eps):
        launch = rowwise(functools.partial(kernels.forward, eps=eps), (ROWS, WHOLE, WHOLE), (ROWS, ROWS),
                         row_ndim=x.ndim - 1)
        return fold_vmap_into_rows(launch, row_args=(0,))(x, scale, offset)

    def backward_rows(x, scale, stats, dy, eps):
        # dscale/doffset sum over rows, so a vmapped batch cannot fold into the
        # rows (each batch element needs its own sums): no row_args, which makes
        # vmap run the backward kernel once per batch element.
        launch = rowwise(functools.partial(kernels.backward, eps=eps), (ROWS, WHOLE, ROWS, ROWS), (ROWS, SUM, SUM),
                         row_ndim=x.ndim - 1)
        return fold_vmap_into_rows(launch, row_args=())(x, scale, stats, dy)

    @functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
    def norm_rows(x, scale, offset, eps):
        return forward_rows(x, scale, offset, eps)[0]

    def norm_rows_fwd(x, scale, offset, eps):
        y, stats = forward_rows(x, scale, offset, eps)
        return y, (x, scale, offset, stats)

    def norm_rows_bwd(eps, residuals, dy):
        x, scale, offset, stats = residuals
        dx, dscale, doffset = backward_rows(x, scale, stats, dy, eps)
        doffset = None if offset is None else doffset.astype(offset.dtype)
        return dx.astype(x.dtype), dscale.astype(scale.dtype), doffset

    norm_rows.defvjp(norm_rows_fwd, norm_rows_bwd)

    def norm(x: Array, scale: Array, offset: Array | None = None, *, eps: float) -> Array:
        return norm_rows(x, scale, offset, eps)

    return norm


def rms_only(norm: Callable[..., Array]) -> Callable[..., Array]:
    """`rms_norm(x, scale, *, eps)` signature over a norm that takes an offset."""

    def rms_norm(x: Array, scale: Array, *, eps: float) -> Array:
        return norm(x, scale, None, eps=eps)

    return rms_norm


def row_count(x: Array) -> int:
    """Number of rows when x is viewed as (rows, x.shape[-1])."""
    return int(x.size // x.shape[-1]) if x.shape[-1] else 0


