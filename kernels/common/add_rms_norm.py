"""The differentiable shell every fused add + RMSNorm backend shares.

    s = x + residual          (in x's dtype, as a plain add gives it)
    normed = s * rstd * scale, rstd = rsqrt(mean(s^2) + eps) in f32
    returns (normed, s)

A backend supplies two row kernels over 2-D arrays (rows x D):

    forward(x, residual, scale, eps)            -> (normed, s, rstd)    rstd: per-row f32
    backward(s, scale, rstd, dnormed, dsum, eps) -> (ds, dscale)          dscale: f32 [D]

with the gradient (shat = s * rstd, g = dnormed * scale)

    ds = rstd * (g - shat * mean(g * shat)) + dsum,   dx = dresidual = ds
    dscale = sum_rows(dnormed * shat)

This module turns them into `fn(x, residual, scale, *, eps)` for x of any leading shape, with
a `custom_vjp` (backward kernels, not autodiff through them) and vmap (a batch axis of x and
residual folds into the rows; a batched scale runs the kernels per batch element).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax

from forgeax.kernels.common.batching import fold_vmap_into_rows
from forgeax.kernels.common.partitioning import ROWS, SUM, WHOLE, rowwise

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class AddRmsNormKernels:
    """A backend's forward and backward row kernels (see module docstring)."""

    forward: Callable[..., tuple[Array, Array, Array]]
    backward: Callable[..., tuple[Array, Array]]


def differentiable_add_rms_norm(kernels: AddRmsNormKernels) -> Callable[..., tuple[Array, Array]]:
    """`add_rms_norm(x, residual, scale, *, eps) -> (normed, s)` from row kernels."""

    # x keeps its leading axes down to the launches, which the SPMD partitioner splits by rows
    # (kernels/common/partitioning.py): batch- or token-sharded x stays sharded.
    def forward_rows(x, r, scale, eps):
        launch = rowwise(functools.partial(kernels.forward, eps=eps), (ROWS, ROWS, WHOLE), (ROWS, ROWS, ROWS),
                         row_ndim=x.ndim - 1)
        return fold_vmap_into_rows(launch, row_args=(0, 1))(x, r, scale)

    def backward_rows(s, scale, rstd, dn, dsum, eps):
        # dscale sums over rows: a vmapped batch cannot fold into them (see kernels/common/norms.py).
        launch = rowwise(functools.partial(kernels.backward, eps=eps), (ROWS, WHOLE, ROWS, ROWS, ROWS), (ROWS, SUM),
                         row_ndim=s.ndim - 1)
        return fold_vmap_into_rows(launch, row_args=())(s, scale, rstd, dn, dsum)

    @functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
    def run(x, r, scale, eps):
        normed, s, _ = forward_rows(x, r, scale, eps)
        return normed, s

    def run_fwd(x, r, scale, eps):
        normed, s, rstd = forward_rows(x, r, scale, eps)
        return (normed, s), (s, scale, rstd)

    def run_bwd(eps, residuals, cotangents):
        s, scale, rstd = residuals
        dn, dsum = cotangents
        ds, dscale = backward_rows(s, scale, rstd, dn.astype(s.dtype), dsum.astype(s.dtype), eps)
        ds = ds.astype(s.dtype)
        return ds, ds, dscale.astype(scale.dtype)

    run.defvjp(run_fwd, run_bwd)

    def add_rms_norm(x: Array, residual: Array, scale: Array, *, eps: float) -> tuple[Array, Array]:
        return run(x, residual, scale, eps)

    return add_rms_norm
