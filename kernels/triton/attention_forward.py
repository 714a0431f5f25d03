"""The Triton attention forward: FlashAttention-2, one program per (query block, batch-head).

Grid (cdiv(T, BM), B*N), the last query block first (under causal masking it is the heaviest).
Per query block, an online softmax over the key blocks of `query_block_keys`, in log2 units:
    z2 = log2(e) * logits(q k^T)        logits: scale, soft cap, + bias, -inf where not allowed
    m' = max(m, rowmax z2);  l = l 2^(m - m') + rowsum 2^(z2 - m');  acc likewise with p @ v
    out = acc / l / (1 - rate) (0 when l == 0),  lse = ln 2 * (m + log2 l) (-inf when l == 0).
m is replaced by 0 while it is -inf, so a row with no allowed key so far never makes NaN.
Dropout multiplies p by the keep mask in the `acc` update only (l, hence lse, is pre-dropout).
The key loop runs in three ranges: masked blocks, blocks every row sees whole (no position,
tail or segment masks: MASKED=False), masked blocks.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import triton
import triton.language as tl

from forgeax.kernels.triton.attention_tiles import (
    LN2, dot, head_hash, head_rows, keep_mask, kernel_statics, logits2, optional_inputs, query_block_keys,
)
from forgeax.kernels.triton.launch import triton_call

if TYPE_CHECKING:
    from forgeax.kernels.triton.attention import TritonAttentionConfig


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
    kt = head_rows(K, k_base, s, hk, KH * H, S, H, HP, MASKED, True)
    z, th = logits2(dot(q, kt, DOT), t[:, None], s[None, :], b, n, BIAS, MASK, QSEG, KVSEG, T, S, SCALE,
                     CAP, LEFT, RIGHT, HAS_BIAS, BIAS_SB, BIAS_SN, HAS_MASK, MASK_SB, MASK_SN, HAS_SEG, MASKED)
    m_new = tl.maximum(m_i, tl.max(z, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.math.exp2(z - m_safe[:, None])
    alpha = tl.math.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    if DROP:
        p = tl.where(keep_mask(h_bn, t[:, None], s[None, :], THRESH), p, 0.0)
    vt = head_rows(V, v_base, s, hv, KH * HV, S, HV, HVP, MASKED, False)
    acc = acc * alpha[:, None] + dot(p.to(vt.dtype), vt, DOT)
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
    # loads' in unmasked blocks, `head_rows`) cost ptxas's schedule: more dependency stalls, a
    # third slower soft-capped forward at T 4008 than at T 4000
    # (benchmarks/results/attention_H200_2026-11-26_triton_odd_lengths.json).
    q = tl.load(Q + q_base + tl.minimum(t, T - 1)[:, None] * (N * H) + h[None, :], mask=h[None, :] < H, other=0.0)
    h_bn = 0
    if DROP:
        h_bn = head_hash(SEED, b, n, N)
    acc = tl.zeros([BM, HVP], dtype=tl.float32)
    m_i = tl.full([BM], float("-inf"), tl.float32)
    l_i = tl.zeros([BM], dtype=tl.float32)
    lo, a, c, hi = query_block_keys(m0, b, QRANGE, BM, BN, T, S, LEFT, RIGHT, HAS_SEG)
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


def forward(q, k, v, bias, mask, q_segment_ids, kv_segment_ids, dropout_seed, spec, *, config: TritonAttentionConfig):
    """(out [B, T, N, Hv] in q's dtype, lse [B, N, T] f32) of the contract (kernels/common/attention.py)."""
    B, T, N, _ = q.shape
    HV = v.shape[3]
    statics = kernel_statics(q, k, v, bias, mask, q_segment_ids, spec)
    out, lse = triton_call(
        q, k, v, *optional_inputs(bias, mask, q_segment_ids, kv_segment_ids, dropout_seed, query_block=config.block_m),
        kernel=_fwd_kernel,
        out_shape=(jax.ShapeDtypeStruct((B, T, N, HV), q.dtype), jax.ShapeDtypeStruct((B, N, T), jnp.float32)),
        grid=(triton.cdiv(T, config.block_m), B * N),
        num_warps=config.fwd_warps, num_stages=config.fwd_stages,
        BM=config.block_m, BN=config.block_n, **statics,
    )
    return out, lse
