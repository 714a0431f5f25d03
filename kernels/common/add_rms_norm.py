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

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class AddRmsNormKernels:
    """A backend's forward and backward row kernels (see module docstring)."""

    forward: Callable[..., tuple[Array, Array, Array]]
    backward: Callable[..., tuple[Array, Array]]


def differentiable_add_rms_norm(kernels: AddRmsNormKernels) -> Callable[..., tuple[Array, Array]]:
    """`add_rms_norm(x, residual, scale, *, eps) -> (normed, s)` from row kernels."""

    def forward_rows(x2, r2, scale, eps):
        return fold_vmap_into_rows(functools.partial(kernels.forward, eps=eps), row_args=(0, 1))(x2, r2, scale)

    def backward_rows(s2, scale, rstd, dn, dsum, eps):
        # dscale sums over rows: a vmapped batch cannot fold into them (see kernels/common/norms.py).
        return fold_vmap_into_rows(functools.partial(kernels.backward, eps=eps), row_args=())(s2, scale, rstd, dn, dsum)

    @functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
    def run(x2, r2, scale, eps):
        normed, s, _ = forward_rows(x2, r2, scale, eps)
        return normed, s

    def run_fwd(x2, r2, scale, eps):
        normed, s, rstd = forward_rows(x2, r2, scale, eps)
        return (normed, s), (s, scale, rstd)

    def run_bwd(eps, residuals, cotangents):
        s, scale, rstd = residuals
        dn, dsum = cotangents
        ds, dscale = backward_rows(s, scale, rstd, dn.astype(s.dtype), dsum.astype(s.dtype), eps)
        ds = ds.astype(s.dtype)
        return ds, ds, dscale.astype(scale.dtype)

    run.defvjp(run_fwd, run_bwd)

    def add_rms_norm(x: Array, residual: Array, scale: Array, *, eps: float) -> tuple[Array, Array]:
        d = x.shape[-1]
        normed, s = run(x.reshape(-1, d), residual.reshape(-1, d), scale, eps)
        return normed.reshape(x.shape), s.reshape(x.shape)

    return add_rms_norm
