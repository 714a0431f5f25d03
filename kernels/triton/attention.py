"""Attention as Triton kernels: FlashAttention-2 forward and a fused, atomic-free backward.

The contract (math, masks, causal alignment, dropout hash) is the docstring of
kernels/common/attention.py. Arrays arrive normalised: q [B,T,N,H], k [B,S,K,H], v [B,S,K,Hv]
(contiguous, read in place: every stride is a constexpr derived from the static shape, so loads
vectorise and nothing is transposed in HBM); query head n reads kv head n // G, G = N // K.

Forward (`_fwd_kernel`, grid (cdiv(T, BM), B*N), the last query block first: under causal
masking it is the heaviest). Per query block, an online softmax over key blocks in log2 units:
    z2 = log2(e) * logits(q k^T)        logits: scale, soft cap, + bias, -inf where not allowed
    m' = max(m, rowmax z2);  l = l 2^(m - m') + rowsum 2^(z2 - m');  acc likewise with p @ v
    out = acc / l / (1 - rate) (0 when l == 0),  lse = ln 2 * (m + log2 l) (-inf when l == 0).
m is replaced by 0 while it is -inf, so a row with no allowed key so far never makes NaN.
Dropout multiplies p by the keep mask in the `acc` update only (l, hence lse, is pre-dropout).

Block sparsity: `_key_blocks` turns the causal/window rule into [lo, hi) key bounds for a query
block (blocks outside are never read) and an inner [full_lo, full_hi) of blocks every row may
see entirely, which skip the position/tail masking (`MASKED=False`). `_query_blocks` gives the
query bounds from a key block's side (the dK/dV loop masks every tile: see there why). With
segment ids the bounds are narrowed further to the keys (queries) a block's ids may reach, from
`segment_ranges` (computed by XLA, one [B, blocks, 3] table per block size), so packed
sequences skip the blocks between documents; the unmasked blocks are then only those inside
one segment that every row of the query block shares, and the other tiles compare segment
ids. The mask and the bias are data, applied on every tile.

Backward: `_delta_kernel` computes D = rowsum(dout * out) - dlse, then ONE `_bwd_kernel` launch
with grid (cdiv(S, BN1) + cdiv(T, BM2), B*N): the first programs of each (b, n) row do dK/dV for
a key block, looping over query blocks; the rest do dQ for a query block, looping over key
blocks (recomputing p and dp). At padded head dim 128, while B*N*S*T tiles in q's dtype fit 4 GiB
(`_DZ_TILES_PADDED_HEAD_DIMS`, `_DZ_TILES_MAX_BYTES`), the launch has only the dK/dV
programs, which also store each dz^T tile they compute (DZT_OUT), and `_dq_kernel` computes
dq = scale * dz k from them: one matmul per tile instead of three (H200, causal B4 T4096 N32
fwd+bwd 4.659 against 5.160 ms; H100 3-5% faster). No atomics, deterministic either way: a
one-pass variant adding dz k into an f32 dq by atomics (5 matmuls per tile instead of 7)
measured slower on an H200 (causal H128 3.66 against 3.55-3.60 ms, non-causal 8.71 against
6.51, GQA 4.17 against 3.56; results/attention_H200_2026-11-26_triton_atomic_dq.json). GQA: the
dK/dV program of kv head h loops over its G query heads itself (only the programs with
n % G == 0 work; the others exit), so dk/dv are summed in f32 registers and written once in k's
dtype: no G-times larger f32 per-query-head buffers and no extra XLA reduction. With a bias, the dQ half also writes
dz = p (dp - D) (before the soft-cap factor) as f32 [B,N,T,S], zeros on skipped blocks, when
the bias has that full extent; a bias broadcast over batch or heads gets `_dbias_kernel`, which
sums dz over the broadcast axes in registers (recomputing the scores), never B*N*T*S floats.

Head dims are padded to powers of two (>= 16) with masked loads; f32 inputs use tf32x3 dots
(see `_dot`) so f32 results meet the f32 tolerance. Optional inputs are passed as 1-element
dummies with a constexpr flag. Tunables: `AttentionConfig`s keyed by padded head dim and dtype
width (`config_for`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import triton
import triton.language as tl

from forgeax.kernels.common.attention import (
    FMIX_1, FMIX_2, GOLDEN_BN, GOLDEN_S, GOLDEN_T, AttentionKernels, AttentionSpec,
    differentiable_attention, segment_ranges,
)
from forgeax.kernels.triton.elementwise import tanh
from forgeax.kernels.triton.launch import triton_call
from forgeax.core.registry import Implementation
from forgeax.core.runtime import current_device_kind, interpret_enabled

_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)
MAX_HEAD_DIM = 256
# Globals a @triton.jit function reads must be constexprs.
LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)
_FMIX_1, _FMIX_2 = tl.constexpr(FMIX_1), tl.constexpr(FMIX_2)
_GOLDEN_BN, _GOLDEN_T, _GOLDEN_S = tl.constexpr(GOLDEN_BN), tl.constexpr(GOLDEN_T), tl.constexpr(GOLDEN_S)


# ----------------------------------------------------------------------------- shared tile math


@triton.jit
def _dot(a, b, DOT: tl.constexpr):
    """a @ b in f32. DOT: 0 native (16-bit inputs); 1 f32 inputs as 3 TF32 products (about f32
    accuracy on tensor cores; plain tl.dot is 1 TF32 product, below the f32 tolerance); 2 the
    interpreter: operands upcast to f32 first (Triton 3.6's interpreter multiplies the raw uint16
    bit patterns of bf16 operands)."""
    if DOT == 1:
        return tl.dot(a, b, input_precision="tf32x3")
    if DOT == 2:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b)


@triton.jit
def _fmix(x):
    x = x ^ (x >> 16)
    x = x * tl.full([], _FMIX_1, tl.uint32)
    x = x ^ (x >> 13)
    x = x * tl.full([], _FMIX_2, tl.uint32)
    return x ^ (x >> 16)


@triton.jit
def _head_hash(SEED, b, n, N: tl.constexpr):
    seed = tl.load(SEED).to(tl.uint32)
    return _fmix(seed ^ ((b * N + n).to(tl.uint32) * tl.full([], _GOLDEN_BN, tl.uint32)))


@triton.jit
def _keep(h_bn, t, s, THRESH: tl.constexpr):
    """The contract's keep mask for query indices t and key indices s (broadcast shapes)."""
    h = _fmix(h_bn ^ (t.to(tl.uint32) * tl.full([], _GOLDEN_T, tl.uint32)))
    h = _fmix(h ^ (s.to(tl.uint32) * tl.full([], _GOLDEN_S, tl.uint32)))
    return (h >> 8) >= tl.full([], THRESH, tl.uint32)


