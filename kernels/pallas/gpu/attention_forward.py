"""The pallas_gpu attention forward: one CTA = 128 query rows of one (b, n), 3 warpgroups.

WG 0 and WG 1 (consumers) each own 64 query rows: Q via TMA into SMEM, then per key block j
    s = (q k_j^T) * scale * log2(e)          (soft cap: cap*tanh(scale*qk/cap)*log2(e))
    m' = max(m, rowmax s);  p = exp2(s - m');  l = l*exp2(m - m') + rowsum p
    acc = acc*exp2(m - m') + p v_j            (p cast to the input dtype, wgmma from registers)
and finally out = acc / l (0 where l = 0), lse = (m + log2 l) * ln 2 (-inf where l = 0), written
through SMEM with TMA stores. Without a soft cap the scale stays out of s: one FMA and one exp2
per score. WG 2 (producer) streams K and V blocks into a ring of SMEM slots.

Schedules (FlashAttention-3, Shah et al. 2024), chosen by `AttentionConfig`:
  * sequential: per block Q K^T, softmax, P V; the two consumers ping-pong on named barriers,
    one running its softmax while the other has the tensor cores;
  * overlapped (`overlap`): a WG also runs block j's softmax while its own P_{j-1} V_{j-1} is in
    flight (intra-warpgroup overlap; needs the registers of head_dim <= 128);
  * flat (`flat_forward`, persistent grids): the overlapped schedule as one software pipeline
    over all of a CTA's tiles, a tile's first Q K^T issued with the previous tile's last P V;
  * grid: one CTA per tile, or persistent (`persistent`: one CTA per SM running the tiles
    `balance` gives it, in tile order).
Only the key blocks a query block can see are visited (`Band`); the blocks every row fully sees
skip the mask (`three_loops`). With segment ids the range narrows further to the tile's reach.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from forgeax.core.runtime import interpret_enabled
from forgeax.kernels.pallas.gpu.attention_tiles import (
    LN2, SMEM_BUDGET, SMEM_LIMIT, Band, Tails, Tile, allowed, block_transforms, key_block_producer, ring_stages,
    scores, exp2_scaled, segment_ids, segment_inputs, staging_and_segment_buffers, tails_of, three_loops, tile_schedule,
)
from forgeax.kernels.pallas.gpu.warpgroups import (
    CTA, F32, FIRST_NAMED_BARRIER, ROWS, WG_AXIS, WGS, Mma, PingPong, SlotFree, bcast, full_rows, i32, launch,
    warp_specialized, zeros,
)

if TYPE_CHECKING:
    from forgeax.kernels.pallas.gpu.attention import AttentionConfig


def forward(q, k, v, bias, mask, q_segment_ids, kv_segment_ids, dropout_seed, spec, config: AttentionConfig):
    """(out, lse) of the contract (kernels/common/attention.py) for the schedules `config` picks."""
    del bias, mask, dropout_seed  # refused by `supports`
    tails = tails_of(q, k, v)
    out, lse = _flash_forward(tails.tma_rows(q), tails.tma_cols(k), tails.tma_cols(v, value=True),
                              *tails.ids(q_segment_ids, kv_segment_ids), spec, tails, config)
    return tails.real_rows(out, tails.Hv), lse[:, :, :tails.T]


def _flash_forward(q, k, v, q_segment_ids, kv_segment_ids, spec, tails: Tails, config: AttentionConfig):
    """(out [B, Tq, N, Hv] for q [B, Tq, N, H] and v [B, Sk, K, Hv], lse [B, N, T] over whole
    tiles, `Tails`)."""
    B, _, N, H = q.shape
    K, Hv = k.shape[2], v.shape[3]
    T, S = tails.T_padded, tails.S_padded  # the tiles' extent; q, k may end before (`Tails`)
    G, dt = N // K, q.dtype
    bkv = 128 if H <= 128 else 64
    item = jnp.dtype(dt).itemsize
    segmented = q_segment_ids is not None
    per_stage = bkv * (H + Hv) * item + (4 * bkv if segmented else 0)
    q_bytes, out_bytes = CTA * H * item, CTA * Hv * item
    band = Band.forward(spec, tails)
    interpret = interpret_enabled()
    overlap = config.overlap
    q_tiles = T // CTA

    def tile_at(t, reach=None) -> Tile:
        tl = Tile.of(t, (N, q_tiles, B), band, bkv, S, last_first=True, reach=reach)
        if overlap:
            # The overlapped schedule peels the first block: a tile whose rows see no key (causal
            # with T > S, windows) still visits one block, fully masked (zero output, lse -inf).
            lo = jnp.minimum(tl.lo, S // bkv - 1)
            tl = dataclasses.replace(tl, lo=lo, hi=jnp.maximum(tl.hi, lo + 1))
        return tl

    schedule = tile_schedule(lambda t: tile_at(t).steps, (N, q_tiles, B), segmented, interpret, config.persistent)
    # One pipeline over the CTA's tiles: two Q buffers per warpgroup (the next tile's Q lands
    # while the current one's are read), a separate output buffer, two ring stages and the lse
    # rows (CTA * 4), with 1 KB left for the barriers and the buffers' alignment.
    flat = (overlap and config.flat_forward and schedule.table is not None and not segmented
            and 2 * q_bytes + out_bytes + 2 * per_stage + CTA * 4 <= SMEM_LIMIT - 1024)
    q_slots = 2 if flat else 1
    # A separate output buffer lets a consumer load its next Q tile before its last P V; where
    # it would leave fewer than 2 ring stages (H = 256) the output goes out through Q's buffer.
    separate_out = flat or SMEM_BUDGET - q_bytes - out_bytes >= 2 * per_stage
    assert separate_out or Hv == H, "an output narrower than Q needs its own buffer (`kernel_head_dims`)"
    stages = 2 if flat else ring_stages(per_stage, q_bytes + (out_bytes if separate_out else 0))

    kernel = _ForwardKernel(spec, band, tile_at, schedule, H=H, Hv=Hv, G=G, bkv=bkv, stages=stages, dt=dt,
                            segmented=segmented, interpret=interpret, overlap=overlap, flat=flat,
                            separate_out=separate_out)

    tr = block_transforms(dt, H, Hv)

    scratch = [
        plgpu.SMEM((q_slots * WGS, ROWS, H), dt, transforms=tr),
        plgpu.SMEM((WGS, ROWS, Hv), dt, transforms=tr) if separate_out else None,
        plgpu.SMEM((stages, bkv, H), dt, transforms=tr),
        plgpu.SMEM((stages, bkv, Hv), dt, transforms=tr),
        plgpu.SMEM((WGS, ROWS), F32),
        *staging_and_segment_buffers(dt, bkv, stages, interpret, segmented),
    ]
    ids = 1 if segmented else 0  # one more TMA copy per barrier use: the segment ids
    bars = [
        plgpu.Barrier(num_arrivals=1 + ids, num_barriers=q_slots * WGS),
        plgpu.Barrier(num_arrivals=1 + ids, num_barriers=stages),
        plgpu.Barrier(num_barriers=stages),
        plgpu.Barrier(num_arrivals=WGS, num_barriers=stages),
        plgpu.Barrier(num_arrivals=WGS, num_barriers=stages),
    ]
    out_type = (jax.ShapeDtypeStruct(q.shape[:3] + (Hv,), dt), jax.ShapeDtypeStruct((B, N, T), F32))
    # Its reductions are the softmax's row max and sum (`row_reductions_only`).
    out, lse = launch("attention_fwd", kernel, scratch, bars, out_type, schedule, interpret, row_reductions_only=flat)(
        q, k, v, schedule.input(), *segment_inputs(q_segment_ids, kv_segment_ids))
    return out, lse


class _ForwardKernel:
    """The forward kernel of one call: its static choices (from `_flash_forward`) and, once Pallas
    calls it with the kernel's refs, the schedules its consumer and producer warpgroups run."""

    def __init__(self, spec, band: Band, tile_at, schedule, *, H: int, Hv: int, G: int, bkv: int, stages: int, dt,
                 segmented: bool, interpret: bool, overlap: bool, flat: bool, separate_out: bool):
        self.spec, self.band, self.tile_at, self.schedule = spec, band, tile_at, schedule
        self.H, self.Hv, self.G, self.bkv, self.stages, self.dt = H, Hv, G, bkv, stages, dt
        self.segmented, self.interpret, self.overlap, self.flat, self.separate_out = (
            segmented, interpret, overlap, flat, separate_out)

    def __call__(self, q_ref, k_ref, v_ref, table_ref, row_ids_ref, col_ids_ref, reach_ref, out_ref, lse_ref,
                 q_smem, o_smem, k_smem, v_smem, lse_smem, stage, row_ids_smem, col_ids_smem,
                 q_bar, k_bar, v_bar, k_free, v_free):
        self.q_ref, self.k_ref, self.v_ref, self.table_ref = q_ref, k_ref, v_ref, table_ref
        self.row_ids_ref, self.col_ids_ref, self.out_ref, self.lse_ref = row_ids_ref, col_ids_ref, out_ref, lse_ref
        self.q_smem, self.o_smem, self.k_smem, self.v_smem, self.lse_smem = q_smem, o_smem, k_smem, v_smem, lse_smem
        self.stage, self.row_ids_smem, self.col_ids_smem = stage, row_ids_smem, col_ids_smem
        self.q_bar, self.k_bar, self.v_bar = q_bar, k_bar, v_bar
        self.wg = lax.axis_index(WG_AXIS)
        self.tile = functools.partial(self.tile_at, reach=reach_ref if self.segmented else None)
        # K/V ring uses are numbered across this CTA's tiles: key block j of a tile is use
        # g = base + j - lo (`Schedule.run`).
        self.k_ring = SlotFree(k_free, self.stages, FIRST_NAMED_BARRIER, not self.interpret)
        self.v_ring = SlotFree(v_free, self.stages, self.k_ring.next_id, not self.interpret)
        self.sched = PingPong(self.wg, self.v_ring.next_id, not self.interpret)
        warp_specialized(self.wg, self.schedule, table_ref, self.flat_consumer if self.flat else self.consumer,
                         lambda: key_block_producer(self.tile, self.G, self.stages, self.copy_block))

    def col_ids_at(self, slot, masked: bool):
        """Segment ids of the key block in ring slot `slot` (WGMMA column layout), for masked
        steps: read before the slot is released."""
        return segment_ids(self.col_ids_smem, slot, 0) if masked else None

    def softmax(self, s, m, l, rows, j, masked, ids):
        """Online softmax of key block j: (p, m', l', alpha) with m' = max(m, rowmax s),
        p = exp2(s - m'), alpha = exp2(m - m'), l' = l alpha + rowsum p (log2 domain).
        ids: (row, column) segment ids, or (None, None)."""
        s, c = scores(s, self.spec)
        if masked:
            s = jnp.where(allowed(self.band, rows, j * self.bkv, s.shape, *ids), s, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(s, axis=1) * c)
        m_use = m_new
        if masked:  # a row may have seen no key yet: keep exp2 away from -inf - -inf
            m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        alpha = jnp.exp2(m - m_use)
        p = exp2_scaled(s, c, bcast(m_use, s.shape, 0))
        return p, m_new, l * alpha + jnp.sum(p, axis=1), alpha

    def last_pv(self, mma, acc, p16, g, total):
        """The overlapped schedule's closing P V (ring use g) in the warpgroup's last turn: WG 1
        started with a handover, so it skips its last one and the arrivals pair up."""
        last = lax.rem(g, i32(self.stages))
        plgpu.barrier_wait(self.v_bar.at[last])
        self.sched.turn()
        acc = mma(p16, self.v_smem.at[last], (ROWS, self.Hv), acc=acc, a_in_regs=True,
                  after_issue=lambda: pl.when(self.wg == 0)(self.sched.handover))
        self.v_ring.release(last, g, total)
        return acc

    def sequential(self, tl, base, total, rows, row_ids, q_s, mma, m, l, q_free):
        """Ping-pong per block: Q K_j^T, softmax, P_j V_j; a WG waits for its turn before P V."""
        pl.when(self.wg == 1)(self.sched.turn)  # WG 1 starts one turn behind

        def step(j, carry, masked):
            acc, m, l = carry
            g = base + j - tl.lo
            slot = lax.rem(g, i32(self.stages))
            plgpu.barrier_wait(self.k_bar.at[slot])
            col_ids = self.col_ids_at(slot, masked)
            s = mma(q_s, self.k_smem.at[slot].transpose((1, 0)), (ROWS, self.bkv), after_issue=self.sched.handover)
            self.k_ring.release(slot, g, total)
            p, m, l_new, alpha = self.softmax(s, m, l, rows, j, masked, (row_ids, col_ids))
            acc = acc * bcast(alpha, acc.shape, 0)
            p16 = p.astype(self.dt)
            if self.H <= 128:  # finish the softmax before handing over the tensor cores
                l = l_new
                acc, l, m, p16 = lax.optimization_barrier((acc, l, m, p16))
            plgpu.barrier_wait(self.v_bar.at[slot])
            self.sched.turn()
            if self.H > 128:
                l = l_new
            acc = mma(p16, self.v_smem.at[slot], (ROWS, self.Hv), acc=acc, a_in_regs=True)
            self.v_ring.release(slot, g, total)
            return acc, m, l

        carry = (zeros((ROWS, self.Hv)), m, l)
        acc, m, l = three_loops(tl.lo, tl.full_lo, tl.full_hi, tl.hi, step, carry, self.band, self.segmented)
        pl.when(self.wg == 0)(self.sched.handover)  # WG 1's last turn
        q_free()
        return acc, m, l

    def overlapped(self, tl, base, total, rows, row_ids, q_s, mma, m, l, q_free):
        """FA3's schedule: in its turn a WG issues Q K_j^T and P_{j-1} V_{j-1} together, hands
        the tensor cores over, runs block j's softmax while its P V is still in flight, then
        rescales. Interpret mode runs the same order synchronously."""
        pl.when(self.wg == 1)(self.sched.handover)  # WG 0 takes the first turn
        first_slot = lax.rem(base, i32(self.stages))
        plgpu.barrier_wait(self.k_bar.at[first_slot])
        first_masked = self.band.masks or self.segmented
        col_ids = self.col_ids_at(first_slot, first_masked)
        self.sched.turn()
        s = mma(q_s, self.k_smem.at[first_slot].transpose((1, 0)), (ROWS, self.bkv), after_issue=self.sched.handover)
        self.k_ring.release(first_slot, base, total)
        p, m, l, _ = self.softmax(s, m, l, rows, tl.lo, first_masked, (row_ids, col_ids))

        def step(j, carry, masked):
            acc, m, l, p_prev = carry
            g = base + j - tl.lo
            slot, prev = lax.rem(g, i32(self.stages)), lax.rem(g - 1, i32(self.stages))
            plgpu.barrier_wait(self.k_bar.at[slot])
            col_ids = self.col_ids_at(slot, masked)
            plgpu.barrier_wait(self.v_bar.at[prev])
            self.sched.turn()

            def between(s):  # runs while P_{j-1} V_{j-1} is in flight
                self.k_ring.release(slot, g, total)
                p, m_new, l_new, alpha = self.softmax(s, m, l, rows, j, masked, (row_ids, col_ids))
                return p.astype(self.dt), m_new, l_new, alpha

            acc, (p16, m, l, alpha) = mma.overlapped(
                q_s, self.k_smem.at[slot].transpose((1, 0)), (ROWS, self.bkv), p_prev, self.v_smem.at[prev], acc,
                between, (p_prev, m, l, m), after_issue=self.sched.handover)
            self.v_ring.release(prev, g - 1, total)
            return acc * bcast(alpha, acc.shape, 0), m, l, p16

        first = tl.lo + 1  # block lo was the prologue
        mid_lo = jnp.maximum(tl.full_lo, first)
        acc, m, l, p16 = three_loops(first, mid_lo, jnp.maximum(tl.full_hi, mid_lo), tl.hi, step,
                                      (zeros((ROWS, self.Hv)), m, l, p.astype(self.dt)), self.band, self.segmented)
        q_free()  # every Q K^T of this tile is done
        return self.last_pv(mma, acc, p16, base + tl.steps - 1, total), m, l

    def store_tile(self, tl, acc, m, l, o_s, wait: bool):
        """A finished tile's rows acc / l and lse = (m + log2 l) ln 2 (-inf and 0 for rows that
        saw no key) out by TMA through o_s and lse_smem; wait: for the previous tile's stores
        to have read them first."""
        seen = l > 0.0
        inv = jnp.where(seen, 1.0 / jnp.where(seen, l, 1.0), 0.0)
        if wait:
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)
        o_s[...] = (acc * bcast(inv, acc.shape, 0)).astype(self.dt)
        self.lse_smem.at[self.wg][...] = jnp.where(seen, (m + jnp.log2(jnp.where(seen, l, 1.0))) * LN2, -jnp.inf)
        plgpu.commit_smem()
        rows = pl.ds(tl.r0 + self.wg * ROWS, ROWS)
        plgpu.copy_smem_to_gmem(o_s, self.out_ref.at[tl.b, rows, tl.n])
        plgpu.copy_smem_to_gmem(self.lse_smem.at[self.wg], self.lse_ref.at[tl.b, tl.n, rows])

    def consumer(self):
        q_s = self.q_smem.at[self.wg]
        o_s = self.o_smem.at[self.wg] if self.separate_out else q_s
        mma = Mma(self.interpret, None if self.stage is None else self.stage.at[self.wg])
        total = self.schedule.total(self.table_ref, lambda t: self.tile(t).steps)
        self.k_ring.prime(total)
        self.v_ring.prime(total)

        def load_q(kk):
            tl = self.tile(self.schedule.tile(self.table_ref, kk))
            rows = (tl.b, pl.ds(tl.r0 + self.wg * ROWS, ROWS), tl.n)
            plgpu.copy_gmem_to_smem(self.q_ref.at[rows], q_s, self.q_bar.at[self.wg])
            if self.segmented:
                plgpu.copy_gmem_to_smem(self.row_ids_ref.at[rows[:2]], self.row_ids_smem.at[self.wg],
                                        self.q_bar.at[self.wg])

        load_q(0)

        def one_tile(kk, t, base):
            tl = self.tile(t)
            rows = tl.r0 + self.wg * ROWS
            prefetch = lambda: pl.when(self.schedule.has_next(self.table_ref, kk))(functools.partial(load_q, kk + 1))
            if self.schedule.table is not None:
                self.sched.realign()
            plgpu.barrier_wait(self.q_bar.at[self.wg])
            row_ids = segment_ids(self.row_ids_smem, self.wg, 1)
            loop = self.overlapped if self.overlap else self.sequential
            acc, m, l = loop(tl, base, total, rows, row_ids, q_s, mma, full_rows(ROWS, -jnp.inf, 1),
                             full_rows(ROWS, 0.0, 1), prefetch if self.separate_out else lambda: None)
            self.store_tile(tl, acc, m, l, o_s, self.separate_out)
            if not self.separate_out:  # Q's buffer holds the output until the store has read it
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                prefetch()
            return base + tl.steps

        return one_tile

    def flat_consumer(self):
        """Every tile of this CTA in one software pipeline: `overlapped` carried across tiles.
        Tile kk's first Q K^T is issued with tile kk-1's last P V, its softmax (from fresh row
        statistics) runs while that P V is in flight, and then tile kk-1's rows are stored, so
        the tensor cores keep the other warpgroup's work at a tile boundary. Q alternates
        between two buffers per warpgroup (the next tile's lands while this one's are read);
        the warpgroups ping-pong from the CTA's first block to its last without meeting."""
        mma = Mma(self.interpret, None if self.stage is None else self.stage.at[self.wg])
        o_s = self.o_smem.at[self.wg]
        tiles = self.schedule.count(self.table_ref)
        tile_of = lambda kk: self.tile(self.schedule.tile(self.table_ref, kk))
        total = self.schedule.total(self.table_ref, lambda t: self.tile(t).steps)
        self.k_ring.prime(total)
        self.v_ring.prime(total)
        q_buf = lambda kk: lax.rem(kk, i32(2)) * WGS + self.wg
        fresh = lambda: (full_rows(ROWS, -jnp.inf, 1), full_rows(ROWS, 0.0, 1))

        def load_q(kk):
            tl = tile_of(kk)
            plgpu.copy_gmem_to_smem(self.q_ref.at[tl.b, pl.ds(tl.r0 + self.wg * ROWS, ROWS), tl.n],
                                    self.q_smem.at[q_buf(kk)], self.q_bar.at[q_buf(kk)])

        def step(tl, kk, base, j, carry, masked, first=False):
            """Block j of tile kk with the previous ring use's P V in flight: (acc + P V, then
            block j's p16, m', l', alpha). first: block j starts the tile (fresh m and l)."""
            acc, m, l, p_prev = carry
            g = base + j - tl.lo
            slot, prev = lax.rem(g, i32(self.stages)), lax.rem(g - 1, i32(self.stages))
            if first:
                plgpu.barrier_wait(self.q_bar.at[q_buf(kk)])
                m, l = fresh()
            plgpu.barrier_wait(self.k_bar.at[slot])
            plgpu.barrier_wait(self.v_bar.at[prev])
            self.sched.turn()

            def between(s):  # runs while the previous P V is in flight
                self.k_ring.release(slot, g, total)
                p, m_new, l_new, alpha = self.softmax(s, m, l, tl.r0 + self.wg * ROWS, j, masked, (None, None))
                return p.astype(self.dt), m_new, l_new, alpha

            acc, (p16, m, l, alpha) = mma.overlapped(
                self.q_smem.at[q_buf(kk)], self.k_smem.at[slot].transpose((1, 0)), (ROWS, self.bkv), p_prev,
                self.v_smem.at[prev], acc, between, (p_prev, m, l, m), after_issue=self.sched.handover)
            self.v_ring.release(prev, g - 1, total)
            return acc, p16, m, l, alpha

        def rest(tl, kk, base, carry):
            """Blocks lo + 1 .. hi - 1 of tile kk."""
            def body(j, carry, masked):
                acc, p16, m, l, alpha = step(tl, kk, base, j, carry, masked)
                return acc * bcast(alpha, acc.shape, 0), m, l, p16

            first = tl.lo + 1
            mid_lo = jnp.maximum(tl.full_lo, first)
            return three_loops(first, mid_lo, jnp.maximum(tl.full_hi, mid_lo), tl.hi, body, carry, self.band)

        def next_tile(kk, state):
            carry, base = state
            tl = tile_of(kk)
            acc, p16, m, l, _ = step(tl, kk, base, tl.lo, carry, self.band.masks, first=True)
            # Into tile kk - 1's Q buffer: its Q K^Ts are done.
            pl.when(kk + 1 < tiles)(functools.partial(load_q, kk + 1))
            self.store_tile(tile_of(kk - 1), acc, carry[1], carry[2], o_s, True)
            return rest(tl, kk, base, (zeros((ROWS, self.Hv)), m, l, p16)), base + tl.steps

        load_q(i32(0))
        pl.when(tiles > 1)(functools.partial(load_q, i32(1)))
        pl.when(self.wg == 1)(self.sched.handover)  # WG 0 takes the first turn
        tl = tile_of(i32(0))  # its first block: Q K^T alone
        plgpu.barrier_wait(self.q_bar.at[q_buf(i32(0))])
        plgpu.barrier_wait(self.k_bar.at[0])
        self.sched.turn()
        s = mma(self.q_smem.at[q_buf(i32(0))], self.k_smem.at[0].transpose((1, 0)), (ROWS, self.bkv),
                after_issue=self.sched.handover)
        self.k_ring.release(i32(0), i32(0), total)
        p, m, l, _ = self.softmax(s, *fresh(), tl.r0 + self.wg * ROWS, tl.lo, self.band.masks, (None, None))
        carry = rest(tl, i32(0), i32(0), (zeros((ROWS, self.Hv)), m, l, p.astype(self.dt)))
        carry, _ = lax.fori_loop(1, tiles, next_tile, (carry, tl.steps))
        acc, m, l, p16 = carry
        acc = self.last_pv(mma, acc, p16, total - 1, total)
        self.store_tile(tile_of(tiles - 1), acc, m, l, o_s, True)

    def copy_block(self, tl, kh, i, g, slot):
        keys = (tl.b, pl.ds((tl.lo + i) * self.bkv, self.bkv), kh)
        self.k_ring.acquire(slot, g)
        plgpu.copy_gmem_to_smem(self.k_ref.at[keys], self.k_smem.at[slot], self.k_bar.at[slot])
        if self.segmented:
            plgpu.copy_gmem_to_smem(self.col_ids_ref.at[keys[:2]], self.col_ids_smem.at[slot], self.k_bar.at[slot])
        self.v_ring.acquire(slot, g)
        plgpu.copy_gmem_to_smem(self.v_ref.at[keys], self.v_smem.at[slot], self.v_bar.at[slot])
