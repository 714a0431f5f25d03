"""Gated MLP on Hopper GPUs: a Mosaic GPU dual-GEMM (TMA ring -> two wgmma accumulators) with
the gating in its epilogue.

Shapes (kernels/common/gated_mlp.py folds the leading axes and holds the custom_vjp): x
`[M, K]` (rows zero-padded to a multiple of 128), gate/up weights `[K, N]` each, or the fused
`[K, 2, N]` viewed in place as `[K, 2N]` (up columns at offset N). One CTA, one warpgroup,
owns a 128 x 64 output tile. Per K step of 64 a ring slot receives by TMA the x tile
(128 x 64) and the gate and up tiles (64 x 64 each; one barrier, three arrivals), and two
wgmmas add x @ w_gate and x @ w_up into two 128 x 64 f32 accumulators (128 registers per
thread for both). `wgmma_wait(1)` after issuing step k's pair retires every wgmma of step
k-1, whose slot is then refilled with step k-1+stages. Epilogue, in registers (WGMMA layout):

  forward:  h = act(gate) * up                               -> SMEM -> TMA -> h [M, N]
  backward: dh tile by TMA at the start; d_gate = dh * up * act'(gate), d_up = dh * act(gate)
            -> dpre [M, 2N] (columns c and N + c), and h when the down projection needs it.

The `[M, 2N]` pre-activations never reach memory in the forward. Tiles run in a 1-D grid
swizzled in groups of `group_m` row blocks so the CTAs resident together share x rows and
weight columns in L2. The backward's plain products (dx, dW, dh, dw_down) are XLA dots.
gelu's erf is a rational-exponential approximation (|error| < 1.5e-7; Mosaic GPU's default
lowering has no erf rule).

The forward has a second, warp-specialised form (`warp_specialized=True`, the default when N is a
multiple of `block_n`): a persistent grid (one CTA per SM, tiles dealt by warpgroups.Schedule),
a producer warpgroup streaming the x tile (128 x 64) and the gate and up tiles (64 x block_n
each) into the ring, and two consumer warpgroups of 64 rows each, so every wgmma is
64 x block_n x 16: the wider N halves the SMEM reads of x per FLOP against the one-warpgroup
kernel's 64-wide accumulators, and while one consumer waits on its wgmmas the other issues.
Each consumer retires a step's wgmmas one step late (`wgmma_wait(2)` after issuing the next
step's pair), then releases that step's slot.

Scope: bf16/f16, K and N multiples of 64 (others are refused: the XLA/Triton backends run them).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from forgeax.core.config import KernelConfig
from forgeax.core.registry import Implementation
from forgeax.core.runtime import interpret_enabled
from forgeax.kernels.common.gated_mlp import differentiable_gated_mlp, hidden_size
from forgeax.kernels.pallas.gpu import gpu_refusal, interpret_params, kernel_axis
from forgeax.kernels.pallas.gpu.warpgroups import (
    CLUSTER_AXIS, CTA, FIRST_NAMED_BARRIER, ROWS, WG_AXIS, WGS, Schedule, SlotFree, launch, warp_specialized)
from forgeax.kernels.pallas.interpret import without_effects

_F32 = jnp.float32
_BM = 128  # rows per CTA: one warpgroup's wgmma M
_BN = 64  # columns per accumulator: two 128 x 64 f32 accumulators = 128 registers/thread
_TK = 64  # K step: 64 bf16 = one 128-byte swizzled row
_SMEM_BYTES = 232448  # dynamic shared memory per CTA on Hopper
_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
_TILE_AXIS = kernel_axis("t")  # the grid: one CTA per output tile


@dataclasses.dataclass(frozen=True, kw_only=True)
class GatedMLPPallasGpuConfig(KernelConfig):
    """stages: depth of the TMA ring; group_m: row blocks per L2 group of the tile order.
    warp_specialized: the forward's persistent producer/consumer kernel (the backward always runs
    the one-warpgroup kernel); block_n: its columns per accumulator (64 or 128; two 64 x block_n
    f32 accumulators per consumer); named_barriers: its ring slots are released on hardware named
    barriers instead of mbarriers (GPU only; interpret mode has none; not with clusters);
    cluster_m: 2 runs pairs of row-adjacent tiles on a 2-CTA cluster that multicasts the shared
    gate/up tiles (each CTA fetches half), a third less L2 -> SMEM traffic per FLOP.
    SMEM: stages * 32 KiB + 16 KiB (one-warpgroup forward) or 64 KiB (backward);
    warp-specialised, stages * (16 + block_n / 4) KiB + block_n / 4 KiB."""

    stages: int = 4
    group_m: int = 16
    warp_specialized: bool = True
    block_n: int = 128
    named_barriers: bool = False
    cluster_m: int = 1

    def validate(self) -> None:
        super().validate()
        if self.stages < 2:
            raise ValueError(f"GatedMLPPallasGpuConfig.stages: expected >= 2, got {self.stages}")
        if self.cluster_m not in (1, 2):
            raise ValueError(f"GatedMLPPallasGpuConfig.cluster_m: expected 1 or 2, got {self.cluster_m}")
        if self.block_n not in (64, 128):
            raise ValueError(f"GatedMLPPallasGpuConfig.block_n: expected 64 or 128, got {self.block_n}")
        if self.stages * _stage_bytes(_BM, _BN, 2) + 4 * _BM * _BN * 2 + 1024 > _SMEM_BYTES:
            raise ValueError(f"GatedMLPPallasGpuConfig.stages: {self.stages} stages exceed {_SMEM_BYTES} B of shared memory")
        if self.warp_specialized and (self.stages * _stage_bytes(CTA, self.block_n, 2) + CTA * self.block_n * 2 + 1024
                                      > _SMEM_BYTES):
            raise ValueError(f"GatedMLPPallasGpuConfig: {self.stages} stages of block_n={self.block_n} exceed "
                             f"{_SMEM_BYTES} B of shared memory")


def _stage_bytes(rows: int, cols: int, itemsize: int) -> int:
    """One ring slot: the x tile (rows x _TK) and the gate and up tiles (_TK x cols each)."""
    return (rows * _TK + 2 * _TK * cols) * itemsize


def heuristic_config(x, w_gate, w_up, w_down=None, *, spec) -> GatedMLPPallasGpuConfig:
    del x, w_gate, w_up, w_down, spec
    return GatedMLPPallasGpuConfig()


def candidate_configs(x, w_gate, w_up, w_down=None, *, spec) -> list[GatedMLPPallasGpuConfig]:
    del x, w_gate, w_up, w_down, spec
    return ([GatedMLPPallasGpuConfig(stages=s, group_m=g, block_n=bn) for s in (3, 4) for g in (8, 16, 32)
             for bn in (64, 128)]
            + [GatedMLPPallasGpuConfig(stages=s, group_m=g, warp_specialized=False) for s in (3, 4, 5) for g in (8, 16)])


# ----------------------------------------------------------------------------- epilogue math


def _erf(z):
    # Abramowitz & Stegun 7.1.26: |error| < 1.5e-7.
    a = jnp.abs(z)
    t = 1.0 / (1.0 + 0.3275911 * a)
    poly = t * (0.254829592 + t * (-0.284496736 + t * (1.421413741 + t * (-1.453152027 + t * 1.061405429))))
    r = 1.0 - poly * jnp.exp(-a * a)
    return jnp.where(z < 0, -r, r)


def _act(g, activation: str):
    """(act(g), act'(g)) in f32, with only the elementwise ops Mosaic GPU lowers."""
    if activation == "silu":
        s = 1.0 / (1.0 + jnp.exp(-g))
        return g * s, s * (1.0 + g * (1.0 - s))
    if activation == "gelu":
        cdf = 0.5 * (1.0 + _erf(g * (1.0 / math.sqrt(2.0))))
        return g * cdf, cdf + g * jnp.exp(-0.5 * g * g) * (1.0 / math.sqrt(2.0 * math.pi))
    if activation == "gelu_tanh":
        c = math.sqrt(2.0 / math.pi)
        t = jnp.tanh(c * (g + 0.044715 * g * g * g))
        return 0.5 * g * (1.0 + t), 0.5 * (1.0 + t) + 0.5 * g * (1.0 - t * t) * c * (1.0 + 3 * 0.044715 * g * g)
    return jnp.maximum(g, 0.0), jnp.where(g > 0.0, 1.0, 0.0)


# ----------------------------------------------------------------------------- the kernels


def _tile_coords(t, blocks_m: int, blocks_n: int, group_m: int):
    """Tile id -> (row block, column block): groups of `group_m` row blocks, rows fastest inside
    a group, so the tiles running together share x rows and weight columns in L2."""
    per_group = group_m * blocks_n
    first_m = (t // per_group) * group_m
    size = jnp.minimum(blocks_m - first_m, group_m)
    return first_m + lax.rem(lax.rem(t, per_group), size), lax.div(lax.rem(t, per_group), size)



def _call(x, wg, wu, dh, *, n, up_offset, activation, want_h, config):
    """x [Mp, K], wg/wu the weight buffers ([K, N], or the same [K, 2N] twice with up_offset N),
    dh [Mp, N] or None (forward). Returns (h,) or (dpre [Mp, 2N], h if want_h)."""
    mp, k = x.shape
    dt = x.dtype
    backward = dh is not None
    stages, group_m = config.stages, config.group_m
    nk, blocks_m, blocks_n = k // _TK, mp // _BM, n // _BN
    swizzled = (plgpu.TilingTransform((8, _TK)), plgpu.SwizzleTransform(128))

    def kernel(*refs):
        x_g, wg_g, wu_g = refs[:3]
        dh_g = refs[3] if backward else None
        outs = refs[3 + backward:-1]
        a_s, g_s, u_s, loaded, epi_s, epi_bar = refs[-1]
        pid_m, pid_n = _tile_coords(lax.axis_index(_TILE_AXIS), blocks_m, blocks_n, group_m)
        rows = pl.ds(pl.multiple_of(pid_m * _BM, _BM), _BM)
        c0 = pl.multiple_of(pid_n * _BN, _BN)
        cols = pl.ds(c0, _BN)

        def fetch(step, slot):
            kk = pl.ds(step * _TK if isinstance(step, int) else pl.multiple_of(step * _TK, _TK), _TK)
            plgpu.copy_gmem_to_smem(x_g.at[rows, kk], a_s.at[slot], loaded.at[slot])
            plgpu.copy_gmem_to_smem(wg_g.at[kk, cols], g_s.at[slot], loaded.at[slot])
            plgpu.copy_gmem_to_smem(wu_g.at[kk, pl.ds(c0 + up_offset, _BN)], u_s.at[slot], loaded.at[slot])

        if backward:  # lands during the K loop
            plgpu.copy_gmem_to_smem(dh_g.at[rows, cols], epi_s.at[0], epi_bar)
        for s in range(min(stages, nk)):  # the prologue fills the ring
            fetch(s, s)

        def mac(acc_g, acc_u):
            def step(kstep, _):
                slot = lax.rem(kstep, stages)
                plgpu.barrier_wait(loaded.at[slot])
                plgpu.wgmma(acc_g, a_s.at[slot], g_s.at[slot])
                plgpu.wgmma(acc_u, a_s.at[slot], u_s.at[slot])
                plgpu.wgmma_wait(1)  # every wgmma of step k-1 retired: its slot may be refilled

                @pl.when((kstep >= 1) & (kstep - 1 + stages < nk))
                def _():
                    fetch(kstep - 1 + stages, lax.rem(kstep - 1, stages))

            lax.fori_loop(0, nk, step, None)
            return acc_g[...], acc_u[...]

        gate, up = pl.run_scoped(mac, plgpu.ACC((_BM, _BN), _F32), plgpu.ACC((_BM, _BN), _F32))
        a, da = _act(gate, activation)
        if not backward:
            epi_s.at[0][...] = (a * up).astype(dt)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(epi_s.at[0], outs[0].at[rows, cols])
        else:
            plgpu.barrier_wait(epi_bar)
            d = plgpu.load(epi_s.at[0], layout=plgpu.Layout.WGMMA).astype(_F32)
            epi_s.at[1][...] = (d * up * da).astype(dt)
            epi_s.at[2][...] = (d * a).astype(dt)
            if want_h:
                epi_s.at[3][...] = (a * up).astype(dt)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(epi_s.at[1], outs[0].at[rows, cols])
            plgpu.copy_smem_to_gmem(epi_s.at[2], outs[0].at[rows, pl.ds(c0 + n, _BN)])
            if want_h:
                plgpu.copy_smem_to_gmem(epi_s.at[3], outs[1].at[rows, cols])
        plgpu.wait_smem_to_gmem(0)

    epilogue_tiles = 4 if backward else 1
    scratch = (
        plgpu.SMEM((stages, _BM, _TK), dt, transforms=swizzled),
        plgpu.SMEM((stages, _TK, _BN), dt, transforms=swizzled),
        plgpu.SMEM((stages, _TK, _BN), dt, transforms=swizzled),
        plgpu.Barrier(num_arrivals=3, num_barriers=stages),
        plgpu.SMEM((epilogue_tiles, _BM, _BN), dt, transforms=swizzled),
        plgpu.Barrier(num_arrivals=1),
    )
    if not backward:
        out_type = (jax.ShapeDtypeStruct((mp, n), dt),)
    else:
        out_type = (jax.ShapeDtypeStruct((mp, 2 * n), dt),) + ((jax.ShapeDtypeStruct((mp, n), dt),) if want_h else ())
    call = plgpu.kernel(
        lambda *refs: kernel(*refs[:-len(scratch)], refs[-len(scratch):]),
        out_type=out_type,
        scratch_types=scratch,
        grid=(blocks_m * blocks_n,),
        grid_names=(_TILE_AXIS,),
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=interpret_params(),
    )
    if interpret_enabled():  # the interpreter's effects would block jax.checkpoint: hide them
        call = without_effects(call, out_type)
    return call(x, wg, wu, *((dh,) if backward else ()))


def _warp_specialized_forward(x, wg, wu, *, n, up_offset, activation, config):
    """h = act(x @ wg) * (x @ wu) [Mp, N] by the persistent producer/consumer kernel (module doc);
    x `[Mp, K]` with Mp a multiple of CTA * cluster_m (whole clusters of row tiles)."""
    mp, k = x.shape
    dt = x.dtype
    bn, stages, interpret, cm = config.block_n, config.stages, interpret_enabled(), config.cluster_m
    nk, blocks_m, blocks_n = k // _TK, mp // (CTA * cm), n // bn
    schedule = Schedule.of(lambda t: jnp.int32(nk), (blocks_m * blocks_n, 1, 1), persistent=True, interpret=interpret,
                           cluster=cm)
    swizzled = (plgpu.TilingTransform((8, _TK)), plgpu.SwizzleTransform(128))
    shared = dict(collective_axes=CLUSTER_AXIS) if cm > 1 else {}  # the weight tiles' multicast

    def kernel(x_g, wg_g, wu_g, table_ref, h_g, x_s, g_s, u_s, h_s, loaded, free):
        wg_id = lax.axis_index(WG_AXIS)
        ring = SlotFree(free, stages, FIRST_NAMED_BARRIER, named=config.named_barriers and cm == 1 and not interpret)
        total = schedule.count(table_ref) * nk  # ring uses of this CTA (and of its cluster's other)
        cta_row = lax.axis_index(CLUSTER_AXIS) * CTA if cm > 1 else 0

        def corner(t):
            if isinstance(t, tuple):  # one CTA (cluster) per tile: its grid indices (tile id, 0, 0)
                t = t[0]
            pid_m, pid_n = _tile_coords(t, blocks_m, blocks_n, config.group_m)
            return pl.multiple_of(pid_m * CTA * cm + cta_row, CTA), pl.multiple_of(pid_n * bn, bn)

        def consumer():
            own = pl.ds(pl.multiple_of(wg_id * ROWS, ROWS), ROWS)
            ring.prime(total)

            def one_tile(kk, t, base):
                r0, c0 = corner(t)

                def mac(acc_g, acc_u):
                    def step(i, _):
                        slot = lax.rem(base + i, stages)
                        plgpu.barrier_wait(loaded.at[slot])
                        plgpu.wgmma(acc_g, x_s.at[slot].at[own], g_s.at[slot])
                        plgpu.wgmma(acc_u, x_s.at[slot].at[own], u_s.at[slot])
                        plgpu.wgmma_wait(2)  # step i-1's pair retired: its slot may be refilled

                        @pl.when(i >= 1)
                        def _():
                            ring.release(lax.rem(base + i - 1, stages), base + i - 1, total)

                    lax.fori_loop(0, nk, step, None)
                    gate, up = acc_g[...], acc_u[...]  # waits for the last pair
                    ring.release(lax.rem(base + nk - 1, stages), base + nk - 1, total)
                    return gate, up

                gate, up = pl.run_scoped(mac, plgpu.ACC((ROWS, bn), _F32), plgpu.ACC((ROWS, bn), _F32))
                h = (_act(gate, activation)[0] * up).astype(dt)
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the previous tile's store has read h_s
                h_s.at[wg_id][...] = h
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(h_s.at[wg_id], h_g.at[pl.ds(r0 + wg_id * ROWS, ROWS), pl.ds(c0, bn)])
                return base + nk

            return one_tile

        def producer():
            def one_tile(kk, t, base):
                r0, c0 = corner(t)

                def load(i, _):
                    slot = lax.rem(base + i, stages)
                    ring.acquire(slot, base + i)
                    kb = pl.ds(pl.multiple_of(i * _TK, _TK), _TK)
                    plgpu.copy_gmem_to_smem(x_g.at[pl.ds(r0, CTA), kb], x_s.at[slot], loaded.at[slot])
                    plgpu.copy_gmem_to_smem(wg_g.at[kb, pl.ds(c0, bn)], g_s.at[slot], loaded.at[slot], **shared)
                    plgpu.copy_gmem_to_smem(wu_g.at[kb, pl.ds(c0 + up_offset, bn)], u_s.at[slot], loaded.at[slot],
                                            **shared)

                lax.fori_loop(0, nk, load, None)
                return base + nk

            return one_tile

        warp_specialized(wg_id, schedule, table_ref, consumer, producer)

    scratch = [
        plgpu.SMEM((stages, CTA, _TK), dt, transforms=swizzled),
        plgpu.SMEM((stages, _TK, bn), dt, transforms=swizzled),
        plgpu.SMEM((stages, _TK, bn), dt, transforms=swizzled),
        plgpu.SMEM((WGS, ROWS, bn), dt, transforms=swizzled),
    ]
    # A slot is free once every consumer of the cluster has read it: the other CTA's producer
    # multicasts into it too.
    free = (plgpu.ClusterBarrier(collective_axes=(CLUSTER_AXIS,), num_arrivals=WGS, num_barriers=stages) if cm > 1
            else plgpu.Barrier(num_arrivals=WGS, num_barriers=stages))
    bars = [plgpu.Barrier(num_arrivals=3, num_barriers=stages), free]
    out_type = jax.ShapeDtypeStruct((mp, n), dt)
    call = launch("gated_mlp_fwd", kernel, scratch, bars, out_type, schedule, interpret, row_reductions_only=True,
                  cluster=cm)
    if interpret:  # the interpreter's effects would block jax.checkpoint: hide them
        call = without_effects(call, out_type)
    return call(x, wg, wu, schedule.input())


def _operands(x, w_gate, w_up, row_multiple: int = _BM):
    m, k = x.shape
    n = hidden_size(w_gate, w_up)
    mp = -(-m // row_multiple) * row_multiple
    xp = x if mp == m else jnp.pad(x, ((0, mp - m), (0, 0)))
    if w_up is None:
        w = w_gate.reshape(k, 2 * n)
        return m, n, xp, w, w, n
    return m, n, xp, w_gate, w_up, 0


def forward(x, w_gate, w_up, *, activation, config):
    n = hidden_size(w_gate, w_up)
    warp_specialized = config.warp_specialized and n % config.block_n == 0
    rows = CTA * config.cluster_m if warp_specialized else _BM
    m, n, xp, wg, wu, off = _operands(x, w_gate, w_up, rows)
    if warp_specialized:
        h = _warp_specialized_forward(xp, wg, wu, n=n, up_offset=off, activation=activation, config=config)
    else:
        (h,) = _call(xp, wg, wu, None, n=n, up_offset=off, activation=activation, want_h=False, config=config)
    return h[:m]


def backward(x, w_gate, w_up, dh, *, activation, config, want_h):
    m, n, xp, wg, wu, off = _operands(x, w_gate, w_up)
    dh = dh.astype(x.dtype)
    if xp.shape[0] != m:
        dh = jnp.pad(dh, ((0, xp.shape[0] - m), (0, 0)))
    outs = _call(xp, wg, wu, dh, n=n, up_offset=off, activation=activation, want_h=want_h, config=config)
    return outs[0][:m], (outs[1][:m] if want_h else None)


_DIFFERENTIABLE = differentiable_gated_mlp(forward, backward, n_multiple=_BN)  # N split in whole column tiles


def gated_mlp(x, w_gate, w_up, w_down=None, *, spec, config: GatedMLPPallasGpuConfig):
    return _DIFFERENTIABLE(x, w_gate, w_up, w_down, spec, config)


def supports(x, w_gate, w_up, w_down=None, *, spec) -> str | None:
    del w_down, spec
    if jnp.dtype(x.dtype) not in _DTYPES:
        return f"x dtype {jnp.dtype(x.dtype).name} is not bfloat16/float16 (the wgmma kernel's inputs)"
    if math.prod(x.shape[:-1]) == 0:
        return "no rows (x has an empty leading axis)"
    k, n = int(x.shape[-1]), hidden_size(w_gate, w_up)
    if k % _TK or n % _BN:
        return f"K={k}, N={n}: the wgmma kernel needs multiples of {_TK} (K) and {_BN} (N)"
    return gpu_refusal(wgmma=True)


GATED_MLP = Implementation(
    fn=gated_mlp,
    platforms={"gpu"},
    interpretable=True,
    supports=supports,
    config_type=GatedMLPPallasGpuConfig,
    heuristic_config=heuristic_config,
    candidate_configs=candidate_configs,
)
