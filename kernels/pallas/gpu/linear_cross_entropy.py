"""Linear + cross-entropy on Hopper GPUs: a fused wgmma matmul + online-softmax Mosaic GPU kernel.

The chunk loop is kernels/common/linear_cross_entropy.py; this backend's ChunkKernels take a
chunk's matmul operands (x_c [C, H], W [H, V], b [V] or None; `fused_matmul=True`) and compute
the logits themselves. `_stats_call`, one plgpu.kernel on a grid (vocabulary splits S, row
blocks of BM = 128 x config.warpgroups): each CTA owns BM rows and a run of BN-wide vocabulary
tiles; per tile a TMA ring of config.stages slots feeds wgmma into a 128 x BN f32 accumulator per
warpgroup, then the tile folds into per-row online statistics, in f32:
    l = round_to_matmul_dtype(acc + b)      (as x @ W would be stored)
    z = cap * tanh(l / cap)  (or l);        columns >= V masked out
    m = running max,  s = sum exp(z - m),  zt = z[target],  zs = sum z
and, when asked, l is stored to a [C, V] buffer (SMEM -> TMA). XLA combines the S splits'
(m, s, zt, zs) (lse = M + log sum_s s_s exp(m_s - M)) into the loss of the XLA chunk kernels:
    loss = lse - (1 - ls) zt - ls / V * zs + z_loss * lse^2   (0 if ignored)

  * loss (forward only; "none"'s forward): no [C, V] buffer.
  * loss_and_grad ("mean"/"sum"): the kernel also stores l; g = d loss / d l is one XLA
    elementwise pass (`losses.logits_grad`, the "xla_chunked" closed form) fed to the dx/dW matmuls: 3 matmuls, one
    [C, V] write, one read + write per chunk. Recomputing l to emit g directly would cost a 4th
    matmul (+33% FLOPs) to save one [C, V] write, so it is not done.
  * grad ("none"'s backward rerun): the kernel with the store, then the same pass, scaled.
The statistics see the logits rounded to the matmul dtype, the values the gradient reads back,
so loss and gradient agree (`f32_logits=False`, as in the Triton backend).

Scope: x and W both bf16 or both f16, H a multiple of 64 (the wgmma K step); any V (W and b
zero-padded to a multiple of BN only when needed, padded columns masked); any token count (rows
padded with ignored targets); every option, axis_name included (the statistics of this device's
slice of V are combined over the axis; the gradient pass takes the global lse). About 4 CTAs per SM (`_splits`); with
160-220 KiB of SMEM one CTA runs per SM, so the exp/tanh epilogue does not overlap the tensor
cores: that and the tiling (`LinearCrossEntropyPallasGpuConfig`) are what to tune. Proven in
Mosaic GPU's CPU interpreter and by cross-lowering; the GPU conformance run checks the device.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from forgeax.kernels.common import linear_cross_entropy as chunked
from forgeax.kernels.common.batching import ManualAxes
from forgeax.kernels.common.losses import LossSpec, combine_partials, local_targets, logits_grad, vocab_range
from forgeax.kernels.pallas.interpret import without_effects
from forgeax.kernels.pallas.gpu import gpu_refusal, interpret_params, kernel_axis
from forgeax.core.config import KernelConfig
from forgeax.core.registry import Implementation
from forgeax.core.runtime import gpu_sm_count, interpret_enabled

_F32 = jnp.float32
_WG_ROWS = 128  # rows per compute warpgroup (a 128 x 128 f32 accumulator = 128 registers/thread)
_TK = 64  # K step: 64 bf16 = one 128-byte swizzled row
_SMEM_BYTES = 232448  # dynamic shared memory per CTA on Hopper
_WAVES = 4  # aim for about this many CTAs per SM in the grid
_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
# The kernel's grid and thread axes (private names: a grid axis named like a mesh axis, "v" in a
# vocabulary-parallel shard_map, would read the device's mesh index instead of the CTA's).
_SPLIT, _ROWS, _WG = kernel_axis("lce_split"), kernel_axis("lce_rows"), kernel_axis("lce_wg")


@dataclasses.dataclass(frozen=True, kw_only=True)
class LinearCrossEntropyPallasGpuConfig(KernelConfig):
    """Tiling of the kernel (not tuned yet: to be measured on a GPU).

    warpgroups: compute warpgroups per CTA, each owning 128 rows; they share
      each W tile in SMEM (2: a 256 x block_n CTA tile, half the W traffic per
      FLOP, as JAX's hopper matmul does with 128 x 256; warpgroup 0 refills a
      ring slot once both have arrived on its `consumed` barrier).
      EXPERIMENTAL: 2 passes 13 of the scratch cases in the interpreter but
      hangs there at H=512 (and intermittently at H=128); not isolated whether
      that is the interpreter on a 2-core box or a barrier bug. Keep 1 until
      a GPU run clears it.
    block_n: vocabulary columns per tile (64 or 128: the accumulator is
      128 x block_n f32 per warpgroup).
    stages: depth of the TMA ring. SMEM = stages * (128 * warpgroups + block_n)
      * 64 * 2 B + warpgroups * 128 * block_n * 2 B (the logits tile):
      1 wg, 128, 4 stages: 160 KiB; 2 wg, 128, 3 stages: 208 KiB (limit 227).
    """

    warpgroups: int = 1
    block_n: int = 128
    stages: int = 4

    def validate(self) -> None:
        super().validate()
        name = type(self).__name__
        if self.warpgroups not in (1, 2):
            raise ValueError(f"{name}.warpgroups: expected 1 or 2, got {self.warpgroups}")
        if self.block_n not in (64, 128):
            raise ValueError(f"{name}.block_n: expected 64 or 128, got {self.block_n}")
        if self.stages < 2:
            raise ValueError(f"{name}.stages: expected >= 2, got {self.stages}")
        if self.smem_bytes > _SMEM_BYTES:
            raise ValueError(f"{name}.stages: {self} needs {self.smem_bytes} B of shared memory (at most {_SMEM_BYTES})")

    @property
    def block_m(self) -> int:
        return _WG_ROWS * self.warpgroups

    @property
    def smem_bytes(self) -> int:  # about: the ring, the logits tile, bias slots, targets, statistics, barriers
        ring = self.stages * (self.block_m + self.block_n) * _TK * 2
        return ring + self.block_m * (self.block_n * 2 + 4 + 16) + self.warpgroups * 2 * self.block_n * 4 + 1024


def heuristic_config(x, weight, targets, bias=None, *, spec: LossSpec, chunk_size=None) -> LinearCrossEntropyPallasGpuConfig:
    del x, weight, targets, bias, spec, chunk_size
    return LinearCrossEntropyPallasGpuConfig()


def candidate_configs(x, weight, targets, bias=None, *, spec: LossSpec, chunk_size=None) -> list[LinearCrossEntropyPallasGpuConfig]:
    """Every single-warpgroup tiling that fits in SMEM (2 warpgroups wait for a GPU run, above)."""
    del x, weight, targets, bias, spec, chunk_size
    out = []
    for block_n in (64, 128):
        for stages in range(2, 9):
            try:
                out.append(LinearCrossEntropyPallasGpuConfig(warpgroups=1, block_n=block_n, stages=stages))
            except ValueError:  # over the SMEM budget
                break
    return out


def _splits(row_blocks: int, tiles: int) -> int:
    """Vocabulary splits: enough CTAs for ~_WAVES per SM, at least 2 tiles per split."""
    want = -(-_WAVES * gpu_sm_count() // row_blocks)
    return max(1, min(want, tiles // 2 or 1))


# ----------------------------------------------------------------------------- the kernel


def _aligned(value, multiple):
    # pl.multiple_of on a Python int (the unrolled prologue) has no Mosaic GPU lowering.
    return value if isinstance(value, int) else pl.multiple_of(value, multiple)


def _stats_call(x, w, b, t, *, vocab, cap, smoothing, store, config):
    """x [Cp, H], w [H, Vp], b [Vp] f32 or None, t [Cp] int32 (Cp % block_m == 0, Vp % block_n == 0)
    -> (stats [S, 4, Cp] f32: per-split (m, s, zt, zs); logits [Cp, Vp] in x.dtype or None)."""
    cp, h = x.shape
    vp = w.shape[1]
    dt = x.dtype
    wgs, bm, bn, stages = config.warpgroups, config.block_m, config.block_n, config.stages
    nk, tiles, row_blocks = h // _TK, vp // bn, cp // bm
    splits = _splits(row_blocks, tiles)
    has_bias = b is not None
    swizzled = (plgpu.TilingTransform((8, _TK)), plgpu.SwizzleTransform(128))
    row_layout, col_layout = plgpu.Layout.WGMMA.reduce(1), plgpu.Layout.WGMMA.reduce(0)

    def kernel(x_g, w_g, b_g, t_g, stats_g, logits_g, ring, small, extra):
        a_s, w_s, loaded, consumed = ring
        t_s, t_bar, st_s = small
        o_s, bias_s, bias_bar = extra
        wg = lax.axis_index(_WG) if wgs > 1 else 0

        def leader(fn):  # TMA issued once per CTA, by warpgroup 0
            if wgs > 1:
                pl.when(wg == 0)(fn)
            else:
                fn()

        split, rb = lax.axis_index(_SPLIT), lax.axis_index(_ROWS)
        cta_rows = pl.ds(pl.multiple_of(rb * bm, bm), bm)
        mine = pl.ds(wg * _WG_ROWS, _WG_ROWS)  # this warpgroup's rows inside the CTA block
        my_rows = pl.ds(pl.multiple_of(rb * bm + wg * _WG_ROWS, _WG_ROWS), _WG_ROWS)
        tile0 = split * tiles // splits
        n_tiles = (split + 1) * tiles // splits - tile0
        total = n_tiles * nk  # flat (tile, k) steps of this CTA

        def fetch(step, slot):
            tile, k = tile0 + step // nk, step % nk
            kk = pl.ds(_aligned(k * _TK, _TK), _TK)
            cols = pl.ds(_aligned(tile * bn, bn), bn)
            plgpu.copy_gmem_to_smem(x_g.at[cta_rows, kk], a_s.at[slot], loaded.at[slot])
            plgpu.copy_gmem_to_smem(w_g.at[kk, cols], w_s.at[slot], loaded.at[slot])

        @leader
        def _():
            plgpu.copy_gmem_to_smem(t_g.at[cta_rows], t_s, t_bar)
            for s in range(stages):  # the prologue fills the ring

                @pl.when(s < total)
                def _():
                    fetch(s, s)

        plgpu.barrier_wait(t_bar)
        target = plgpu.load(t_s.at[mine], layout=row_layout)

        def full(value):
            return plgpu.layout_cast(jnp.full((_WG_ROWS,), value, _F32), row_layout)

        def tile_body(i, carry):
            m, s, zt, zs = carry
            c0 = pl.multiple_of((tile0 + i) * bn, bn)
            if has_bias:
                # Lands during the K loop. Per warpgroup (the other one may be a tile behind),
                # 2 slots: slot i-1 was read just now.
                plgpu.copy_gmem_to_smem(b_g.at[pl.ds(c0, bn)], bias_s.at[wg, i % 2], bias_bar.at[wg * 2 + i % 2])

            def mac(acc):
                def step(k, _):
                    g = i * nk + k
                    slot = lax.rem(g, stages)
                    plgpu.barrier_wait(loaded.at[slot])
                    plgpu.wgmma(acc, a_s.at[slot].at[mine], w_s.at[slot])
                    plgpu.wgmma_wait(1)  # wgmma g-1 retired: its slot may be refilled
                    prev = lax.rem(g - 1, stages)

                    @pl.when((g >= 1) & (g - 1 + stages < total))
                    def _():
                        if wgs == 1:
                            fetch(g - 1 + stages, prev)
                        else:  # every warpgroup is done with the slot before warpgroup 0 refills it
                            plgpu.barrier_arrive(consumed.at[prev])

                            @pl.when(wg == 0)
                            def _():
                                plgpu.barrier_wait(consumed.at[prev])
                                fetch(g - 1 + stages, prev)

                lax.fori_loop(0, nk, step, None)
                return acc[...]

            acc = pl.run_scoped(mac, plgpu.ACC((_WG_ROWS, bn), _F32))
            if has_bias:
                plgpu.barrier_wait(bias_bar.at[wg * 2 + i % 2])
                bias = plgpu.load(bias_s.at[wg, i % 2], layout=col_layout)
                acc = acc + lax.broadcast_in_dim(bias, (_WG_ROWS, bn), (1,))
            low = acc.astype(dt)  # the stored logits; the statistics see the same values
            if store:
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the previous tile's store has read o_s
                o_s.at[wg][...] = low
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(o_s.at[wg], logits_g.at[my_rows, pl.ds(c0, bn)])
            z = low.astype(_F32)
            if cap:
                z = cap * jnp.tanh(z * (1.0 / cap))
            col = plgpu.broadcasted_iota(jnp.int32, (_WG_ROWS, bn), 1, layout=plgpu.Layout.WGMMA) + c0
            live = col < vocab
            zm = jnp.where(live, z, -jnp.inf)
            m_new = jnp.maximum(m, jnp.max(zm, axis=1))  # finite: every tile has a live column
            p = jnp.exp(zm - lax.broadcast_in_dim(m_new, (_WG_ROWS, bn), (0,)))
            s = s * jnp.exp(m - m_new) + jnp.sum(p, axis=1)
            hit = col == lax.broadcast_in_dim(target, (_WG_ROWS, bn), (0,))
            zt = zt + jnp.sum(jnp.where(hit, z, 0.0), axis=1)
            if smoothing:
                zs = zs + jnp.sum(jnp.where(live, z, 0.0), axis=1)
            return m_new, s, zt, zs

        init = (full(-jnp.inf), full(0.0), full(0.0), full(0.0))
        results = lax.fori_loop(0, n_tiles, tile_body, init)
        for j, r in enumerate(results):
            st_s.at[wg, j][...] = r
        plgpu.commit_smem()
        for j in range(4):
            plgpu.copy_smem_to_gmem(st_s.at[wg, j], stats_g.at[split, j, my_rows])
        plgpu.wait_smem_to_gmem(0)

    ring = (
        plgpu.SMEM((stages, bm, _TK), dt, transforms=swizzled),
        plgpu.SMEM((stages, _TK, bn), dt, transforms=swizzled),
        plgpu.Barrier(num_arrivals=2, num_barriers=stages),
        plgpu.Barrier(num_arrivals=wgs, num_barriers=stages) if wgs > 1 else None,
    )
    small = (plgpu.SMEM((bm,), jnp.int32), plgpu.Barrier(num_arrivals=1), plgpu.SMEM((wgs, 4, _WG_ROWS), _F32))
    extra = (
        plgpu.SMEM((wgs, _WG_ROWS, bn), dt, transforms=swizzled) if store else None,
        plgpu.SMEM((wgs, 2, bn), _F32) if has_bias else None,
        plgpu.Barrier(num_arrivals=1, num_barriers=2 * wgs) if has_bias else None,
    )

    def body(*refs):
        x_g, w_g = refs[:2]
        b_g = refs[2] if has_bias else None
        t_g, stats_g = refs[2 + has_bias:4 + has_bias]
        logits_g = refs[4 + has_bias] if store else None
        collective = {"collective_axes": _WG} if wgs > 1 else {}  # one allocation shared by the warpgroups
        pl.run_scoped(lambda *s: kernel(x_g, w_g, b_g, t_g, stats_g, logits_g, *s), ring, small, extra, **collective)

    out_type = [jax.ShapeDtypeStruct((splits, 4, cp), _F32)]
    if store:
        out_type.append(jax.ShapeDtypeStruct((cp, vp), dt))
    threads = {"num_threads": wgs, "thread_name": _WG} if wgs > 1 else {}
    call = plgpu.kernel(
        body,
        out_type=tuple(out_type),
        grid=(splits, row_blocks),  # row blocks fastest: CTAs running together share W tiles in L2
        grid_names=(_SPLIT, _ROWS),
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=interpret_params(),
        **threads,
    )
    if interpret_enabled():  # the interpreter's effects would block jax.checkpoint: hide them
        call = without_effects(call, tuple(out_type))
    outs = call(*((x, w) + ((b,) if has_bias else ()) + (t,)))
    return outs[0], (outs[1] if store else None)


# ----------------------------------------------------------------------------- chunk kernels


def _fused_logits(operands, t, spec: LossSpec, config: LinearCrossEntropyPallasGpuConfig, store):
    """(loss [C], lse [C], logits [C, V] in the matmul dtype or None) of one chunk. Vocabulary-
    parallel (spec.axis_name): the kernel's statistics cover this device's slice of V and
    losses.combine_partials combines them over the axis (one pmax + one psum)."""
    x, w, b = operands
    c, v = x.shape[0], w.shape[1]
    axes = ManualAxes.of(x, w, t)
    t_here = local_targets(t, spec, v)  # t itself without axis_name
    cp, vp = -(-c // config.block_m) * config.block_m, -(-v // config.block_n) * config.block_n
    if cp != c:
        x = jnp.pad(x, ((0, cp - c), (0, 0)))
    tp = jnp.pad(t_here, (0, cp - c), constant_values=-1) if cp != c else t_here
    if vp != v:  # only for vocabularies that are not a multiple of BN (a copy of W per chunk)
        w = jnp.pad(w, ((0, 0), (0, vp - v)))
    if b is not None:
        b = jnp.pad(b.astype(_F32), (0, vp - v))
    stats, logits = _stats_call(
        x, w.astype(x.dtype), b, tp, vocab=v, cap=spec.soft_cap, smoothing=spec.label_smoothing, store=store,
        config=config,
    )
    stats = axes.apply(stats[:, :, :c])  # a kernel output: typed varying again inside shard_map
    m_s, s_s, zt, zs = stats[:, 0], stats[:, 1], jnp.sum(stats[:, 2], 0), jnp.sum(stats[:, 3], 0)
    m = jnp.max(m_s, axis=0)
    lse_local = m + jnp.log(jnp.sum(s_s * jnp.exp(m_s - m), axis=0))  # this slice's, over the S splits
    loss, lse = combine_partials(lse_local, zt, zs, t, spec, vocab_range(spec, v)[1])
    if logits is not None and (cp, vp) != (c, v):
        logits = logits[:c, :v]
    return loss, lse, logits


def _loss(operands, t, spec, config):
    return _fused_logits(operands, t, spec, config, store=False)[:2]


def _loss_and_grad(operands, t, spec, config, dtype):
    loss, lse, logits = _fused_logits(operands, t, spec, config, store=True)
    # One XLA elementwise pass (the convert fuses into it): g from the stored logits.
    return loss, lse, logits_grad(logits.astype(_F32), t, lse, jnp.ones_like(lse), spec, dtype)


def _grad(operands, t, lse, scale, spec, config, dtype):
    logits = _fused_logits(operands, t, spec, config, store=True)[2]
    return logits_grad(logits.astype(_F32), t, lse, scale, spec, dtype)


# The loop hands the kernels (x_c, W, b) instead of logits: the matmul happens inside them.
CHUNK_KERNELS = chunked.ChunkKernels(loss=_loss, loss_and_grad=_loss_and_grad, grad=_grad, f32_logits=False, fused_matmul=True)


def _supports(x, weight, targets, bias=None, *, spec: LossSpec = LossSpec(), **options) -> str | None:
    del targets, bias, options, spec
    for name, a in (("x", x), ("weight", weight)):
        if jnp.dtype(a.dtype) not in _DTYPES:
            return f"{name} dtype {jnp.dtype(a.dtype).name} is not bfloat16/float16 (the wgmma kernel's inputs)"
    if jnp.dtype(x.dtype) != jnp.dtype(weight.dtype):
        return f"x ({jnp.dtype(x.dtype).name}) and weight ({jnp.dtype(weight.dtype).name}) dtypes differ"
    if x.size == 0:
        return "no tokens"
    h = weight.shape[0]
    if h % _TK:
        return f"hidden size {h} not supported: needs a multiple of {_TK}"
    return gpu_refusal(wgmma=True)


LINEAR_CROSS_ENTROPY = Implementation(
    fn=chunked.linear_cross_entropy_with(CHUNK_KERNELS, heuristic_config),
    platforms=("gpu",),
    interpretable=True,
    supports=_supports,
    config_type=LinearCrossEntropyPallasGpuConfig,
    heuristic_config=heuristic_config,
    candidate_configs=candidate_configs,
)
