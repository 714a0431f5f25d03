"""The Triton attention backward: a fused, atomic-free dK/dV + dQ launch.

`_delta_kernel` computes D = rowsum(dout * out) - dlse, then ONE `_bwd_kernel` launch with grid
(cdiv(S, BN1) + cdiv(T, BM2), B*N): the first programs of each (b, n) do dK/dV for a key block,
looping over query blocks; the rest do dQ for a query block, looping over key blocks
(recomputing p and dp). GQA: the dK/dV program of kv head h loops over its G query heads itself
(only the programs with n % G == 0 work; the others exit), so dk/dv are summed in f32 registers
and written once in k's dtype. No atomics: deterministic.

With `TritonAttentionConfig.dq_from_dz_tiles` (and no bias, while the B*N heads' dz^T tiles in
q's dtype fit `DZ_TILES_MAX_BYTES`), the launch has only the dK/dV programs, which also store
each dz^T tile they compute (DZT_OUT), and `_dq_kernel` computes dq = scale * dz k from them:
one matmul per tile where the dQ programs recompute q k^T and dO v^T first. The pair runs per
chunk of query heads whose tiles fit `dz_chunk_bytes` (kernels/common/attention_chunks.py),
the chunks reusing one buffer; a GQA group split across chunks carries f32 dk/dv sums.

With a bias, the dQ half also writes dz = p (dp - D) (before the soft-cap factor) as f32
[B, N, T, S], zeros on skipped blocks, when the bias has that full extent; a bias broadcast
over batch or heads gets `_dbias_kernel`, which sums dz over the broadcast axes in registers
(recomputing the scores), never B*N*T*S floats.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import triton
from jax import lax
import triton.language as tl

from forgeax.kernels.common.attention_chunks import HeadChunk, head_chunks
from forgeax.kernels.triton.attention_tiles import (
    LOG2E, dot, head_hash, head_rows, keep_mask, kernel_statics, key_blocks, logits2, optional_inputs, padded_dim,
    query_block_keys, query_blocks, rule_allows,
)
from forgeax.kernels.triton.launch import triton_call

if TYPE_CHECKING:
    from forgeax.kernels.triton.attention import TritonAttentionConfig

# The most memory the dz^T tiles of `dq_from_dz_tiles` may take: 4 GiB holds causal B4 T4096 N32
# and Llama-3-8B's B1 T8192 N32 at 16 bits; longer calls recompute dq in the dQ programs.
DZ_TILES_MAX_BYTES = 4 << 30


@triton.jit
def _delta_kernel(O, DO, DLSE, DELTA, T: tl.constexpr, N: tl.constexpr, HV: tl.constexpr, HVP: tl.constexpr,
                  BM: tl.constexpr):
    """DELTA[b, n, t] = sum_h dout * out - dlse (f32)."""
    bn = tl.program_id(1)
    t = tl.program_id(0) * BM + tl.arange(0, BM)
    hv = tl.arange(0, HVP)
    base = (bn // N).to(tl.int64) * (T * N * HV) + (bn % N) * HV
    offs = base + t[:, None] * (N * HV) + hv[None, :]
    inside = (t[:, None] < T) & (hv[None, :] < HV)
    o = tl.load(O + offs, mask=inside, other=0.0).to(tl.float32)
    do = tl.load(DO + offs, mask=inside, other=0.0).to(tl.float32)
    row, row_inside = _stat_row(bn, t, T)
    dlse = tl.load(DLSE + row, mask=row_inside, other=0.0)
    tl.store(DELTA + row, tl.sum(o * do, 1) - dlse, mask=row_inside)  # 0 on the padding (o, do = 0 there)


@triton.constexpr_function
def stat_row_length(T: int) -> int:
    """Row length of the backward's lse, dlse and delta [B, N, .] (`_stat_row`, `backward`; a
    constexpr function: kernels and host share it): T rounded up to 4 floats. With rows of odd
    length the heads' rows start unaligned, their loads lose vectorisation and the backward runs
    about half again as long (benchmarks/results/attention_H200_2026-11-26_triton_odd_lengths.json)."""
    return -(-T // 4) * 4


@triton.jit
def _stat_row(bn, t, T: tl.constexpr):
    """(offsets, in bounds) of rows t of head bn = b * N + n in the backward's per-row statistics
    (lse, dlse, delta): [B, N, T] padded to `stat_row_length(T)` rows (`backward`; lse -inf, dlse
    and delta 0 there, what an empty row has), so that every head's row starts 16-byte aligned and
    the bound is a multiple of 4: their loads stay vectorised."""
    TR: tl.constexpr = stat_row_length(T)
    return bn.to(tl.int64) * TR + t, t < TR


@triton.jit
def _row_stats(LSE, DELTA, bn, t, T: tl.constexpr):
    """(lse in log2 units with +inf for empty/out-of-range rows, so p = 2^(z - lse) = 0; D)."""
    row, inside = _stat_row(bn, t, T)
    lse = tl.load(LSE + row, mask=inside, other=float("-inf"))
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse * LOG2E)
    return lse2, tl.load(DELTA + row, mask=inside, other=0.0)


@triton.jit
def _dkdv_step(dk, dv, k, v, start, s, b, n, h_bn, dzt_head, Q, DO, LSE, DELTA, BIAS, MASK, QSEG, KVSEG, DZT,
               T: tl.constexpr, S: tl.constexpr, N: tl.constexpr, H: tl.constexpr, HV: tl.constexpr,
               HP: tl.constexpr, HVP: tl.constexpr, SCALE: tl.constexpr, CAP: tl.constexpr,
               LEFT: tl.constexpr, RIGHT: tl.constexpr, HAS_BIAS: tl.constexpr, BIAS_SB: tl.constexpr,
               BIAS_SN: tl.constexpr, HAS_MASK: tl.constexpr, MASK_SB: tl.constexpr, MASK_SN: tl.constexpr,
               HAS_SEG: tl.constexpr, DROP: tl.constexpr, THRESH: tl.constexpr, KEEP_SCALE: tl.constexpr,
               BM: tl.constexpr, DOT: tl.constexpr, MASKED: tl.constexpr, DZT_OUT: tl.constexpr,
               SP: tl.constexpr, TP: tl.constexpr):
    """One query block's contribution to dk, dv of a key block; tiles are [keys, queries]. DZT_OUT:
    the tile's dz^T (with the soft-cap factor, in q's dtype: what the dk product consumes) also
    goes to DZT [heads, SP, TP] at head `dzt_head` (the chunk's b, n), for `_dq_kernel`."""
    t = start + tl.arange(0, BM)
    qt = head_rows(Q, b.to(tl.int64) * (T * N * H) + n * H, t, tl.arange(0, HP), N * H, T, H, HP, True, True)
    do = head_rows(DO, b.to(tl.int64) * (T * N * HV) + n * HV, t, tl.arange(0, HVP), N * HV, T, HV, HVP, True, False)
    lse2, d = _row_stats(LSE, DELTA, b * N + n, t, T)
    zt, tht = logits2(dot(k, qt, DOT), t[None, :], s[:, None], b, n, BIAS, MASK, QSEG, KVSEG, T, S, SCALE, CAP,
                       LEFT, RIGHT, HAS_BIAS, BIAS_SB, BIAS_SN, HAS_MASK, MASK_SB, MASK_SN, HAS_SEG, MASKED)
    pt = tl.math.exp2(zt - lse2[None, :])
    dpt = dot(v, tl.trans(do), DOT)
    if DROP:
        keep = keep_mask(h_bn, t[None, :], s[:, None], THRESH)
        dv += dot(tl.where(keep, pt * KEEP_SCALE, 0.0).to(do.dtype), do, DOT)
        dpt = tl.where(keep, dpt * KEEP_SCALE, 0.0)
    else:
        dv += dot(pt.to(do.dtype), do, DOT)
    dzt = pt * (dpt - d[None, :])
    if CAP > 0:
        dzt = dzt * (1.0 - tht * tht)
    dzt = dzt.to(qt.dtype)
    if DZT_OUT:  # every row and column lies inside DZT's padded extent (`backward`)
        tl.store(DZT + dzt_head.to(tl.int64) * (SP * TP) + s[:, None] * TP + t[None, :], dzt)
    dk += dot(dzt, tl.trans(qt), DOT)
    return dk, dv


@triton.jit
def _query_tile(Q, DO, LSE, DELTA, b, n, t, T: tl.constexpr, N: tl.constexpr, H: tl.constexpr,
                HV: tl.constexpr, HP: tl.constexpr, HVP: tl.constexpr):
    """(q, dout, lse2, D) of queries t of head n in batch b, zeros past T (`_row_stats`)."""
    q = head_rows(Q, b.to(tl.int64) * (T * N * H) + n * H, t, tl.arange(0, HP), N * H, T, H, HP, True, False)
    do = head_rows(DO, b.to(tl.int64) * (T * N * HV) + n * HV, t, tl.arange(0, HVP), N * HV, T, HV, HVP, True, False)
    lse2, d = _row_stats(LSE, DELTA, b * N + n, t, T)
    return q, do, lse2, d


@triton.jit
def _dz_tile(q, do, lse2, d, start, t, b, n, h_bn, K, V, k_base, v_base, BIAS, MASK, QSEG, KVSEG,
             T: tl.constexpr, S: tl.constexpr, KH: tl.constexpr, H: tl.constexpr, HV: tl.constexpr,
             HP: tl.constexpr, HVP: tl.constexpr, SCALE: tl.constexpr, CAP: tl.constexpr, LEFT: tl.constexpr,
             RIGHT: tl.constexpr, HAS_BIAS: tl.constexpr, BIAS_SB: tl.constexpr, BIAS_SN: tl.constexpr,
             HAS_MASK: tl.constexpr, MASK_SB: tl.constexpr, MASK_SN: tl.constexpr, HAS_SEG: tl.constexpr,
             DROP: tl.constexpr, THRESH: tl.constexpr, KEEP_SCALE: tl.constexpr, BN: tl.constexpr,
             DOT: tl.constexpr, MASKED: tl.constexpr):
    """(dz = p (dp - D) before the soft-cap factor, tanh of the cap, k^T) of queries t against the
    key block at `start`."""
    s = start + tl.arange(0, BN)
    h = tl.arange(0, HP)
    hv = tl.arange(0, HVP)
    kt = head_rows(K, k_base, s, h, KH * H, S, H, HP, MASKED, True)
    vt = head_rows(V, v_base, s, hv, KH * HV, S, HV, HVP, MASKED, True)
    z, th = logits2(dot(q, kt, DOT), t[:, None], s[None, :], b, n, BIAS, MASK, QSEG, KVSEG, T, S, SCALE, CAP,
                     LEFT, RIGHT, HAS_BIAS, BIAS_SB, BIAS_SN, HAS_MASK, MASK_SB, MASK_SN, HAS_SEG, MASKED)
    p = tl.math.exp2(z - lse2[:, None])
    dp = dot(do, vt, DOT)
    if DROP:
        dp = tl.where(keep_mask(h_bn, t[:, None], s[None, :], THRESH), dp * KEEP_SCALE, 0.0)
    return p * (dp - d[:, None]), th, kt


@triton.jit
def _dq_step(dq, q, do, lse2, d, start, t, b, n, h_bn, K, V, k_base, v_base, BIAS, MASK, QSEG, KVSEG, DZ,
             T: tl.constexpr, S: tl.constexpr, N: tl.constexpr, KH: tl.constexpr, H: tl.constexpr,
             HV: tl.constexpr, HP: tl.constexpr, HVP: tl.constexpr, SCALE: tl.constexpr, CAP: tl.constexpr,
             LEFT: tl.constexpr, RIGHT: tl.constexpr, HAS_BIAS: tl.constexpr, BIAS_SB: tl.constexpr,
             BIAS_SN: tl.constexpr, HAS_MASK: tl.constexpr, MASK_SB: tl.constexpr, MASK_SN: tl.constexpr,
             HAS_SEG: tl.constexpr, DROP: tl.constexpr, THRESH: tl.constexpr, KEEP_SCALE: tl.constexpr,
             BN: tl.constexpr, DOT: tl.constexpr, MASKED: tl.constexpr, DZ_OUT: tl.constexpr):
    """One key block's contribution to dq of a query block (and its dz tile with DZ_OUT)."""
    dz, th, kt = _dz_tile(q, do, lse2, d, start, t, b, n, h_bn, K, V, k_base, v_base, BIAS, MASK, QSEG, KVSEG,
                          T, S, KH, H, HV, HP, HVP, SCALE, CAP, LEFT, RIGHT, HAS_BIAS, BIAS_SB, BIAS_SN, HAS_MASK,
                          MASK_SB, MASK_SN, HAS_SEG, DROP, THRESH, KEEP_SCALE, BN, DOT, MASKED)
    if DZ_OUT:
        s = start + tl.arange(0, BN)
        dz_base = (b * N + n).to(tl.int64) * (T * S)
        tl.store(DZ + dz_base + t[:, None] * S + s[None, :], dz, mask=(t[:, None] < T) & (s[None, :] < S))
    if CAP > 0:
        dz = dz * (1.0 - th * th)
    return dq + dot(dz.to(kt.dtype), tl.trans(kt), DOT)


@triton.jit
def _bwd_kernel(Q, K, V, BIAS, MASK, QSEG, KVSEG, SEED, QRANGE, KRANGE, DO, LSE, DELTA, DKI, DVI, DQ, DK, DV, DZ, DZT,
                T: tl.constexpr, S: tl.constexpr, N: tl.constexpr, KH: tl.constexpr, H: tl.constexpr,
                HV: tl.constexpr, HP: tl.constexpr, HVP: tl.constexpr, SCALE: tl.constexpr,
                CAP: tl.constexpr, LEFT: tl.constexpr, RIGHT: tl.constexpr, HAS_BIAS: tl.constexpr,
                BIAS_SB: tl.constexpr, BIAS_SN: tl.constexpr, HAS_MASK: tl.constexpr, MASK_SB: tl.constexpr,
                MASK_SN: tl.constexpr, HAS_SEG: tl.constexpr, DROP: tl.constexpr, THRESH: tl.constexpr,
                KEEP_SCALE: tl.constexpr, BM1: tl.constexpr, BN1: tl.constexpr, BM2: tl.constexpr,
                BN2: tl.constexpr, DOT: tl.constexpr, DZ_OUT: tl.constexpr, DZT_OUT: tl.constexpr,
                SP: tl.constexpr, TP: tl.constexpr, K0: tl.constexpr, KC: tl.constexpr, G0: tl.constexpr,
                GC: tl.constexpr, CARRY_IN: tl.constexpr, CARRY_OUT: tl.constexpr):
    """Programs (key block | query block, b * N + n); with DZT_OUT only key blocks, of
    (b * KC + kv head of the chunk): a chunk of query heads (`HeadChunk`: kv heads K0 + [0, KC),
    of each group the query heads G0 + [0, GC)); dk, dv [B, S, KC, .] then start from DKI, DVI
    (CARRY_IN) and leave unscaled in f32 when the group continues in the next chunk (CARRY_OUT)."""
    G: tl.constexpr = N // KH
    pid = tl.program_id(0)
    bn = tl.program_id(1)
    if DZT_OUT:
        b = bn // KC
        kl = bn % KC
        kh = K0 + kl
        n0 = kh * G + G0
        lead = True
    else:
        b = bn // N
        n0 = bn % N
        kh = n0 // G
        kl = kh
        lead = n0 % G == 0
    h = tl.arange(0, HP)
    hv = tl.arange(0, HVP)
    k_base = b.to(tl.int64) * (S * KH * H) + kh * H
    v_base = b.to(tl.int64) * (S * KH * HV) + kh * HV
    NKB: tl.constexpr = (S + BN1 - 1) // BN1
    if pid < NKB:
        if lead:  # the first query head of its group (chunk) does the group's dk/dv
            s = pid * BN1 + tl.arange(0, BN1)  # key block 0 (the heaviest under causal) first
            k_mask = (s[:, None] < S) & (h[None, :] < H)
            v_mask = (s[:, None] < S) & (hv[None, :] < HV)
            k = tl.load(K + k_base + s[:, None] * (KH * H) + h[None, :], mask=k_mask, other=0.0)
            v = tl.load(V + v_base + s[:, None] * (KH * HV) + hv[None, :], mask=v_mask, other=0.0)
            dk_at = b.to(tl.int64) * (S * KC * H) + kl * H + s[:, None] * (KC * H) + h[None, :]
            dv_at = b.to(tl.int64) * (S * KC * HV) + kl * HV + s[:, None] * (KC * HV) + hv[None, :]
            if CARRY_IN:  # the previous chunk's f32 sums: the same additions as one launch
                dk = tl.load(DKI + dk_at, mask=k_mask, other=0.0)
                dv = tl.load(DVI + dv_at, mask=v_mask, other=0.0)
            else:
                dk = tl.zeros([BN1, HP], dtype=tl.float32)
                dv = tl.zeros([BN1, HVP], dtype=tl.float32)
            # One loop, every tile position-masked: with separate masked/unmasked loops over the
            # same dk/dv accumulators ptxas serialises the wgmmas (C7515, seen at H=64 and 128).
            # Masking only the tiles the band or a tail crosses through a runtime branch in the
            # loop avoids C7515 but measured no faster (causal H128 within noise, H64 3% and GQA
            # 3-5% slower; benchmarks/results/attention_H200_2026-11-26_triton_dkdv_mask_branch.json).
            lo, hi = query_blocks(pid * BN1, BM1, BN1, T, S, LEFT, RIGHT)
            if HAS_SEG:  # the queries this key block's segment ids may reach (`segment_ranges`)
                lo = tl.maximum(lo, tl.load(KRANGE + (b * NKB + pid) * 3) // BM1 * BM1)
                hi = tl.minimum(hi, tl.load(KRANGE + (b * NKB + pid) * 3 + 1))
            for g in range(GC):
                n = n0 + g
                h_bn = 0
                if DROP:
                    h_bn = head_hash(SEED, b, n, N)
                dzt_head = (b * KC + kl) * GC + g
                for start in range(lo, hi, BM1):
                    dk, dv = _dkdv_step(dk, dv, k, v, start, s, b, n, h_bn, dzt_head, Q, DO, LSE, DELTA, BIAS, MASK,
                                        QSEG, KVSEG,
                                        DZT, T, S, N, H, HV, HP, HVP, SCALE, CAP, LEFT, RIGHT, HAS_BIAS, BIAS_SB,
                                        BIAS_SN, HAS_MASK, MASK_SB, MASK_SN, HAS_SEG, DROP, THRESH, KEEP_SCALE, BM1,
                                        DOT, True, DZT_OUT, SP, TP)
            if CARRY_OUT:
                tl.store(DK + dk_at, dk, mask=k_mask)
                tl.store(DV + dv_at, dv, mask=v_mask)
            else:
                tl.store(DK + dk_at, (dk * SCALE).to(DK.dtype.element_ty), mask=k_mask)
                tl.store(DV + dv_at, dv.to(DV.dtype.element_ty), mask=v_mask)
    elif not DZT_OUT:  # (with DZT_OUT the grid has no dQ programs: `_dq_kernel` follows)
        n = n0
        m0 = (tl.num_programs(0) - 1 - pid) * BM2  # the last (heaviest) query block first
        t = m0 + tl.arange(0, BM2)
        q, do, lse2, d = _query_tile(Q, DO, LSE, DELTA, b, n, t, T, N, H, HV, HP, HVP)
        h_bn = 0
        if DROP:
            h_bn = head_hash(SEED, b, n, N)
        dq = tl.zeros([BM2, HP], dtype=tl.float32)
        lo, a, c, hi = query_block_keys(m0, b, QRANGE, BM2, BN2, T, S, LEFT, RIGHT, HAS_SEG)
        for start in range(lo, a, BN2):
            dq = _dq_step(dq, q, do, lse2, d, start, t, b, n, h_bn, K, V, k_base, v_base, BIAS, MASK, QSEG, KVSEG, DZ,
                          T, S, N, KH, H, HV, HP, HVP, SCALE, CAP, LEFT, RIGHT, HAS_BIAS, BIAS_SB, BIAS_SN, HAS_MASK,
                          MASK_SB, MASK_SN, HAS_SEG, DROP, THRESH, KEEP_SCALE, BN2, DOT, True, DZ_OUT)
        for start in range(a, c, BN2):
            dq = _dq_step(dq, q, do, lse2, d, start, t, b, n, h_bn, K, V, k_base, v_base, BIAS, MASK, QSEG, KVSEG, DZ,
                          T, S, N, KH, H, HV, HP, HVP, SCALE, CAP, LEFT, RIGHT, HAS_BIAS, BIAS_SB, BIAS_SN, HAS_MASK,
                          MASK_SB, MASK_SN, HAS_SEG, DROP, THRESH, KEEP_SCALE, BN2, DOT, False, DZ_OUT)
        for start in range(c, hi, BN2):
            dq = _dq_step(dq, q, do, lse2, d, start, t, b, n, h_bn, K, V, k_base, v_base, BIAS, MASK, QSEG, KVSEG, DZ,
                          T, S, N, KH, H, HV, HP, HVP, SCALE, CAP, LEFT, RIGHT, HAS_BIAS, BIAS_SB, BIAS_SN, HAS_MASK,
                          MASK_SB, MASK_SN, HAS_SEG, DROP, THRESH, KEEP_SCALE, BN2, DOT, True, DZ_OUT)
        _store_dq(DQ, dq, b, n, t, h, T, N, H, SCALE)
        if DZ_OUT:  # dz is 0 on the key blocks the bounds skipped
            dz_base = bn.to(tl.int64) * (T * S)
            zeros = tl.zeros([BM2, BN2], dtype=tl.float32)
            for start in range(0, lo, BN2):
                s = start + tl.arange(0, BN2)
                tl.store(DZ + dz_base + t[:, None] * S + s[None, :], zeros, mask=(t[:, None] < T) & (s[None, :] < S))
            for start in range(tl.maximum(hi, lo), S, BN2):
                s = start + tl.arange(0, BN2)
                tl.store(DZ + dz_base + t[:, None] * S + s[None, :], zeros,
                         mask=(t[:, None] < T) & (s[None, :] < S) & (s[None, :] >= 0))


@triton.jit
def _store_dq(DQ, dq, b, n, t, h, T: tl.constexpr, N: tl.constexpr, H: tl.constexpr, SCALE: tl.constexpr):
    """DQ[b, t, n, :H] = scale * dq (f32 [len(t), len(h)]), rows past T and columns past H dropped."""
    offsets = b.to(tl.int64) * (T * N * H) + n * H + t[:, None] * (N * H) + h[None, :]
    tl.store(DQ + offsets, (dq * SCALE).to(DQ.dtype.element_ty), mask=(t[:, None] < T) & (h[None, :] < H))


@triton.jit
def _dq_tile(dq, t, start, b, K, k_base, QSEG, KVSEG, DZT, dzt_base, T: tl.constexpr, S: tl.constexpr,
             KH: tl.constexpr, H: tl.constexpr, HP: tl.constexpr, LEFT: tl.constexpr, RIGHT: tl.constexpr,
             HAS_SEG: tl.constexpr, BN: tl.constexpr, TP: tl.constexpr, DOT: tl.constexpr, MASKED: tl.constexpr):
    """dq + dz k for the key block at `start`, dz read from DZT's dz^T tile. In masked tiles only
    the allowed pairs are read (the dK/dV programs wrote every tile that holds one, and nothing
    else); rows past T may read what no program wrote, and are never stored."""
    s = start + tl.arange(0, BN)
    offsets = dzt_base + s[None, :] * TP + t[:, None]
    if MASKED:
        ok = rule_allows(t[:, None], s[None, :], b, QSEG, KVSEG, T, S, LEFT, RIGHT, HAS_SEG)
        dz = tl.load(DZT + offsets, mask=ok, other=0.0)
    else:
        dz = tl.load(DZT + offsets)
    kt = head_rows(K, k_base, s, tl.arange(0, HP), KH * H, S, H, HP, MASKED, False)
    return dq + dot(dz, kt, DOT)


@triton.jit
def _dq_kernel(K, QSEG, KVSEG, QRANGE, DZT, DQ, T: tl.constexpr, S: tl.constexpr, N: tl.constexpr,
               KH: tl.constexpr, H: tl.constexpr, HP: tl.constexpr, SCALE: tl.constexpr, LEFT: tl.constexpr,
               RIGHT: tl.constexpr, HAS_SEG: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, SP: tl.constexpr,
               TP: tl.constexpr, DOT: tl.constexpr, K0: tl.constexpr, KC: tl.constexpr, GC: tl.constexpr):
    """dq = scale * dz k for a block of BM queries, over the key blocks of `key_blocks`, from the
    dz^T tiles [B*N, SP, TP] `_bwd_kernel` wrote with DZT_OUT: one matmul per tile where its own
    dQ programs recompute q k^T and dO v^T first (5 matmuls per tile in all instead of 7). The
    program's head is the chunk's (`_bwd_kernel`): b * KC * GC + i, query head i of the chunk,
    kv head K0 + i // GC; dq [B, T, KC * GC, H]."""
    m0 = (tl.num_programs(0) - 1 - tl.program_id(0)) * BM  # the last (heaviest) query block first
    bn = tl.program_id(1)
    b = bn // (KC * GC)
    n = bn % (KC * GC)
    t = m0 + tl.arange(0, BM)
    h = tl.arange(0, HP)
    k_base = b.to(tl.int64) * (S * KH * H) + (K0 + n // GC) * H
    dzt_base = bn.to(tl.int64) * (SP * TP)
    dq = tl.zeros([BM, HP], dtype=tl.float32)
    lo, a, c, hi = query_block_keys(m0, b, QRANGE, BM, BN, T, S, LEFT, RIGHT, HAS_SEG)
    for start in range(lo, a, BN):
        dq = _dq_tile(dq, t, start, b, K, k_base, QSEG, KVSEG, DZT, dzt_base, T, S, KH, H, HP, LEFT, RIGHT, HAS_SEG,
                      BN, TP, DOT, True)
    for start in range(a, c, BN):
        dq = _dq_tile(dq, t, start, b, K, k_base, QSEG, KVSEG, DZT, dzt_base, T, S, KH, H, HP, LEFT, RIGHT, HAS_SEG,
                      BN, TP, DOT, False)
    for start in range(c, hi, BN):
        dq = _dq_tile(dq, t, start, b, K, k_base, QSEG, KVSEG, DZT, dzt_base, T, S, KH, H, HP, LEFT, RIGHT, HAS_SEG,
                      BN, TP, DOT, True)
    _store_dq(DQ, dq, b, n, t, h, T, KC * GC, H, SCALE)


@triton.jit
def _dbias_kernel(Q, K, V, BIAS, MASK, QSEG, KVSEG, SEED, QRANGE, DO, LSE, DELTA, DBIAS,
                  B: tl.constexpr, T: tl.constexpr, S: tl.constexpr, N: tl.constexpr, KH: tl.constexpr,
                  H: tl.constexpr, HV: tl.constexpr, HP: tl.constexpr, HVP: tl.constexpr, SCALE: tl.constexpr,
                  CAP: tl.constexpr, LEFT: tl.constexpr, RIGHT: tl.constexpr, HAS_BIAS: tl.constexpr,
                  BIAS_SB: tl.constexpr, BIAS_SN: tl.constexpr, HAS_MASK: tl.constexpr, MASK_SB: tl.constexpr,
                  MASK_SN: tl.constexpr, HAS_SEG: tl.constexpr, DROP: tl.constexpr, THRESH: tl.constexpr,
                  KEEP_SCALE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, DOT: tl.constexpr,
                  BIAS_B: tl.constexpr, BIAS_N: tl.constexpr):
    """dbias [BIAS_B, BIAS_N, T, S] of a bias broadcast over batch (BIAS_B = 1) and/or heads
    (BIAS_N = 1). One program per (query block, key block, bias batch-head): the tile's dz is
    summed over the broadcast (b, n) in registers and stored once (zeros where the position
    bounds or segment ids leave nothing). It recomputes the scores and dO V^T per (b, n): extra
    matmuls, in exchange for memory of the bias' size, not B*N*T*S floats. One program per tile,
    not per query block looping over the key blocks: a bias shared by every (b, n) would
    otherwise give only T / BM programs, each summing B*N heads for a whole row of tiles."""
    G: tl.constexpr = N // KH
    RB: tl.constexpr = B if BIAS_B == 1 else 1
    RN: tl.constexpr = N if BIAS_N == 1 else 1
    gbn = tl.program_id(2)
    gb = gbn // BIAS_N
    gn = gbn % BIAS_N
    m0 = tl.program_id(0) * BM
    start = tl.program_id(1) * BN
    t = m0 + tl.arange(0, BM)
    s = start + tl.arange(0, BN)
    lo, a, c, hi = key_blocks(m0, BM, BN, T, S, LEFT, RIGHT)  # every tile is masked here: a, c unused
    dbias = tl.zeros([BM, BN], dtype=tl.float32)
    if (start >= lo) & (start < hi):
        for r in range(RB * RN):
            b = gb + r // RN
            n = gn + r % RN
            live = True
            if HAS_SEG:  # the keys this query block's ids may reach in batch b (`segment_ranges`)
                reach = QRANGE + (b * tl.cdiv(T, BM) + m0 // BM) * 3
                live = (start + BN > tl.load(reach)) & (start < tl.load(reach + 1))
            if live:
                q, do, lse2, d = _query_tile(Q, DO, LSE, DELTA, b, n, t, T, N, H, HV, HP, HVP)
                h_bn = 0
                if DROP:
                    h_bn = head_hash(SEED, b, n, N)
                k_base = b.to(tl.int64) * (S * KH * H) + (n // G) * H
                v_base = b.to(tl.int64) * (S * KH * HV) + (n // G) * HV
                dz, th, kt = _dz_tile(q, do, lse2, d, start, t, b, n, h_bn, K, V, k_base, v_base, BIAS, MASK, QSEG,
                                      KVSEG, T, S, KH, H, HV, HP, HVP, SCALE, CAP, LEFT, RIGHT, HAS_BIAS, BIAS_SB,
                                      BIAS_SN, HAS_MASK, MASK_SB, MASK_SN, HAS_SEG, DROP, THRESH, KEEP_SCALE, BN,
                                      DOT, True)  # th, kt: only dQ needs them
                dbias += dz
    tl.store(DBIAS + gbn.to(tl.int64) * (T * S) + t[:, None] * S + s[None, :], dbias,
             mask=(t[:, None] < T) & (s[None, :] < S))


def dz_tiles_extent(B: int, N: int, T: int, S: int, dtype, config: TritonAttentionConfig) -> tuple[int, int] | None:
    """(rows, columns) of each head's dz^T tiles [S, T] rounded up to whole blocks of both
    backward halves, when the B*N of them fit `DZ_TILES_MAX_BYTES` (and int32 offsets inside
    a head); else None: dq is recomputed by the dQ programs."""
    rows = triton.cdiv(S, config.block_n1) * config.block_n1
    block = max(config.block_m1, config.block_m2)
    cols = triton.cdiv(T, block) * block
    if rows * cols >= 2**31 or B * N * rows * cols * jnp.dtype(dtype).itemsize > DZ_TILES_MAX_BYTES:
        return None
    return rows, cols


def backward(q, k, v, bias, mask, q_segment_ids, kv_segment_ids, dropout_seed, out, lse, dout, dlse, spec, *,
             config: TritonAttentionConfig):
    """(dq, dk, dv, dbias or None) of the contract (kernels/common/attention.py)."""
    B, T, N, H = q.shape
    S, KH, HV = k.shape[1], k.shape[2], v.shape[3]
    cfg = config
    statics = kernel_statics(q, k, v, bias, mask, q_segment_ids, spec)
    pad = ((0, 0), (0, 0), (0, stat_row_length(T) - T))  # rows past T: empty ones (`_stat_row`)
    lse = jnp.pad(lse, pad, constant_values=-jnp.inf)
    dlse = jnp.pad(jnp.broadcast_to(dlse, (B, N, T)).astype(jnp.float32), pad)
    delta_bm = cfg.delta_block_m
    delta = triton_call(
        out, dout.astype(out.dtype), dlse,
        kernel=_delta_kernel, out_shape=jax.ShapeDtypeStruct((B, N, stat_row_length(T)), jnp.float32),
        grid=(triton.cdiv(T, delta_bm), B * N), num_warps=4, num_stages=1,
        T=T, N=N, HV=HV, HVP=statics["HVP"], BM=delta_bm,
    )
    # A bias of the full [B, N] extent takes dz from the dQ programs; a broadcast one its own kernel.
    dz_out = bias is not None and tuple(bias.shape[:2]) == (B, N)
    dz_shape = (B, N, T, S) if dz_out else (1,)
    G = N // KH
    chunks = None
    if bias is None and cfg.dq_from_dz_tiles and (extent := dz_tiles_extent(B, N, T, S, q.dtype, cfg)) is not None:
        rows_p, cols_p = extent  # the chunks of query heads whose tiles take turns in one buffer
        chunks = head_chunks(B, KH, G, triton.cdiv(S, cfg.block_n1), B * rows_p * cols_p * jnp.dtype(q.dtype).itemsize,
                             cfg.dz_chunk_bytes, cfg.dz_chunk_min_programs)
    dzt_out = chunks is not None
    rows_p, cols_p = extent if dzt_out else (0, 0)
    optional = optional_inputs(bias, mask, q_segment_ids, kv_segment_ids, dropout_seed,
                               query_block=cfg.block_m2, key_block=cfg.block_n1)
    do = dout.astype(q.dtype)

    def launch(c: HeadChunk, carried):
        """_bwd_kernel for chunk c (every head at once without dz^T tiles)."""
        dkv_dt = (jnp.float32,) * 2 if c.carry_out else (k.dtype, v.dtype)
        return triton_call(
            q, k, v, *optional, do, lse, delta, *(carried or (jnp.zeros((1,), jnp.float32),) * 2),
            kernel=_bwd_kernel,
            out_shape=(jax.ShapeDtypeStruct((1,) if dzt_out else q.shape, q.dtype),
                       jax.ShapeDtypeStruct((B, S, c.kv, H), dkv_dt[0]), jax.ShapeDtypeStruct((B, S, c.kv, HV), dkv_dt[1]),
                       jax.ShapeDtypeStruct(dz_shape, jnp.float32),
                       jax.ShapeDtypeStruct((B * c.heads * rows_p * cols_p,) if dzt_out else (1,), q.dtype)),
            grid=(triton.cdiv(S, cfg.block_n1) + (0 if dzt_out else triton.cdiv(T, cfg.block_m2)),
                  B * (c.kv if dzt_out else N)),
            num_warps=cfg.bwd_warps, num_stages=cfg.bwd_stages,
            BM1=cfg.block_m1, BN1=cfg.block_n1, BM2=cfg.block_m2, BN2=cfg.block_n2, DZ_OUT=dz_out, DZT_OUT=dzt_out,
            SP=rows_p, TP=cols_p, K0=c.k0, KC=c.kv, G0=c.g0, GC=c.g, CARRY_IN=c.carry_in, CARRY_OUT=c.carry_out,
            **statics,
        )

    if not dzt_out:
        dq, dk, dv, dz, _ = launch(HeadChunk(0, KH, 0, G, G), None)
    else:
        # One chunk at a time; each waits for the previous chunk's dq (an optimization barrier),
        # so its dz^T tiles are dead before the next chunk's are written: XLA gives them one buffer.
        _, _, qseg, kvseg, _, qrange, _ = optional
        dqs, dks, dvs = {}, {}, {}
        carried = dq_c = None
        for c in chunks:
            if dq_c is not None:
                q = lax.optimization_barrier((q, dq_c))[0]
            _, dk_c, dv_c, dz, dzt = launch(c, carried)
            dq_c = triton_call(
                k, qseg, kvseg, qrange, dzt, kernel=_dq_kernel,
                out_shape=jax.ShapeDtypeStruct((B, T, c.heads, H), q.dtype),
                grid=(triton.cdiv(T, cfg.block_m2), B * c.heads), num_warps=cfg.bwd_warps, num_stages=cfg.bwd_stages,
                BM=cfg.block_m2, BN=cfg.block_n2, SP=rows_p, TP=cols_p, K0=c.k0, KC=c.kv, GC=c.g,
                **{name: statics[name] for name in ("T", "S", "N", "KH", "H", "HP", "SCALE", "LEFT", "RIGHT",
                                                    "HAS_SEG", "DOT")},
            )
            dqs.setdefault(c.k0, []).append(dq_c.reshape(B, T, c.kv, c.g, H))
            carried = (dk_c, dv_c) if c.carry_out else None
            if not c.carry_out:
                dks[c.k0], dvs[c.k0] = dk_c, dv_c
        if len(chunks) == 1:
            dq, dk, dv = dq_c, dk_c, dv_c
        else:  # the chunks' results in head order: one copy each
            dq = jnp.concatenate([jnp.concatenate(dqs[k0], axis=3) for k0 in sorted(dqs)], axis=2).reshape(B, T, N, H)
            dk = jnp.concatenate([dks[k0] for k0 in sorted(dks)], axis=2)
            dv = jnp.concatenate([dvs[k0] for k0 in sorted(dvs)], axis=2)
    dbias = dz if dz_out else None
    if bias is not None and not dz_out:
        Bb, Nb = bias.shape[:2]
        # Its (b, n) loop is pipelined with a q, dO, K, V and bias tile per stage: at head_dim 128,
        # 3 stages ask for 288 KB of shared memory (Hopper has 227 KB), and at head_dim 256 the
        # dQ programs' 128-query blocks 320 KB, so its query block is capped at 128 * 128 / H.
        rows = min(cfg.block_m2, 128 * 128 // padded_dim(max(q.shape[3], v.shape[3])))
        dbias = triton_call(
            q, k, v, *optional_inputs(bias, mask, q_segment_ids, kv_segment_ids, dropout_seed,
                                      query_block=rows),
            dout.astype(q.dtype), lse, delta,
            kernel=_dbias_kernel, out_shape=jax.ShapeDtypeStruct((Bb, Nb, T, S), jnp.float32),
            grid=(triton.cdiv(T, rows), triton.cdiv(S, cfg.block_n2), Bb * Nb),
            num_warps=cfg.bwd_warps, num_stages=min(cfg.bwd_stages, 2),
            B=B, BM=rows, BN=cfg.block_n2, BIAS_B=Bb, BIAS_N=Nb, **statics,
        )
    return dq, dk, dv, dbias


