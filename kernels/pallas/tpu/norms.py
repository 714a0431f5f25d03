"""RMSNorm and LayerNorm as Mosaic TPU Pallas kernels (forward and backward).

Shapes: x, dy, y, dx are (R, D) row-major (the shared shell in
kernels/common/norms.py folds leading axes and vmap into R); scale/offset (D,).
Each grid step owns a (block_rows, D) tile: the whole feature axis sits in one
VMEM block, so every row's statistics are a single in-register reduction.

    RMSNorm:   rstd = rsqrt(mean(x^2) + eps),           y = x * rstd * scale
    LayerNorm: rstd = rsqrt(mean((x - mu)^2) + eps),    y = (x - mu) * rstd * scale + offset
    backward (xhat = normalised x, g = dy * scale):
      RMSNorm:   dx = rstd * (g - xhat * mean(g * xhat))
      LayerNorm: dx = rstd * (g - mean(g) - xhat * mean(g * xhat))
      dscale = sum_rows(dy * xhat),  doffset = sum_rows(dy)

The forward writes y and the per-row f32 statistics ((R, 1) arrays: rstd, and
mu for LayerNorm). The backward writes dx and, per grid step, the partial
column sums of dy * xhat and dy as (num_blocks, 1, D) f32; XLA adds those few
rows afterwards. Per-block partials (rather than one accumulator revisited on an
"arbitrary" axis) keep every grid axis "parallel", so megacore chips split the
rows between their TensorCores.

TPU block rules: the last two block dims must be multiples of (8, 128) or equal
the array's. The feature block is always the full D (any D is allowed), the row
block is either all R rows or a multiple of 8 (f32) / 16 (bf16, f16: two rows
pack into one sublane). When R is not a multiple of the row block, the last
block reads past the end (undefined values, NaN in the interpreter); its rows
are independent and their writes are dropped, but the dscale/doffset partial
sums select them out with `where` (never multiply: 0 * NaN is NaN).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from forgeax.kernels.common.norms import NormKernels, differentiable_norm, rms_only
from forgeax.core.registry import Implementation
from forgeax.core.runtime import interpret_enabled

__all__ = ["RMS_NORM", "LAYER_NORM", "block_rows"]

_F32 = jnp.float32
_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))

# One f32 (rows, D) temporary may take this much VMEM. The backward keeps ~4
# such temporaries live plus double-buffered x, dy, dx tiles: at D=4096 bf16
# that is 64 rows, ~8 MiB in all, under the 16 MiB default scoped VMEM limit of
# v5e (the smallest default among current chips).
_F32_TILE_BYTES = 1 << 20
_MAX_BLOCK_ROWS = 1024
# What the smallest legal block must fit in (see _vmem_estimate); larger D is refused.
_VMEM_BUDGET = 12 << 20


def _row_align(dtype) -> int:
    """Row-block multiple: 8 sublanes of 32 bits, 16 rows for 16-bit dtypes."""
    return 8 * (4 // jnp.dtype(dtype).itemsize)


def block_rows(rows: int, d: int, dtype) -> int:
    """Rows per grid step: a VMEM-sized multiple of the row alignment, or all rows."""
    align = _row_align(dtype)
    want = max(align, min(_MAX_BLOCK_ROWS, _F32_TILE_BYTES // (4 * d)) // align * align)
    return rows if rows <= want else want


def _vmem_estimate(rows: int, d: int, dtype) -> int:
    """Bytes of VMEM the backward (the larger kernel) needs for a (rows, D) block."""
    pad_d = -(-d // 128) * 128  # lanes are padded to 128
    io = 2 * 3 * rows * pad_d * jnp.dtype(dtype).itemsize  # x, dy, dx, double-buffered
    temps = 4 * rows * pad_d * 4  # f32 x, dy, xhat, g live at once
    return io + temps


# ----------------------------------------------------------------------------- kernels


def _row_stats(x, *, eps, centred):
    """(xhat, mu or None, rstd) for an f32 (rows, D) tile."""
    if centred:
        mu = jnp.mean(x, axis=-1, keepdims=True)
        x = x - mu
    else:
        mu = None
    rstd = jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)
    return x * rstd, mu, rstd


def _fwd_kernel(*refs, eps, centred, has_offset):
    x_ref, scale_ref = refs[:2]
    offset_ref = refs[2] if has_offset else None
    y_ref, *stat_refs = refs[2 + has_offset :]
    xhat, mu, rstd = _row_stats(x_ref[...].astype(_F32), eps=eps, centred=centred)
    y = xhat * scale_ref[...]
    if has_offset:
        y = y + offset_ref[...]
    y_ref[...] = y.astype(y_ref.dtype)
    stat_refs[0][...] = rstd
    if centred:
        stat_refs[1][...] = mu


def _bwd_kernel(*refs, centred, has_offset, rows, block):
    x_ref, scale_ref, rstd_ref = refs[:3]
    mu_ref = refs[3] if centred else None
    dy_ref, dx_ref, dscale_ref = refs[3 + centred : 6 + centred]
    doffset_ref = refs[6 + centred] if has_offset else None

    rstd = rstd_ref[...]
    x = x_ref[...].astype(_F32)
    if centred:
        x = x - mu_ref[...]
    xhat = x * rstd
    dy = dy_ref[...].astype(_F32)
    g = dy * scale_ref[...]
    proj = jnp.mean(g * xhat, axis=-1, keepdims=True)
    if centred:
        g = g - jnp.mean(g, axis=-1, keepdims=True)
    dx_ref[...] = (rstd * (g - xhat * proj)).astype(dx_ref.dtype)

    dscale = dy * xhat
    if rows % block:  # ragged last block: its tail rows hold garbage (maybe NaN)
        row = pl.program_id(0) * block + jax.lax.broadcasted_iota(jnp.int32, (block, 1), 0)
        valid = row < rows
        dscale = jnp.where(valid, dscale, 0.0)
        dy = jnp.where(valid, dy, 0.0)
    dscale_ref[...] = jnp.sum(dscale, axis=0, keepdims=True)
    if has_offset:
        doffset_ref[...] = jnp.sum(dy, axis=0, keepdims=True)


# ----------------------------------------------------------------------------- launchers


def _call(kernel, *, grid, in_specs, out_specs, out_shape, cost):
    interpret = pltpu.InterpretParams() if interpret_enabled() else False
    return pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",)),
        cost_estimate=cost,
        interpret=interpret,
    )


@dataclasses.dataclass(frozen=True)
class _Tiling:
    """Grid and BlockSpecs shared by the forward and backward of one (R, D) call."""

    rows: int
    d: int
    block: int

    @classmethod
    def of(cls, x):
        rows, d = x.shape
        return cls(rows, d, block_rows(rows, d, x.dtype))

    @property
    def grid(self):
        return (pl.cdiv(self.rows, self.block),)

    def tile(self):  # (block, D) slab of an (R, D) array
        return pl.BlockSpec((self.block, self.d), lambda i: (i, 0))

    def stat(self):  # (block, 1) slab of an (R, 1) per-row statistic
        return pl.BlockSpec((self.block, 1), lambda i: (i, 0))

    def param(self):  # the whole (1, D) scale/offset, same block every step
        return pl.BlockSpec((1, self.d), lambda i: (0, 0))

    def partial(self):  # row i of the (num_blocks, 1, D) partial sums
        return pl.BlockSpec((None, 1, self.d), lambda i: (i, 0, 0))


def _as_row(p):
    return p.astype(_F32).reshape(1, -1)


def _forward(x, scale, offset, *, eps, centred):
    t = _Tiling.of(x)
    has_offset = offset is not None
    n_stats = 2 if centred else 1
    stat_shape = jax.ShapeDtypeStruct((t.rows, 1), _F32)
    params = [_as_row(scale)] + ([_as_row(offset)] if has_offset else [])
    nbytes = 2 * x.size * x.dtype.itemsize
    out = _call(
        functools.partial(_fwd_kernel, eps=eps, centred=centred, has_offset=has_offset),
        grid=t.grid,
        in_specs=[t.tile()] + [t.param()] * len(params),
        out_specs=[t.tile()] + [t.stat()] * n_stats,
        out_shape=[jax.ShapeDtypeStruct(x.shape, x.dtype)] + [stat_shape] * n_stats,
        cost=pl.CostEstimate(flops=5 * x.size, transcendentals=t.rows, bytes_accessed=nbytes),
    )(x, *params)
    y, *stats = out
    return y, tuple(stats)


def _backward(x, scale, stats, dy, *, centred, has_offset):
    t = _Tiling.of(x)
    nblocks = t.grid[0]
    partial_shape = jax.ShapeDtypeStruct((nblocks, 1, t.d), _F32)
    nbytes = 3 * x.size * x.dtype.itemsize
    out = _call(
        functools.partial(_bwd_kernel, centred=centred, has_offset=has_offset, rows=t.rows, block=t.block),
        grid=t.grid,
        in_specs=[t.tile(), t.param()] + [t.stat()] * len(stats) + [t.tile()],
        out_specs=[t.tile()] + [t.partial()] * (1 + has_offset),
        out_shape=[jax.ShapeDtypeStruct(x.shape, x.dtype)] + [partial_shape] * (1 + has_offset),
        cost=pl.CostEstimate(flops=10 * x.size, transcendentals=0, bytes_accessed=nbytes),
    )(x, _as_row(scale), *stats, dy)
    dx, dscale, *doffset = out
    dscale = jnp.sum(dscale, axis=(0, 1))
    doffset = jnp.sum(doffset[0], axis=(0, 1)) if has_offset else None
    return dx, dscale, doffset


# ----------------------------------------------------------------------------- row kernels for the shell


def _empty_forward(x, centred):
    stats = (jnp.zeros((0, 1), _F32),) * (2 if centred else 1)
    return jnp.zeros(x.shape, x.dtype), stats


def _rms_fwd(x, scale, offset, *, eps):
    del offset  # always None for RMSNorm
    if x.shape[0] == 0:
        return _empty_forward(x, centred=False)
    return _forward(x, scale, None, eps=eps, centred=False)


def _rms_bwd(x, scale, stats, dy, *, eps):
    del eps  # rstd is in stats
    if x.shape[0] == 0:
        return jnp.zeros_like(x), jnp.zeros(scale.shape, _F32), None
    return _backward(x, scale, stats, dy.astype(x.dtype), centred=False, has_offset=False)


def _ln_fwd(x, scale, offset, *, eps):
    if x.shape[0] == 0:
        return _empty_forward(x, centred=True)
    return _forward(x, scale, offset, eps=eps, centred=True)  # stats = (rstd, mu)


def _ln_bwd(x, scale, stats, dy, *, eps):
    del eps
    if x.shape[0] == 0:
        return jnp.zeros_like(x), jnp.zeros(scale.shape, _F32), jnp.zeros(scale.shape, _F32)
    # doffset is always computed: the shell drops it when there is no offset.
    return _backward(x, scale, stats, dy.astype(x.dtype), centred=True, has_offset=True)


# ----------------------------------------------------------------------------- supports


def _supports(x, *params, eps=None) -> str | None:
    del params, eps  # scale/offset are used in f32 whatever their float dtype; any eps > 0 works
    dtype = jnp.dtype(x.dtype)
    if dtype not in _DTYPES:
        return f"x dtype {dtype.name} is not one of float32/bfloat16/float16"
    d = x.shape[-1]
    if d == 0:
        return "D=0 (an empty feature axis) is not supported"
    need = _vmem_estimate(_row_align(dtype), d, dtype)
    if need > _VMEM_BUDGET:
        return (
            f"D={d} does not fit in VMEM: the smallest {_row_align(dtype)}-row block needs "
            f"~{need / 2**20:.1f} MiB (budget {_VMEM_BUDGET / 2**20:.0f} MiB)"
        )
    return None


def _rms_supports(x, scale, *, eps=None):
    return _supports(x, scale, eps=eps)


def _ln_supports(x, scale, offset=None, *, eps=None):
    return _supports(x, scale, offset, eps=eps)


RMS = differentiable_norm(NormKernels(forward=_rms_fwd, backward=_rms_bwd))
LN = differentiable_norm(NormKernels(forward=_ln_fwd, backward=_ln_bwd))

RMS_NORM = Implementation(fn=rms_only(RMS), platforms={"tpu"}, interpretable=True, supports=_rms_supports)
LAYER_NORM = Implementation(fn=LN, platforms={"tpu"}, interpretable=True, supports=_ln_supports)
