"""Ragged (grouped) matmul: the reference, and jax.lax.ragged_dot as the "xla_ragged" backend.

    out[r] = lhs[r] @ rhs[g]   for rows r of group g;   0 for rows r >= sum(group_sizes)
    tr[g]  = sum over rows r of group g of  lhs[r]^T dout[r]          ([G, K, N])

lhs `[M, K]` (rows sorted by group), rhs `[G, K, N]`, group_sizes `[G]` int32. The reference is
a loop over groups of masked dense products in f32 (HIGHEST precision): G times the FLOPs, but
obviously right; its gradient is JAX autodiff, the oracle of every backward kernel. The
"xla_ragged" backend is XLA's production path, `jax.lax.ragged_dot` (and
`jax.lax.ragged_dot_general` with a ragged contracting dimension for the transposed product),
differentiated by JAX's own rules.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from forgeax.core.registry import Implementation
from forgeax.kernels.common.ragged_dot import RaggedDotSpec, group_bounds


def _row_masks(group_sizes, m):
    starts, ends = group_bounds(group_sizes, m)
    rows = jnp.arange(m, dtype=jnp.int32)
    return (rows[None, :] >= starts[:, None]) & (rows[None, :] < ends[:, None])  # [G, M]


def ragged_dot(lhs: Float[Array, "M K"], rhs: Float[Array, "G K N"], group_sizes: Int[Array, "G"], *,
               spec: RaggedDotSpec) -> Float[Array, "M N"]:
    masks = _row_masks(group_sizes, lhs.shape[0])
    lhs32, rhs32 = lhs.astype(jnp.float32), rhs.astype(jnp.float32)

    def body(g, acc):
        product = jnp.matmul(lhs32, rhs32[g], precision=jax.lax.Precision.HIGHEST)
        return acc + jnp.where(masks[g][:, None], product, 0.0)

    out = jax.lax.fori_loop(0, rhs.shape[0], body, jnp.zeros((lhs.shape[0], rhs.shape[2]), jnp.float32))
    return out.astype(spec.out_dtype)


def ragged_dot_transposed(lhs: Float[Array, "M K"], dout: Float[Array, "M N"], group_sizes: Int[Array, "G"], *,
                          spec: RaggedDotSpec) -> Float[Array, "G K N"]:
    masks = _row_masks(group_sizes, lhs.shape[0])
    lhs32, dout32 = lhs.astype(jnp.float32), dout.astype(jnp.float32)
    masked = jnp.where(masks[:, :, None], lhs32[None], 0.0)  # [G, M, K]
    out = jnp.einsum("gmk,mn->gkn", masked, dout32, precision=jax.lax.Precision.HIGHEST)
    return out.astype(spec.out_dtype)


_TRANSPOSED = jax.lax.RaggedDotDimensionNumbers(dot_dimension_numbers=(([0], [0]), ([], [])),
                                                lhs_ragged_dimensions=[0], rhs_group_dimensions=[])


def _precision(dtype):
    # f32 operands get true f32 products (no TF32 on GPUs), as the reference.
    return jax.lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else None


def lax_ragged_dot(lhs, rhs, group_sizes, *, spec: RaggedDotSpec):
    return jax.lax.ragged_dot(lhs, rhs, group_sizes, precision=_precision(lhs.dtype),
                              preferred_element_type=jnp.dtype(spec.out_dtype))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _lax_transposed(lhs, dout, group_sizes, out_dtype):
    return jax.lax.ragged_dot_general(lhs, dout.astype(lhs.dtype), group_sizes, _TRANSPOSED,
                                      precision=_precision(lhs.dtype), preferred_element_type=out_dtype)


def _lax_transposed_fwd(lhs, dout, group_sizes, out_dtype):
    return _lax_transposed(lhs, dout, group_sizes, out_dtype), (lhs, dout, group_sizes)


def _lax_transposed_bwd(out_dtype, residuals, dt):
    # JAX has no transpose rule for a ragged contracting dimension: the two grouped products.
    del out_dtype
    lhs, dout, group_sizes = residuals
    dt = dt.astype(lhs.dtype)
    precision = _precision(lhs.dtype)
    dlhs = jax.lax.ragged_dot(dout.astype(lhs.dtype), jnp.swapaxes(dt, 1, 2), group_sizes, precision=precision,
                              preferred_element_type=lhs.dtype)
    ddout = jax.lax.ragged_dot(lhs, dt, group_sizes, precision=precision, preferred_element_type=dout.dtype)
    return dlhs, ddout, None


_lax_transposed.defvjp(_lax_transposed_fwd, _lax_transposed_bwd)


def lax_ragged_dot_transposed(lhs, dout, group_sizes, *, spec: RaggedDotSpec):
    return _lax_transposed(lhs, dout, group_sizes, jnp.dtype(spec.out_dtype))


RAGGED_DOT = Implementation(fn=ragged_dot)
RAGGED_DOT_TRANSPOSED = Implementation(fn=ragged_dot_transposed)
XLA_RAGGED = Implementation(fn=lax_ragged_dot)
XLA_RAGGED_TRANSPOSED = Implementation(fn=lax_ragged_dot_transposed)
