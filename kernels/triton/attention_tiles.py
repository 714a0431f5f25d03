"""What the Triton attention kernels (attention_forward.py, attention_backward.py) share.

Tile math in log2 units (`logits2`: scale, soft cap, bias, the masks), the dropout keep mask of
kernels/common/attention.py (`head_hash`, `keep_mask`), head-row loads (`head_rows`), and the
block-sparse bounds: `key_blocks` turns the causal/window rule into [lo, hi) key bounds for a
query block (blocks outside are never read) and an inner [a, c) of blocks every row may see
entirely, which skip the position/tail masking (MASKED=False); `query_blocks` gives the query
bounds from a key block's side. With segment ids the bounds narrow further to the columns a
block's ids may reach (`segment_ranges`, one [B, blocks, 3] table per block size, computed by
XLA), so packed sequences skip the blocks between documents.

Host side: the constexprs every kernel of one call shares (`kernel_statics`) and the optional
inputs as 1-element dummies with constexpr flags (`optional_inputs`).
"""

from __future__ import annotations

import jax.numpy as jnp
import triton
import triton.language as tl

from forgeax.core.runtime import interpret_enabled
from forgeax.kernels.common.attention import FMIX_1, FMIX_2, GOLDEN_BN, GOLDEN_S, GOLDEN_T, AttentionSpec, segment_ranges
from forgeax.kernels.triton.elementwise import tanh

# Globals a @triton.jit function reads must be constexprs.
LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)
_FMIX_1, _FMIX_2 = tl.constexpr(FMIX_1), tl.constexpr(FMIX_2)
_GOLDEN_BN, _GOLDEN_T, _GOLDEN_S = tl.constexpr(GOLDEN_BN), tl.constexpr(GOLDEN_T), tl.constexpr(GOLDEN_S)


@triton.jit
def dot(a, b, DOT: tl.constexpr):
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
def fmix(x):
    x = x ^ (x >> 16)
    x = x * tl.full([], _FMIX_1, tl.uint32)
    x = x ^ (x >> 13)
    x = x * tl.full([], _FMIX_2, tl.uint32)
    return x ^ (x >> 16)


@triton.jit
def head_hash(SEED, b, n, N: tl.constexpr):
    seed = tl.load(SEED).to(tl.uint32)
    return fmix(seed ^ ((b * N + n).to(tl.uint32) * tl.full([], _GOLDEN_BN, tl.uint32)))


@triton.jit
def keep_mask(h_bn, t, s, THRESH: tl.constexpr):
    """The contract's keep mask for query indices t and key indices s (broadcast shapes)."""
    h = fmix(h_bn ^ (t.to(tl.uint32) * tl.full([], _GOLDEN_T, tl.uint32)))
    h = fmix(h ^ (s.to(tl.uint32) * tl.full([], _GOLDEN_S, tl.uint32)))
    return (h >> 8) >= tl.full([], THRESH, tl.uint32)


