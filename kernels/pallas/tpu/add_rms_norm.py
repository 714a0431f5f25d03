"""Fused residual add + RMSNorm as Mosaic TPU Pallas kernels (forward and backward).

Rows of (R, D) arrays (kernels/common/add_rms_norm.py folds leading axes and vmap into R);
each grid step owns a (block_rows, D) tile, the whole feature axis in one VMEM block:

    forward:  s = x + residual (x's dtype), rstd = rsqrt(mean(s^2) + eps), normed = s * rstd * scale
    backward: shat = s * rstd, g = dnormed * scale,
              ds = rstd * (g - shat * mean(g * shat)) + dsum;  dscale partials = sum_rows(dnormed * shat)

The backward writes one (1, D) f32 partial of dscale per grid step (every grid axis stays
"parallel" for megacore chips); XLA sums them. Row blocks follow the TPU rule (a multiple of
8 rows, 16 for 16-bit dtypes, or all rows; kernels/pallas/tpu/norms.py `block_rows`); a
ragged last block reads undefined rows, selected out of the partial sums with `where`.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from forgeax.core.config import KernelConfig
from forgeax.core.registry import Implementation
from forgeax.core.runtime import interpret_enabled
from forgeax.kernels.common.add_rms_norm import AddRmsNormKernels, differentiable_add_rms_norm
from forgeax.kernels.pallas.tpu.norms import block_rows

_F32 = jnp.float32
_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
# The smallest legal block's VMEM (five double-buffered row tiles and ~4 f32 temporaries) must fit this.
_VMEM_BUDGET = 12 << 20


@dataclasses.dataclass(frozen=True, kw_only=True)
class AddRmsNormTpuConfig(KernelConfig):
    """block_rows: rows per grid step, a multiple of 16 (legal for every dtype) unless it covers every row."""

    block_rows: int

    def validate(self) -> None:
        super().validate()
        if self.block_rows % 16:
            raise ValueError(f"AddRmsNormTpuConfig.block_rows: expected a multiple of 16, got {self.block_rows}")


def heuristic_config(x, residual, scale, *, eps) -> AddRmsNormTpuConfig:
    del residual, scale, eps
    # norms' choice for a huge row count is its VMEM-sized block (R = 1 << 30 only picks it).
    return AddRmsNormTpuConfig(block_rows=max(16, block_rows(1 << 30, x.shape[-1], x.dtype) // 16 * 16))


def candidate_configs(x, residual, scale, *, eps) -> list[AddRmsNormTpuConfig]:
    base = heuristic_config(x, residual, scale, eps=eps)
    return [base, AddRmsNormTpuConfig(block_rows=max(16, base.block_rows // 2 // 16 * 16)),
            AddRmsNormTpuConfig(block_rows=base.block_rows * 2)]


def _fwd_kernel(x_ref, r_ref, scale_ref, y_ref, s_ref, rstd_ref, *, eps):
    s = (x_ref[...].astype(_F32) + r_ref[...].astype(_F32)).astype(s_ref.dtype)
    s_ref[...] = s
    s = s.astype(_F32)
    rstd = jax.lax.rsqrt(jnp.mean(s * s, axis=-1, keepdims=True) + eps)
    y_ref[...] = (s * rstd * scale_ref[...]).astype(y_ref.dtype)
    rstd_ref[...] = rstd


def _bwd_kernel(s_ref, scale_ref, rstd_ref, dn_ref, dsum_ref, ds_ref, dscale_ref, *, rows, block):
    rstd = rstd_ref[...]
    shat = s_ref[...].astype(_F32) * rstd
    dn = dn_ref[...].astype(_F32)
    g = dn * scale_ref[...]
    proj = jnp.mean(g * shat, axis=-1, keepdims=True)
    ds_ref[...] = (rstd * (g - shat * proj) + dsum_ref[...].astype(_F32)).astype(ds_ref.dtype)
    dscale = dn * shat
    if rows % block:  # ragged last block: its tail rows hold garbage (maybe NaN)
        row = pl.program_id(0) * block + jax.lax.broadcasted_iota(jnp.int32, (block, 1), 0)
        dscale = jnp.where(row < rows, dscale, 0.0)
    dscale_ref[...] = jnp.sum(dscale, axis=0, keepdims=True)


def _call(kernel, *, grid, in_specs, out_specs, out_shape, nbytes):
    return pl.pallas_call(
        kernel, grid=grid, in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",)),
        cost_estimate=pl.CostEstimate(flops=0, transcendentals=0, bytes_accessed=nbytes),
        interpret=pltpu.InterpretParams() if interpret_enabled() else False,
    )


def _specs(rows, d, config):
    block = rows if rows <= config.block_rows else config.block_rows
    tile = pl.BlockSpec((block, d), lambda i: (i, 0))
    stat = pl.BlockSpec((block, 1), lambda i: (i, 0))
    param = pl.BlockSpec((1, d), lambda i: (0, 0))
    return block, (pl.cdiv(rows, block),), tile, stat, param


def _forward(x, residual, scale, *, eps, config):
    rows, d = x.shape
    if rows == 0:
        return jnp.zeros_like(x), jnp.zeros_like(x), jnp.zeros((0, 1), _F32)
    _, grid, tile, stat, param = _specs(rows, d, config)
    arr = jax.ShapeDtypeStruct(x.shape, x.dtype)
    return _call(functools.partial(_fwd_kernel, eps=eps), grid=grid, in_specs=[tile, tile, param],
                 out_specs=[tile, tile, stat], out_shape=[arr, arr, jax.ShapeDtypeStruct((rows, 1), _F32)],
                 nbytes=4 * x.size * x.dtype.itemsize)(x, residual.astype(x.dtype), scale.astype(_F32).reshape(1, d))


def _backward(s, scale, rstd, dn, dsum, *, eps, config):
    del eps
    rows, d = s.shape
    if rows == 0:
        return jnp.zeros_like(s), jnp.zeros((d,), _F32)
    block, grid, tile, stat, param = _specs(rows, d, config)
    partial = pl.BlockSpec((None, 1, d), lambda i: (i, 0, 0))
    ds, dscale = _call(
        functools.partial(_bwd_kernel, rows=rows, block=block), grid=grid,
        in_specs=[tile, param, stat, tile, tile], out_specs=[tile, partial],
        out_shape=[jax.ShapeDtypeStruct(s.shape, s.dtype), jax.ShapeDtypeStruct((grid[0], 1, d), _F32)],
        nbytes=4 * s.size * s.dtype.itemsize)(s, scale.astype(_F32).reshape(1, d), rstd, dn, dsum)
    return ds, jnp.sum(dscale, axis=(0, 1))


@functools.cache
def _differentiable(config: AddRmsNormTpuConfig):
    return differentiable_add_rms_norm(AddRmsNormKernels(
        forward=functools.partial(_forward, config=config), backward=functools.partial(_backward, config=config)))


def add_rms_norm(x, residual, scale, *, eps, config: AddRmsNormTpuConfig):
    return _differentiable(config)(x, residual, scale, eps=eps)


def _vmem_estimate(rows: int, d: int, dtype) -> int:
    pad_d = -(-d // 128) * 128
    return 2 * 4 * rows * pad_d * jnp.dtype(dtype).itemsize + 4 * rows * pad_d * 4


def _supports(x, residual, scale, *, eps):
    del residual, scale, eps
    dtype = jnp.dtype(x.dtype)
    if dtype not in _DTYPES:
        return f"x dtype {dtype.name} is not one of float32/bfloat16/float16"
    d = x.shape[-1]
    if d == 0:
        return "D=0 (an empty feature axis) is not supported"
    need = _vmem_estimate(16, d, dtype)
    if need > _VMEM_BUDGET:
        return f"D={d} does not fit in VMEM: the smallest 16-row block needs ~{need / 2**20:.1f} MiB"
    return None


ADD_RMS_NORM = Implementation(fn=add_rms_norm, platforms={"tpu"}, interpretable=True, supports=_supports,
                              config_type=AddRmsNormTpuConfig, heuristic_config=heuristic_config,
                              candidate_configs=candidate_configs)
