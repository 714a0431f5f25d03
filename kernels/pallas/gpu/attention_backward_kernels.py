"""The pallas_gpu attention backward kernels: dQ, dK/dV and dq-from-dz^T.

attention_backward.py picks and chains them (`backward`). lse * log2(e) is a plain jnp op there;
delta = rowsum(dO * O) - dlse comes from XLA or, in `_dq`, from the dQ kernel itself
(`delta_in_dq_kernel`). Per tile, on the kernels' 128-row CTA (two consumer warpgroups of 64
rows, one producer streaming a ring of SMEM slots):
  * dQ (`_dq`): 128 query rows of one (b, n); K/V blocks of `dq_block_kv` keys streamed:
        p = exp2(s - lse);  dp = dO v^T;  ds = p (dp - delta);  dq += ds k.
  * dK/dV (`_dkv`): 128 keys of one (b, kv head); each consumer owns 64 keys (K, V in SMEM) and
    loops over the G query heads of its group and the query blocks that see its keys:
        pT = exp2(s^T - lse);  dv += pT dO;  dpT = v dO^T;  dsT = pT (dpT - delta);  dk += dsT q
    dk, dv stay in registers for the whole loop (deterministic; GQA groups summed in-kernel). Two
    step orders: FA3's (both score wgmmas, then both gradient wgmmas; `dkv_fa3_order`) or three
    waits. At head_dim > 128 dk and dv may take a launch each (`one_dkv_launch`).
  * dz^T tiles (`dz_tiles`): the dK/dV kernel also TMA-stores every dz^T tile it computes,
    packed to the (128 keys, 64 queries) pairs the band lets meet (`PackedTiles`), and
    `_dq_from_dz` computes dq = scale * dz k with one wgmma per key block: 5 matmuls per block
    in all instead of 7, at the cost of the tiles' HBM traffic and memory. Both may cover one
    chunk of query heads (`HeadChunk`; `_dkv` carries its f32 sums from chunk to chunk).
dq is not fused into the dK/dV kernel with float atomics (FA3's one-pass form): the dz^T tiles
give the same 5 matmuls deterministically. Measurements behind each choice: docs/performance.md.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from forgeax.core.runtime import interpret_enabled
from forgeax.kernels.common.attention_chunks import HeadChunk
from forgeax.kernels.pallas.gpu.attention_tiles import (
    Band, PackedTiles, Tails, Tile, allowed, backward_barriers, block_transforms, cap_grad, exp2_scaled,
    key_block_producer, ring_stages, scores, segment_ids, segment_inputs, staging_and_segment_buffers, three_loops,
    tile_schedule,
)
from forgeax.kernels.pallas.gpu.warpgroups import (
    CTA, F32, FIRST_NAMED_BARRIER, ROWS, WG_AXIS, WGS, Mma, SlotFree, bcast, i32, launch, warp_specialized, zeros,
)

if TYPE_CHECKING:
    from forgeax.kernels.pallas.gpu.attention import AttentionConfig


def _dkv_query_block(H: int, parts: tuple[str, ...], dk_query_block: int = 32) -> int:
    """The dK/dV kernel's query block for q/k head dim H computing `parts` (see `_dkv`): 64 at
    H <= 128; above, 32 for dk and dv in one launch (beside a narrower v), `dk_query_block` for
    dk alone, 64 for dv alone."""
    if H <= 128 or parts == ("dv",):
        return 64
    if parts == ("dk",):
        return dk_query_block
    return 32


def _dkv(q, k, v, do, lse2, delta, q_segment_ids, kv_segment_ids, spec, tails: Tails, config: AttentionConfig,
         parts: tuple[str, ...] = ("dk", "dv"), dz_tiles: PackedTiles | None = None, chunk: HeadChunk | None = None,
         carried: tuple | None = None):
    """The `parts` of (dk [B, S, K, H], dv [B, S, K, Hv]): one CTA per 128 keys of one (b, kv
    head), the accumulators in registers, query blocks of `_dkv_query_block` rows streamed.

    At H > 128 dk and dv would take 192-256 registers per thread together, so `backward` may
    launch this kernel once per part (`one_dkv_launch` off): dk (which needs V too, for dpT) with
    `dk_query_block`-query blocks, dv (K only) with 64, each in at most 192 registers and about
    192 KB of SMEM. Beside a narrower v (MLA's 192 / 128) both fit one launch with 32-query blocks.

    dz_tiles (with dk; attention_backward.py's `_dz_layout`): each step's dz^T tile (q's dtype,
    what the dk product consumes) also goes out, into [B, N, pairs, 128 keys, 64 queries] packed
    by it (each warpgroup writes its 64 keys' half), for `_dq_from_dz`, through a double-buffered
    SMEM tile per warpgroup and a TMA store (a store from registers straight to global memory was
    slower).

    chunk (`HeadChunk`, with both parts): only the kv heads [k0, k0 + kv) and, of each group, the
    query heads [g0, g0 + g); the outputs cover those kv heads ([B, S, kv, .]) and dz^T those
    kv * g query heads. A chunk that does not end its group returns its f32 accumulators
    unscaled (stored from registers) and the next one starts from them (`carried`, loaded into
    registers), so dk and dv are summed in the unchunked order, bit for bit.
    """
    B, _, N, H = q.shape
    K, Hv = k.shape[2], v.shape[3]
    T, S = tails.T_padded, tails.S_padded  # the tiles' extent; q, k may end before (`Tails`)
    G, dt = N // K, q.dtype
    chunk = chunk or HeadChunk(0, K, 0, G, G)
    assert chunk.whole or parts == ("dk", "dv")
    assert (carried is not None) == chunk.carry_in
    Gc = chunk.g
    bq = _dkv_query_block(H, parts, config.dk_query_block)
    want_dk, want_dv = "dk" in parts, "dv" in parts
    item = jnp.dtype(dt).itemsize
    interpret = interpret_enabled()
    segmented = q_segment_ids is not None
    # Per ring slot Q, dO, lse (and delta for dk); per tile K, and V for dk's dpT = v dO^T. dv
    # goes out through V's buffer, or K's when there is none and it is as wide.
    v_tile = want_dk or Hv != H
    widths = {"dk": H, "dv": Hv}
    row_terms = (2 if want_dk else 1) + (1 if segmented else 0)
    packed = dz_tiles
    assert want_dk or packed is None
    assert packed is None or packed.blk == bq
    dz_bytes = 2 * CTA * bq * item if packed else 0
    stages = ring_stages(bq * (H + Hv) * item + row_terms * bq * 4,
                     CTA * (H + (Hv if v_tile else 0)) * item + dz_bytes)
    band = Band.keys_by_query(spec, tails)
    fa3_order = config.dkv_fa3_order and want_dk and want_dv
    fresh_pair = fa3_order or not want_dv  # q k^T and dO v^T issued together

    def tile_at(t, reach=None) -> Tile:  # rows = 128 keys of kv head k0 + n, columns = blocks of bq queries
        return Tile.of(t, (chunk.kv, S // CTA, B), band, bq, T, last_first=False, reach=reach)

    schedule = tile_schedule(lambda t: Gc * tile_at(t).steps, (chunk.kv, S // CTA, B), segmented, interpret,
                             config.persistent_dkv)

    def kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, table_ref, row_ids_ref, col_ids_ref, reach_ref,
               dz_base_ref, dk_in_ref, dv_in_ref, *refs):
        out_refs, refs = dict(zip(parts, refs[:len(parts)])), refs[len(parts):]
        dz_ref, refs = (refs[0], refs[1:]) if packed else (None, refs)
        (k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem, dz_smem, stage, row_ids_smem, col_ids_smem,
         kv_bar, loaded, free) = refs
        wg = lax.axis_index(WG_AXIS)
        ring = SlotFree(free, stages, FIRST_NAMED_BARRIER, named=False)
        tile = functools.partial(tile_at, reach=reach_ref if segmented else None)
        steps_of = lambda t: Gc * tile(t).steps  # ring uses: every query head of the chunk's group

        def consumer():
            total = schedule.total(table_ref, steps_of)
            ring.prime(total)
            k_s = k_smem.at[wg]
            v_s = v_smem.at[wg] if v_tile else None
            mma = Mma(interpret, None if stage is None else stage.at[wg])

            def one_tile(kk, t, base):
                tl = tile(t)
                keys = tl.r0 + wg * ROWS
                per_head = tl.steps
                gk = (tl.b, pl.ds(keys, ROWS), chunk.k0 + tl.n)  # k, v
                own = (tl.b, pl.ds(keys, ROWS), tl.n)  # the outputs (the chunk's kv heads)
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last tile's dk/dv left k_s, v_s
                plgpu.copy_gmem_to_smem(k_ref.at[gk], k_s, kv_bar.at[wg])
                if want_dk:
                    plgpu.copy_gmem_to_smem(v_ref.at[gk], v_s, kv_bar.at[wg])
                if segmented:
                    plgpu.copy_gmem_to_smem(row_ids_ref.at[gk[:2]], row_ids_smem.at[wg], kv_bar.at[wg])
                plgpu.barrier_wait(kv_bar.at[wg])
                row_ids = segment_ids(row_ids_smem, wg, 1)

                def head(g, carry):
                    def step(j, carry, masked):
                        acc = dict(zip(parts, carry))
                        i = base + g * per_head + j - tl.lo
                        slot = lax.rem(i, i32(stages))
                        plgpu.barrier_wait(loaded.at[slot])
                        q_t, do_t = q_smem.at[slot].transpose((1, 0)), do_smem.at[slot].transpose((1, 0))
                        if fresh_pair:
                            st, dpt = mma.fresh([(k_s, q_t), (v_s, do_t)], (ROWS, bq))
                            st, c = scores(st, spec)
                        else:
                            st, c = scores(mma(k_s, q_t, (ROWS, bq)), spec)
                        lse = plgpu.load(lse_smem.at[slot], layout=plgpu.Layout.WGMMA.reduce(0))
                        pt = exp2_scaled(st, c, bcast(lse, st.shape, 1))
                        if masked:
                            col_ids = segment_ids(col_ids_smem, slot, 0)
                            pt = jnp.where(allowed(band, keys, j * bq, st.shape, row_ids, col_ids), pt, 0.0)
                        if not want_dk:
                            acc["dv"] = mma(pt.astype(dt), do_smem.at[slot], (ROWS, Hv), acc=acc["dv"], a_in_regs=True)
                        elif not fresh_pair:
                            acc["dv"], dpt = mma.two(acc["dv"], pt.astype(dt), do_smem.at[slot], v_s, do_t, (ROWS, bq))
                        if want_dk:
                            dl = plgpu.load(delta_smem.at[slot], layout=plgpu.Layout.WGMMA.reduce(0))
                            dst = pt * (dpt - bcast(dl, st.shape, 1))
                            if spec.logit_soft_cap is not None:
                                dst = dst * cap_grad(st, spec)
                            dst = dst.astype(dt)

                            def store_dz():  # the other buffer's store (the last step's) may stay in flight
                                buf = dz_smem.at[wg, lax.rem(i, i32(2))]
                                plgpu.wait_smem_to_gmem(1, wait_read_only=True)
                                buf[...] = dst
                                plgpu.commit_smem()
                                entry = packed.entry(dz_base_ref, lax.div(tl.r0, i32(CTA)), j)
                                plgpu.copy_smem_to_gmem(buf, dz_ref.at[tl.b, tl.n * Gc + g, entry, pl.ds(wg * ROWS, ROWS)])

                            if fa3_order:
                                if packed:
                                    store_dz()
                                acc["dv"], acc["dk"] = mma.update([(acc["dv"], pt.astype(dt), do_smem.at[slot]),
                                                                   (acc["dk"], dst, q_smem.at[slot])])
                            else:  # the dz^T store runs while the dk wgmma is in flight
                                acc["dk"] = mma(dst, q_smem.at[slot], (ROWS, H), acc=acc["dk"], a_in_regs=True,
                                                after_issue=store_dz if packed else None)
                        ring.release(slot, i, total)
                        return tuple(acc[name] for name in parts)

                    return three_loops(tl.lo, tl.full_lo, tl.full_hi, tl.hi, step, carry, band, segmented)

                if chunk.carry_in:  # the previous chunk's f32 sums, straight from global memory
                    start = tuple(plgpu.load(ref.at[own], layout=plgpu.Layout.WGMMA, optimized=False)
                                  for ref in (dk_in_ref, dv_in_ref))
                else:
                    start = tuple(zeros((ROWS, widths[name])) for name in parts)
                accs = lax.fori_loop(0, Gc, head, start)
                if chunk.carry_out:  # f32 sums for the next chunk: no SMEM is free for f32 tiles
                    for name, acc in zip(parts, accs):
                        out_refs[name].at[own][...] = acc
                    return base + Gc * per_head
                # The results go out through the K/V buffers (every wgmma reading them is done).
                bufs = {"dk": k_s, "dv": k_s if v_s is None else v_s}
                for name, acc in zip(parts, accs):
                    buf = bufs[name]
                    buf[...] = (acc * spec.scale if name == "dk" else acc).astype(dt)
                    plgpu.commit_smem()
                    plgpu.copy_smem_to_gmem(buf, out_refs[name].at[own])
                return base + Gc * per_head

            return one_tile

        def producer():
            def one_tile(kk, t, base):
                tl = tile(t)
                per_head = jnp.maximum(tl.steps, 1)

                def load(i, c):
                    slot = lax.rem(base + i, i32(stages))
                    n = (chunk.k0 + tl.n) * G + chunk.g0 + lax.div(i, per_head)
                    t0 = (tl.lo + lax.rem(i, per_head)) * bq
                    ring.acquire(slot, base + i)
                    rows = (tl.b, pl.ds(t0, bq), n)
                    plgpu.copy_gmem_to_smem(q_ref.at[rows], q_smem.at[slot], loaded.at[slot])
                    plgpu.copy_gmem_to_smem(do_ref.at[rows], do_smem.at[slot], loaded.at[slot])
                    plgpu.copy_gmem_to_smem(lse_ref.at[tl.b, n, pl.ds(t0, bq)], lse_smem.at[slot], loaded.at[slot])
                    if want_dk:
                        plgpu.copy_gmem_to_smem(delta_ref.at[tl.b, n, pl.ds(t0, bq)], delta_smem.at[slot], loaded.at[slot])
                    if segmented:
                        plgpu.copy_gmem_to_smem(col_ids_ref.at[rows[:2]], col_ids_smem.at[slot], loaded.at[slot])
                    return c

                lax.fori_loop(0, Gc * tl.steps, load, None)
                return base + Gc * tl.steps

            return one_tile

        warp_specialized(wg, schedule, table_ref, consumer, producer)

    tr = block_transforms(dt, bq, H, Hv)  # one swizzle for every wgmma operand

    scratch = [
        plgpu.SMEM((WGS, ROWS, H), dt, transforms=tr),
        plgpu.SMEM((WGS, ROWS, Hv), dt, transforms=tr) if v_tile else None,
        plgpu.SMEM((stages, bq, H), dt, transforms=tr),
        plgpu.SMEM((stages, bq, Hv), dt, transforms=tr),
        plgpu.SMEM((stages, bq), F32),
        plgpu.SMEM((stages, bq), F32) if want_dk else None,
        plgpu.SMEM((WGS, 2, ROWS, bq), dt, transforms=tr) if packed else None,
        *staging_and_segment_buffers(dt, bq, stages, interpret, segmented),
    ]
    # Tile copies: K (and V); slot copies: Q, dO, lse (and delta).
    bars = backward_barriers(tile_copies=2 if want_dk else 1, slot_copies=4 if want_dk else 3, stages=stages,
                              segmented=segmented)
    # f32 carries cover the whole tiles (stored from registers: nothing clips them as TMA does).
    out_dt, out_keys = (F32, S) if chunk.carry_out else (dt, k.shape[1])
    out_type = tuple(jax.ShapeDtypeStruct((B, out_keys, chunk.kv, widths[name]), out_dt) for name in parts) + (
        (jax.ShapeDtypeStruct((B, chunk.heads, packed.entries, CTA, bq), dt),) if packed else ())
    name = "attention_" + "".join(parts) if len(parts) == 1 else "attention_dkv"
    carried = carried if chunk.carry_in else (jnp.zeros((1,), F32),) * 2
    return launch(name, kernel, scratch, bars, out_type, schedule, interpret)(
        q, k, v, do, lse2, delta, schedule.input(), *segment_inputs(kv_segment_ids, q_segment_ids),
        jnp.asarray(packed.base if packed else np.zeros(1, np.int32)), *carried)


def _dq(q, k, v, do, out, lse2, row_term, q_segment_ids, kv_segment_ids, spec, tails: Tails, config: AttentionConfig,
        *, fused_delta: bool):
    """dq [B, T, N, H] (v, dO, O [.., Hv]): one CTA per 128 query rows of one (b, n), key blocks of
    `dq_block_kv` streamed.

    fused_delta: row_term is dlse, and delta = rowsum(dO * O) - dlse is computed here for the
    CTA's own rows before its loop and returned too, (dq, delta [B, N, T] f32), for the dK/dV
    kernel (the producer streams the tile's O rows through the tile's first ring slot: the
    kernel has no SMEM to spare, so a tile makes steps + 1 ring uses; so Hv = H). Otherwise
    row_term is delta itself and `out` is not read (`delta_in_dq_kernel`)."""
    B, _, N, H = q.shape
    K, Hv = k.shape[2], v.shape[3]
    T, S = tails.T_padded, tails.S_padded  # the tiles' extent; q, k may end before (`Tails`)
    G, dt = N // K, q.dtype
    bkv = config.dq_block_kv
    assert (bkv >= CTA and Hv == H) or not fused_delta, "the O rows of a tile go through one K ring slot"
    item = jnp.dtype(dt).itemsize
    segmented = q_segment_ids is not None
    assert not (segmented and fused_delta), "the O rows' ring use has no segment ids copy"
    stages = ring_stages(bkv * (H + Hv) * item + (4 * bkv if segmented else 0), CTA * (H + Hv) * item)
    band = Band.forward(spec, tails)
    interpret = interpret_enabled()
    tile_at = lambda t, reach=None: Tile.of(t, (N, T // CTA, B), band, bkv, S, last_first=True, reach=reach)
    first = 1 if fused_delta else 0  # ring uses before the key blocks
    schedule = tile_schedule(lambda t: tile_at(t).steps + first, (N, T // CTA, B), segmented, interpret,
                             config.persistent_dq)

    def kernel(q_ref, k_ref, v_ref, do_ref, o_ref, lse_ref, row_ref, table_ref, row_ids_ref, col_ids_ref, reach_ref,
               dq_ref, *rest):
        delta_ref = rest[0] if fused_delta else None
        (q_smem, do_smem, k_smem, v_smem, lse_smem, row_smem, delta_smem, stage, row_ids_smem, col_ids_smem,
         q_bar, loaded, free) = rest[-13:]
        wg = lax.axis_index(WG_AXIS)
        ring = SlotFree(free, stages, FIRST_NAMED_BARRIER, named=False)
        tile = functools.partial(tile_at, reach=reach_ref if segmented else None)
        steps_of = lambda t: tile(t).steps + first

        def consumer():
            total = schedule.total(table_ref, steps_of)
            ring.prime(total)
            q_s, do_s = q_smem.at[wg], do_smem.at[wg]
            mma = Mma(interpret, None if stage is None else stage.at[wg])

            def one_tile(kk, t, base):
                tl = tile(t)
                rows = tl.r0 + wg * ROWS
                gq = (tl.b, pl.ds(rows, ROWS), tl.n)
                row_stats = (tl.b, tl.n, pl.ds(rows, ROWS))
                plgpu.copy_gmem_to_smem(do_ref.at[gq], do_s, q_bar.at[wg])
                plgpu.copy_gmem_to_smem(lse_ref.at[row_stats], lse_smem.at[wg], q_bar.at[wg])
                plgpu.copy_gmem_to_smem(row_ref.at[row_stats], row_smem.at[wg], q_bar.at[wg])
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last tile's dq and delta stores
                plgpu.copy_gmem_to_smem(q_ref.at[gq], q_s, q_bar.at[wg])
                if segmented:
                    plgpu.copy_gmem_to_smem(row_ids_ref.at[gq[:2]], row_ids_smem.at[wg], q_bar.at[wg])
                plgpu.barrier_wait(q_bar.at[wg])
                lse = plgpu.load(lse_smem.at[wg], layout=plgpu.Layout.WGMMA.reduce(1))
                dl = plgpu.load(row_smem.at[wg], layout=plgpu.Layout.WGMMA.reduce(1))
                row_ids = segment_ids(row_ids_smem, wg, 1)
                if fused_delta:
                    # Ring use `base`: this tile's O rows, WG w's at rows [64 w, 64 w + 64) of the K slot.
                    o_slot = lax.rem(base, i32(stages))
                    plgpu.barrier_wait(loaded.at[o_slot])
                    wgmma_rows = lambda ref: plgpu.load(ref, layout=plgpu.Layout.WGMMA).astype(F32)
                    o_s = k_smem.at[o_slot, pl.ds(pl.multiple_of(wg * ROWS, ROWS), ROWS)]
                    dl = jnp.sum(wgmma_rows(do_s) * wgmma_rows(o_s), axis=1) - dl
                    ring.release(o_slot, base, total)
                    delta_smem.at[wg][...] = dl
                    plgpu.commit_smem()
                    plgpu.copy_smem_to_gmem(delta_smem.at[wg], delta_ref.at[row_stats])

                def step(j, dq, masked):
                    i = base + first + j - tl.lo
                    slot = lax.rem(i, i32(stages))
                    plgpu.barrier_wait(loaded.at[slot])
                    s, c = scores(mma(q_s, k_smem.at[slot].transpose((1, 0)), (ROWS, bkv)), spec)
                    p = exp2_scaled(s, c, bcast(lse, s.shape, 0))
                    if masked:
                        col_ids = segment_ids(col_ids_smem, slot, 0)
                        p = jnp.where(allowed(band, rows, j * bkv, s.shape, row_ids, col_ids), p, 0.0)
                    dp = mma(do_s, v_smem.at[slot].transpose((1, 0)), (ROWS, bkv))
                    ds = p * (dp - bcast(dl, s.shape, 0))
                    if spec.logit_soft_cap is not None:
                        ds = ds * cap_grad(s, spec)
                    dq = mma(ds.astype(dt), k_smem.at[slot], (ROWS, H), acc=dq, a_in_regs=True)
                    ring.release(slot, i, total)
                    return dq

                dq = three_loops(tl.lo, tl.full_lo, tl.full_hi, tl.hi, step, zeros((ROWS, H)), band, segmented)
                q_s[...] = (dq * spec.scale).astype(dt)
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(q_s, dq_ref.at[gq])
                return base + first + tl.steps

            return one_tile

        def producer():
            def one_tile(kk, t, base):
                tl = tile(t)
                kh = lax.div(tl.n, i32(G))
                if fused_delta:
                    slot = lax.rem(base, i32(stages))
                    ring.acquire(slot, base)
                    for w in range(WGS):  # two copies: the slot's "loaded" barrier counts two arrivals
                        o_rows = (tl.b, pl.ds(tl.r0 + w * ROWS, ROWS), tl.n)
                        plgpu.copy_gmem_to_smem(o_ref.at[o_rows], k_smem.at[slot, pl.ds(w * ROWS, ROWS)],
                                                loaded.at[slot])

                def load(i, c):
                    slot = lax.rem(base + first + i, i32(stages))
                    ring.acquire(slot, base + first + i)
                    keys = (tl.b, pl.ds((tl.lo + i) * bkv, bkv), kh)
                    plgpu.copy_gmem_to_smem(k_ref.at[keys], k_smem.at[slot], loaded.at[slot])
                    plgpu.copy_gmem_to_smem(v_ref.at[keys], v_smem.at[slot], loaded.at[slot])
                    if segmented:
                        plgpu.copy_gmem_to_smem(col_ids_ref.at[keys[:2]], col_ids_smem.at[slot], loaded.at[slot])
                    return c

                lax.fori_loop(0, tl.steps, load, None)
                return base + first + tl.steps

            return one_tile

        warp_specialized(wg, schedule, table_ref, consumer, producer)

    tr = block_transforms(dt, bkv, H, Hv)  # one swizzle for every wgmma operand

    scratch = [
        plgpu.SMEM((WGS, ROWS, H), dt, transforms=tr),
        plgpu.SMEM((WGS, ROWS, Hv), dt, transforms=tr),
        plgpu.SMEM((stages, bkv, H), dt, transforms=tr),
        plgpu.SMEM((stages, bkv, Hv), dt, transforms=tr),
        plgpu.SMEM((WGS, ROWS), F32),
        plgpu.SMEM((WGS, ROWS), F32),
        plgpu.SMEM((WGS, ROWS), F32),
        *staging_and_segment_buffers(dt, bkv, stages, interpret, segmented),
    ]
    # Tile copies: dO, lse, the row term, Q; slot copies: K, V (or a tile's O rows, two halves).
    bars = backward_barriers(tile_copies=4, slot_copies=2, stages=stages, segmented=segmented)
    out_type = (jax.ShapeDtypeStruct(q.shape, dt),) + (
        (jax.ShapeDtypeStruct((B, N, T), F32),) if fused_delta else ())
    return launch("attention_dq", kernel, scratch, bars, out_type, schedule, interpret)(
        q, k, v, do, out, lse2, row_term, schedule.input(), *segment_inputs(q_segment_ids, kv_segment_ids))


def _dq_from_dz(q, k, dz, packed: PackedTiles, q_segment_ids, kv_segment_ids, spec, tails: Tails,
                config: AttentionConfig, chunk: HeadChunk | None = None):
    """dq = scale * dz k [B, T, N, H] from the dz^T tiles `_dkv` wrote, packed as `packed` (`_dz_layout`):
    one CTA per 128 query rows of one (b, n), blocks of `dq_from_dz_block_kv` keys streamed with
    their dz^T tiles (one per warpgroup's 64 queries), one wgmma per step where `_dq` also recomputes q k^T and
    dO v^T. The CTA's key blocks (`Band.forward`) may hold tiles `_dkv` never wrote for one
    warpgroup's 64 rows (its query blocks come from `Band.keys_by_query` per 128 keys): a
    warpgroup keeps a step's product only where its query block was in that key tile's range.
    chunk (`HeadChunk`): dz holds (and dq [B, T, kv * g, H] covers) only that chunk's query heads,
    head i being kv head k0 + i // g's query head g0 + i % g."""
    B, _, N, H = q.shape
    K = k.shape[2]
    T, S = tails.T_padded, tails.S_padded
    G, dt = N // K, q.dtype
    chunk = chunk or HeadChunk(0, K, 0, G, G)
    item = jnp.dtype(dt).itemsize
    bq = _dkv_query_block(H, ("dk", "dv"))
    assert bq == ROWS, "a warpgroup's rows are one dK/dV query block"
    bkv = config.dq_from_dz_block_kv
    segmented = q_segment_ids is not None
    stages = ring_stages(bkv * (H + WGS * ROWS) * item, WGS * ROWS * H * item, cap=4)
    band, written = Band.forward(spec, tails), Band.keys_by_query(spec, tails)
    interpret = interpret_enabled()
    heads = chunk.heads
    tile_at = lambda t, reach=None: Tile.of(t, (heads, T // CTA, B), band, bkv, S, last_first=True, reach=reach)
    schedule = tile_schedule(lambda t: tile_at(t).steps, (heads, T // CTA, B), segmented, interpret,
                             config.persistent_dq_from_dz)

    def kernel(k_ref, dz_ref, table_ref, reach_ref, key_reach_ref, dz_base_ref, dq_ref, k_smem, dz_smem, out_smem,
               loaded, free):
        wg = lax.axis_index(WG_AXIS)
        ring = SlotFree(free, stages, FIRST_NAMED_BARRIER, named=False)
        tile = functools.partial(tile_at, reach=reach_ref if segmented else None)
        steps_of = lambda t: tile(t).steps

        def consumer():
            total = schedule.total(table_ref, steps_of)
            ring.prime(total)

            def one_tile(kk, t, base):
                tl = tile(t)
                rows = tl.r0 + wg * ROWS
                kh = chunk.k0 + lax.div(tl.n, i32(chunk.g))
                query_block = lax.div(rows, i32(bq))

                def steps(acc):
                    def step(j, carry):
                        i = base + j - tl.lo
                        slot = lax.rem(i, i32(stages))
                        keys = Tile.of((kh, lax.div(j * bkv, i32(CTA)), tl.b), (K, S // CTA, B), written, bq, T,
                                       last_first=False, reach=key_reach_ref if segmented else None)
                        plgpu.barrier_wait(loaded.at[slot])

                        @pl.when((keys.lo <= query_block) & (query_block < keys.hi))
                        def _():
                            plgpu.wgmma(acc, dz_smem.at[slot, wg].transpose((1, 0)), k_smem.at[slot])
                            plgpu.wgmma_wait(0)

                        ring.release(slot, i, total)
                        return carry

                    lax.fori_loop(tl.lo, tl.hi, step, None)
                    return acc[...]

                dq = pl.run_scoped(steps, plgpu.ACC((ROWS, H), F32))
                out = out_smem.at[wg]
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last tile's dq store
                out[...] = (dq * spec.scale).astype(dt)
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(out, dq_ref.at[tl.b, pl.ds(rows, ROWS), tl.n])
                return base + tl.steps

            return one_tile

        def copy_block(tl, kh, i, g, slot):
            ring.acquire(slot, g)
            k0 = (tl.lo + i) * bkv
            plgpu.copy_gmem_to_smem(k_ref.at[tl.b, pl.ds(k0, bkv), chunk.k0 + kh], k_smem.at[slot], loaded.at[slot])
            key_tile, row = lax.div(k0, i32(CTA)), pl.ds(lax.rem(k0, i32(CTA)), bkv)
            for w in range(WGS):
                entry = packed.entry(dz_base_ref, key_tile, lax.div(tl.r0, i32(bq)) + w)
                plgpu.copy_gmem_to_smem(dz_ref.at[tl.b, tl.n, entry, row], dz_smem.at[slot, w], loaded.at[slot])

        # kh = the chunk's own kv head (tl.n // g); copy_block adds k0.
        warp_specialized(wg, schedule, table_ref, consumer,
                         lambda: key_block_producer(tile, chunk.g, stages, copy_block))

    tr = block_transforms(dt, bkv, H, ROWS)
    scratch = [
        plgpu.SMEM((stages, bkv, H), dt, transforms=tr),
        plgpu.SMEM((stages, WGS, bkv, ROWS), dt, transforms=tr),
        plgpu.SMEM((WGS, ROWS, H), dt, transforms=tr),
    ]
    # Per ring slot: K and each warpgroup's dz^T tile landed; both consumers released it.
    bars = [plgpu.Barrier(num_arrivals=1 + WGS, num_barriers=stages),
            plgpu.Barrier(num_arrivals=WGS, num_barriers=stages)]
    reach = segment_inputs(q_segment_ids, kv_segment_ids)[2]
    key_reach = segment_inputs(kv_segment_ids, q_segment_ids)[2]
    return launch("attention_dq_from_dz", kernel, scratch, bars, jax.ShapeDtypeStruct((B, q.shape[1], heads, H), dt),
                  schedule, interpret)(k, dz, schedule.input(), reach, key_reach, jnp.asarray(packed.base))