@triton.jit
def _allowed(t, s, b, QSEG, KVSEG, T: tl.constexpr, S: tl.constexpr, LEFT: tl.constexpr, RIGHT: tl.constexpr,
             HAS_SEG: tl.constexpr):
    """Whether query t may see key s (broadcast shapes) by position (causal alignment, window), the
    key tail and the segment ids: every rule but the data (mask, bias)."""
    ok = s < S
    if RIGHT >= 0:
        ok = ok & (s <= t + (S - T + RIGHT))
    if LEFT >= 0:
        ok = ok & (s >= t + (S - T - LEFT))
    if HAS_SEG:
        qs = tl.load(QSEG + b * T + t, mask=t < T, other=0)
        ks = tl.load(KVSEG + b * S + s, mask=s < S, other=0)
        ok = ok & (qs == ks)
    return ok


@triton.jit
def _logits2(qk, t, s, b, n, BIAS, MASK, QSEG, KVSEG, T: tl.constexpr, S: tl.constexpr,
             SCALE: tl.constexpr, CAP: tl.constexpr, LEFT: tl.constexpr, RIGHT: tl.constexpr,
             HAS_BIAS: tl.constexpr, BIAS_SB: tl.constexpr, BIAS_SN: tl.constexpr,
             HAS_MASK: tl.constexpr, MASK_SB: tl.constexpr, MASK_SN: tl.constexpr,
             HAS_SEG: tl.constexpr, MASKED: tl.constexpr):
    """(z in log2 units, -inf where not allowed; tanh of the soft cap or 0) for a tile of q.k.

    t and s are the tile's query and key indices, broadcastable to qk's shape (either
    orientation). MASKED: apply the position rule, the key tail and the segment ids (else the
    caller knows the whole tile is inside all three).
    """
    th = 0.0
    if CAP > 0:
        th = tanh(qk * (SCALE / CAP))
        z = th * (CAP * LOG2E)
    else:
        z = qk * (SCALE * LOG2E)
    inside = (t < T) & (s < S)
    if HAS_BIAS:
        base = b.to(tl.int64) * BIAS_SB + n.to(tl.int64) * BIAS_SN
        z += tl.load(BIAS + base + t * S + s, mask=inside, other=0.0).to(tl.float32) * LOG2E
    if MASKED:  # unmasked tiles lie inside the band, below S and in one shared segment
        z = tl.where(_allowed(t, s, b, QSEG, KVSEG, T, S, LEFT, RIGHT, HAS_SEG), z, float("-inf"))
    if HAS_MASK:
        base = b.to(tl.int64) * MASK_SB + n.to(tl.int64) * MASK_SN
        allowed = tl.load(MASK + base + t * S + s, mask=inside, other=0)
        z = tl.where(allowed != 0, z, float("-inf"))
    return z, th


@triton.jit
def _head_rows(PTR, base, s, d, ROW: tl.constexpr, S: tl.constexpr, D: tl.constexpr, DP: tl.constexpr,
               MASKED: tl.constexpr, TRANSPOSED: tl.constexpr):
    """Rows s (row stride ROW, S of them) of one head of Q, K, V or dO: [DP, len(s)] if
    TRANSPOSED else [len(s), DP], zeros past S and past D. MASKED=False where every row lies
    below S (unmasked key blocks, `_key_blocks`): the load then takes no mask when DP == D (see
    `_fwd_kernel`'s Q load for why row masks matter)."""
    if TRANSPOSED:
        offsets = s[None, :] * ROW + d[:, None]
        inside = (s[None, :] < S) & (d[:, None] < D)
    else:
        offsets = s[:, None] * ROW + d[None, :]
        inside = (s[:, None] < S) & (d[None, :] < D)
    if MASKED or DP != D:
        return tl.load(PTR + base + offsets, mask=inside, other=0.0)
    return tl.load(PTR + base + offsets)


@triton.jit
def _clamp(x, lo, hi):
    return tl.minimum(tl.maximum(x, lo), tl.maximum(hi, lo))


