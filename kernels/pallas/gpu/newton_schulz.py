"""Newton-Schulz orthogonalisation on Hopper GPUs: Mosaic GPU matmuls (TMA ring -> wgmma).

Each step of the iteration (kernels/common/newton_schulz.py) on x [batch, M, K] (M <= K) runs
one kernel, `_matmul`, three times:

    A = x x^T          upper tiles (i <= j) only, each off-diagonal one also stored mirrored
    B = c A A^T + b A  the same (A A = A A^T: A is symmetric), b A added in the epilogue
    x = B x + a x      every tile, a x added in the epilogue (or XLA's dot: `pallas_update`)

The kernel: out tile (r, s) = alpha * lhs[r] @ rhs[s] (+ beta * extra[r, s]) for the (r, s) of a
static tile table, one CTA (one warpgroup) per tile and matrix. A `stages`-deep TMA ring feeds
block x 64 operand tiles to wgmma (f32 accumulator); rhs is read as [N, K] tiles transposed in
SMEM for the Gram products. The epilogue tile (extra) lands by TMA during the K loop. The f32
epilogue is rounded to bf16, stored to SMEM and written by TMA; for a mirrored tile (r != s)
the transpose is I @ tile^T, one more wgmma of the identity (an input, by TMA) with the SMEM
tile read transposed (exact: bf16 values times 1 summed in f32), a block / K fraction of the
tile's FLOPs, stored at (s, r). So A and B are exactly symmetric off the diagonal tiles, and the two Gram products
cost (T + 1) / 2T of the full ones (T tiles per side).

Scope: M and K multiples of 64 (others are refused: the XLA/Triton backends run them); the
input may be any float dtype (the normalisation runs in XLA, f32). The gradient is the
reference's autodiff (kernels/common/newton_schulz.py), not a kernel.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from forgeax.core.config import KernelConfig
from forgeax.core.registry import Implementation
from forgeax.core.runtime import interpret_enabled
from forgeax.kernels.common import newton_schulz as common
from forgeax.kernels.pallas.gpu import gpu_refusal, kernel_axis
from forgeax.kernels.pallas.gpu.warpgroups import F32, k_block, one_warpgroup_kernel, tma_wgmma_loop, transforms

_TK = 64  # K step: 64 bf16 = one 128-byte swizzled row
_BLOCKS = (64, 128)  # wgmma M (one warpgroup) and N; 128 x 128 f32 = 128 registers per thread
_SMEM_BYTES = 232448  # dynamic shared memory per CTA on Hopper
_RESERVED = 2048 + 1024  # Pallas' reduction scratch and the barriers, rounded up
_DT = common.ITERATION_DTYPE
_BATCH_AXIS, _TILE_AXIS = kernel_axis("b"), kernel_axis("t")  # the grid: matrix, tile


@dataclasses.dataclass(frozen=True, kw_only=True)
class NewtonSchulzPallasGpuConfig(KernelConfig):
    """`block`: the square output tile of the Gram products; `update_block_m/n`: the update
    product's output tile; `stages`: TMA ring depth (both kernels); `group_m`: row tiles per L2
    group of the update's tile order; `pallas_update`: run the update product in this module's
    kernel (False: XLA's dot, i.e. cuBLAS). Tiles in {64, 128}; K steps of 64."""

    block: int = 128
    update_block_m: int = 128
    update_block_n: int = 128
    stages: int = 4
    group_m: int = 8
    pallas_update: bool = True

    def validate(self) -> None:
        super().validate()
        for name in ("block", "update_block_m", "update_block_n"):
            if getattr(self, name) not in _BLOCKS:
                raise ValueError(f"{type(self).__name__}.{name}: expected one of {_BLOCKS}, got {getattr(self, name)}")
        if self.stages < 2:
            raise ValueError(f"{type(self).__name__}.stages: expected >= 2, got {self.stages}")
        if self.group_m < 1:
            raise ValueError(f"{type(self).__name__}.group_m: expected >= 1, got {self.group_m}")
        worst = max(_smem_bytes(self.block, self.block, self.stages, True, True),
                    _smem_bytes(self.update_block_m, self.update_block_n, self.stages, True, False))
        if worst > _SMEM_BYTES:
            raise ValueError(f"{type(self).__name__}.stages: {self.stages} stages need {worst} B of shared memory "
                             f"(> {_SMEM_BYTES})")


def _smem_bytes(bm: int, bn: int, stages: int, extra: bool, mirror: bool) -> int:
    """Ring, output tile, epilogue/mirror tile, identity (2-byte elements), reserved."""
    return 2 * (stages * (bm + bn) * _TK + bm * bn * (1 + (extra or mirror)) + bn * bn * mirror) + _RESERVED


def _fit(size: int, block: int) -> int:
    return block if size % block == 0 else 64


def heuristic_config(g, *, spec) -> NewtonSchulzPallasGpuConfig:
    """128-wide tiles where the sides allow (from 1024 up), else 64; 4 stages (the Gram kernel with its epilogue
    and mirror tiles then fills the 227 KiB of shared memory). The interpreter pays per CTA and
    ring step: 64-wide tiles, 2 stages."""
    del spec
    m, n = sorted(int(d) for d in g.shape[-2:])
    if interpret_enabled():
        return NewtonSchulzPallasGpuConfig(block=64, update_block_m=64, update_block_n=64, stages=2, group_m=2)
    tile = 128 if m >= 1024 else 64  # small matrices: more, smaller tiles keep more SMs busy
    return NewtonSchulzPallasGpuConfig(block=_fit(m, tile), update_block_m=_fit(m, tile), update_block_n=_fit(n, tile))


def candidate_configs(g, *, spec) -> list[NewtonSchulzPallasGpuConfig]:
    out = [heuristic_config(g, spec=spec)]
    m, n = sorted(int(d) for d in g.shape[-2:])
    for block, stages, group_m, pallas_update in ((128, 4, 8, True), (128, 3, 8, True), (128, 4, 16, True),
                                                  (128, 4, 4, True), (64, 4, 8, True), (64, 6, 8, True),
                                                  (128, 4, 8, False), (128, 3, 8, False)):
        cfg = NewtonSchulzPallasGpuConfig(block=_fit(m, block), update_block_m=_fit(m, block),
                                          update_block_n=_fit(n, block), stages=stages, group_m=group_m,
                                          pallas_update=pallas_update)
        if cfg not in out:
            out.append(cfg)
    return out


# ----------------------------------------------------------------------------- tile tables


def _grouped_tiles(rows: int, cols: int, group_m: int) -> np.ndarray:
    """[2, rows * cols] int32 (row tile, column tile): group_m row tiles walk the column tiles
    together, so the CTAs resident at one time share rhs columns in L2."""
    out = []
    for first in range(0, rows, group_m):
        size = min(group_m, rows - first)
        out += [(first + r, c) for c in range(cols) for r in range(size)]
    return np.asarray(out, np.int32).T.copy()


def _upper_tiles(tiles: int) -> np.ndarray:
    return np.stack(common.upper_tiles(tiles)).astype(np.int32)


# ----------------------------------------------------------------------------- the kernel


def _matmul(lhs, rhs, extra, table: np.ndarray, *, alpha: float, beta: float, rhs_nk: bool, mirror: bool,
            bm: int, bn: int, stages: int):
    """out[b] tiles (r, s) of `table` = alpha * lhs[b] @ rhs'[b] (+ beta * extra[b]) in bf16, with
    rhs' = rhs^T (rhs_nk: rhs [batch, N, K]) or rhs ([batch, K, N]); lhs [batch, M, K]. mirror: the
    output is symmetric ([batch, M, M]) and also gets tile (s, r) = tile (r, s)^T when r != s."""
    batch, m, k = lhs.shape
    n = rhs.shape[1] if rhs_nk else rhs.shape[2]
    steps = k // _TK
    has_extra = extra is not None

    def kernel(table_g, eye_g, lhs_g, rhs_g, *refs):
        extra_g = refs[0] if has_extra else None
        out_g, a_s, b_s, loaded, o_s, e_s, eye_s, e_bar, eye_bar = refs[has_extra:]
        b, t = lax.axis_index(_BATCH_AXIS), lax.axis_index(_TILE_AXIS)
        r, s = table_g[0, t], table_g[1, t]
        rows = pl.ds(pl.multiple_of(r * bm, bm), bm)
        cols = pl.ds(pl.multiple_of(s * bn, bn), bn)

        if has_extra:  # lands during the K loop
            plgpu.copy_gmem_to_smem(extra_g.at[b, rows, cols], e_s, e_bar)
        if mirror:  # the identity too (a TMA from L2: building it in registers costs 256 of them)
            pl.when(r != s)(lambda: plgpu.copy_gmem_to_smem(eye_g, eye_s, eye_bar))

        def fetch(step, slot):
            kk = k_block(step, _TK)
            plgpu.copy_gmem_to_smem(lhs_g.at[b, rows, kk], a_s.at[slot], loaded.at[slot])
            plgpu.copy_gmem_to_smem(rhs_g.at[b, cols, kk] if rhs_nk else rhs_g.at[b, kk, cols], b_s.at[slot],
                                    loaded.at[slot])

        def mac(acc):
            tma_wgmma_loop(
                fetch, lambda slot: plgpu.wgmma(acc, a_s.at[slot], b_s.at[slot].transpose((1, 0)) if rhs_nk else b_s.at[slot]),
                steps, stages, loaded)
            return acc[...]

        y = alpha * pl.run_scoped(mac, plgpu.ACC((bm, bn), F32))
        if has_extra:
            plgpu.barrier_wait(e_bar)
            y = y + beta * plgpu.load(e_s, layout=plgpu.Layout.WGMMA).astype(F32)
        o_s[...] = y.astype(_DT)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_s, out_g.at[b, rows, cols])

        if mirror:
            @pl.when(r != s)
            def _():
                plgpu.barrier_wait(eye_bar)

                def transpose(acc):
                    plgpu.wgmma(acc, eye_s, o_s.transpose((1, 0)))
                    return acc[...]

                # e_s was read into registers above (and the extra TMA waited for): free to reuse.
                e_s[...] = pl.run_scoped(transpose, plgpu.ACC((bn, bm), F32)).astype(_DT)
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(e_s, out_g.at[b, cols, rows])

        plgpu.wait_smem_to_gmem(0)

    tf = transforms(_DT)
    scratch = (
        plgpu.SMEM((stages, bm, _TK), _DT, transforms=tf),
        plgpu.SMEM((stages, bn, _TK) if rhs_nk else (stages, _TK, bn), _DT, transforms=tf),
        plgpu.Barrier(num_arrivals=2, num_barriers=stages),
        plgpu.SMEM((bm, bn), _DT, transforms=tf),
        plgpu.SMEM((bm, bn) if has_extra or mirror else (8, 64), _DT, transforms=tf),
        plgpu.SMEM((bn, bn) if mirror else (8, 64), _DT, transforms=tf),
        plgpu.Barrier(num_arrivals=1),
        plgpu.Barrier(num_arrivals=1),
    )
    out_type = jax.ShapeDtypeStruct((batch, m, n), _DT)
    call = one_warpgroup_kernel(kernel, scratch, out_type, grid=(batch, table.shape[1]),
                                grid_names=(_BATCH_AXIS, _TILE_AXIS))
    eye = jnp.eye(bn, dtype=_DT) if mirror else jnp.zeros((8, 64), _DT)
    return call(jnp.asarray(table), eye, lhs, rhs, *((extra,) if has_extra else ()))


