"""Flash attention as Pallas Mosaic GPU kernels (Hopper: TMA, wgmma, warp specialisation).

Contract: kernels/common/attention.py (q [B,T,N,H], k/v [B,S,K,H], lse [B,N,T] f32, GQA head
n -> kv head n // G with G = N // K, causal/window aligned so the last query sits at the last key:
query t is at key position t + off, off = S - T). Scope: bf16/f16, kernels at head dim 64, 96,
128, 192 and 256 (other head dims up to 256 zero-padded to the next; a narrower v at its own,
`_kernel_head_dims`), causal / window / logit soft cap / segment ids; everything else is refused
by `_supports` (the op then falls back to Triton or XLA). Lengths that are not multiples of 128
run as whole tiles over the arrays in place (TMA zero-fills past their end), the keys past the
end cut by the band or by a column limit. The block ranges, masks and padding the kernels share
(`Band`, `Tile`, `Tails`) are in attention_tiles.py; the warpgroup machinery in warpgroups.py.

Forward (one CTA = 128 query rows of one (b, n); 3 warpgroups):
  * WG 0 and WG 1 (consumers) each own 64 query rows: Q via TMA into SMEM, then per key block j
        s = (q k_j^T) * scale * log2(e)          (soft cap: cap*tanh(scale*qk/cap)*log2(e))
        m' = max(m, rowmax s);  p = exp2(s - m');  l = l*exp2(m - m') + rowsum p
        acc = acc*exp2(m - m') + p v_j            (p cast to the input dtype, wgmma from registers)
    and finally out = acc / l (0 where l = 0), lse = (m + log2 l) * ln 2 (-inf where l = 0),
    written through SMEM with TMA stores. Without a soft cap the scale stays out of s: one FMA
    and one exp2 per score.
  * Schedules (FA3): the two consumers ping-pong on hardware named barriers, one running its
    softmax while the other has the tensor cores. At H = 128 a WG also overlaps block j's
    softmax with its own in-flight P_{j-1} V_{j-1} (intra-warpgroup overlap, 240 registers per
    consumer); at H = 64, 96, 192 and 256 each block is Q K^T, softmax, P V in turn.
  * WG 2 (producer, 24 registers) streams K and V blocks into a ring of `stages` SMEM slots
    (per-slot "loaded" mbarriers filled by TMA, "free" named barriers released by both consumers).
  * Grid: at H = 64, 96 and 128, and 192 beside a narrower v, persistent (one CTA per SM running
    the tiles `balance` gives it, in tile order, so the next tile's loads overlap the current
    tile's end); otherwise at H = 192 and 256 one CTA per tile (see `_PERSISTENT_HEAD_DIMS`).
  * Only the key blocks a query block can see are visited ([lo, hi) from causal/window); the
    blocks every row fully sees skip the mask (three loops: masked edge, unmasked middle,
    masked edge), so causal costs ~half of non-causal.
  * Segment ids (packed sequences; every kernel alike): [lo, hi) is narrowed further to the
    columns the tile's ids may reach (`segment_ranges`, read per tile from a [B, tiles, 3]
    table, `within_reach`), the masked steps also compare the row ids (loaded once per tile)
    with the column block's ids (TMA'd into the ring with K, or with Q/dO in the dK/dV kernel),
    and only blocks inside one segment shared by the whole tile stay unmasked. The blocks then
    depend on the data, so the kernels run one CTA per tile and the dQ kernel reads
    delta from XLA, but the forward at H = 64 with at least 32 query heads and the dK/dV kernel
    at H = 64 and 128 with at least 32 kv heads stay persistent, their tiles dealt in tile
    order with equal weights (`_PERSISTENT_SEGMENTED_HEAD_DIMS`).

Backward (lse * log2(e) is a plain jnp op). At H = 128 without a left window, while the dz^T
tiles fit 4 GiB (`_DZ_TILES_HEAD_DIMS`, `_DZ_TILES_MAX_BYTES`, `_dz_tiles`): delta from XLA,
then the dK/dV kernel below, which also TMA-stores every dz^T tile it computes (in flight beside
its dk wgmma), packed to the (128 keys, 64 queries) pairs the band lets meet (`_dz_layout`:
about half of [B, N, S, T] under causal masking), then `_dq_from_dz`: dq = scale * dz k, one
wgmma per 64-key block (5 matmuls per
block in all instead of 7; H100: fwd+bwd 1.05-1.07x cuDNN against 1.02x, GQA 1.09-1.12x; the
tiles cost the HBM traffic of writing and reading them, and the memory). Otherwise the dQ kernel
runs first and, except under a left window where XLA does, computes delta
(`_DELTA_IN_DQ_KERNEL`):
  * dQ kernel (persistent at H = 192 and 256, `_PERSISTENT_DQ_HEAD_DIMS`): a tile = 128 query rows of
    one (b, n), consumers own 64 rows, the producer streams the tile's O rows, then K/V blocks
    of `_DQ_BLOCK_KV` keys:
        delta = rowsum(dO * O) - dlse;  p, dp = dO v^T, ds = p (dp - delta), dq += ds k.
  * dK/dV kernel (persistent without a left window, `_PERSISTENT_DKV_HEAD_DIMS`):
    tiles of 128 keys of one (b, kv head); each consumer WG owns 64 keys (K, V in SMEM), loops
    over the G query heads of its group and the query blocks (64 rows) that see its keys,
    streamed by the producer WG (Q, dO, lse, delta per ring slot):
        pT = exp2(s^T - lse);  dv += pT dO;  dpT = v dO^T;  dsT = pT (dpT - delta);  dk += dsT q
    dk, dv stay in registers for the whole loop (deterministic; GQA groups summed in-kernel).
  * H = 192 and 256 (every kernel takes the H > 128 paths: 64-key forward blocks, two dK/dV
    launches, dQ blocks of 64 keys at 192 and 32 at 256): dk + dv would need 192-256
    accumulator registers per thread, so dk and dv take a launch each of the dK/dV kernel (dk,
    which also needs V, with 64-query blocks at 192 and 32 at 256; dv with 64; beside MLA's
    narrower v both fit one launch, `_ONE_DKV_LAUNCH_NARROW_V_HEAD_DIMS`), and the dQ
    kernel streams its key blocks beside its 80-128 KB of Q and dO (delta from XLA): 8 matmuls
    per block instead of 7. At 256 the backward took 1.98 ms against 4.82 for Triton's fused
    backward, which ran this head size before (B2 T4096 N16 causal, H200; with a soft cap 2.14
    against 5.29).
  * dq is not fused into the dK/dV kernel: FA3-style one-pass variants (f32 dq accumulated by
    TMA reduce-adds) measured slower on an H200, three times (see `_dkv`); the dz^T tiles
    above give the same 5 matmuls without atomics, deterministically.

Interpret mode (FORGEAX_INTERPRET / interpret_mode()): the interpreter cannot run wgmma with a
register LHS nor `run_state` with `ACC.init` (notes/MOSAIC_GPU.md §8), so there the 16-bit
probabilities are staged through a per-WG SMEM buffer and every product is added to the
register accumulator, the named barriers (which it lacks) become mbarriers or, for the
ping-pong (scheduling only), nothing; the TMA/loop structure is the same as on the GPU.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from forgeax.kernels.common.attention import AttentionKernels, AttentionSpec, differentiable_attention
from forgeax.kernels.pallas.gpu import gpu_refusal
from forgeax.kernels.pallas.gpu.attention_tiles import (
    Band, PackedTiles, Tails, Tile, allowed, segment_ids, segment_inputs, three_loops,
)
from forgeax.kernels.pallas.gpu.warpgroups import (
    CTA, F32, FIRST_NAMED_BARRIER, ROWS, WGS, Mma, PingPong, Schedule, SlotFree, bcast, full_rows, i32, launch,
    transforms, warp_specialized, zeros,
)
from forgeax.core.registry import Implementation
from forgeax.core.runtime import interpret_enabled

_LOG2E = math.log2(math.e)
_LN2 = math.log(2.0)
_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
# Every setting below was chosen by GPU measurements; the numbers and JSON behind each are in
# benchmarks/ATTENTION.md ("pallas_gpu's settings"). The kernels' head dims (others are zero-padded
# to the next, `Tails`): 192 for MLA (1.31x fwd+bwd over padding to 256), 96 for Phi-3 (64-byte
# swizzle, 1.41x over padding to 128).
_HEAD_DIMS = (64, 96, 128, 192, 256)
_SMEM_BUDGET = 200 * 1024
# FA3's intra-warpgroup overlap in the forward: a gain only at H = 128 (with 240 registers per
# consumer); slower at 64 and 96, no registers at 192/256.
_OVERLAP_HEAD_DIMS = (128,)
# Persistent forward (`Schedule`, tiles in tile order): saves each tile's launch and pipeline ramp
# at 64, 96, 128; within noise at 256 and slower at 192, which run one CTA per tile.
_PERSISTENT_HEAD_DIMS = (64, 96, 128)
# Persistent overlapped forward as one software pipeline over all of a CTA's tiles (`flat` in
# `_flash_forward`): a tile's first Q K^T is issued with the previous tile's last P V, so the
# previous tile's epilogue and the next one's first softmax no longer leave the tensor cores idle
# at every tile boundary. It takes two Q buffers per warpgroup (224 KB of SMEM at H = 128).
_FLAT_FORWARD_HEAD_DIMS = (128,)
_SMEM_LIMIT = 227 * 1024  # Hopper's largest allocation per CTA (Mosaic GPU refuses more when lowering)
# ... and at these q/k head dims when v's is narrower (MLA's 192 / 128: fewer accumulator registers).
_PERSISTENT_NARROW_V_HEAD_DIMS = (192,)
# With segment ids the tiles' work depends on the data: tiles dealt round robin at equal weights
# (`_schedule`), which gained for the forward at H = 64 and for dK/dV at 64 and 128 without GQA, and
# only with at least 32 heads (round robin aliases with the documents below ~24, by
# benchmarks/segmented_schedule_model.py).
_PERSISTENT_SEGMENTED_HEAD_DIMS = (64,)
_PERSISTENT_SEGMENTED_DKV_HEAD_DIMS = (64, 128)
_PERSISTENT_SEGMENTED_MIN_HEADS = 32
# Persistent backward kernels: dK/dV at every head dim except under a left window (`_dkv`); dQ only
# where delta comes from XLA (H > 128): computing delta in it spilled and lost.
_PERSISTENT_DKV_HEAD_DIMS = (64, 96, 128, 192, 256)
_PERSISTENT_DQ_HEAD_DIMS = (192, 256)
# q/k head dims (> 128) whose separate dk launch streams 64-query blocks instead of 32 (at 256
# their SMEM does not fit): at 192 its kernel took 0.99 against 1.29 ms.
_DK_QUERY_BLOCK_64_HEAD_DIMS = (192,)
# Keys per dQ step (at least 128: a tile's O rows go through one K slot); 128 beat 64 on every shape.
_DQ_BLOCK_KV = 128
# q/k head dims (> 128) whose dQ kernel streams 64-key blocks instead of 32 (at 256 their SMEM
# does not fit): at 192 its kernel took 0.89 against 1.12 ms.
_DQ_BLOCK_KV_64_HEAD_DIMS = (192,)
# q/k head dims above 128 whose dK/dV kernel runs once for both dk and dv, with 32-query blocks,
# when v's head dim is narrower (MLA's 192 / 128: dk's 96 and dv's 64 accumulator registers fit
# beside the scores of 32 queries). MLA on an H200: 1.35-1.36 ms against 0.89-0.90 + 0.64-0.65 for
# the two launches; with 64-query blocks 1.47; at 192 / 192 one launch lost (2.12 against 1.80).
_ONE_DKV_LAUNCH_NARROW_V_HEAD_DIMS = (192,)


def _dq_block_kv(H: int) -> int:
    """The dQ kernel's key block: `_DQ_BLOCK_KV`, but 32 or 64 at H > 128, where the tile's Q and
    dO take 80-128 KB of SMEM (two stages of those fit beside them)."""
    if H <= 128:
        return _DQ_BLOCK_KV
    return 64 if H in _DQ_BLOCK_KV_64_HEAD_DIMS else 32


# delta = rowsum(dO * O) - dlse in the dQ kernel (faster than XLA's reduction except under a left
# window, where XLA computes it).
_DELTA_IN_DQ_KERNEL = True
# dq from the dz^T tiles the dK/dV kernel stores (`_dq_from_dz`: 5 matmuls per block instead of 7)
# at these head dims, without a left window, while the tiles fit the budget; they are packed to
# the pairs of 128 keys and 64 queries the band lets meet (`_dz_layout`), about B*N*S*T bytes
# under causal masking (2.06 GiB at causal B4 T4096 N32 and 2.03 at Llama-3-8B's B1 T8192 N32;
# causal B1 N32 up to T 11264 fits 4 GiB); otherwise the dQ kernel recomputes them.
_DZ_TILES_HEAD_DIMS = (128,)
_DZ_TILES_MAX_BYTES = 4 << 30
_DZ_TILES_WINDOWED = False  # with a left window too (measured slower: `_dz_tiles`)
_DQ_FROM_DZ_BLOCK_KV = 64
_PERSISTENT_DQ_FROM_DZ_HEAD_DIMS = ()
# dK/dV step order: FA3's (both score wgmmas, then both gradient wgmmas) only at H = 64, where it
# was faster; at 128 no faster and it spills. Overlapping the backward's softmax with its second
# wgmma was not kept (it lost on a power-capped H200).
_DKV_FA3_ORDER_HEAD_DIMS = (64,)


def _schedule(steps_of, dims: tuple[int, int, int], H: int, segmented: bool, interpret: bool, *,
              persistent_dims: tuple[int, ...], segmented_dims: tuple[int, ...] = ()) -> Schedule:
    """A kernel's `Schedule` over tiles dims = (heads, row tiles, batch). Persistent at the head
    dims `persistent_dims`, balanced by steps_of (a tile's ring uses); with segment ids a tile's
    uses depend on the data, which the table built here cannot know (the kernel counts them
    itself): persistent only at `segmented_dims` with at least `_PERSISTENT_SEGMENTED_MIN_HEADS`
    heads, the tiles dealt in tile order at equal weights."""
    if segmented:
        persistent = H in segmented_dims and dims[0] >= _PERSISTENT_SEGMENTED_MIN_HEADS
        steps_of = lambda t: t * 0 + 1
    else:
        persistent = H in persistent_dims
    return Schedule.of(steps_of, dims, persistent, interpret)



def _scores(x, spec: AttentionSpec):
    """Raw q.k products -> (s, c) with log2-domain logits s * c (scale * log2 e, soft cap).

    Without a soft cap s stays raw and c = scale * log2 e, so that `_exp2(s, c, m)` is one FMA
    and an exp2 per element (the softmax's ALU work sits between the matmuls); with
    one, s are the capped logits and c = 1."""
    if spec.logit_soft_cap is None:
        return x, spec.scale * _LOG2E
    cap = spec.logit_soft_cap
    return jnp.tanh(x * (spec.scale / cap)) * (cap * _LOG2E), 1.0


def _exp2(s, c: float, m):
    """exp2(s * c - m)."""
    return jnp.exp2((s * c if c != 1.0 else s) - m)


def _cap_grad(s2, spec: AttentionSpec):
    """d capped / d uncapped = 1 - tanh^2, from the log2-domain capped logits s2."""
    t = s2 * (1.0 / (spec.logit_soft_cap * _LOG2E))
    return 1.0 - t * t


def _stages(per_stage: int, fixed: int, cap: int = 3) -> int:
    return max(2, min(cap, (_SMEM_BUDGET - fixed) // per_stage))


def _block_transforms(dt, *widths: int):
    """SMEM transforms of buffers whose rows or columns are wgmma K blocks of these widths (head
    dims, key or query blocks): the widest swizzle (128, 64 or 32 bytes) that divides every width's
    bytes (`transforms`), so 32-wide blocks and head_dim 96 get 64 bytes."""
    nbytes = [w * jnp.dtype(dt).itemsize for w in widths]
    return transforms(dt, next(s for s in (128, 64, 32) if all(n % s == 0 for n in nbytes)))


def _staging_and_segment_buffers(dt, blk: int, stages: int, interpret: bool, segmented: bool) -> list:
    """The last scratch entries of every kernel here (None where the call needs none): the
    per-warpgroup (rows, blk) buffer through which interpret mode stages register-LHS wgmma
    operands (`Mma`), the row segment ids of each warpgroup's rows, and the column segment ids
    of each ring slot's blk columns."""
    return [
        plgpu.SMEM((WGS, ROWS, blk), dt, transforms=_block_transforms(dt, blk)) if interpret else None,
        plgpu.SMEM((WGS, ROWS), jnp.int32) if segmented else None,
        plgpu.SMEM((stages, blk), jnp.int32) if segmented else None,
    ]


def _backward_barriers(tile_copies: int, slot_copies: int, stages: int, segmented: bool) -> list:
    """The dQ and dK/dV kernels' barriers: per consumer warpgroup, its tile's `tile_copies` TMA
    copies landed; per ring slot, the slot's `slot_copies` copies landed, and both consumers
    released it. With segment ids the first two count one more copy each (the ids)."""
    ids = 1 if segmented else 0
    return [
        plgpu.Barrier(num_arrivals=tile_copies + ids, num_barriers=WGS),
        plgpu.Barrier(num_arrivals=slot_copies + ids, num_barriers=stages),
        plgpu.Barrier(num_arrivals=WGS, num_barriers=stages),
    ]


def _kernel_head_dims(H: int, Hv: int) -> tuple[int, int] | None:
    """The kernels' (q/k, v) head dims for a call's H and Hv (None past 256): each the smallest of
    `_HEAD_DIMS` that holds it. v's may be narrower than q/k's (MLA's 192 / 128 computes P V, dO V^T
    and dv at 128), except beside 256, whose forward has no SMEM for a narrower output buffer; a v
    wider than q/k pads q/k too."""
    fit = lambda n: next((d for d in _HEAD_DIMS if d >= n), None)
    dims = fit(H), fit(Hv)
    if None in dims:
        return None
    if dims[1] > dims[0] or dims[0] == _HEAD_DIMS[-1]:
        return (max(dims),) * 2
    return dims


def _key_block_producer(tile, G: int, stages: int, copy_block):
    """The producer's tile body in the kernels whose ring uses are a query tile's key blocks (the
    forward, `_dq_from_dz`): for block i of tile t (ring use g = base + i, in slot g mod stages)
    copy_block(tile t, its kv head, i, g, slot) waits for the slot and starts its copies."""

    def one_tile(kk, t, base):
        tl = tile(t)
        kh = lax.div(tl.n, i32(G))

        def load(i, c):
            g = base + i
            copy_block(tl, kh, i, g, lax.rem(g, i32(stages)))
            return c

        lax.fori_loop(0, tl.steps, load, None)
        return base + tl.steps

    return one_tile


def _tails(q, k, v) -> Tails:
    return Tails.of(q, k, v, _kernel_head_dims(q.shape[3], v.shape[3]))


# ----------------------------------------------------------------------------- forward


def _forward(q, k, v, bias, mask, q_segment_ids, kv_segment_ids, dropout_seed, spec):
    del bias, mask, dropout_seed  # refused by _supports
    tails = _tails(q, k, v)
    out, lse = _flash_forward(tails.tma_rows(q), tails.tma_cols(k), tails.tma_cols(v, value=True),
                              *tails.ids(q_segment_ids, kv_segment_ids), spec, tails)
    return tails.real_rows(out, tails.Hv), lse[:, :, :tails.T]


def _flash_forward(q, k, v, q_segment_ids, kv_segment_ids, spec, tails: Tails):
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
    overlap = H in _OVERLAP_HEAD_DIMS
    q_tiles = T // CTA

    def tile_at(t, reach=None) -> Tile:
        tl = Tile.of(t, (N, q_tiles, B), band, bkv, S, last_first=True, reach=reach)
        if overlap:
            # The overlapped schedule peels the first block: a tile whose rows see no key (causal
            # with T > S, windows) still visits one block, fully masked (zero output, lse -inf).
            lo = jnp.minimum(tl.lo, S // bkv - 1)
            tl = dataclasses.replace(tl, lo=lo, hi=jnp.maximum(tl.hi, lo + 1))
        return tl

    persistent_dims = _PERSISTENT_HEAD_DIMS + (_PERSISTENT_NARROW_V_HEAD_DIMS if Hv < H else ())
    schedule = _schedule(lambda t: tile_at(t).steps, (N, q_tiles, B), H, segmented, interpret,
                         persistent_dims=persistent_dims, segmented_dims=_PERSISTENT_SEGMENTED_HEAD_DIMS)
    # One pipeline over the CTA's tiles: two Q buffers per warpgroup (the next tile's Q lands
    # while the current one's are read), a separate output buffer, two ring stages and the lse
    # rows (CTA * 4), with 1 KB left for the barriers and the buffers' alignment.
    flat = (overlap and H in _FLAT_FORWARD_HEAD_DIMS and schedule.table is not None and not segmented
            and 2 * q_bytes + out_bytes + 2 * per_stage + CTA * 4 <= _SMEM_LIMIT - 1024)
    q_slots = 2 if flat else 1
    # A separate output buffer lets a consumer load its next Q tile before its last P V; where
    # it would leave fewer than 2 ring stages (H = 256) the output goes out through Q's buffer.
    separate_out = flat or _SMEM_BUDGET - q_bytes - out_bytes >= 2 * per_stage
    assert separate_out or Hv == H, "an output narrower than Q needs its own buffer (`_kernel_head_dims`)"
    stages = 2 if flat else _stages(per_stage, q_bytes + (out_bytes if separate_out else 0))

    def kernel(q_ref, k_ref, v_ref, table_ref, row_ids_ref, col_ids_ref, reach_ref, out_ref, lse_ref,
               q_smem, o_smem, k_smem, v_smem, lse_smem, stage, row_ids_smem, col_ids_smem,
               q_bar, k_bar, v_bar, k_free, v_free):
        wg = lax.axis_index("wg")
        tile = functools.partial(tile_at, reach=reach_ref if segmented else None)
        # Segment ids of the key block in ring slot `slot` (WGMMA column layout), for masked steps:
        # read before the slot is released.
        col_ids_at = lambda slot, masked: segment_ids(col_ids_smem, slot, 0) if masked else None
        # K/V ring uses are numbered across this CTA's tiles: key block j of a tile is use
        # g = base + j - lo (`Schedule.run`).
        k_ring = SlotFree(k_free, stages, FIRST_NAMED_BARRIER, not interpret)
        v_ring = SlotFree(v_free, stages, k_ring.next_id, not interpret)
        sched = PingPong(wg, v_ring.next_id, not interpret)

        def softmax(s, m, l, rows, j, masked, ids):
            """Online softmax of key block j: (p, m', l', alpha) with m' = max(m, rowmax s),
            p = exp2(s - m'), alpha = exp2(m - m'), l' = l alpha + rowsum p (log2 domain).
            ids: (row, column) segment ids, or (None, None)."""
            s, c = _scores(s, spec)
            if masked:
                s = jnp.where(allowed(band, rows, j * bkv, s.shape, *ids), s, -jnp.inf)
            m_new = jnp.maximum(m, jnp.max(s, axis=1) * c)
            m_use = m_new
            if masked:  # a row may have seen no key yet: keep exp2 away from -inf - -inf
                m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)
            alpha = jnp.exp2(m - m_use)
            p = _exp2(s, c, bcast(m_use, s.shape, 0))
            return p, m_new, l * alpha + jnp.sum(p, axis=1), alpha

        def last_pv(mma, acc, p16, g, total):
            """The overlapped schedule's closing P V (ring use g) in the warpgroup's last turn: WG 1
            started with a handover, so it skips its last one and the arrivals pair up."""
            last = lax.rem(g, i32(stages))
            plgpu.barrier_wait(v_bar.at[last])
            sched.turn()
            acc = mma(p16, v_smem.at[last], (ROWS, Hv), acc=acc, a_in_regs=True,
                      after_issue=lambda: pl.when(wg == 0)(sched.handover))
            v_ring.release(last, g, total)
            return acc

        def sequential(tl, base, total, rows, row_ids, q_s, mma, m, l, q_free):
            """Ping-pong per block: Q K_j^T, softmax, P_j V_j; a WG waits for its turn before P V."""
            pl.when(wg == 1)(sched.turn)  # WG 1 starts one turn behind

            def step(j, carry, masked):
                acc, m, l = carry
                g = base + j - tl.lo
                slot = lax.rem(g, i32(stages))
                plgpu.barrier_wait(k_bar.at[slot])
                col_ids = col_ids_at(slot, masked)
                s = mma(q_s, k_smem.at[slot].transpose((1, 0)), (ROWS, bkv), after_issue=sched.handover)
                k_ring.release(slot, g, total)
                p, m, l_new, alpha = softmax(s, m, l, rows, j, masked, (row_ids, col_ids))
                acc = acc * bcast(alpha, acc.shape, 0)
                p16 = p.astype(dt)
                if H <= 128:  # finish the softmax before handing over the tensor cores
                    l = l_new
                    acc, l, m, p16 = lax.optimization_barrier((acc, l, m, p16))
                plgpu.barrier_wait(v_bar.at[slot])
                sched.turn()
                if H > 128:
                    l = l_new
                acc = mma(p16, v_smem.at[slot], (ROWS, Hv), acc=acc, a_in_regs=True)
                v_ring.release(slot, g, total)
                return acc, m, l

            carry = (zeros((ROWS, Hv)), m, l)
            acc, m, l = three_loops(tl.lo, tl.full_lo, tl.full_hi, tl.hi, step, carry, band, segmented)
            pl.when(wg == 0)(sched.handover)  # WG 1's last turn
            q_free()
            return acc, m, l

        def overlapped(tl, base, total, rows, row_ids, q_s, mma, m, l, q_free):
            """FA3's schedule: in its turn a WG issues Q K_j^T and P_{j-1} V_{j-1} together, hands
            the tensor cores over, runs block j's softmax while its P V is still in flight, then
            rescales. Interpret mode runs the same order synchronously."""
            pl.when(wg == 1)(sched.handover)  # WG 0 takes the first turn
            first_slot = lax.rem(base, i32(stages))
            plgpu.barrier_wait(k_bar.at[first_slot])
            first_masked = band.masks or segmented
            col_ids = col_ids_at(first_slot, first_masked)
            sched.turn()
            s = mma(q_s, k_smem.at[first_slot].transpose((1, 0)), (ROWS, bkv), after_issue=sched.handover)
            k_ring.release(first_slot, base, total)
            p, m, l, _ = softmax(s, m, l, rows, tl.lo, first_masked, (row_ids, col_ids))

            def step(j, carry, masked):
                acc, m, l, p_prev = carry
                g = base + j - tl.lo
                slot, prev = lax.rem(g, i32(stages)), lax.rem(g - 1, i32(stages))
                plgpu.barrier_wait(k_bar.at[slot])
                col_ids = col_ids_at(slot, masked)
                plgpu.barrier_wait(v_bar.at[prev])
                sched.turn()

                def between(s):  # runs while P_{j-1} V_{j-1} is in flight
                    k_ring.release(slot, g, total)
                    p, m_new, l_new, alpha = softmax(s, m, l, rows, j, masked, (row_ids, col_ids))
                    return p.astype(dt), m_new, l_new, alpha

                acc, (p16, m, l, alpha) = mma.overlapped(
                    q_s, k_smem.at[slot].transpose((1, 0)), (ROWS, bkv), p_prev, v_smem.at[prev], acc,
                    between, (p_prev, m, l, m), after_issue=sched.handover)
                v_ring.release(prev, g - 1, total)
                return acc * bcast(alpha, acc.shape, 0), m, l, p16

            first = tl.lo + 1  # block lo was the prologue
            mid_lo = jnp.maximum(tl.full_lo, first)
            acc, m, l, p16 = three_loops(first, mid_lo, jnp.maximum(tl.full_hi, mid_lo), tl.hi, step,
                                          (zeros((ROWS, Hv)), m, l, p.astype(dt)), band, segmented)
            q_free()  # every Q K^T of this tile is done
            return last_pv(mma, acc, p16, base + tl.steps - 1, total), m, l

        def store_tile(tl, acc, m, l, o_s, wait: bool):
            """A finished tile's rows acc / l and lse = (m + log2 l) ln 2 (-inf and 0 for rows that
            saw no key) out by TMA through o_s and lse_smem; wait: for the previous tile's stores
            to have read them first."""
            seen = l > 0.0
            inv = jnp.where(seen, 1.0 / jnp.where(seen, l, 1.0), 0.0)
            if wait:
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)
            o_s[...] = (acc * bcast(inv, acc.shape, 0)).astype(dt)
            lse_smem.at[wg][...] = jnp.where(seen, (m + jnp.log2(jnp.where(seen, l, 1.0))) * _LN2, -jnp.inf)
            plgpu.commit_smem()
            rows = pl.ds(tl.r0 + wg * ROWS, ROWS)
            plgpu.copy_smem_to_gmem(o_s, out_ref.at[tl.b, rows, tl.n])
            plgpu.copy_smem_to_gmem(lse_smem.at[wg], lse_ref.at[tl.b, tl.n, rows])

        def consumer():
            q_s = q_smem.at[wg]
            o_s = o_smem.at[wg] if separate_out else q_s
            mma = Mma(interpret, None if stage is None else stage.at[wg])
            total = schedule.total(table_ref, lambda t: tile(t).steps)
            k_ring.prime(total)
            v_ring.prime(total)

            def load_q(kk):
                tl = tile(schedule.tile(table_ref, kk))
                rows = (tl.b, pl.ds(tl.r0 + wg * ROWS, ROWS), tl.n)
                plgpu.copy_gmem_to_smem(q_ref.at[rows], q_s, q_bar.at[wg])
                if segmented:
                    plgpu.copy_gmem_to_smem(row_ids_ref.at[rows[:2]], row_ids_smem.at[wg], q_bar.at[wg])

            load_q(0)

            def one_tile(kk, t, base):
                tl = tile(t)
                rows = tl.r0 + wg * ROWS
                prefetch = lambda: pl.when(schedule.has_next(table_ref, kk))(functools.partial(load_q, kk + 1))
                if schedule.table is not None:
                    sched.realign()
                plgpu.barrier_wait(q_bar.at[wg])
                row_ids = segment_ids(row_ids_smem, wg, 1)
                loop = overlapped if overlap else sequential
                acc, m, l = loop(tl, base, total, rows, row_ids, q_s, mma, full_rows(ROWS, -jnp.inf, 1),
                                 full_rows(ROWS, 0.0, 1), prefetch if separate_out else lambda: None)
                store_tile(tl, acc, m, l, o_s, separate_out)
                if not separate_out:  # Q's buffer holds the output until the store has read it
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                    prefetch()
                return base + tl.steps

            return one_tile

        def flat_consumer():
            """Every tile of this CTA in one software pipeline: `overlapped` carried across tiles.
            Tile kk's first Q K^T is issued with tile kk-1's last P V, its softmax (from fresh row
            statistics) runs while that P V is in flight, and then tile kk-1's rows are stored, so
            the tensor cores keep the other warpgroup's work at a tile boundary. Q alternates
            between two buffers per warpgroup (the next tile's lands while this one's are read);
            the warpgroups ping-pong from the CTA's first block to its last without meeting."""
            mma = Mma(interpret, None if stage is None else stage.at[wg])
            o_s = o_smem.at[wg]
            tiles = schedule.count(table_ref)
            tile_of = lambda kk: tile(schedule.tile(table_ref, kk))
            total = schedule.total(table_ref, lambda t: tile(t).steps)
            k_ring.prime(total)
            v_ring.prime(total)
            q_buf = lambda kk: lax.rem(kk, i32(2)) * WGS + wg
            fresh = lambda: (full_rows(ROWS, -jnp.inf, 1), full_rows(ROWS, 0.0, 1))

            def load_q(kk):
                tl = tile_of(kk)
                plgpu.copy_gmem_to_smem(q_ref.at[tl.b, pl.ds(tl.r0 + wg * ROWS, ROWS), tl.n],
                                        q_smem.at[q_buf(kk)], q_bar.at[q_buf(kk)])

            def step(tl, kk, base, j, carry, masked, first=False):
                """Block j of tile kk with the previous ring use's P V in flight: (acc + P V, then
                block j's p16, m', l', alpha). first: block j starts the tile (fresh m and l)."""
                acc, m, l, p_prev = carry
                g = base + j - tl.lo
                slot, prev = lax.rem(g, i32(stages)), lax.rem(g - 1, i32(stages))
                if first:
                    plgpu.barrier_wait(q_bar.at[q_buf(kk)])
                    m, l = fresh()
                plgpu.barrier_wait(k_bar.at[slot])
                plgpu.barrier_wait(v_bar.at[prev])
                sched.turn()

                def between(s):  # runs while the previous P V is in flight
                    k_ring.release(slot, g, total)
                    p, m_new, l_new, alpha = softmax(s, m, l, tl.r0 + wg * ROWS, j, masked, (None, None))
                    return p.astype(dt), m_new, l_new, alpha

                acc, (p16, m, l, alpha) = mma.overlapped(
                    q_smem.at[q_buf(kk)], k_smem.at[slot].transpose((1, 0)), (ROWS, bkv), p_prev, v_smem.at[prev],
                    acc, between, (p_prev, m, l, m), after_issue=sched.handover)
                v_ring.release(prev, g - 1, total)
                return acc, p16, m, l, alpha

            def rest(tl, kk, base, carry):
                """Blocks lo + 1 .. hi - 1 of tile kk."""
                def body(j, carry, masked):
                    acc, p16, m, l, alpha = step(tl, kk, base, j, carry, masked)
                    return acc * bcast(alpha, acc.shape, 0), m, l, p16

                first = tl.lo + 1
                mid_lo = jnp.maximum(tl.full_lo, first)
                return three_loops(first, mid_lo, jnp.maximum(tl.full_hi, mid_lo), tl.hi, body, carry, band)

            def next_tile(kk, state):
                carry, base = state
                tl = tile_of(kk)
                acc, p16, m, l, _ = step(tl, kk, base, tl.lo, carry, band.masks, first=True)
                # Into tile kk - 1's Q buffer: its Q K^Ts are done.
                pl.when(kk + 1 < tiles)(functools.partial(load_q, kk + 1))
                store_tile(tile_of(kk - 1), acc, carry[1], carry[2], o_s, True)
                return rest(tl, kk, base, (zeros((ROWS, Hv)), m, l, p16)), base + tl.steps

            load_q(i32(0))
            pl.when(tiles > 1)(functools.partial(load_q, i32(1)))
            pl.when(wg == 1)(sched.handover)  # WG 0 takes the first turn
            tl = tile_of(i32(0))  # its first block: Q K^T alone
            plgpu.barrier_wait(q_bar.at[q_buf(i32(0))])
            plgpu.barrier_wait(k_bar.at[0])
            sched.turn()
            s = mma(q_smem.at[q_buf(i32(0))], k_smem.at[0].transpose((1, 0)), (ROWS, bkv), after_issue=sched.handover)
            k_ring.release(i32(0), i32(0), total)
            p, m, l, _ = softmax(s, *fresh(), tl.r0 + wg * ROWS, tl.lo, band.masks, (None, None))
            carry = rest(tl, i32(0), i32(0), (zeros((ROWS, Hv)), m, l, p.astype(dt)))
            carry, _ = lax.fori_loop(1, tiles, next_tile, (carry, tl.steps))
            acc, m, l, p16 = carry
            acc = last_pv(mma, acc, p16, total - 1, total)
            store_tile(tile_of(tiles - 1), acc, m, l, o_s, True)

        def copy_block(tl, kh, i, g, slot):
            keys = (tl.b, pl.ds((tl.lo + i) * bkv, bkv), kh)
            k_ring.acquire(slot, g)
            plgpu.copy_gmem_to_smem(k_ref.at[keys], k_smem.at[slot], k_bar.at[slot])
            if segmented:
                plgpu.copy_gmem_to_smem(col_ids_ref.at[keys[:2]], col_ids_smem.at[slot], k_bar.at[slot])
            v_ring.acquire(slot, g)
            plgpu.copy_gmem_to_smem(v_ref.at[keys], v_smem.at[slot], v_bar.at[slot])

        warp_specialized(wg, schedule, table_ref, flat_consumer if flat else consumer,
                         lambda: _key_block_producer(tile, G, stages, copy_block))

    tr = _block_transforms(dt, H, Hv)

    scratch = [
        plgpu.SMEM((q_slots * WGS, ROWS, H), dt, transforms=tr),
        plgpu.SMEM((WGS, ROWS, Hv), dt, transforms=tr) if separate_out else None,
        plgpu.SMEM((stages, bkv, H), dt, transforms=tr),
        plgpu.SMEM((stages, bkv, Hv), dt, transforms=tr),
        plgpu.SMEM((WGS, ROWS), F32),
        *_staging_and_segment_buffers(dt, bkv, stages, interpret, segmented),
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


# ----------------------------------------------------------------------------- backward


def _dkv_query_block(H: int, parts: tuple[str, ...]) -> int:
    """The dK/dV kernel's query block for q/k head dim H computing `parts` (see `_dkv`): 64 at
    H <= 128; above, 32 for dk and dv in one launch (beside a narrower v), 64 or 32 for dk alone
    (`_DK_QUERY_BLOCK_64_HEAD_DIMS`), 64 for dv alone."""
    if H <= 128 or parts == ("dv",):
        return 64
    if parts == ("dk",):
        return 64 if H in _DK_QUERY_BLOCK_64_HEAD_DIMS else 32
    return 32


def _dkv(q, k, v, do, lse2, delta, q_segment_ids, kv_segment_ids, spec, tails: Tails,
         parts: tuple[str, ...] = ("dk", "dv"), dz_tiles: PackedTiles | None = None):
    """The `parts` of (dk [B, S, K, H], dv [B, S, K, Hv]): one CTA per 128 keys of one (b, kv
    head), the accumulators in registers, query blocks of `_dkv_query_block` rows streamed.

    At H > 128 dk and dv would take 192-256 registers per thread together, so `_backward` launches
    this kernel once per part: dk (which needs V too, for dpT) with 64-query blocks at H = 192
    and 32 at 256 (`_DK_QUERY_BLOCK_64_HEAD_DIMS`), dv (K only) with 64, each in at most 192
    registers and about 192 KB of SMEM. Beside a narrower v (MLA's 192 / 128) both fit one launch
    with 32-query blocks (`_ONE_DKV_LAUNCH_NARROW_V_HEAD_DIMS`).

    One-pass variants that also add each CTA's ds k into an f32 dq with TMA reduce-adds (5
    matmuls instead of 7, FA3-style) were built three times and measured slower on H200s
    (benchmarks/ATTENTION.md; the last one's code is in commit 8589a0f). So dq stays a separate,
    deterministic kernel: `_dq`, or `_dq_from_dz` from the tiles below.

    dz_tiles (with dk; `_dz_tiles`'s layout): each step's dz^T tile (q's dtype, what the dk product
    consumes) also goes out, into [B, N, pairs, 128 keys, 64 queries] packed by it (each warpgroup writes
    its 64 keys' half), for `_dq_from_dz`, through a double-buffered SMEM
    tile per warpgroup and a TMA store (storing the registers straight to global memory made
    the kernel 1.5x as slow: 2.968 against 1.956 ms, H200).
    """
    B, _, N, H = q.shape
    K, Hv = k.shape[2], v.shape[3]
    T, S = tails.T_padded, tails.S_padded  # the tiles' extent; q, k may end before (`Tails`)
    G, dt = N // K, q.dtype
    bq = _dkv_query_block(H, parts)
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
    stages = _stages(bq * (H + Hv) * item + row_terms * bq * 4,
                     CTA * (H + (Hv if v_tile else 0)) * item + dz_bytes)
    band = Band.keys_by_query(spec, tails)
    fa3_order = H in _DKV_FA3_ORDER_HEAD_DIMS and want_dk and want_dv
    fresh_pair = fa3_order or not want_dv  # q k^T and dO v^T issued together

    def tile_at(t, reach=None) -> Tile:  # rows = 128 keys of kv head n, columns = blocks of bq queries
        return Tile.of(t, (K, S // CTA, B), band, bq, T, last_first=False, reach=reach)

    # A left window: every tile is long and persistent measured slower (see _PERSISTENT_DKV_HEAD_DIMS).
    windowed = spec.window_left is not None
    schedule = _schedule(lambda t: G * tile_at(t).steps, (K, S // CTA, B), H, segmented, interpret,
                         persistent_dims=() if windowed else _PERSISTENT_DKV_HEAD_DIMS,
                         segmented_dims=() if windowed else _PERSISTENT_SEGMENTED_DKV_HEAD_DIMS)

    def kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, table_ref, row_ids_ref, col_ids_ref, reach_ref,
               dz_base_ref, *refs):
        out_refs, refs = dict(zip(parts, refs[:len(parts)])), refs[len(parts):]
        dz_ref, refs = (refs[0], refs[1:]) if packed else (None, refs)
        (k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem, dz_smem, stage, row_ids_smem, col_ids_smem,
         kv_bar, loaded, free) = refs
        wg = lax.axis_index("wg")
        ring = SlotFree(free, stages, FIRST_NAMED_BARRIER, named=False)
        tile = functools.partial(tile_at, reach=reach_ref if segmented else None)
        steps_of = lambda t: G * tile(t).steps  # ring uses: every query head of the group

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
                gk = (tl.b, pl.ds(keys, ROWS), tl.n)
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
                            st, c = _scores(st, spec)
                        else:
                            st, c = _scores(mma(k_s, q_t, (ROWS, bq)), spec)
                        lse = plgpu.load(lse_smem.at[slot], layout=plgpu.Layout.WGMMA.reduce(0))
                        pt = _exp2(st, c, bcast(lse, st.shape, 1))
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
                                dst = dst * _cap_grad(st, spec)
                            dst = dst.astype(dt)

                            def store_dz():  # the other buffer's store (the last step's) may stay in flight
                                buf = dz_smem.at[wg, lax.rem(i, i32(2))]
                                plgpu.wait_smem_to_gmem(1, wait_read_only=True)
                                buf[...] = dst
                                plgpu.commit_smem()
                                entry = packed.entry(dz_base_ref, lax.div(tl.r0, i32(CTA)), j)
                                plgpu.copy_smem_to_gmem(buf, dz_ref.at[tl.b, tl.n * G + g, entry, pl.ds(wg * ROWS, ROWS)])

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

                accs = lax.fori_loop(0, G, head, tuple(zeros((ROWS, widths[name])) for name in parts))
                # The results go out through the K/V buffers (every wgmma reading them is done).
                bufs = {"dk": k_s, "dv": k_s if v_s is None else v_s}
                for name, acc in zip(parts, accs):
                    buf = bufs[name]
                    buf[...] = (acc * spec.scale if name == "dk" else acc).astype(dt)
                    plgpu.commit_smem()
                    plgpu.copy_smem_to_gmem(buf, out_refs[name].at[gk])
                return base + G * per_head

            return one_tile

        def producer():
            def one_tile(kk, t, base):
                tl = tile(t)
                per_head = jnp.maximum(tl.steps, 1)

                def load(i, c):
                    slot = lax.rem(base + i, i32(stages))
                    n = tl.n * G + lax.div(i, per_head)
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

                lax.fori_loop(0, G * tl.steps, load, None)
                return base + G * tl.steps

            return one_tile

        warp_specialized(wg, schedule, table_ref, consumer, producer)

    tr = _block_transforms(dt, bq, H, Hv)  # one swizzle for every wgmma operand

    scratch = [
        plgpu.SMEM((WGS, ROWS, H), dt, transforms=tr),
        plgpu.SMEM((WGS, ROWS, Hv), dt, transforms=tr) if v_tile else None,
        plgpu.SMEM((stages, bq, H), dt, transforms=tr),
        plgpu.SMEM((stages, bq, Hv), dt, transforms=tr),
        plgpu.SMEM((stages, bq), F32),
        plgpu.SMEM((stages, bq), F32) if want_dk else None,
        plgpu.SMEM((WGS, 2, ROWS, bq), dt, transforms=tr) if packed else None,
        *_staging_and_segment_buffers(dt, bq, stages, interpret, segmented),
    ]
    # Tile copies: K (and V); slot copies: Q, dO, lse (and delta).
    bars = _backward_barriers(tile_copies=2 if want_dk else 1, slot_copies=4 if want_dk else 3, stages=stages,
                              segmented=segmented)
    out_type = tuple(jax.ShapeDtypeStruct(k.shape[:3] + (widths[name],), dt) for name in parts) + (
        (jax.ShapeDtypeStruct((B, N, packed.entries, CTA, bq), dt),) if packed else ())
    name = "attention_" + "".join(parts) if len(parts) == 1 else "attention_dkv"
    return launch(name, kernel, scratch, bars, out_type, schedule, interpret)(
        q, k, v, do, lse2, delta, schedule.input(), *segment_inputs(kv_segment_ids, q_segment_ids),
        jnp.asarray(packed.base if packed else np.zeros(1, np.int32)))


def _dq(q, k, v, do, out, lse2, row_term, q_segment_ids, kv_segment_ids, spec, tails: Tails, *,
        fused_delta: bool):
    """dq [B, T, N, H] (v, dO, O [.., Hv]): one CTA per 128 query rows of one (b, n), key blocks of
    `_dq_block_kv` streamed.

    fused_delta: row_term is dlse, and delta = rowsum(dO * O) - dlse is computed here for the
    CTA's own rows before its loop and returned too, (dq, delta [B, N, T] f32), for the dK/dV
    kernel (the producer streams the tile's O rows through the tile's first ring slot: the
    kernel has no SMEM to spare, so a tile makes steps + 1 ring uses; so Hv = H). Otherwise
    row_term is delta itself and `out` is not read (see `_DELTA_IN_DQ_KERNEL`)."""
    B, _, N, H = q.shape
    K, Hv = k.shape[2], v.shape[3]
    T, S = tails.T_padded, tails.S_padded  # the tiles' extent; q, k may end before (`Tails`)
    G, dt = N // K, q.dtype
    bkv = _dq_block_kv(H)
    assert (bkv >= CTA and Hv == H) or not fused_delta, "the O rows of a tile go through one K ring slot"
    item = jnp.dtype(dt).itemsize
    segmented = q_segment_ids is not None
    assert not (segmented and fused_delta), "the O rows' ring use has no segment ids copy"
    stages = _stages(bkv * (H + Hv) * item + (4 * bkv if segmented else 0), CTA * (H + Hv) * item)
    band = Band.forward(spec, tails)
    interpret = interpret_enabled()
    tile_at = lambda t, reach=None: Tile.of(t, (N, T // CTA, B), band, bkv, S, last_first=True, reach=reach)
    first = 1 if fused_delta else 0  # ring uses before the key blocks
    schedule = _schedule(lambda t: tile_at(t).steps + first, (N, T // CTA, B), H, segmented, interpret,
                         persistent_dims=_PERSISTENT_DQ_HEAD_DIMS)

    def kernel(q_ref, k_ref, v_ref, do_ref, o_ref, lse_ref, row_ref, table_ref, row_ids_ref, col_ids_ref, reach_ref,
               dq_ref, *rest):
        delta_ref = rest[0] if fused_delta else None
        (q_smem, do_smem, k_smem, v_smem, lse_smem, row_smem, delta_smem, stage, row_ids_smem, col_ids_smem,
         q_bar, loaded, free) = rest[-13:]
        wg = lax.axis_index("wg")
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
                    s, c = _scores(mma(q_s, k_smem.at[slot].transpose((1, 0)), (ROWS, bkv)), spec)
                    p = _exp2(s, c, bcast(lse, s.shape, 0))
                    if masked:
                        col_ids = segment_ids(col_ids_smem, slot, 0)
                        p = jnp.where(allowed(band, rows, j * bkv, s.shape, row_ids, col_ids), p, 0.0)
                    dp = mma(do_s, v_smem.at[slot].transpose((1, 0)), (ROWS, bkv))
                    ds = p * (dp - bcast(dl, s.shape, 0))
                    if spec.logit_soft_cap is not None:
                        ds = ds * _cap_grad(s, spec)
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

    tr = _block_transforms(dt, bkv, H, Hv)  # one swizzle for every wgmma operand

    scratch = [
        plgpu.SMEM((WGS, ROWS, H), dt, transforms=tr),
        plgpu.SMEM((WGS, ROWS, Hv), dt, transforms=tr),
        plgpu.SMEM((stages, bkv, H), dt, transforms=tr),
        plgpu.SMEM((stages, bkv, Hv), dt, transforms=tr),
        plgpu.SMEM((WGS, ROWS), F32),
        plgpu.SMEM((WGS, ROWS), F32),
        plgpu.SMEM((WGS, ROWS), F32),
        *_staging_and_segment_buffers(dt, bkv, stages, interpret, segmented),
    ]
    # Tile copies: dO, lse, the row term, Q; slot copies: K, V (or a tile's O rows, two halves).
    bars = _backward_barriers(tile_copies=4, slot_copies=2, stages=stages, segmented=segmented)
    out_type = (jax.ShapeDtypeStruct(q.shape, dt),) + (
        (jax.ShapeDtypeStruct((B, N, T), F32),) if fused_delta else ())
    return launch("attention_dq", kernel, scratch, bars, out_type, schedule, interpret)(
        q, k, v, do, out, lse2, row_term, schedule.input(), *segment_inputs(q_segment_ids, kv_segment_ids))


def _dq_from_dz(q, k, dz, packed: PackedTiles, q_segment_ids, kv_segment_ids, spec, tails: Tails):
    """dq = scale * dz k [B, T, N, H] from the dz^T tiles `_dkv` wrote, packed as `packed` (`_dz_tiles`):
    one CTA per 128 query rows of one (b, n), blocks of `_DQ_FROM_DZ_BLOCK_KV` keys streamed with
    their dz^T tiles (one per warpgroup's 64 queries), one wgmma per step where `_dq` also recomputes q k^T and
    dO v^T. The CTA's key blocks (`Band.forward`) may hold tiles `_dkv` never wrote for one
    warpgroup's 64 rows (its query blocks come from `Band.keys_by_query` per 128 keys): a
    warpgroup keeps a step's product only where its query block was in that key tile's range."""
    B, _, N, H = q.shape
    K = k.shape[2]
    T, S = tails.T_padded, tails.S_padded
    G, dt = N // K, q.dtype
    item = jnp.dtype(dt).itemsize
    bq = _dkv_query_block(H, ("dk", "dv"))
    assert bq == ROWS, "a warpgroup's rows are one dK/dV query block"
    bkv = _DQ_FROM_DZ_BLOCK_KV
    segmented = q_segment_ids is not None
    stages = _stages(bkv * (H + WGS * ROWS) * item, WGS * ROWS * H * item, cap=4)
    band, written = Band.forward(spec, tails), Band.keys_by_query(spec, tails)
    interpret = interpret_enabled()
    tile_at = lambda t, reach=None: Tile.of(t, (N, T // CTA, B), band, bkv, S, last_first=True, reach=reach)
    schedule = _schedule(lambda t: tile_at(t).steps, (N, T // CTA, B), H, segmented, interpret,
                         persistent_dims=_PERSISTENT_DQ_FROM_DZ_HEAD_DIMS)

    def kernel(k_ref, dz_ref, table_ref, reach_ref, key_reach_ref, dz_base_ref, dq_ref, k_smem, dz_smem, out_smem,
               loaded, free):
        wg = lax.axis_index("wg")
        ring = SlotFree(free, stages, FIRST_NAMED_BARRIER, named=False)
        tile = functools.partial(tile_at, reach=reach_ref if segmented else None)
        steps_of = lambda t: tile(t).steps

        def consumer():
            total = schedule.total(table_ref, steps_of)
            ring.prime(total)

            def one_tile(kk, t, base):
                tl = tile(t)
                rows = tl.r0 + wg * ROWS
                kh = lax.div(tl.n, i32(G))
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
            plgpu.copy_gmem_to_smem(k_ref.at[tl.b, pl.ds(k0, bkv), kh], k_smem.at[slot], loaded.at[slot])
            key_tile, row = lax.div(k0, i32(CTA)), pl.ds(lax.rem(k0, i32(CTA)), bkv)
            for w in range(WGS):
                entry = packed.entry(dz_base_ref, key_tile, lax.div(tl.r0, i32(bq)) + w)
                plgpu.copy_gmem_to_smem(dz_ref.at[tl.b, tl.n, entry, row], dz_smem.at[slot, w], loaded.at[slot])

        warp_specialized(wg, schedule, table_ref, consumer, lambda: _key_block_producer(tile, G, stages, copy_block))

    tr = _block_transforms(dt, bkv, H, ROWS)
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
    return launch("attention_dq_from_dz", kernel, scratch, bars, jax.ShapeDtypeStruct(q.shape, dt), schedule,
                  interpret)(k, dz, schedule.input(), reach, key_reach, jnp.asarray(packed.base))


def _dz_layout(spec: AttentionSpec, tails: Tails) -> PackedTiles:
    """Where `_dkv` puts each dz^T tile (128 keys x one query block of 64) of a head: one entry per
    (key tile, query block) pair the band lets meet (`PackedTiles`), so a causal call stores
    half of [S, T] and a windowed one only its band."""
    return PackedTiles.of(Band.keys_by_query(spec, tails), tails.S_padded // CTA,
                          _dkv_query_block(tails.head_dim, ("dk", "dv")), tails.T_padded)


def _dz_tiles(spec: AttentionSpec, tails: Tails, B: int, N: int, dt) -> PackedTiles | None:
    """The dz^T tiles' layout (`_dz_layout`) when the backward takes dq from them (`_dq_from_dz`),
    else None: at `_DZ_TILES_HEAD_DIMS` (one dK/dV launch), without a left window
    (`_DZ_TILES_WINDOWED`), while the B*N heads' packed tiles fit `_DZ_TILES_MAX_BYTES`. Under a
    window the tiles' stores slowed the dK/dV kernel (one CTA per tile there) by more than the dq
    kernel saved: window (4096, 0) causal B1 T16384 N32, kernels 7.103 against 6.635 ms (dK/dV
    3.984 against 2.970; H100, benchmarks/results/attention_H100_2026-11-26_packed_dz_tiles_window.json)."""
    if (tails.head_dim not in _DZ_TILES_HEAD_DIMS or tails.value_head_dim > tails.head_dim
            or (spec.window_left is not None and not _DZ_TILES_WINDOWED)):
        return None
    layout = _dz_layout(spec, tails)
    nbytes = B * N * layout.entries * CTA * layout.blk * jnp.dtype(dt).itemsize
    return layout if nbytes <= _DZ_TILES_MAX_BYTES else None


def _backward(q, k, v, bias, mask, q_segment_ids, kv_segment_ids, dropout_seed, out, lse, dout, dlse, spec):
    del bias, mask, dropout_seed  # refused by _supports
    tails = _tails(q, k, v)
    H, dt = tails.head_dim, q.dtype
    dlse = jnp.broadcast_to(dlse, lse.shape).astype(F32)
    # log2-domain lse; an empty row (lse = -inf) gets +inf so that exp2(s - lse) = 0; so do the
    # rows past T (`Tails`), whose dO is 0.
    lse2 = tails.row_stats(jnp.where(jnp.isfinite(lse), lse * _LOG2E, jnp.inf), jnp.inf)
    q, k, v = tails.tma_rows(q), tails.tma_cols(k), tails.tma_cols(v, value=True)
    out, dout = tails.tma_rows(out.astype(dt), value=True), tails.tma_rows(dout.astype(dt), value=True)
    segments = tails.ids(q_segment_ids, kv_segment_ids)
    rows = slice(0, tails.T)
    xla_delta = lambda: tails.row_stats(
        jnp.einsum("btnh,btnh->bnt", dout[:, rows].astype(F32), out[:, rows].astype(F32)) - dlse)
    dz_tiles = _dz_tiles(spec, tails, q.shape[0], q.shape[2], dt)
    if dz_tiles is not None:  # dK/dV first, then dq from its dz^T tiles
        delta = xla_delta()
        dk, dv, dz = _dkv(q, k, v, dout, lse2, delta, *segments, spec, tails, dz_tiles=dz_tiles)
        dq = _dq_from_dz(q, k, dz, dz_tiles, *segments, spec, tails)
    else:
        # delta in the dQ kernel needs a key block that holds a tile's O rows (`_dq`).
        if (_DELTA_IN_DQ_KERNEL and spec.window_left is None and q_segment_ids is None
                and _dq_block_kv(H) >= CTA and tails.value_head_dim == H):
            dq, delta = _dq(q, k, v, dout, out, lse2, tails.row_stats(dlse), *segments, spec, tails, fused_delta=True)
        else:
            delta = xla_delta()
            (dq,) = _dq(q, k, v, dout, out, lse2, delta, *segments, spec, tails, fused_delta=False)
        if H <= 128 or (tails.value_head_dim < H and H in _ONE_DKV_LAUNCH_NARROW_V_HEAD_DIMS):
            dk, dv = _dkv(q, k, v, dout, lse2, delta, *segments, spec, tails)
        else:  # one accumulator per launch (`_dkv`)
            (dk,) = _dkv(q, k, v, dout, lse2, delta, *segments, spec, tails, parts=("dk",))
            (dv,) = _dkv(q, k, v, dout, lse2, delta, *segments, spec, tails, parts=("dv",))
    return tails.real_rows(dq, tails.H), tails.real_cols(dk, tails.H), tails.real_cols(dv, tails.Hv), None


# ----------------------------------------------------------------------------- wiring


def _supports(q, k, v, bias, mask, q_segment_ids, kv_segment_ids, dropout_seed, *, spec) -> str | None:
    del dropout_seed
    _, T, _, H = q.shape
    S, Hv = k.shape[1], v.shape[3]
    if jnp.dtype(q.dtype) not in _DTYPES:
        return f"dtype {jnp.dtype(q.dtype).name} not supported: needs bf16 or f16"
    if bias is not None or mask is not None:
        return "bias/mask not supported"
    if spec.dropout_rate > 0:
        return "dropout not supported"
    if _kernel_head_dims(H, Hv) is None:
        return f"head_dim {H} (v {Hv}) not supported: needs both at most {_HEAD_DIMS[-1]}"
    if T == 0 or S == 0:
        return f"T={T}, S={S}: empty"
    return gpu_refusal(wgmma=True)


ATTENTION = Implementation(
    fn=differentiable_attention(AttentionKernels(forward=_forward, backward=_backward)),
    platforms=("gpu",),
    interpretable=True,
    supports=_supports,
)