@triton.jit
def rule_allows(t, s, b, QSEG, KVSEG, T: tl.constexpr, S: tl.constexpr, LEFT: tl.constexpr, RIGHT: tl.constexpr,
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
def logits2(qk, t, s, b, n, BIAS, MASK, QSEG, KVSEG, T: tl.constexpr, S: tl.constexpr,
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
        z = tl.where(rule_allows(t, s, b, QSEG, KVSEG, T, S, LEFT, RIGHT, HAS_SEG), z, float("-inf"))
    if HAS_MASK:
        base = b.to(tl.int64) * MASK_SB + n.to(tl.int64) * MASK_SN
        allowed = tl.load(MASK + base + t * S + s, mask=inside, other=0)
        z = tl.where(allowed != 0, z, float("-inf"))
    return z, th


@triton.jit
def head_rows(PTR, base, s, d, ROW: tl.constexpr, S: tl.constexpr, D: tl.constexpr, DP: tl.constexpr,
               MASKED: tl.constexpr, TRANSPOSED: tl.constexpr):
    """Rows s (row stride ROW, S of them) of one head of Q, K, V or dO: [DP, len(s)] if
    TRANSPOSED else [len(s), DP], zeros past S and past D. MASKED=False where every row lies
    below S (unmasked key blocks, `key_blocks`): the load then takes no mask when DP == D (see
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
def key_blocks(m0, BM: tl.constexpr, BN: tl.constexpr, T: tl.constexpr, S: tl.constexpr,
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
def query_blocks(n0, BM: tl.constexpr, BN: tl.constexpr, T: tl.constexpr, S: tl.constexpr,
                  LEFT: tl.constexpr, RIGHT: tl.constexpr):
    """Query bounds [lo, hi) (lo a multiple of BM) for keys [n0, n0 + BN): the rows that may see
    one of them under the position rule of `key_blocks`."""
    lo = n0 * 0
    hi = lo + T
    if RIGHT >= 0:  # s <= t + S - T + RIGHT  <=>  t >= s - (S - T + RIGHT)
        lo = tl.maximum(n0 - (S - T + RIGHT), 0) // BM * BM
    if LEFT >= 0:  # s >= t + S - T - LEFT  <=>  t <= s - (S - T - LEFT)
        hi = tl.minimum(hi, n0 + (BN - S + T + LEFT))
    return lo, hi


@triton.jit
def query_block_keys(m0, b, QRANGE, BM: tl.constexpr, BN: tl.constexpr, T: tl.constexpr, S: tl.constexpr,
                      LEFT: tl.constexpr, RIGHT: tl.constexpr, HAS_SEG: tl.constexpr):
    """(lo, a, c, hi) of `key_blocks` for the query block at m0 of batch b, narrowed by
    `_within_segments` to its reach in QRANGE (`segment_ranges` per block of BM queries)."""
    lo, a, c, hi = key_blocks(m0, BM, BN, T, S, LEFT, RIGHT)
    if HAS_SEG:
        lo, a, c, hi = _within_segments(lo, a, c, hi, QRANGE + (b * tl.cdiv(T, BM) + m0 // BM) * 3, BN)
    return lo, a, c, hi


@triton.jit
def _within_segments(lo, a, c, hi, RANGE, BN: tl.constexpr):
    """Narrows block bounds (lo, a, c, hi) of `key_blocks` to the columns [RANGE[0], RANGE[1])
    the block's segment ids may reach (`segment_ranges`). The unmasked blocks [a, c) keep only
    those inside one segment shared by every row (RANGE[2] = uniform), none otherwise: the
    segment mask is applied with the position mask (`logits2`, MASKED). lo and the loop starts
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


# ----------------------------------------------------------------------------- host side


def padded_dim(x: int) -> int:
    """A head dim as the kernels hold it: the next power of two, at least 16 (tl.dot's minimum)."""
    return max(16, triton.next_power_of_2(x))


def kernel_statics(q, k, v, bias, mask, qseg, spec: AttentionSpec) -> dict:
    """The constexprs shared by every kernel of one call."""
    B, T, N, H = q.shape
    S, KH, HV = k.shape[1], k.shape[2], v.shape[3]
    pair_strides = lambda a: (0, 0) if a is None else (
        0 if a.shape[0] == 1 else a.shape[1] * T * S, 0 if a.shape[1] == 1 else T * S)
    bias_sb, bias_sn = pair_strides(bias)
    mask_sb, mask_sn = pair_strides(mask)
    rate = spec.dropout_rate
    return dict(
        T=T, S=S, N=N, KH=KH, H=H, HV=HV, HP=padded_dim(H), HVP=padded_dim(HV), SCALE=float(spec.scale),
        CAP=float(spec.logit_soft_cap or 0.0),
        LEFT=-1 if spec.window_left is None else int(spec.window_left),
        RIGHT=-1 if spec.right is None else int(spec.right),
        HAS_BIAS=bias is not None, BIAS_SB=bias_sb, BIAS_SN=bias_sn,
        HAS_MASK=mask is not None, MASK_SB=mask_sb, MASK_SN=mask_sn, HAS_SEG=qseg is not None,
        DROP=rate > 0, THRESH=int(spec.dropout_threshold), KEEP_SCALE=float(1.0 / (1.0 - rate)),
        DOT=2 if interpret_enabled() else int(q.dtype == jnp.float32),
    )


def optional_inputs(bias, mask, qseg, kvseg, seed, *, query_block: int, key_block: int | None = None):
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