# ----------------------------------------------------------------------------- the products


def gram(x, c, alpha: float, beta: float, config: NewtonSchulzPallasGpuConfig):
    """alpha x x^T (+ beta c) for x [batch, M, K] bf16 (c symmetric): upper tiles, mirrored."""
    block = config.block
    return _matmul(x, x, c, _upper_tiles(x.shape[1] // block), alpha=float(alpha), beta=float(beta), rhs_nk=True,
                   mirror=True, bm=block, bn=block, stages=config.stages)


def update(b, x, a: float, config: NewtonSchulzPallasGpuConfig):
    """b x + a x for b [batch, M, M], x [batch, M, N] bf16: this module's kernel or XLA's dot."""
    if not config.pallas_update:
        return common.xla_update(b, x, a)
    bm, bn = config.update_block_m, config.update_block_n
    table = _grouped_tiles(x.shape[1] // bm, x.shape[2] // bn, config.group_m)
    return _matmul(b, x, x, table, alpha=1.0, beta=float(a), rhs_nk=False, mirror=False, bm=bm, bn=bn,
                   stages=config.stages)


_KERNELS = common.Kernels(gram=gram, update=update)
_RUN = common.newton_schulz_with(_KERNELS)


def newton_schulz(g, *, spec, config: NewtonSchulzPallasGpuConfig):
    m, n = sorted(int(d) for d in g.shape[-2:])
    for name, size, tile in (("block", m, config.block), ("update_block_m", m, config.update_block_m),
                             ("update_block_n", n, config.update_block_n)):
        if size % tile:
            raise ValueError(f"config.{name}: {tile} does not divide the matrix side {size} (sides {m} x {n})")
    return _RUN(g, spec=spec, config=config)


def supports(g, *, spec) -> str | None:
    del spec
    m, n = sorted(int(d) for d in g.shape[-2:])
    if m % _TK or n % _TK:
        return f"matrix sides {m} x {n}: the wgmma kernels need multiples of {_TK}"
    return gpu_refusal(wgmma=True)


NEWTON_SCHULZ = Implementation(
    fn=newton_schulz,
    platforms={"gpu"},
    interpretable=True,
    supports=supports,
    config_type=NewtonSchulzPallasGpuConfig,
    heuristic_config=heuristic_config,
    candidate_configs=candidate_configs,
)
