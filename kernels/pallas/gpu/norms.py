"""RMSNorm and LayerNorm as Pallas Mosaic GPU kernels (`plgpu.kernel`, Hopper).

Over rows of x2d [R, D], statistics in f32:

    RMSNorm:   rstd = rsqrt(mean(x^2) + eps),            y = x * rstd * scale
    LayerNorm: mu = mean(x), rstd = rsqrt(var(x) + eps), y = (x - mu) * rstd * scale (+ offset)

Backward (xhat = normalised x, g = dy * scale):

    RMSNorm:   dx = rstd * (g - xhat * mean(g * xhat))
    LayerNorm: dx = rstd * (g - mean(g) - xhat * mean(g * xhat))
    dscale = sum_rows(dy * xhat),  doffset = sum_rows(dy)

Design: Mosaic GPU's lane lowering semantics with explicit
register layouts and no shared memory -- direct GMEM loads/stores. The layout
`_row_layout(vec)` is a 4 x (32*vec) tile: row i -> warp i, the columns -> 32
lanes x `vec` contiguous elements, so row reductions stay inside a warp
(shuffles). Rows are processed in tiles of 4, columns in chunks of `chunk`
(a multiple of 32*vec) in loops, since whole rows do not fit in registers.

* forward: one CTA per block of `block_rows` rows. Pass 1 accumulates the row
  sums, pass 2 reloads each chunk (mostly from L2) and writes y. When R is not
  a multiple of `block_rows` the last block starts at R - block_rows: the
  overlapping rows are computed twice and written twice with identical values.
* backward: a fixed grid of CTAs, each looping over row blocks g, g+G, ...
  Pass 1 gets the two per-row dot products, pass 2 writes dx and adds
  dy * xhat (and dy) over the 4-row tiles into a per-CTA [4, D] f32 partial
  kept in a GMEM output that only this CTA and only the owning thread touches
  (each element of a 4 x C tile belongs to exactly one thread: no atomics, no
  races). XLA sums the [G, 4, D] partials afterwards. Rows are zero-padded to
  a multiple of 4 (dy = 0 rows contribute nothing).

Small rows (<= 32 KiB per block: D <= 4096 in bf16) are kept in registers
between the passes (one GMEM read); larger ones are re-read per pass.

Requires D % 128 == 0 (the tile width); other D are refused by `supports`.
Checked on one H200 against the XLA reference (fwd + grads, f32/bf16/f16).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from forgeax.kernels.common.norms import NormKernels, differentiable_norm, rms_only, row_count
from forgeax.kernels.pallas.gpu import gpu_refusal, interpret_params, kernel_axis
from forgeax.core.registry import Implementation

_F32 = jnp.float32
_LANES = 32
_TILE_ROWS = 4  # one row per warp of the warpgroup
_MAX_CHUNK = 1024  # columns per loop step (note §6, V5)
_MAX_D = 65536
_CACHE_BYTES = 32 * 1024  # tiles kept in registers: <= 256 B (64 regs) per thread
_BWD_MAX_CTAS = 1024  # backward grid; partial sums are [G, 4, D] f32
_ROWS_AXIS, _CTAS_AXIS = kernel_axis("rows"), kernel_axis("ctas")  # forward / backward grid
_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def _row_layout(vec: int):
    # Canonical spelling of a 4 x (32*vec) tile with vec-element vectors (note §3.3).
    return plgpu.Layout.TILED(
        plgpu.Tiling(((_TILE_ROWS, _LANES * vec), (vec,))), warp_dims=(-3,), lane_dims=(-2,), vector_dim=-1
    )


def _chunk(d: int, width: int) -> int:
    """Largest multiple of `width` that divides d and is at most _MAX_CHUNK."""
    best = width
    for c in range(width, min(d, _MAX_CHUNK) + 1, width):
        if d % c == 0:
            best = c
    return best


def _compiler_params(*, no_auto_barriers: bool):
    return plgpu.CompilerParams(
        lowering_semantics=plgpu.LoweringSemantics.Lane, unsafe_no_auto_barriers=no_auto_barriers
    )


class _Tiles:
    """Loads/broadcasts in one register layout (Lane semantics: layouts flow forward).

    With `cache=True` the chunk loops are unrolled in Python and each (ref,
    row, column) tile is loaded from GMEM once and kept in registers (in its
    storage dtype) for the later passes; otherwise loops are `fori_loop`s and
    every pass reloads (the second read mostly hits L2).
    """

    def __init__(self, vec: int, rows: int, chunk: int, n_chunks: int, cache: bool):
        self.layout = _row_layout(vec)
        self.rows, self.chunk, self.n_chunks, self.cache = rows, chunk, n_chunks, cache
        self._tiles = {}

    def loop(self, fn, carry):
        """carry = fn(c0, carry) for every column chunk start c0."""
        if self.cache:
            for c in range(self.n_chunks):
                carry = fn(c * self.chunk, carry)
            return carry
        return lax.fori_loop(0, self.n_chunks, lambda c, acc: fn(pl.multiple_of(c * self.chunk, self.chunk), acc), carry)

    def load(self, ref, r0, c0, key=None):  # (rows, chunk) tile -> f32
        if self.cache and key is not None and (key, c0) in self._tiles:
            return self._tiles[key, c0].astype(_F32)
        tile = plgpu.load(ref.at[pl.ds(r0, self.rows), pl.ds(c0, self.chunk)], layout=self.layout, optimized=False)
        if self.cache and key is not None:
            self._tiles[key, c0] = tile
        return tile.astype(_F32)

    def load_cols(self, ref, c0):  # (chunk,) f32 vector -> broadcast over rows
        v = plgpu.load(ref.at[pl.ds(c0, self.chunk)], layout=self.layout.reduce(0), optimized=False)
        return plgpu.layout_cast(lax.broadcast_in_dim(v, (self.rows, self.chunk), (1,)), self.layout)

    def load_rows(self, ref, r0):  # (rows,) f32 per-row statistic
        return plgpu.load(ref.at[pl.ds(r0, self.rows)], layout=self.layout.reduce(1), optimized=False)

    def per_row(self, v):  # (rows,) -> broadcast over columns
        return plgpu.layout_cast(lax.broadcast_in_dim(v, (self.rows, self.chunk), (0,)), self.layout)

    def zeros_rows(self):
        return plgpu.layout_cast(jnp.zeros((self.rows,), _F32), self.layout.reduce(1))

    def zeros(self):
        return plgpu.layout_cast(jnp.zeros((self.rows, self.chunk), _F32), self.layout)


# ----------------------------------------------------------------------------- forward


def _forward(x, scale, offset, *, eps, centered):
    rows, d = x.shape
    vec = 8 if x.dtype.itemsize == 2 and d % 256 == 0 else 4  # 16-byte (or 8-byte) accesses
    chunk = _chunk(d, _LANES * vec)
    # Small D: more rows per CTA so that a CTA moves at least ~4K elements.
    block_rows = _TILE_ROWS * max(1, min(8, 4096 // (_TILE_ROWS * d)))
    pad = max(0, block_rows - rows)  # only tiny inputs are padded; otherwise the last block overlaps
    xp = jnp.pad(x, ((0, pad), (0, 0))) if pad else x
    r_all = rows + pad
    cache = block_rows * d * x.dtype.itemsize <= _CACHE_BYTES
    inv_d = 1.0 / d

    def body(x_ref, scale_ref, *refs):
        if offset is not None:
            offset_ref, *refs = refs
        y_ref, rstd_ref, *mean_ref = refs
        t = _Tiles(vec, block_rows, chunk, d // chunk, cache)
        # Last block: shifted back to end at row r_all (overlaps its neighbour,
        # which writes the same values), so no rows are padded or masked.
        r0 = jnp.minimum(lax.axis_index(_ROWS_AXIS) * block_rows, r_all - block_rows)

        def centred(c0):
            xc = t.load(x_ref, r0, c0, key="x")
            return xc - t.per_row(mean) if centered else xc

        mean = None
        if centered:
            mean = t.loop(lambda c0, s: s + jnp.sum(t.load(x_ref, r0, c0, key="x"), axis=1), t.zeros_rows()) * inv_d
            mean_ref[0][pl.ds(r0, block_rows)] = mean

        def sum_sq(c0, s):
            xc = centred(c0)
            return s + jnp.sum(xc * xc, axis=1)

        rstd = lax.rsqrt(t.loop(sum_sq, t.zeros_rows()) * inv_d + eps)
        rstd_ref[pl.ds(r0, block_rows)] = rstd

        def write(c0, carry):
            y = centred(c0) * t.per_row(rstd) * t.load_cols(scale_ref, c0)
            if offset is not None:
                y = y + t.load_cols(offset_ref, c0)
            y_ref[pl.ds(r0, block_rows), pl.ds(c0, chunk)] = y.astype(y_ref.dtype)
            return carry

        t.loop(write, 0)

    out_type = [jax.ShapeDtypeStruct((r_all, d), x.dtype), jax.ShapeDtypeStruct((r_all,), _F32)]
    if centered:
        out_type.append(jax.ShapeDtypeStruct((r_all,), _F32))
    args = [xp, scale.astype(_F32)] + ([offset.astype(_F32)] if offset is not None else [])
    y, rstd, *mean = plgpu.kernel(
        body,
        out_type=tuple(out_type),
        grid=(pl.cdiv(r_all, block_rows),),
        grid_names=(_ROWS_AXIS,),
        # Every thread only reads inputs and writes outputs (no SMEM, no
        # location both read and written): the automatic warpgroup barrier
        # after each store is not needed (CompilerParams docs).
        compiler_params=_compiler_params(no_auto_barriers=True),
        interpret=interpret_params(),
    )(*args)
    if pad:
        y, rstd, mean = y[:rows], rstd[:rows], [m[:rows] for m in mean]
    return y, (tuple(mean) + (rstd,))


# ----------------------------------------------------------------------------- backward


def _backward(x, scale, stats, dy, *, eps, centered, with_offset):
    del eps  # the forward's statistics are reused
    rows, d = x.shape
    vec = 4  # f32 partial sums and 16-bit loads alike
    chunk = _chunk(d, _LANES * vec)
    r_pad = -rows % _TILE_ROWS
    if r_pad:  # zero rows: dy = 0 adds nothing to dscale/doffset, and their dx is dropped
        x, dy = (jnp.pad(a, ((0, r_pad), (0, 0))) for a in (x, dy))
        stats = tuple(jnp.pad(s, (0, r_pad)) for s in stats)
    r_all = rows + r_pad
    n_tiles = r_all // _TILE_ROWS
    # k 4-row tiles per block: a larger k amortises the partial-sum
    # read-modify-write; caching x and dy in registers (small D) wins over it.
    tile_bytes = _TILE_ROWS * d * (x.dtype.itemsize + dy.dtype.itemsize)
    fits = [j for j in (1, 2, 4) if n_tiles % j == 0 and j * tile_bytes <= _CACHE_BYTES]
    cache = bool(fits)
    k = max(fits) if cache else max(j for j in (1, 2, 4) if n_tiles % j == 0)
    n_blocks = n_tiles // k
    n_ctas = min(n_blocks, _BWD_MAX_CTAS)
    inv_d = 1.0 / d

    def body(x_ref, dy_ref, scale_ref, *refs):
        if centered:
            mean_ref, *refs = refs
        rstd_ref, dx_ref, dscale_ref, *doffset_ref = refs
        g = lax.axis_index(_CTAS_AXIS)
        parts = [dscale_ref] + doffset_ref  # this CTA's [4, D] slices: parts[i].at[g]

        # Zero the partials in the same layout as the read-modify-writes
        # below, so each element is only ever touched by its owning thread.
        t0 = _Tiles(vec, _TILE_ROWS, chunk, d // chunk, cache=False)

        def zero(c0, carry):
            for part in parts:
                part[g, :, pl.ds(c0, chunk)] = t0.zeros()
            return carry

        t0.loop(zero, 0)

        def block(i, carry):
            t = _Tiles(vec, _TILE_ROWS, chunk, d // chunk, cache)  # fresh cache per block
            r0s = [(g + i * n_ctas) * (k * _TILE_ROWS) + j * _TILE_ROWS for j in range(k)]
            rstd = [t.load_rows(rstd_ref, r0) for r0 in r0s]
            mean = [t.load_rows(mean_ref, r0) for r0 in r0s] if centered else None

            def tile(j, c0):  # xhat, dy, g = dy * scale for tile j, chunk c0
                xc = t.load(x_ref, r0s[j], c0, key=("x", j))
                if centered:
                    xc = xc - t.per_row(mean[j])
                dyc = t.load(dy_ref, r0s[j], c0, key=("dy", j))
                return xc * t.per_row(rstd[j]), dyc, dyc * t.load_cols(scale_ref, c0)

            def dots(c0, sums):  # per row: sum(g * xhat) and (LayerNorm) sum(g)
                new = []
                for j in range(k):
                    xhat, _, gg = tile(j, c0)
                    s_gx, s_g = sums[j]
                    new.append((s_gx + jnp.sum(gg * xhat, axis=1), s_g + jnp.sum(gg, axis=1) if centered else s_g))
                return tuple(new)

            sums = t.loop(dots, tuple((t.zeros_rows(), t.zeros_rows()) for _ in range(k)))

            def grads(c0, carry):
                acc_s, acc_o = t.zeros(), t.zeros()
                for j in range(k):
                    xhat, dyc, gg = tile(j, c0)
                    s_gx, s_g = sums[j]
                    inner = gg - xhat * t.per_row(s_gx * inv_d)
                    if centered:
                        inner = inner - t.per_row(s_g * inv_d)
                    dx = inner * t.per_row(rstd[j])
                    dx_ref[pl.ds(r0s[j], _TILE_ROWS), pl.ds(c0, chunk)] = dx.astype(dx_ref.dtype)
                    acc_s = acc_s + dyc * xhat
                    acc_o = acc_o + dyc
                # Read-modify-write of this CTA's partial sums. A 4 x chunk tile
                # has no replicated elements: each is read and written by the
                # one thread that owns it, so this is race-free without atomics.
                for part, acc in zip(parts, (acc_s, acc_o)):
                    part[g, :, pl.ds(c0, chunk)] = t.load(part.at[g], 0, c0) + acc
                return carry

            t.loop(grads, 0)
            return carry

        # Blocks g, g + G, g + 2G, ...: every CTA gets the same count +- 1.
        lax.fori_loop(0, (n_blocks - g + n_ctas - 1) // n_ctas, block, 0)

    part = jax.ShapeDtypeStruct((n_ctas, _TILE_ROWS, d), _F32)
    out_type = (jax.ShapeDtypeStruct((r_all, d), x.dtype), part) + ((part,) if with_offset else ())
    dx, dscale, *doffset = plgpu.kernel(
        body,
        out_type=out_type,
        grid=(n_ctas,),
        grid_names=(_CTAS_AXIS,),
        compiler_params=_compiler_params(no_auto_barriers=False),
        interpret=interpret_params(),
    )(x, dy, scale.astype(_F32), *stats)
    dx = dx[:rows] if r_pad else dx
    doffset = jnp.sum(doffset[0], axis=(0, 1)) if with_offset else None
    return dx, jnp.sum(dscale, axis=(0, 1)), doffset


# ----------------------------------------------------------------------------- wiring


def _rms_fwd(x, scale, offset, *, eps):
    del offset
    return _forward(x, scale, None, eps=eps, centered=False)


def _rms_bwd(x, scale, stats, dy, *, eps):
    return _backward(x, scale, stats, dy, eps=eps, centered=False, with_offset=False)


def _ln_fwd(x, scale, offset, *, eps):
    return _forward(x, scale, offset, eps=eps, centered=True)


def _ln_bwd(x, scale, stats, dy, *, eps, with_offset):
    return _backward(x, scale, stats, dy, eps=eps, centered=True, with_offset=with_offset)


def supports(x, scale, offset=None, *, eps) -> str | None:
    del scale, offset, eps
    d = x.shape[-1]
    if jnp.dtype(x.dtype) not in _DTYPES:
        return f"x dtype {jnp.dtype(x.dtype).name} is not f32/bf16/f16"
    if d % 128 or d == 0:
        return f"D={d} is not a multiple of 128 (the register tile width)"
    if d > _MAX_D:
        return f"D={d} exceeds {_MAX_D}"
    if row_count(x) == 0:
        return "x has no rows (an empty grid)"
    return gpu_refusal(wgmma=False)


def _rms_supports(x, scale, *, eps) -> str | None:
    return supports(x, scale, None, eps=eps)


_RMS = differentiable_norm(NormKernels(forward=_rms_fwd, backward=_rms_bwd))
# The backward kernel does not see offset, so LayerNorm with and without bias
# are two shells (no doffset partials when there is no bias).
_LN_BIAS = differentiable_norm(NormKernels(_ln_fwd, functools.partial(_ln_bwd, with_offset=True)))
_LN_NO_BIAS = differentiable_norm(NormKernels(_ln_fwd, functools.partial(_ln_bwd, with_offset=False)))


def _layer_norm(x, scale, offset=None, *, eps):
    return (_LN_NO_BIAS if offset is None else _LN_BIAS)(x, scale, offset, eps=eps)


RMS_NORM = Implementation(fn=rms_only(_RMS), platforms={"gpu"}, interpretable=True, supports=_rms_supports)
LAYER_NORM = Implementation(fn=_layer_norm, platforms={"gpu"}, interpretable=True, supports=supports)
