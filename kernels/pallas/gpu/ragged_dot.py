"""Ragged (grouped) matmul on Hopper GPUs: Mosaic GPU grouped GEMMs (TMA ring -> wgmma).

lhs `[M, K]` rows sorted by group, rhs `[G, K, N]`, group_sizes `[G]` int32.

  * `_forward`: out[r] = lhs[r] @ rhs[g(r)]. Work items, built in XLA from group_sizes with a
    static count (cdiv(M, block_m) + G): each group visits the aligned block_m-row blocks its
    rows overlap (a block that straddles a group boundary is visited once per group; empty
    groups visit none; the rows past sum(group_sizes) are one more pseudo-group whose visits
    read no rhs and give zeros). One CTA (one warpgroup) per (row block, column tile) runs its
    block's visits in order, each a `stages`-deep TMA ring of (block_m x block_k) lhs and
    (block_k x block_n) rhs[g] tiles feeding wgmma into an f32 accumulator. A visit that owns
    the whole block writes the accumulator to the SMEM output tile; a visit of a shared block
    keeps its group's rows only (the other rows masked to 0 in registers) and adds them into the
    tile (rows are disjoint: the sum is exact). One TMA store of the whole tile at the end.
    The same kernel reads rhs `[G, N, K]` transposed for the backward's d lhs = dout @ rhs^T.
  * `_transposed`: tr[g] = lhs_g^T @ dout_g (`[G, K, N]`, d rhs). One CTA per (group, K tile,
    N tile) walks the aligned block_k-row blocks of the group's rows through the same kind of
    ring; the first and last block are masked in SMEM (rows of other groups zeroed in lhs)
    before their wgmma; an empty group stores zeros.

CTAs run in bands of `group_m` row blocks (K tiles in `_transposed`) so that CTAs resident
together share operand tiles in L2.
Scope: bf16/f16 operands (f32 accumulation, any float output), K and N multiples of 64; M any
(rows are padded to a block multiple when M is not one).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from forgeax.core.config import KernelConfig
from forgeax.core.registry import Implementation
from forgeax.core.runtime import interpret_enabled
from forgeax.kernels.common.ragged_dot import RaggedDotSpec, differentiable_ragged_dot, group_bounds
from forgeax.kernels.pallas.gpu import gpu_refusal, kernel_axis
from forgeax.kernels.pallas.gpu.warpgroups import F32, k_block, one_warpgroup_kernel, tma_wgmma_loop, transforms

_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
_ALIGN = 64  # K and N multiples: one 128-byte swizzled row of 16-bit elements
_SMEM_BYTES = 232448  # dynamic shared memory per CTA on Hopper
_TILE_AXIS = kernel_axis("t")  # both kernels' grid: one CTA per output tile


@dataclasses.dataclass(frozen=True, kw_only=True)
class RaggedDotPallasGpuConfig(KernelConfig):
    """Forward: block_m x block_n output tiles (one warpgroup's f32 accumulator: block_m *
    block_n <= 128 * 128), K steps of block_k. Transposed: block_m x block_n tiles of the
    [K, N] output, block_k rows per reduction step. stages: TMA ring depth; group_m: row items
    per L2 band. block_m, block_n in {64, 128}; block_k = 64 (the 128-byte swizzle of 16-bit)."""

    block_m: int = 128
    block_n: int = 128
    block_k: int = 64
    stages: int = 4
    group_m: int = 8

    def validate(self) -> None:
        super().validate()
        for name in ("block_m", "block_n"):
            if getattr(self, name) not in (64, 128):
                raise ValueError(f"RaggedDotPallasGpuConfig.{name}: expected 64 or 128, got {getattr(self, name)}")
        if self.block_k != _ALIGN:
            raise ValueError(f"RaggedDotPallasGpuConfig.block_k: expected {_ALIGN}, got {self.block_k}")
        if self.stages < 2:
            raise ValueError(f"RaggedDotPallasGpuConfig.stages: expected >= 2, got {self.stages}")
        if self.group_m < 1:
            raise ValueError(f"RaggedDotPallasGpuConfig.group_m: expected >= 1, got {self.group_m}")
        if _smem_bytes(self, 4) > _SMEM_BYTES:
            raise ValueError(f"RaggedDotPallasGpuConfig.stages: {self.stages} stages exceed {_SMEM_BYTES} B of shared memory")


def _smem_bytes(cfg: RaggedDotPallasGpuConfig, out_itemsize: int) -> int:
    ring = cfg.stages * (cfg.block_m * cfg.block_k + cfg.block_k * cfg.block_n) * 2
    return ring + cfg.block_m * cfg.block_n * out_itemsize + 1024


def _fit(cfg: RaggedDotPallasGpuConfig, n: int) -> RaggedDotPallasGpuConfig:
    """block_n = 64 where N is no multiple of 128."""
    return cfg if n % cfg.block_n == 0 else dataclasses.replace(cfg, block_n=_ALIGN)


def heuristic_config(lhs, rhs, group_sizes, *, spec) -> RaggedDotPallasGpuConfig:
    """128 x 128 x 64 tiles, 4 stages (128 KiB ring + the output tile); the interpreter pays per
    CTA and per ring step: 64 x 64 tiles, 2 stages."""
    del lhs, group_sizes, spec
    if interpret_enabled():
        return RaggedDotPallasGpuConfig(block_m=64, block_n=64, stages=2, group_m=2)
    return _fit(RaggedDotPallasGpuConfig(), int(rhs.shape[-1]))


def candidate_configs(lhs, rhs, group_sizes, *, spec) -> list[RaggedDotPallasGpuConfig]:
    out = [heuristic_config(lhs, rhs, group_sizes, spec=spec)]
    for bm, bn, stages in ((128, 128, 4), (128, 128, 3), (128, 128, 5), (128, 64, 6), (64, 128, 6)):
        for group_m in (8, 16):
            cfg = _fit(RaggedDotPallasGpuConfig(block_m=bm, block_n=bn, stages=stages, group_m=group_m), int(rhs.shape[-1]))
            if cfg not in out:
                out.append(cfg)
    return out


def _band(pid, items: int, tiles: int, group_m: int):
    """CTA id -> (item, column tile), items fastest within bands of group_m items."""
    per_band = group_m * tiles
    first = lax.div(pid, per_band) * group_m
    size = jnp.minimum(items - first, group_m)
    return first + lax.rem(lax.rem(pid, per_band), size), lax.div(lax.rem(pid, per_band), size)


def _launch(kernel, scratch, out_type, ctas: int):
    return one_warpgroup_kernel(kernel, scratch, out_type, grid=(ctas,), grid_names=(_TILE_AXIS,))


# ----------------------------------------------------------------------------- forward


def block_items(group_sizes: jax.Array, m: int, block_m: int) -> tuple[jax.Array, jax.Array]:
    """The forward's schedule: (items [4, T], blocks [2, cdiv(M, block_m)]), int32.

    Item = one group's visit of one aligned row block: (group, row block, first row, end row);
    group G is the zero tail [sum, M). Items run in group order, so a block's visits are
    consecutive: blocks = (first item, number of items) per row block (>= 1: every row is in a
    group or the tail). T = cdiv(M, block_m) + G bounds the item count (each boundary between
    groups adds at most one shared block); entries past it are never read."""
    g = group_sizes.shape[0]
    n_blocks = -(-m // block_m)
    starts, ends = group_bounds(group_sizes, m)
    starts = jnp.concatenate([starts, ends[-1:]])
    ends = jnp.concatenate([ends, jnp.full((1,), m, jnp.int32)])
    first = starts // block_m
    blocks = jnp.where(ends > starts, (jnp.maximum(ends, 1) - 1) // block_m - first + 1, 0)
    item_end = jnp.cumsum(blocks).astype(jnp.int32)
    t = jnp.arange(n_blocks + g, dtype=jnp.int32)
    grp = jnp.minimum(jnp.searchsorted(item_end, t, side="right"), g).astype(jnp.int32)
    blk = jnp.where(t < item_end[-1], first[grp] + t - (item_end[grp] - blocks[grp]), n_blocks)
    lo = jnp.maximum(starts[grp], blk * block_m)
    hi = jnp.minimum(ends[grp], blk * block_m + block_m)
    b = jnp.arange(n_blocks, dtype=jnp.int32)
    visit0 = jnp.searchsorted(blk, b, side="left")
    visits = jnp.searchsorted(blk, b, side="right") - visit0
    return jnp.stack([grp, blk, lo, hi]).astype(jnp.int32), jnp.stack([visit0, visits]).astype(jnp.int32)


def _forward_call(lhs, rhs, items, blocks, *, n, out_dtype, transpose_rhs, cfg):
    """lhs [Mp, K] (Mp a multiple of block_m), rhs [G, K, N] (or [G, N, K]) -> [Mp, N]."""
    mp, k = lhs.shape
    g = rhs.shape[0]
    bm, bn, bk, stages = cfg.block_m, cfg.block_n, cfg.block_k, cfg.stages
    nk, tiles, n_blocks = k // bk, n // bn, blocks.shape[1]
    dt = lhs.dtype

    def kernel(items_g, blocks_g, lhs_g, rhs_g, out_g, a_s, b_s, loaded, o_s):
        bi, nt = _band(lax.axis_index(_TILE_AXIS), n_blocks, tiles, cfg.group_m)
        row0 = pl.multiple_of(bi * bm, bm)
        rows = pl.ds(row0, bm)
        cols = pl.ds(pl.multiple_of(nt * bn, bn), bn)

        def visit(v, _):
            it = blocks_g[0, bi] + v
            grp, lo, hi = items_g[0, it], items_g[2, it], items_g[3, it]

            def fetch(step, slot):
                kk = k_block(step, bk)
                plgpu.copy_gmem_to_smem(lhs_g.at[rows, kk], a_s.at[slot], loaded.at[slot])
                b = rhs_g.at[grp, cols, kk] if transpose_rhs else rhs_g.at[grp, kk, cols]
                plgpu.copy_gmem_to_smem(b, b_s.at[slot], loaded.at[slot])

            def mac(acc):
                def issue(slot):
                    plgpu.wgmma(acc, a_s.at[slot], b_s.at[slot].transpose((1, 0)) if transpose_rhs else b_s.at[slot])

                pl.when(grp < g)(lambda: tma_wgmma_loop(fetch, issue, nk, stages, loaded))  # the zero tail reads no rhs
                return acc[...]  # waits for every wgmma: the ring is free for the next visit

            acc = pl.run_scoped(mac, plgpu.ACC((bm, bn), F32))
            whole = (lo == row0) & (hi == row0 + bm)

            @pl.when(whole)  # the block is all this group's (its only visit)
            def _():
                o_s[...] = acc.astype(o_s.dtype)

            @pl.when(jnp.logical_not(whole))  # a shared block: this group's rows only
            def _():
                r = plgpu.layout_cast(lax.broadcasted_iota(jnp.int32, (bm, bn), 0), plgpu.Layout.WGMMA) + row0
                mine = jnp.where((r >= lo) & (r < hi), acc, 0.0)

                @pl.when(v == 0)
                def _():
                    o_s[...] = mine.astype(o_s.dtype)

                @pl.when(v > 0)  # rows are disjoint across visits: the sum is exact
                def _():
                    o_s[...] = (plgpu.load(o_s, layout=plgpu.Layout.WGMMA).astype(F32) + mine).astype(o_s.dtype)

        lax.fori_loop(0, blocks_g[1, bi], visit, None)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_s, out_g.at[rows, cols])
        plgpu.wait_smem_to_gmem(0)

    tf = transforms(dt)
    b_tile = (bn, bk) if transpose_rhs else (bk, bn)
    scratch = (
        plgpu.SMEM((stages, bm, bk), dt, transforms=tf),
        plgpu.SMEM((stages, *b_tile), dt, transforms=tf),
        plgpu.Barrier(num_arrivals=2, num_barriers=stages),
        plgpu.SMEM((bm, bn), out_dtype, transforms=transforms(out_dtype)),
    )
    out_type = jax.ShapeDtypeStruct((mp, n), out_dtype)
    return _launch(kernel, scratch, out_type, n_blocks * tiles)(items, blocks, lhs, rhs)


def _pad_rows(x, multiple: int):
    extra = -x.shape[0] % multiple
    return x if not extra else jnp.pad(x, ((0, extra), (0, 0)))


def forward(lhs, rhs, group_sizes, *, out_dtype, config: RaggedDotPallasGpuConfig, transpose_rhs: bool):
    """lhs @ rhs[g] per group; with transpose_rhs, rhs `[G, N, K]` is read as `[G, K, N]`."""
    m = lhs.shape[0]
    n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
    cfg = _fit(config, n)
    items, blocks = block_items(group_sizes, m, cfg.block_m)
    out = _forward_call(_pad_rows(lhs, cfg.block_m), rhs.astype(lhs.dtype), items, blocks, n=n,
                        out_dtype=jnp.dtype(out_dtype), transpose_rhs=transpose_rhs, cfg=cfg)
    return out if out.shape[0] == m else out[:m]


# ----------------------------------------------------------------------------- transposed


def _transposed_call(lhs, dout, groups, *, out_dtype, cfg):
    """lhs [Mp, K], dout [Mp, N] (Mp a multiple of block_k), groups [4, G] -> [G, K, N]."""
    k, n, g = lhs.shape[1], dout.shape[1], groups.shape[1]
    bko, bn, br, stages = cfg.block_m, cfg.block_n, cfg.block_k, cfg.stages
    k_tiles, n_tiles = k // bko, n // bn
    dt = lhs.dtype

    def kernel(groups_g, lhs_g, dout_g, out_g, a_s, d_s, loaded, o_s):
        pid = lax.axis_index(_TILE_AXIS)
        gi = lax.div(pid, k_tiles * n_tiles)
        # Within a group, K tiles fastest in bands of group_m: the CTAs resident together read a
        # few K-tile slabs of lhs and N-tile slabs of dout, each several times, from L2.
        kt, nt = _band(lax.rem(pid, k_tiles * n_tiles), k_tiles, n_tiles, cfg.group_m)
        start, end, b0, nb = (groups_g[i, gi] for i in range(4))
        kcols = pl.ds(pl.multiple_of(kt * bko, bko), bko)
        ncols = pl.ds(pl.multiple_of(nt * bn, bn), bn)

        def fetch(step, slot):
            rows = pl.ds(pl.multiple_of((b0 + step) * br, br), br)
            plgpu.copy_gmem_to_smem(lhs_g.at[rows, kcols], a_s.at[slot], loaded.at[slot])
            plgpu.copy_gmem_to_smem(dout_g.at[rows, ncols], d_s.at[slot], loaded.at[slot])

        def mask(slot, i):
            row0 = (b0 + i) * br

            @pl.when((row0 < start) | (row0 + br > end))
            def _():  # a block shared with another group: zero the other group's lhs rows
                tile = a_s.at[slot]
                rows = plgpu.layout_cast(lax.broadcasted_iota(jnp.int32, (br, bko), 0), plgpu.Layout.WGMMA) + row0
                tile[...] = tile[...] * ((rows >= start) & (rows < end)).astype(dt)
                plgpu.commit_smem()

        def mac(acc):
            def issue(slot):
                plgpu.wgmma(acc, a_s.at[slot].transpose((1, 0)), d_s.at[slot])

            tma_wgmma_loop(fetch, issue, nb, stages, loaded, prepare=mask)  # an empty group: no steps, zeros
            return acc[...]

        acc = pl.run_scoped(mac, plgpu.ACC((bko, bn), F32))
        o_s[...] = acc.astype(o_s.dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_s, out_g.at[gi, kcols, ncols])
        plgpu.wait_smem_to_gmem(0)

    tf = transforms(dt)
    scratch = (
        plgpu.SMEM((stages, br, bko), dt, transforms=tf),
        plgpu.SMEM((stages, br, bn), dt, transforms=tf),
        plgpu.Barrier(num_arrivals=2, num_barriers=stages),
        plgpu.SMEM((bko, bn), out_dtype, transforms=transforms(out_dtype)),
    )
    out_type = jax.ShapeDtypeStruct((g, k, n), out_dtype)
    return _launch(kernel, scratch, out_type, g * k_tiles * n_tiles)(groups, lhs, dout)


def group_blocks(group_sizes: jax.Array, m: int, block: int) -> jax.Array:
    """[4, G] int32: each group's (first row, end row, first aligned block, number of blocks)."""
    starts, ends = group_bounds(group_sizes, m)
    first = starts // block
    blocks = jnp.where(ends > starts, -(-ends // block) - first, 0)
    return jnp.stack([starts, ends, first, blocks]).astype(jnp.int32)


def transposed(lhs, dout, group_sizes, *, out_dtype, config: RaggedDotPallasGpuConfig):
    """lhs_g^T @ dout_g per group: `[G, K, N]`."""
    m, n = lhs.shape[0], dout.shape[1]
    cfg = _fit(config, n)
    if lhs.shape[1] % cfg.block_m:
        cfg = dataclasses.replace(cfg, block_m=_ALIGN)
    groups = group_blocks(group_sizes, m, cfg.block_k)
    return _transposed_call(_pad_rows(lhs, cfg.block_k), _pad_rows(dout.astype(lhs.dtype), cfg.block_k), groups,
                            out_dtype=jnp.dtype(out_dtype), cfg=cfg)


_RAGGED_DOT, _RAGGED_DOT_T = differentiable_ragged_dot(forward, transposed, multiple=_ALIGN)  # K, N split in whole tiles


def ragged_dot(lhs, rhs, group_sizes, *, spec: RaggedDotSpec, config: RaggedDotPallasGpuConfig):
    return _RAGGED_DOT(lhs, rhs, group_sizes, jnp.dtype(spec.out_dtype), config)


def ragged_dot_transposed(lhs, dout, group_sizes, *, spec: RaggedDotSpec, config: RaggedDotPallasGpuConfig):
    return _RAGGED_DOT_T(lhs, dout, group_sizes, jnp.dtype(spec.out_dtype), config)


def supports(lhs, other, group_sizes, *, spec) -> str | None:
    """other: rhs `[G, K, N]` (ragged_dot) or dout `[M, N]` (ragged_dot_transposed)."""
    del group_sizes, spec
    if jnp.dtype(lhs.dtype) not in _DTYPES:
        return f"lhs dtype {jnp.dtype(lhs.dtype).name} is not bfloat16/float16 (the wgmma kernel's inputs)"
    if 0 in lhs.shape or 0 in other.shape:
        return "empty operand"
    k, n = int(lhs.shape[1]), int(other.shape[-1])
    if k % _ALIGN or n % _ALIGN:
        return f"K={k}, N={n}: the wgmma kernel needs multiples of {_ALIGN}"
    return gpu_refusal(wgmma=True)


def _transposed_heuristic(lhs, dout, group_sizes, *, spec) -> RaggedDotPallasGpuConfig:
    del group_sizes, spec
    if interpret_enabled():
        return RaggedDotPallasGpuConfig(block_m=64, block_n=64, stages=2, group_m=2)
    cfg = _fit(RaggedDotPallasGpuConfig(), int(dout.shape[1]))
    return cfg if lhs.shape[1] % cfg.block_m == 0 else dataclasses.replace(cfg, block_m=_ALIGN)


RAGGED_DOT = Implementation(fn=ragged_dot, platforms={"gpu"}, interpretable=True, supports=supports,
                            config_type=RaggedDotPallasGpuConfig, heuristic_config=heuristic_config,
                            candidate_configs=candidate_configs)
RAGGED_DOT_TRANSPOSED = Implementation(fn=ragged_dot_transposed, platforms={"gpu"}, interpretable=True, supports=supports,
                                       config_type=RaggedDotPallasGpuConfig, heuristic_config=_transposed_heuristic)