@triton.jit
def _key_blocks(m0, BM: tl.constexpr, BN: tl.constexpr, T: tl.constexpr, S: tl.constexpr,
                LEFT: tl.constexpr, RIGHT: tl.constexpr):
    """Key bounds for queries [m0, m0 + BM): read [lo, hi), mask [lo, a) and [c, hi) only.

    Query t sits at key position t + S - T and sees [pos - LEFT, pos + RIGHT] (-1 = unbounded).
    lo, a, c are multiples of BN; a key block [x, x + BN) inside [a, c) is allowed for every
    row of the block and lies below S.
    """
    zero = m0 * 0
    lo = zero
    hi = zero + S
    full_lo = zero
    full_hi = zero + (S // BN) * BN
    if RIGHT >= 0:
        hi = tl.minimum(hi, m0 + (BM + S - T + RIGHT))
        full_hi = tl.minimum(full_hi, tl.maximum(m0 + (S - T + RIGHT + 1), 0) // BN * BN)
    if LEFT >= 0:
        lo = tl.maximum(m0 + (S - T - LEFT), 0) // BN * BN
        full_lo = (tl.maximum(m0 + (BM - 1 + S - T - LEFT), 0) + BN - 1) // BN * BN
    a = _clamp(full_lo, lo, hi)
    c = _clamp(full_hi, a, hi)
    return lo, a, c, hi


@triton.jit
def _query_blocks(n0, BM: tl.constexpr, BN: tl.constexpr, T: tl.constexpr, S: tl.constexpr,
                  LEFT: tl.constexpr, RIGHT: tl.constexpr):
    """Query bounds [lo, hi) (lo a multiple of BM) for keys [n0, n0 + BN): the rows that may see
    one of them under the position rule of `_key_blocks`."""
    lo = n0 * 0
    hi = lo + T
    if RIGHT >= 0:  # s <= t + S - T + RIGHT  <=>  t >= s - (S - T + RIGHT)
        lo = tl.maximum(n0 - (S - T + RIGHT), 0) // BM * BM
    if LEFT >= 0:  # s >= t + S - T - LEFT  <=>  t <= s - (S - T - LEFT)
        hi = tl.minimum(hi, n0 + (BN - S + T + LEFT))
    return lo, hi


@triton.jit
def _query_block_keys(m0, b, QRANGE, BM: tl.constexpr, BN: tl.constexpr, T: tl.constexpr, S: tl.constexpr,
                      LEFT: tl.constexpr, RIGHT: tl.constexpr, HAS_SEG: tl.constexpr):
    """(lo, a, c, hi) of `_key_blocks` for the query block at m0 of batch b, narrowed by
    `_within_segments` to its reach in QRANGE (`segment_ranges` per block of BM queries)."""
    lo, a, c, hi = _key_blocks(m0, BM, BN, T, S, LEFT, RIGHT)
    if HAS_SEG:
        lo, a, c, hi = _within_segments(lo, a, c, hi, QRANGE + (b * tl.cdiv(T, BM) + m0 // BM) * 3, BN)
    return lo, a, c, hi


@triton.jit
def _within_segments(lo, a, c, hi, RANGE, BN: tl.constexpr):
    """Narrows block bounds (lo, a, c, hi) of `_key_blocks` to the columns [RANGE[0], RANGE[1])
    the block's segment ids may reach (`segment_ranges`). The unmasked blocks [a, c) keep only
    those inside one segment shared by every row (RANGE[2] = uniform), none otherwise: the
    segment mask is applied with the position mask (`_logits2`, MASKED). lo and the loop starts
    stay multiples of BN; an empty reach (RANGE[1] <= RANGE[0]) leaves no block."""
    seg_lo = tl.load(RANGE)
    seg_hi = tl.load(RANGE + 1)
    uniform = tl.load(RANGE + 2) != 0
    lo = tl.maximum(lo, seg_lo // BN * BN)
    hi = tl.minimum(hi, seg_hi)
    a = tl.where(uniform, tl.maximum(a, (seg_lo + BN - 1) // BN * BN), hi)
    c = tl.where(uniform, tl.minimum(c, seg_hi // BN * BN), hi)
    a = _clamp(a, lo, hi)
    c = _clamp(c, a, hi)
    return lo, a, c, hi


# ----------------------------------------------------------------------------- forward


@triton.jit
def _fwd_step(acc, m_i, l_i, q, start, t, b, n, h_bn, K, V, k_base, v_base, BIAS, MASK, QSEG, KVSEG,
              T: tl.constexpr, S: tl.constexpr, KH: tl.constexpr, H: tl.constexpr, HV: tl.constexpr,
              HP: tl.constexpr, HVP: tl.constexpr, SCALE: tl.constexpr, CAP: tl.constexpr,
              LEFT: tl.constexpr, RIGHT: tl.constexpr, HAS_BIAS: tl.constexpr, BIAS_SB: tl.constexpr,
              BIAS_SN: tl.constexpr, HAS_MASK: tl.constexpr, MASK_SB: tl.constexpr, MASK_SN: tl.constexpr,
              HAS_SEG: tl.constexpr, DROP: tl.constexpr, THRESH: tl.constexpr, BN: tl.constexpr,
              DOT: tl.constexpr, MASKED: tl.constexpr):
    s = start + tl.arange(0, BN)
    hk = tl.arange(0, HP)
    hv = tl.arange(0, HVP)
    kt = _head_rows(K, k_base, s, hk, KH * H, S, H, HP, MASKED, True)
    z, th = _logits2(_dot(q, kt, DOT), t[:, None], s[None, :], b, n, BIAS, MASK, QSEG, KVSEG, T, S, SCALE,
                     CAP, LEFT, RIGHT, HAS_BIAS, BIAS_SB, BIAS_SN, HAS_MASK, MASK_SB, MASK_SN, HAS_SEG, MASKED)
    m_new = tl.maximum(m_i, tl.max(z, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.math.exp2(z - m_safe[:, None])
    alpha = tl.math.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    if DROP:
        p = tl.where(_keep(h_bn, t[:, None], s[None, :], THRESH), p, 0.0)
    vt = _head_rows(V, v_base, s, hv, KH * HV, S, HV, HVP, MASKED, False)
    acc = acc * alpha[:, None] + _dot(p.to(vt.dtype), vt, DOT)
    return acc, m_new, l_i


@triton.jit
def _fwd_kernel(Q, K, V, BIAS, MASK, QSEG, KVSEG, SEED, QRANGE, O, LSE,
                T: tl.constexpr, S: tl.constexpr, N: tl.constexpr, KH: tl.constexpr, H: tl.constexpr,
                HV: tl.constexpr, HP: tl.constexpr, HVP: tl.constexpr, SCALE: tl.constexpr,
                CAP: tl.constexpr, LEFT: tl.constexpr, RIGHT: tl.constexpr, HAS_BIAS: tl.constexpr,
                BIAS_SB: tl.constexpr, BIAS_SN: tl.constexpr, HAS_MASK: tl.constexpr, MASK_SB: tl.constexpr,
                MASK_SN: tl.constexpr, HAS_SEG: tl.constexpr, DROP: tl.constexpr, THRESH: tl.constexpr,
                KEEP_SCALE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, DOT: tl.constexpr):
    m0 = (tl.num_programs(0) - 1 - tl.program_id(0)) * BM  # heaviest (last) query block first
    bn = tl.program_id(1)
    b = bn // N
    n = bn % N
    kh = n // (N // KH)
    t = m0 + tl.arange(0, BM)
    h = tl.arange(0, HP)
    hv = tl.arange(0, HVP)
    q_base = b.to(tl.int64) * (T * N * H) + n * H
    k_base = b.to(tl.int64) * (S * KH * H) + kh * H
    v_base = b.to(tl.int64) * (S * KH * HV) + kh * HV
    # Rows past T read row T - 1 (their outputs are not stored) rather than take a row mask. At
    # T, S not multiples of 32 the row masks (this one, kept live through the loop, and the K/V
    # loads' in unmasked blocks, `_head_rows`) cost ptxas's schedule: the soft-capped forward ran
    # 1.35-1.39x as long as at T 4000 at the same clock (ncu: more dependency stalls), 2.69 ms at
    # T 4008; without them 2.06 (T 4016 1.82, T 4000 1.89; H200,
    # results/attention_H200_2026-11-26_triton_odd_lengths.json).
    q = tl.load(Q + q_base + tl.minimum(t, T - 1)[:, None] * (N * H) + h[None, :], mask=h[None, :] < H, other=0.0)
    h_bn = 0
    if DROP:
        h_bn = _head_hash(SEED, b, n, N)
    acc = tl.zeros([BM, HVP], dtype=tl.float32)
    m_i = tl.full([BM], float("-inf"), tl.float32)
    l_i = tl.zeros([BM], dtype=tl.float32)
    lo, a, c, hi = _query_block_keys(m0, b, QRANGE, BM, BN, T, S, LEFT, RIGHT, HAS_SEG)
    for start in range(lo, a, BN):
        acc, m_i, l_i = _fwd_step(acc, m_i, l_i, q, start, t, b, n, h_bn, K, V, k_base, v_base, BIAS, MASK, QSEG,
                                  KVSEG, T, S, KH, H, HV, HP, HVP, SCALE, CAP, LEFT, RIGHT, HAS_BIAS, BIAS_SB,
                                  BIAS_SN, HAS_MASK, MASK_SB, MASK_SN, HAS_SEG, DROP, THRESH, BN, DOT, True)
    for start in range(a, c, BN):
        acc, m_i, l_i = _fwd_step(acc, m_i, l_i, q, start, t, b, n, h_bn, K, V, k_base, v_base, BIAS, MASK, QSEG,
                                  KVSEG, T, S, KH, H, HV, HP, HVP, SCALE, CAP, LEFT, RIGHT, HAS_BIAS, BIAS_SB,
                                  BIAS_SN, HAS_MASK, MASK_SB, MASK_SN, HAS_SEG, DROP, THRESH, BN, DOT, False)
    for start in range(c, hi, BN):
        acc, m_i, l_i = _fwd_step(acc, m_i, l_i, q, start, t, b, n, h_bn, K, V, k_base, v_base, BIAS, MASK, QSEG,
                                  KVSEG, T, S, KH, H, HV, HP, HVP, SCALE, CAP, LEFT, RIGHT, HAS_BIAS, BIAS_SB,
                                  BIAS_SN, HAS_MASK, MASK_SB, MASK_SN, HAS_SEG, DROP, THRESH, BN, DOT, True)
    nonempty = l_i > 0.0
    inv = tl.where(nonempty, KEEP_SCALE / tl.where(nonempty, l_i, 1.0), 0.0)
    out = acc * inv[:, None]
    o_base = b.to(tl.int64) * (T * N * HV) + n * HV
    tl.store(O + o_base + t[:, None] * (N * HV) + hv[None, :], out.to(O.dtype.element_ty),
             mask=(t[:, None] < T) & (hv[None, :] < HV))
    m_safe = tl.where(m_i == float("-inf"), 0.0, m_i)
    lse = tl.where(nonempty, (m_safe + tl.math.log2(tl.where(nonempty, l_i, 1.0))) * LN2, float("-inf"))
    tl.store(LSE + bn.to(tl.int64) * T + t, lse, mask=t < T)


# ----------------------------------------------------------------------------- backward


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
    length the heads' rows start unaligned and the backward ran 1.51x as long (H200, causal B4 N32
    H128, CUPTI: 5.39 ms at T 4001 against 3.56 at T 4000 and 3.83 at T 4008;
    results/attention_H200_2026-11-26_triton_odd_lengths.json)."""
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
def _dkdv_step(dk, dv, k, v, start, s, b, n, h_bn, Q, DO, LSE, DELTA, BIAS, MASK, QSEG, KVSEG, DZT,
               T: tl.constexpr, S: tl.constexpr, N: tl.constexpr, H: tl.constexpr, HV: tl.constexpr,
               HP: tl.constexpr, HVP: tl.constexpr, SCALE: tl.constexpr, CAP: tl.constexpr,
               LEFT: tl.constexpr, RIGHT: tl.constexpr, HAS_BIAS: tl.constexpr, BIAS_SB: tl.constexpr,
               BIAS_SN: tl.constexpr, HAS_MASK: tl.constexpr, MASK_SB: tl.constexpr, MASK_SN: tl.constexpr,
               HAS_SEG: tl.constexpr, DROP: tl.constexpr, THRESH: tl.constexpr, KEEP_SCALE: tl.constexpr,
               BM: tl.constexpr, DOT: tl.constexpr, MASKED: tl.constexpr, DZT_OUT: tl.constexpr,
               SP: tl.constexpr, TP: tl.constexpr):
    """One query block's contribution to dk, dv of a key block; tiles are [keys, queries]. DZT_OUT:
    the tile's dz^T (with the soft-cap factor, in q's dtype: what the dk product consumes) also
    goes to DZT [B*N, SP, TP], for `_dq_kernel`."""
    t = start + tl.arange(0, BM)
    qt = _head_rows(Q, b.to(tl.int64) * (T * N * H) + n * H, t, tl.arange(0, HP), N * H, T, H, HP, True, True)
    do = _head_rows(DO, b.to(tl.int64) * (T * N * HV) + n * HV, t, tl.arange(0, HVP), N * HV, T, HV, HVP, True, False)
    lse2, d = _row_stats(LSE, DELTA, b * N + n, t, T)
    zt, tht = _logits2(_dot(k, qt, DOT), t[None, :], s[:, None], b, n, BIAS, MASK, QSEG, KVSEG, T, S, SCALE, CAP,
                       LEFT, RIGHT, HAS_BIAS, BIAS_SB, BIAS_SN, HAS_MASK, MASK_SB, MASK_SN, HAS_SEG, MASKED)
    pt = tl.math.exp2(zt - lse2[None, :])
    dpt = _dot(v, tl.trans(do), DOT)
    if DROP:
        keep = _keep(h_bn, t[None, :], s[:, None], THRESH)
        dv += _dot(tl.where(keep, pt * KEEP_SCALE, 0.0).to(do.dtype), do, DOT)
        dpt = tl.where(keep, dpt * KEEP_SCALE, 0.0)
    else:
        dv += _dot(pt.to(do.dtype), do, DOT)
    dzt = pt * (dpt - d[None, :])
    if CAP > 0:
        dzt = dzt * (1.0 - tht * tht)
    dzt = dzt.to(qt.dtype)
    if DZT_OUT:  # every row and column lies inside DZT's padded extent (`backward`)
        tl.store(DZT + (b * N + n).to(tl.int64) * (SP * TP) + s[:, None] * TP + t[None, :], dzt)
    dk += _dot(dzt, tl.trans(qt), DOT)
    return dk, dv


@triton.jit
def _query_tile(Q, DO, LSE, DELTA, b, n, t, T: tl.constexpr, N: tl.constexpr, H: tl.constexpr,
                HV: tl.constexpr, HP: tl.constexpr, HVP: tl.constexpr):
    """(q, dout, lse2, D) of queries t of head n in batch b, zeros past T (`_row_stats`)."""
    q = _head_rows(Q, b.to(tl.int64) * (T * N * H) + n * H, t, tl.arange(0, HP), N * H, T, H, HP, True, False)
    do = _head_rows(DO, b.to(tl.int64) * (T * N * HV) + n * HV, t, tl.arange(0, HVP), N * HV, T, HV, HVP, True, False)
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
    kt = _head_rows(K, k_base, s, h, KH * H, S, H, HP, MASKED, True)
    vt = _head_rows(V, v_base, s, hv, KH * HV, S, HV, HVP, MASKED, True)
    z, th = _logits2(_dot(q, kt, DOT), t[:, None], s[None, :], b, n, BIAS, MASK, QSEG, KVSEG, T, S, SCALE, CAP,
                     LEFT, RIGHT, HAS_BIAS, BIAS_SB, BIAS_SN, HAS_MASK, MASK_SB, MASK_SN, HAS_SEG, MASKED)
    p = tl.math.exp2(z - lse2[:, None])
    dp = _dot(do, vt, DOT)
    if DROP:
        dp = tl.where(_keep(h_bn, t[:, None], s[None, :], THRESH), dp * KEEP_SCALE, 0.0)
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
    return dq + _dot(dz.to(kt.dtype), tl.trans(kt), DOT)


@triton.jit
def _bwd_kernel(Q, K, V, BIAS, MASK, QSEG, KVSEG, SEED, QRANGE, KRANGE, DO, LSE, DELTA, DQ, DK, DV, DZ, DZT,
                T: tl.constexpr, S: tl.constexpr, N: tl.constexpr, KH: tl.constexpr, H: tl.constexpr,
                HV: tl.constexpr, HP: tl.constexpr, HVP: tl.constexpr, SCALE: tl.constexpr,
                CAP: tl.constexpr, LEFT: tl.constexpr, RIGHT: tl.constexpr, HAS_BIAS: tl.constexpr,
                BIAS_SB: tl.constexpr, BIAS_SN: tl.constexpr, HAS_MASK: tl.constexpr, MASK_SB: tl.constexpr,
                MASK_SN: tl.constexpr, HAS_SEG: tl.constexpr, DROP: tl.constexpr, THRESH: tl.constexpr,
                KEEP_SCALE: tl.constexpr, BM1: tl.constexpr, BN1: tl.constexpr, BM2: tl.constexpr,
                BN2: tl.constexpr, DOT: tl.constexpr, DZ_OUT: tl.constexpr, DZT_OUT: tl.constexpr,
                SP: tl.constexpr, TP: tl.constexpr):
    G: tl.constexpr = N // KH
    pid = tl.program_id(0)
    bn = tl.program_id(1)
    b = bn // N
    n0 = bn % N
    kh = n0 // G
    h = tl.arange(0, HP)
    hv = tl.arange(0, HVP)
    k_base = b.to(tl.int64) * (S * KH * H) + kh * H
    v_base = b.to(tl.int64) * (S * KH * HV) + kh * HV
    NKB: tl.constexpr = (S + BN1 - 1) // BN1
    if pid < NKB:
        if n0 % G == 0:  # the first query head of its group does the group's dk/dv
            s = pid * BN1 + tl.arange(0, BN1)  # key block 0 (the heaviest under causal) first
            k_mask = (s[:, None] < S) & (h[None, :] < H)
            v_mask = (s[:, None] < S) & (hv[None, :] < HV)
            k = tl.load(K + k_base + s[:, None] * (KH * H) + h[None, :], mask=k_mask, other=0.0)
            v = tl.load(V + v_base + s[:, None] * (KH * HV) + hv[None, :], mask=v_mask, other=0.0)
            dk = tl.zeros([BN1, HP], dtype=tl.float32)
            dv = tl.zeros([BN1, HVP], dtype=tl.float32)
            # One loop, every tile position-masked: with separate masked/unmasked loops over the
            # same dk/dv accumulators ptxas serialises the wgmmas (C7515, seen at H=64 and 128).
            # Masking only the tiles the band or a tail crosses through a runtime branch in the
            # loop avoids C7515 but measured no faster (causal H128 within noise, H64 3% and GQA
            # 3-5% slower; results/attention_H200_2026-11-26_triton_dkdv_mask_branch.json).
            lo, hi = _query_blocks(pid * BN1, BM1, BN1, T, S, LEFT, RIGHT)
            if HAS_SEG:  # the queries this key block's segment ids may reach (`segment_ranges`)
                lo = tl.maximum(lo, tl.load(KRANGE + (b * NKB + pid) * 3) // BM1 * BM1)
                hi = tl.minimum(hi, tl.load(KRANGE + (b * NKB + pid) * 3 + 1))
            for g in range(G):
                n = n0 + g
                h_bn = 0
                if DROP:
                    h_bn = _head_hash(SEED, b, n, N)
                for start in range(lo, hi, BM1):
                    dk, dv = _dkdv_step(dk, dv, k, v, start, s, b, n, h_bn, Q, DO, LSE, DELTA, BIAS, MASK, QSEG, KVSEG,
                                        DZT, T, S, N, H, HV, HP, HVP, SCALE, CAP, LEFT, RIGHT, HAS_BIAS, BIAS_SB,
                                        BIAS_SN, HAS_MASK, MASK_SB, MASK_SN, HAS_SEG, DROP, THRESH, KEEP_SCALE, BM1,
                                        DOT, True, DZT_OUT, SP, TP)
            tl.store(DK + k_base + s[:, None] * (KH * H) + h[None, :], (dk * SCALE).to(DK.dtype.element_ty), mask=k_mask)
            tl.store(DV + v_base + s[:, None] * (KH * HV) + hv[None, :], dv.to(DV.dtype.element_ty), mask=v_mask)
    elif not DZT_OUT:  # (with DZT_OUT the grid has no dQ programs: `_dq_kernel` follows)
        n = n0
        m0 = (tl.num_programs(0) - 1 - pid) * BM2  # the last (heaviest) query block first
        t = m0 + tl.arange(0, BM2)
        q, do, lse2, d = _query_tile(Q, DO, LSE, DELTA, b, n, t, T, N, H, HV, HP, HVP)
        h_bn = 0
        if DROP:
            h_bn = _head_hash(SEED, b, n, N)
        dq = tl.zeros([BM2, HP], dtype=tl.float32)
        lo, a, c, hi = _query_block_keys(m0, b, QRANGE, BM2, BN2, T, S, LEFT, RIGHT, HAS_SEG)
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
        ok = _allowed(t[:, None], s[None, :], b, QSEG, KVSEG, T, S, LEFT, RIGHT, HAS_SEG)
        dz = tl.load(DZT + offsets, mask=ok, other=0.0)
    else:
        dz = tl.load(DZT + offsets)
    kt = _head_rows(K, k_base, s, tl.arange(0, HP), KH * H, S, H, HP, MASKED, False)
    return dq + _dot(dz, kt, DOT)


@triton.jit
def _dq_kernel(K, QSEG, KVSEG, QRANGE, DZT, DQ, T: tl.constexpr, S: tl.constexpr, N: tl.constexpr,
               KH: tl.constexpr, H: tl.constexpr, HP: tl.constexpr, SCALE: tl.constexpr, LEFT: tl.constexpr,
               RIGHT: tl.constexpr, HAS_SEG: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, SP: tl.constexpr,
               TP: tl.constexpr, DOT: tl.constexpr):
    """dq = scale * dz k for a block of BM queries, over the key blocks of `_key_blocks`, from the
    dz^T tiles [B*N, SP, TP] `_bwd_kernel` wrote with DZT_OUT: one matmul per tile where its own
    dQ programs recompute q k^T and dO v^T first (5 matmuls per tile in all instead of 7)."""
    m0 = (tl.num_programs(0) - 1 - tl.program_id(0)) * BM  # the last (heaviest) query block first
    bn = tl.program_id(1)
    b = bn // N
    n = bn % N
    t = m0 + tl.arange(0, BM)
    h = tl.arange(0, HP)
    k_base = b.to(tl.int64) * (S * KH * H) + (n // (N // KH)) * H
    dzt_base = bn.to(tl.int64) * (SP * TP)
    dq = tl.zeros([BM, HP], dtype=tl.float32)
    lo, a, c, hi = _query_block_keys(m0, b, QRANGE, BM, BN, T, S, LEFT, RIGHT, HAS_SEG)
    for start in range(lo, a, BN):
        dq = _dq_tile(dq, t, start, b, K, k_base, QSEG, KVSEG, DZT, dzt_base, T, S, KH, H, HP, LEFT, RIGHT, HAS_SEG,
                      BN, TP, DOT, True)
    for start in range(a, c, BN):
        dq = _dq_tile(dq, t, start, b, K, k_base, QSEG, KVSEG, DZT, dzt_base, T, S, KH, H, HP, LEFT, RIGHT, HAS_SEG,
                      BN, TP, DOT, False)
    for start in range(c, hi, BN):
        dq = _dq_tile(dq, t, start, b, K, k_base, QSEG, KVSEG, DZT, dzt_base, T, S, KH, H, HP, LEFT, RIGHT, HAS_SEG,
                      BN, TP, DOT, True)
    _store_dq(DQ, dq, b, n, t, h, T, N, H, SCALE)


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
    lo, a, c, hi = _key_blocks(m0, BM, BN, T, S, LEFT, RIGHT)  # every tile is masked here: a, c unused
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
                    h_bn = _head_hash(SEED, b, n, N)
                k_base = b.to(tl.int64) * (S * KH * H) + (n // G) * H
                v_base = b.to(tl.int64) * (S * KH * HV) + (n // G) * HV
                dz, th, kt = _dz_tile(q, do, lse2, d, start, t, b, n, h_bn, K, V, k_base, v_base, BIAS, MASK, QSEG,
                                      KVSEG, T, S, KH, H, HV, HP, HVP, SCALE, CAP, LEFT, RIGHT, HAS_BIAS, BIAS_SB,
                                      BIAS_SN, HAS_MASK, MASK_SB, MASK_SN, HAS_SEG, DROP, THRESH, KEEP_SCALE, BN,
                                      DOT, True)  # th, kt: only dQ needs them
                dbias += dz
    tl.store(DBIAS + gbn.to(tl.int64) * (T * S) + t[:, None] * S + s[None, :], dbias,
             mask=(t[:, None] < T) & (s[None, :] < S))


# ----------------------------------------------------------------------------- configs and launch


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
    """Tiles and launch shape: forward (block_m queries x block_n keys); fused backward with
    dK/dV programs of block_n1 keys looping over block_m1 queries, dQ programs of block_m2
    queries looping over block_n2 keys (one num_warps/num_stages for both halves)."""

    block_m: int
    block_n: int
    fwd_warps: int
    fwd_stages: int
    block_m1: int
    block_n1: int
    block_m2: int
    block_n2: int
    bwd_warps: int
    bwd_stages: int


# One per (max(H, Hv) padded to 128 or 256, element width): `config_for`. 16-bit, <= 128: the H200
# measurements of notes/TRITON_JAX.md, then forward key blocks of 64 instead of 128, measured
# faster side by side on an H200 (benchmarks/tune_attention.py, causal B4 T4096 N32 H128, two
# runs: fwd 1.368 / 1.373 against 1.411 / 1.426 ms, fwd+bwd 5.079 / 5.056 against 5.140 / 5.131;
# benchmarks/results/attention_H200_triton_forward_block.json). An H100 prefers 128 (same
# benchmark, two copies of each config interleaved in one run: fwd 1.344 / 1.347 against 1.412 /
# 1.384 ms, fwd+bwd 5.166 / 5.223 against 5.217 / 5.277;
# benchmarks/results/attention_H100_triton_forward_block.json): `_FORWARD_KEY_BLOCK`. The f32 ones were sized with
# ptxas -v (sm_90a) on CPU cross-lowered PTX at B4 T4096 N32 causal, not timed: f32 (tf32x3 dots) 128 spills 76 B
# (fwd) / 152 B (bwd). f32 at 256 spilled 2-40 KB in every config tried, so `_supports` refuses it
# on GPU.
_CONFIG_16BIT_128 = AttentionConfig(128, 64, 8, 3, 64, 128, 128, 64, 8, 3)
# Forward key block of _CONFIG_16BIT_128 per device kind (prefix of jax's device_kind).
_FORWARD_KEY_BLOCK = (("NVIDIA H100", 128),)
# 16-bit 256: measured side by side on an H200 (B2 T4096 N16 causal, CUPTI kernel ms against the
# ptxas-sized (64, 64, 8, 2, 32, 64, 64, 32, 8, 2) before it, two runs): forward 128-query blocks
# 0.635 against 1.245; dQ programs of 128 queries and dK/dV programs of 64 queries 2.894 against
# 4.742 (ptxas spills 128 bytes there; without spills, 32-query dK/dV programs 3.37-3.40);
# fwd+bwd 3.69 against 6.13 ms (results/attention_H200_2026-11-26_triton_h256_tiles.json).
_CONFIG_16BIT_256 = AttentionConfig(128, 64, 8, 2, 64, 64, 128, 32, 8, 2)
_CONFIG_F32_128 = AttentionConfig(64, 32, 4, 2, 32, 32, 32, 32, 8, 2)
_CONFIG_F32_256 = AttentionConfig(32, 32, 4, 2, 16, 32, 32, 16, 8, 2)  # refused on GPU (spills)
# The interpreter pays per block operation; small, unequal tiles still exercise the block bounds.
_INTERPRET_CONFIG = AttentionConfig(32, 16, 4, 1, 16, 32, 32, 16, 4, 1)


# dq from the dz^T tiles the dK/dV programs store (`_dq_kernel`) at these padded head dims (q's
# and v's, the wider), while the tiles [B*N, S, T] (rounded up to blocks, q's dtype) fit
# _DZ_TILES_MAX_BYTES (4 GiB: causal B4 T4096 N32, Llama-3-8B's B1 T8192 N32); otherwise the dQ
# programs of `_bwd_kernel` recompute them. Measured against those (benchmarks/tune_attention.py,
# B4 T4096 N32 fwd+bwd): at 128 on an H200, causal 4.659 against 5.160 ms, non-causal 8.200
# against 9.199, GQA 4.802 against 5.020 (results/attention_H200_2026-11-26_triton_dq_from_dz_tiles_*.json);
# on an H100, causal 4.896 / 4.852 (two copies) against 5.027, non-causal 8.416 / 8.230 against
# 8.705, GQA 4.995 / 4.863 against 4.935 (results/attention_H100_2026-11-26_triton_dq_from_dz_tiles.json).
# Not at 64: even on the H200 (3.153 against 3.150), slower on the H100 (3.595 against 3.291).
_DZ_TILES_PADDED_HEAD_DIMS = (128,)
_DZ_TILES_MAX_BYTES = 4 << 30


def dz_tiles_extent(B: int, N: int, T: int, S: int, dtype, cfg: AttentionConfig) -> tuple[int, int] | None:
    """(rows, columns) of each head's dz^T tiles [S, T] rounded up to whole blocks of both
    backward halves, when the B*N of them fit `_DZ_TILES_MAX_BYTES` (and int32 offsets inside
    a head); else None: dq is recomputed by the dQ programs."""
    rows = triton.cdiv(S, cfg.block_n1) * cfg.block_n1
    block = max(cfg.block_m1, cfg.block_m2)
    cols = triton.cdiv(T, block) * block
    if rows * cols >= 2**31 or B * N * rows * cols * jnp.dtype(dtype).itemsize > _DZ_TILES_MAX_BYTES:
        return None
    return rows, cols


def _pow2(x: int) -> int:
    return max(16, triton.next_power_of_2(x))


def config_for(head_dim: int, value_dim: int, dtype, *, streams_scores_tiles: bool = False) -> AttentionConfig:
    """`streams_scores_tiles`: the forward loads a [block_m, block_n] tile of a bias or mask per
    step. The pipeline buffers those too, so the device's larger key block is not taken then: at
    head_dim 128 with a bias it would ask for 288 KB of shared memory (Hopper has 227 KB)."""
    if interpret_enabled():
        return _INTERPRET_CONFIG
    width = 128 if max(_pow2(head_dim), _pow2(value_dim)) <= 128 else 256
    if jnp.dtype(dtype).itemsize == 4:
        return _CONFIG_F32_128 if width == 128 else _CONFIG_F32_256
    if width == 256:
        return _CONFIG_16BIT_256
    if streams_scores_tiles:
        return _CONFIG_16BIT_128
    kind = current_device_kind()
    block_n = next((n for prefix, n in _FORWARD_KEY_BLOCK if kind.startswith(prefix)), _CONFIG_16BIT_128.block_n)
    return dataclasses.replace(_CONFIG_16BIT_128, block_n=block_n)


def _statics(q, k, v, bias, mask, qseg, spec: AttentionSpec) -> dict:
    """The constexprs shared by every kernel of one call."""
    B, T, N, H = q.shape
    S, KH, HV = k.shape[1], k.shape[2], v.shape[3]
    pair_strides = lambda a: (0, 0) if a is None else (
        0 if a.shape[0] == 1 else a.shape[1] * T * S, 0 if a.shape[1] == 1 else T * S)
    bias_sb, bias_sn = pair_strides(bias)
    mask_sb, mask_sn = pair_strides(mask)
    rate = spec.dropout_rate
    return dict(
        T=T, S=S, N=N, KH=KH, H=H, HV=HV, HP=_pow2(H), HVP=_pow2(HV), SCALE=float(spec.scale),
        CAP=float(spec.logit_soft_cap or 0.0),
        LEFT=-1 if spec.window_left is None else int(spec.window_left),
        RIGHT=-1 if spec.right is None else int(spec.right),
        HAS_BIAS=bias is not None, BIAS_SB=bias_sb, BIAS_SN=bias_sn,
        HAS_MASK=mask is not None, MASK_SB=mask_sb, MASK_SN=mask_sn, HAS_SEG=qseg is not None,
        DROP=rate > 0, THRESH=int(spec.dropout_threshold), KEEP_SCALE=float(1.0 / (1.0 - rate)),
        DOT=2 if interpret_enabled() else int(q.dtype == jnp.float32),
    )


def _optional_inputs(bias, mask, qseg, kvseg, seed, *, query_block: int, key_block: int | None = None):
    """Absent inputs become 1-element dummies (the kernels never read them: constexpr flags).
    With segments, also the key range of each block of `query_block` queries and (backward) the
    query range of each block of `key_block` keys that the block-sparse loops stay inside."""
    dummy = lambda dt: jnp.zeros((1,), dt)
    ranges = [dummy(jnp.int32)] * (1 if key_block is None else 2)
    if qseg is not None:
        qseg, kvseg = qseg.astype(jnp.int32), kvseg.astype(jnp.int32)
        ranges[0] = segment_ranges(qseg, kvseg, query_block)
        if key_block is not None:
            ranges[1] = segment_ranges(kvseg, qseg, key_block)
    return (
        dummy(jnp.float32) if bias is None else bias,
        dummy(jnp.int8) if mask is None else mask.astype(jnp.int8),  # a bool pointer is not portable
        dummy(jnp.int32) if qseg is None else qseg,
        dummy(jnp.int32) if kvseg is None else kvseg,
        dummy(jnp.uint32) if seed is None else jnp.asarray(seed, jnp.uint32).reshape(1),
        *ranges,
    )


def _forward(q, k, v, bias, mask, q_segment_ids, kv_segment_ids, dropout_seed, spec):
    B, T, N, _ = q.shape
    HV = v.shape[3]
    cfg = config_for(q.shape[3], HV, q.dtype, streams_scores_tiles=bias is not None or mask is not None)
    statics = _statics(q, k, v, bias, mask, q_segment_ids, spec)
    out, lse = triton_call(
        q, k, v, *_optional_inputs(bias, mask, q_segment_ids, kv_segment_ids, dropout_seed, query_block=cfg.block_m),
        kernel=_fwd_kernel,
        out_shape=(jax.ShapeDtypeStruct((B, T, N, HV), q.dtype), jax.ShapeDtypeStruct((B, N, T), jnp.float32)),
        grid=(triton.cdiv(T, cfg.block_m), B * N),
        num_warps=cfg.fwd_warps, num_stages=cfg.fwd_stages,
        BM=cfg.block_m, BN=cfg.block_n, **statics,
    )
    return out, lse


def backward(q, k, v, bias, mask, q_segment_ids, kv_segment_ids, dropout_seed, out, lse, dout, dlse, spec):
    B, T, N, H = q.shape
    S, HV = k.shape[1], v.shape[3]
    cfg = config_for(H, HV, q.dtype)
    statics = _statics(q, k, v, bias, mask, q_segment_ids, spec)
    pad = ((0, 0), (0, 0), (0, stat_row_length(T) - T))  # rows past T: empty ones (`_stat_row`)
    lse = jnp.pad(lse, pad, constant_values=-jnp.inf)
    dlse = jnp.pad(jnp.broadcast_to(dlse, (B, N, T)).astype(jnp.float32), pad)
    delta_bm = 64 if not interpret_enabled() else 32
    delta = triton_call(
        out, dout.astype(out.dtype), dlse,
        kernel=_delta_kernel, out_shape=jax.ShapeDtypeStruct((B, N, stat_row_length(T)), jnp.float32),
        grid=(triton.cdiv(T, delta_bm), B * N), num_warps=4, num_stages=1,
        T=T, N=N, HV=HV, HVP=statics["HVP"], BM=delta_bm,
    )
    # A bias of the full [B, N] extent takes dz from the dQ programs; a broadcast one its own kernel.
    dz_out = bias is not None and tuple(bias.shape[:2]) == (B, N)
    dz_shape = (B, N, T, S) if dz_out else (1,)
    dz_tiles = None
    if bias is None and max(statics["HP"], statics["HVP"]) in _DZ_TILES_PADDED_HEAD_DIMS:
        dz_tiles = dz_tiles_extent(B, N, T, S, q.dtype, cfg)
    dzt_out = dz_tiles is not None
    rows_p, cols_p = dz_tiles or (0, 0)
    optional = _optional_inputs(bias, mask, q_segment_ids, kv_segment_ids, dropout_seed,
                                query_block=cfg.block_m2, key_block=cfg.block_n1)
    dq, dk, dv, dz, dzt = triton_call(
        q, k, v, *optional, dout.astype(q.dtype), lse, delta,
        kernel=_bwd_kernel,
        out_shape=(jax.ShapeDtypeStruct((1,) if dzt_out else q.shape, q.dtype), jax.ShapeDtypeStruct(k.shape, k.dtype),
                   jax.ShapeDtypeStruct(v.shape, v.dtype), jax.ShapeDtypeStruct(dz_shape, jnp.float32),
                   jax.ShapeDtypeStruct((B * N * rows_p * cols_p,) if dzt_out else (1,), q.dtype)),
        grid=(triton.cdiv(S, cfg.block_n1) + (0 if dzt_out else triton.cdiv(T, cfg.block_m2)), B * N),
        num_warps=cfg.bwd_warps, num_stages=cfg.bwd_stages,
        BM1=cfg.block_m1, BN1=cfg.block_n1, BM2=cfg.block_m2, BN2=cfg.block_n2, DZ_OUT=dz_out, DZT_OUT=dzt_out,
        SP=rows_p, TP=cols_p, **statics,
    )
    if dzt_out:
        _, _, qseg, kvseg, _, qrange, _ = optional
        dq = triton_call(
            k, qseg, kvseg, qrange, dzt, kernel=_dq_kernel, out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
            grid=(triton.cdiv(T, cfg.block_m2), B * N), num_warps=cfg.bwd_warps, num_stages=cfg.bwd_stages,
            BM=cfg.block_m2, BN=cfg.block_n2, SP=rows_p, TP=cols_p,
            **{name: statics[name] for name in ("T", "S", "N", "KH", "H", "HP", "SCALE", "LEFT", "RIGHT", "HAS_SEG",
                                                "DOT")},
        )
    dbias = dz if dz_out else None
    if bias is not None and not dz_out:
        Bb, Nb = bias.shape[:2]
        # Its (b, n) loop is pipelined with a q, dO, K, V and bias tile per stage: at head_dim 128,
        # 3 stages ask for 288 KB of shared memory (Hopper has 227 KB), and at head_dim 256 the
        # dQ programs' 128-query blocks 320 KB, so its query block is capped at 128 * 128 / H.
        rows = min(cfg.block_m2, 128 * 128 // _pow2(max(q.shape[3], v.shape[3])))
        dbias = triton_call(
            q, k, v, *_optional_inputs(bias, mask, q_segment_ids, kv_segment_ids, dropout_seed,
                                       query_block=rows),
            dout.astype(q.dtype), lse, delta,
            kernel=_dbias_kernel, out_shape=jax.ShapeDtypeStruct((Bb, Nb, T, S), jnp.float32),
            grid=(triton.cdiv(T, rows), triton.cdiv(S, cfg.block_n2), Bb * Nb),
            num_warps=cfg.bwd_warps, num_stages=min(cfg.bwd_stages, 2),
            B=B, BM=rows, BN=cfg.block_n2, BIAS_B=Bb, BIAS_N=Nb, **statics,
        )
    return dq, dk, dv, dbias


def _supports(q, k, v, bias, mask, q_segment_ids, kv_segment_ids, dropout_seed, *, spec: AttentionSpec):
    del q_segment_ids, kv_segment_ids, dropout_seed
    for name, a in (("q", q), ("k", k), ("v", v)) + ((("bias", bias),) if bias is not None else ()):
        if a.dtype not in _DTYPES:
            return f"{name} dtype {jnp.dtype(a.dtype).name} is not one of float32/bfloat16/float16"
    H, HV = q.shape[3], v.shape[3]
    if max(H, HV) > MAX_HEAD_DIM:
        return f"head dims (H={H}, Hv={HV}) above {MAX_HEAD_DIM} are not supported"
    if q.dtype == jnp.float32 and max(H, HV) > 128 and not interpret_enabled():
        return f"float32 with head dims (H={H}, Hv={HV}) above 128 spills registers heavily; use bf16/f16"
    if 0 in q.shape or 0 in k.shape or 0 in v.shape:
        return "empty q/k/v"
    B, T, N, _ = q.shape
    S, KH = k.shape[1], k.shape[2]
    if B * N >= 65536:
        return f"B*N={B * N} exceeds the grid's second axis (65535)"
    pairs = B * N * T * S if bias is not None else (T * S if mask is not None else 0)
    if max(B * T * N * max(H, HV), B * S * KH * max(H, HV), pairs) >= 2**31:
        return "arrays with >= 2^31 elements (int32 tile offsets)"
    return None


ATTENTION = Implementation(
    fn=differentiable_attention(AttentionKernels(forward=_forward, backward=backward)),
    platforms=("gpu",),
    interpretable=True,
    supports=_supports,
)
