"""Ragged paged attention in Triton: mixed prefill + decode over a paged KV cache (forward only).

Semantics: kernels/common/ragged_paged_attention.py (query j of a sequence at key position
kv_len - q_len + j; causal / window / soft cap as ops.attention; GQA).

One launch, two kinds of work item (an XLA prologue builds the static-size item table):
  * tiles: every sequence with q_len > DQ (and the rows of no sequence, which store zeros) is
    cut into tiles of at most BQ query rows. Program (tile, kv head) holds the BQ tokens x
    G = N // KV query heads that share the kv head as one [MP, H] tile (row m: token m // G,
    head m % G; MP = BQ * G padded to a power of two >= 16), so each K/V byte serves all G
    heads. It walks the keys [lo, hi) any of its rows may see in blocks of BK keys; the blocks
    every row sees entirely (below the causal diagonal, inside the window) skip the masking.
  * decode splits: a sequence with 1 <= q_len <= DQ packs its q_len x G rows of a kv head into
    an [MPD, H] tile (MPD = DQ * G padded to >= 16, not a 64-row tile mostly empty) and its keys
    are dealt out in SPLITS contiguous runs of BKD-key blocks, one program each, which store a
    partial (acc / l, lse in log2 units) in f32. XLA merges the runs by lse and scatters the
    rows into the output: lse = log2 sum_j 2^lse_j, out = sum_j 2^(lse_j - lse) out_j.
Tiles are ordered heaviest first and the decode runs (about equally long) interleaved among
them in proportion, so bandwidth-bound decode runs overlap compute-bound prefill tiles.
Key s of a sequence is row (table[seq, s // PAGE] * PAGE + s % PAGE) * KV + kv_head of the
pages viewed as [P * PAGE * KV, H] (page ids and kv_lens clamped in the prologue). Online
softmax in log2 units, f32:
    z = log2(e) * scale <q, k>   (or cap * tanh(scale <q, k> / cap) * log2(e)), -inf where not allowed
    m' = max(m, rowmax z);  l = l 2^(m - m') + rowsum 2^(z - m');  acc = acc 2^(m - m') + p @ v
    out = acc / l  (0 where l == 0: no allowed key)
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import triton
import triton.language as tl

from forgeax.core.config import KernelConfig
from forgeax.core.registry import Implementation
from forgeax.core.runtime import gpu_sm_count, interpret_enabled
from forgeax.kernels.common.attention import AttentionSpec
from forgeax.kernels.common.ragged_paged_attention import clamped_tables, split_heads_launch, work_items
from forgeax.kernels.triton.attention_tiles import LOG2E, dot
from forgeax.kernels.triton.elementwise import tanh
from forgeax.kernels.triton.launch import triton_call

_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
_MAX_HEAD_DIM = 256  # an [MP, H] q tile plus [BK, H] K/V tiles per stage in registers / shared memory


@triton.jit
def _block(q, acc, m_i, l_i, start, K, V, TABLE, seq_c, kvh, pos, row_ok, hi,
           KV: tl.constexpr, H: tl.constexpr, HP: tl.constexpr, HV: tl.constexpr, HVP: tl.constexpr,
           PAGE: tl.constexpr, MAXP: tl.constexpr, BK: tl.constexpr, SCALE: tl.constexpr, CAP: tl.constexpr,
           LEFT: tl.constexpr, RIGHT: tl.constexpr, DOT: tl.constexpr, MASKED: tl.constexpr):
    """One online-softmax step over keys [start, start + BK). MASKED=False: every key of the
    block is < hi and allowed for every row (the caller's bounds say so)."""
    s = start + tl.arange(0, BK)
    h = tl.arange(0, HP)
    hv = tl.arange(0, HVP)
    if MASKED:
        s_ok = s < hi
        page = tl.load(TABLE + seq_c * MAXP + s // PAGE, mask=s_ok, other=0).to(tl.int64)
    else:
        page = tl.load(TABLE + seq_c * MAXP + s // PAGE).to(tl.int64)
    row = (page * PAGE + s % PAGE) * KV + kvh
    if MASKED:
        kt = tl.load(K + row[None, :] * H + h[:, None], mask=s_ok[None, :] & (h[:, None] < H), other=0.0)
    elif H == HP:
        kt = tl.load(K + row[None, :] * H + h[:, None])
    else:
        kt = tl.load(K + row[None, :] * H + h[:, None], mask=h[:, None] < H, other=0.0)
    qk = dot(q, kt, DOT)
    if CAP > 0:
        z = tanh(qk * (SCALE / CAP)) * (CAP * LOG2E)
    else:
        z = qk * (SCALE * LOG2E)
    if MASKED:
        ok = s_ok[None, :] & row_ok[:, None]
        if RIGHT >= 0:
            ok = ok & (s[None, :] <= pos[:, None] + RIGHT)
        if LEFT >= 0:
            ok = ok & (s[None, :] >= pos[:, None] - LEFT)
        z = tl.where(ok, z, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(z, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.math.exp2(z - m_safe[:, None])
    alpha = tl.math.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    if MASKED:
        vt = tl.load(V + row[:, None] * HV + hv[None, :], mask=s_ok[:, None] & (hv[None, :] < HV), other=0.0)
    elif HV == HVP:
        vt = tl.load(V + row[:, None] * HV + hv[None, :])
    else:
        vt = tl.load(V + row[:, None] * HV + hv[None, :], mask=hv[None, :] < HV, other=0.0)
    acc = acc * alpha[:, None] + dot(p.to(vt.dtype), vt, DOT)
    return acc, m_new, l_i


@triton.jit
def _tile(Q, K, V, TABLE, O, seq_c, kvh, r0, r1, shift, lo, hi, h, hv,
          N: tl.constexpr, KV: tl.constexpr, G: tl.constexpr, H: tl.constexpr, HP: tl.constexpr,
          HV: tl.constexpr, HVP: tl.constexpr, PAGE: tl.constexpr, MAXP: tl.constexpr,
          BQ: tl.constexpr, MP: tl.constexpr, BK: tl.constexpr, SCALE: tl.constexpr, CAP: tl.constexpr,
          LEFT: tl.constexpr, RIGHT: tl.constexpr, DOT: tl.constexpr):
    # A tile of BQ tokens: masked blocks at the window's left edge, unmasked blocks every row
    # sees entirely, masked blocks at the causal diagonal / the end.
    m = tl.arange(0, MP)
    tok = r0 + m // G
    heads = kvh * G + m % G
    row_ok = (m < BQ * G) & (tok < r1)
    pos = tok + shift
    tok64 = tok.to(tl.int64)
    q = tl.load(Q + tok64[:, None] * (N * H) + heads[:, None] * H + h[None, :],
                mask=row_ok[:, None] & (h[None, :] < H), other=0.0)
    acc = tl.zeros([MP, HVP], dtype=tl.float32)
    m_i = tl.full([MP], float("-inf"), tl.float32)
    l_i = tl.zeros([MP], dtype=tl.float32)
    b_lo = lo // BK
    b_hi = tl.cdiv(hi, BK)
    full_lo = 0
    if LEFT >= 0:
        full_lo = tl.maximum(r1 - 1 + shift - LEFT, 0)
    full_hi = hi
    if RIGHT >= 0:
        full_hi = tl.minimum(hi, tl.maximum(r0 + shift + RIGHT + 1, 0))
    u0 = tl.minimum(tl.maximum(tl.cdiv(full_lo, BK), b_lo), b_hi)
    u1 = tl.minimum(tl.maximum(full_hi // BK, u0), b_hi)
    if LEFT >= 0:  # else u0 == b_lo
        for blk in range(b_lo, u0):
            acc, m_i, l_i = _block(q, acc, m_i, l_i, blk * BK, K, V, TABLE, seq_c, kvh, pos, row_ok, hi, KV, H, HP,
                                   HV, HVP, PAGE, MAXP, BK, SCALE, CAP, LEFT, RIGHT, DOT, True)
    for blk in range(u0, u1):
        acc, m_i, l_i = _block(q, acc, m_i, l_i, blk * BK, K, V, TABLE, seq_c, kvh, pos, row_ok, hi, KV, H, HP,
                               HV, HVP, PAGE, MAXP, BK, SCALE, CAP, LEFT, RIGHT, DOT, False)
    for blk in range(u1, b_hi):
        acc, m_i, l_i = _block(q, acc, m_i, l_i, blk * BK, K, V, TABLE, seq_c, kvh, pos, row_ok, hi, KV, H, HP,
                               HV, HVP, PAGE, MAXP, BK, SCALE, CAP, LEFT, RIGHT, DOT, True)
    nonempty = l_i > 0.0
    out = acc * tl.where(nonempty, 1.0 / tl.where(nonempty, l_i, 1.0), 0.0)[:, None]
    tl.store(O + tok64[:, None] * (N * HV) + heads[:, None] * HV + hv[None, :], out.to(O.dtype.element_ty),
             mask=row_ok[:, None] & (hv[None, :] < HV))


@triton.jit
def _decode_run(Q, K, V, TABLE, PO, PLSE, split, seq_c, kvh, r0, r1, shift, lo, hi, h, hv,
                N: tl.constexpr, KV: tl.constexpr, G: tl.constexpr, H: tl.constexpr, HP: tl.constexpr,
                HV: tl.constexpr, HVP: tl.constexpr, PAGE: tl.constexpr, MAXP: tl.constexpr,
                DQ: tl.constexpr, MPD: tl.constexpr, BKD: tl.constexpr, SPLITS: tl.constexpr, DSTAGES: tl.constexpr,
                SCALE: tl.constexpr, CAP: tl.constexpr, LEFT: tl.constexpr, RIGHT: tl.constexpr, DOT: tl.constexpr):
    # A decode run: the q_len <= DQ tokens x G heads of the kv head, keys of one split.
    m = tl.arange(0, MPD)
    tok = r0 + m // G
    heads = kvh * G + m % G
    row_ok = (m < DQ * G) & (tok < r1)
    pos = tok + shift
    q = tl.load(Q + tok.to(tl.int64)[:, None] * (N * H) + heads[:, None] * H + h[None, :],
                mask=row_ok[:, None] & (h[None, :] < H), other=0.0)
    acc = tl.zeros([MPD, HVP], dtype=tl.float32)
    m_i = tl.full([MPD], float("-inf"), tl.float32)
    l_i = tl.zeros([MPD], dtype=tl.float32)
    first = lo // BKD
    blocks = tl.maximum(tl.cdiv(hi, BKD) - first, 0)
    per = tl.cdiv(blocks, SPLITS)
    b0 = first + split * per
    b1 = tl.minimum(b0 + per, first + blocks)
    for blk in tl.range(b0, b1, num_stages=DSTAGES):
        acc, m_i, l_i = _block(q, acc, m_i, l_i, blk * BKD, K, V, TABLE, seq_c, kvh, pos, row_ok, hi, KV, H, HP,
                               HV, HVP, PAGE, MAXP, BKD, SCALE, CAP, LEFT, RIGHT, DOT, True)
    nonempty = l_i > 0.0
    out = acc * tl.where(nonempty, 1.0 / tl.where(nonempty, l_i, 1.0), 0.0)[:, None]
    part = ((seq_c.to(tl.int64) * KV + kvh) * SPLITS + split) * (DQ * G) + m
    tl.store(PO + part[:, None] * HV + hv[None, :], out, mask=(m < DQ * G)[:, None] & (hv[None, :] < HV))
    m_safe = tl.where(m_i == float("-inf"), 0.0, m_i)
    lse = tl.where(nonempty, m_safe + tl.math.log2(tl.where(nonempty, l_i, 1.0)), float("-inf"))
    tl.store(PLSE + part, lse, mask=m < DQ * G)


@triton.jit
def _kernel(Q, K, V, CU, LENS, TABLE, ITEM_SEQ, ITEM_ROW0, ITEM_ROW1, ITEM_SPLIT, O, PO, PLSE,
            N: tl.constexpr, KV: tl.constexpr, G: tl.constexpr, H: tl.constexpr, HP: tl.constexpr,
            HV: tl.constexpr, HVP: tl.constexpr, PAGE: tl.constexpr, MAXP: tl.constexpr,
            BQ: tl.constexpr, MP: tl.constexpr, BK: tl.constexpr, DQ: tl.constexpr, MPD: tl.constexpr,
            BKD: tl.constexpr, SPLITS: tl.constexpr, DSTAGES: tl.constexpr, SCALE: tl.constexpr,
            CAP: tl.constexpr, LEFT: tl.constexpr, RIGHT: tl.constexpr, DOT: tl.constexpr):
    w = tl.program_id(0)
    kvh = tl.program_id(1)
    seq = tl.load(ITEM_SEQ + w)
    r0 = tl.load(ITEM_ROW0 + w)
    r1 = tl.load(ITEM_ROW1 + w)
    split = tl.load(ITEM_SPLIT + w)
    seq_c = tl.maximum(seq, 0)
    L = tl.where(seq >= 0, tl.load(LENS + seq_c), 0)
    q_start = tl.load(CU + seq_c)
    shift = L - (tl.load(CU + seq_c + 1) - q_start) - q_start  # key position of row r: r + shift
    lo = 0
    hi = tl.where(r1 > r0, L, 0)
    if RIGHT >= 0:
        hi = tl.minimum(hi, tl.maximum(r1 - 1 + shift + RIGHT + 1, 0))
    if LEFT >= 0:
        lo = tl.maximum(r0 + shift - LEFT, 0)
    h = tl.arange(0, HP)
    hv = tl.arange(0, HVP)
    if DQ == 0:
        _tile(Q, K, V, TABLE, O, seq_c, kvh, r0, r1, shift, lo, hi, h, hv, N, KV, G, H, HP, HV, HVP, PAGE, MAXP,
              BQ, MP, BK, SCALE, CAP, LEFT, RIGHT, DOT)
    elif split < 0:
        _tile(Q, K, V, TABLE, O, seq_c, kvh, r0, r1, shift, lo, hi, h, hv, N, KV, G, H, HP, HV, HVP, PAGE, MAXP,
              BQ, MP, BK, SCALE, CAP, LEFT, RIGHT, DOT)
    else:
        _decode_run(Q, K, V, TABLE, PO, PLSE, split, seq_c, kvh, r0, r1, shift, lo, hi, h, hv, N, KV, G, H, HP, HV,
                    HVP, PAGE, MAXP, DQ, MPD, BKD, SPLITS, DSTAGES, SCALE, CAP, LEFT, RIGHT, DOT)


@dataclasses.dataclass(frozen=True, kw_only=True)
class RaggedPagedAttentionConfig(KernelConfig):
    """block_q: query tokens per prefill tile (a power of two; block_q x G query rows share each
    K/V load); block_k: keys per prefill loop step (a power of two >= 16; it may span pages);
    split_decodes: whether sequences with 1 <= q_len <= decode_max_q take the split decode path
    (decode_max_q x G rows per program; else every sequence is cut into tiles); decode_splits:
    key runs per decode sequence and kv head, merged by lse; decode_block_k / decode_stages: the
    decode loop's key block and pipeline depth; num_warps / num_stages: Triton's launch (shared
    by both paths) and the prefill loops' pipelining."""

    block_q: int = 16
    block_k: int = 64
    split_decodes: bool = True
    decode_max_q: int = 1
    decode_splits: int = 1
    decode_block_k: int = 64
    decode_stages: int = 3
    num_warps: int = 4
    num_stages: int = 3

    def validate(self) -> None:
        super().validate()
        if self.block_q < 1 or self.block_q & (self.block_q - 1):
            raise ValueError(f"RaggedPagedAttentionConfig.block_q: expected a power of two, got {self.block_q}")
        for name in ("block_k", "decode_block_k"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"RaggedPagedAttentionConfig.{name}: expected a power of two >= 16, got {value}")
        if self.decode_max_q > 64:
            raise ValueError(f"RaggedPagedAttentionConfig.decode_max_q: expected 1..64, got {self.decode_max_q}")
        if not 1 <= self.decode_splits <= 64:
            raise ValueError(f"RaggedPagedAttentionConfig.decode_splits: expected 1..64, got {self.decode_splits}")
        if self.decode_stages < 1:
            raise ValueError(f"RaggedPagedAttentionConfig.decode_stages: expected >= 1, got {self.decode_stages}")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"RaggedPagedAttentionConfig.num_warps: expected 1, 2, 4, 8 or 16, got {self.num_warps}")


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def _pow2_at_most(n: int) -> int:
    return 1 << (max(1, int(n)).bit_length() - 1)


def heuristic_config(q, k_pages, v_pages, cu_q_lens, kv_lens, page_table, *, spec: AttentionSpec) -> RaggedPagedAttentionConfig:
    """Prefill tiles of about 64 query rows (block_q x G) at 4 warps: twice as many programs as
    128-row tiles, which balanced the mixed batches of docs/performance.md better on an H100;
    64-key blocks (32 past H = 128, to keep the K/V stages in shared memory). Decodes: q_len x G
    rows up to 16 (an mma's minimum M) take the split path, their keys in runs of about 2048 (and
    enough runs for about 4 programs per SM when every sequence is a decode), so the runs are as
    long as a prefill tile's walk and interleave with it."""
    del cu_q_lens, kv_lens, spec
    G = q.shape[1] // k_pages.shape[2]
    S, KV = page_table.shape[0], k_pages.shape[2]
    wide = max(q.shape[2], v_pages.shape[3]) > 128
    block_q = _pow2_at_most(max(1, 64 // G))
    block_k = 32 if wide else 64
    max_len = page_table.shape[1] * k_pages.shape[1]
    decode_max_q = max(1, 16 // G)
    blocks = -(-max_len // 64)
    splits = max(1, min(32, max(-(-max_len // 2048), -(-4 * gpu_sm_count() // (S * KV))), -(-blocks // 4)))
    if interpret_enabled():  # the interpreter pays per program and per step: fewer, larger tiles
        return RaggedPagedAttentionConfig(block_q=_pow2_at_most(max(1, 128 // G)), block_k=32, decode_max_q=decode_max_q,
                                          decode_splits=2, decode_block_k=32)
    warps = 8 if _pow2_at_least(block_q * G) >= 128 else 4
    return RaggedPagedAttentionConfig(block_q=block_q, block_k=block_k, decode_max_q=decode_max_q, decode_splits=splits,
                                      decode_block_k=32 if wide else 64, num_warps=warps)


def _candidates(base: RaggedPagedAttentionConfig) -> list[RaggedPagedAttentionConfig]:
    r = base.replace
    out = [base, r(block_q=max(1, base.block_q // 2), num_warps=4), r(block_k=32), r(num_stages=2),
           r(decode_splits=max(1, base.decode_splits // 2)), r(decode_splits=min(64, base.decode_splits * 2)),
           r(decode_block_k=32), r(decode_max_q=min(64, base.decode_max_q * 2)),
           r(split_decodes=False),
           # the single-path kernel this op had before the decode path (64-row tiles for everything)
           r(split_decodes=False, block_q=max(1, base.block_q // 2), num_warps=4)]
    return [c for i, c in enumerate(out) if c not in out[:i]]


def _keys_walked(seq, row0, row1, cu_q_lens, kv_lens, spec: AttentionSpec):
    """How many keys each item walks: hi - lo of `_kernel`."""
    sc = jnp.maximum(seq, 0)
    cu = cu_q_lens.astype(jnp.int32)
    L = jnp.where(seq >= 0, kv_lens[sc], 0)
    shift = L - (cu[sc + 1] - cu[sc]) - cu[sc]
    hi = jnp.where(row1 > row0, L, 0)
    lo = jnp.zeros_like(hi)
    if spec.right is not None:
        hi = jnp.minimum(hi, jnp.maximum(row1 + shift + spec.right, 0))
    if spec.window_left is not None:
        lo = jnp.maximum(row0 + shift - spec.window_left, 0)
    return jnp.maximum(hi - lo, 0)


def _interleaved_positions(cost_a, cost_b):
    """Where each item goes (int32 [Wa], [Wb], together a permutation of Wa + Wb): the tiles
    (a) heaviest first, the decode runs (b, about equally long) in sequence order, the busy ones
    of both kinds merged in proportion: tile r before run i iff (2r + 1) nb <= (2i + 1) na, i.e.
    slot (r + 1/2) / na <= (i + 1/2) / nb, in integers (na, nb: busy counts); items with nothing
    to walk last. One sort (the tiles'), then arithmetic: no sort of the merged list."""
    wa, wb = cost_a.shape[0], cost_b.shape[0]
    order = jnp.argsort(-cost_a, stable=True)
    rank = jnp.zeros((wa,), jnp.int32).at[order].set(jnp.arange(wa, dtype=jnp.int32))
    busy_b = cost_b > 0
    na = jnp.sum(cost_a > 0).astype(jnp.int32)
    nb = jnp.sum(busy_b).astype(jnp.int32)
    i = jnp.where(busy_b, jnp.cumsum(busy_b) - 1, nb + jnp.cumsum(~busy_b) - 1).astype(jnp.int32)
    na1, nb1 = jnp.maximum(na, 1), jnp.maximum(nb, 1)
    runs_before = jnp.clip(((2 * rank + 1) * nb - 1 - na) // (2 * na1) + 1, 0, nb)  # (2i+1) na < (2r+1) nb
    tiles_before = jnp.clip(((2 * i + 1) * na - nb) // (2 * nb1) + 1, 0, na)  # (2r+1) nb <= (2i+1) na
    pos_a = jnp.where(rank < na, rank + runs_before, rank + nb)
    pos_b = jnp.where(i < nb, i + tiles_before, wa + i)
    return pos_a.astype(jnp.int32), pos_b.astype(jnp.int32)


def ragged_paged_attention(q, k_pages, v_pages, cu_q_lens, kv_lens, page_table, *, spec: AttentionSpec,
                           config: RaggedPagedAttentionConfig):
    # Sharded heads launch per device on their own query and kv heads (split_heads_launch).
    run = lambda *a: _launch(*a, spec=spec, config=config)  # noqa: E731
    return split_heads_launch(run)(q, k_pages, v_pages, cu_q_lens, kv_lens, page_table)


def _launch(q, k_pages, v_pages, cu_q_lens, kv_lens, page_table, *, spec: AttentionSpec,
            config: RaggedPagedAttentionConfig):
    T, N, H = q.shape
    P, PAGE, KV, _ = k_pages.shape
    HV = v_pages.shape[3]
    S = page_table.shape[0]
    G = N // KV
    BQ, DQ = config.block_q, config.decode_max_q if config.split_decodes else 0
    splits = config.decode_splits if DQ else 1
    kv_lens, page_table = clamped_tables(kv_lens, page_table, P, PAGE)
    cu = cu_q_lens.astype(jnp.int32)
    q_lens = cu[1:] - cu[:-1]
    is_decode = (q_lens >= 1) & (q_lens <= DQ)  # all False when DQ == 0
    seq, row0, row1 = work_items(cu, T, BQ)
    row1 = jnp.where((seq >= 0) & is_decode[jnp.maximum(seq, 0)], row0, row1)  # decode rows: the split path
    cost_a = _keys_walked(seq, row0, row1, cu, kv_lens, spec)
    split = jnp.full(seq.shape, -1, jnp.int32)
    if DQ:
        dseq = jnp.repeat(jnp.arange(S, dtype=jnp.int32), splits)
        d0 = cu[:-1][dseq]
        d1 = jnp.where(is_decode[dseq], cu[1:][dseq], d0)
        cost_b = _keys_walked(dseq, d0, d1, cu, kv_lens, spec) // splits
        pos_a, pos_b = _interleaved_positions(cost_a, cost_b)
        fields = jnp.stack([jnp.concatenate(p) for p in ((seq, dseq), (row0, d0), (row1, d1),
                                                         (split, jnp.tile(jnp.arange(splits, dtype=jnp.int32), S)))], 1)
        fields = jnp.zeros_like(fields).at[jnp.concatenate([pos_a, pos_b])].set(fields, unique_indices=True)
        seq, row0, row1, split = (fields[:, c] for c in range(4))
    else:
        order = jnp.argsort(-cost_a, stable=True)  # heaviest tiles first
        seq, row0, row1 = seq[order], row0[order], row1[order]
    rows = DQ * G
    out, o_part, lse_part = triton_call(
        q, k_pages, v_pages, cu, kv_lens, page_table, seq, row0, row1, split,
        kernel=_kernel,
        out_shape=(jax.ShapeDtypeStruct((T, N, HV), q.dtype),
                   jax.ShapeDtypeStruct((S, KV, splits, rows, HV) if DQ else (1,), jnp.float32),
                   jax.ShapeDtypeStruct((S, KV, splits, rows) if DQ else (1,), jnp.float32)),
        grid=(seq.shape[0], KV),
        num_warps=config.num_warps, num_stages=config.num_stages,
        N=N, KV=KV, G=G, H=H, HP=max(16, _pow2_at_least(H)), HV=HV, HVP=max(16, _pow2_at_least(HV)),
        PAGE=PAGE, MAXP=page_table.shape[1], BQ=BQ, MP=max(16, _pow2_at_least(BQ * G)), BK=config.block_k,
        DQ=DQ, MPD=max(16, _pow2_at_least(rows)), BKD=config.decode_block_k, SPLITS=splits,
        DSTAGES=config.decode_stages, SCALE=spec.scale, CAP=spec.logit_soft_cap or 0.0,
        LEFT=-1 if spec.window_left is None else spec.window_left,
        RIGHT=-1 if spec.right is None else spec.right,
        DOT=2 if interpret_enabled() else int(q.dtype == jnp.float32),
    )
    if not DQ:
        return out
    # Merge the runs by lse (log2 units); a run with no key has lse -inf and weighs 0.
    top = jnp.max(lse_part, axis=2, keepdims=True)
    top = jnp.where(jnp.isfinite(top), top, 0.0)
    wgt = jnp.exp2(lse_part - top)
    total = jnp.sum(wgt, axis=2)
    merged = jnp.sum(wgt[..., None] * o_part, axis=2) / jnp.where(total > 0, total, 1.0)[..., None]  # one fusion
    merged = merged.reshape(S, KV, DQ, G, HV).transpose(0, 2, 1, 3, 4).reshape(S * DQ, N, HV)
    j = jnp.arange(DQ, dtype=jnp.int32)
    dest = jnp.where(is_decode[:, None] & (j[None, :] < q_lens[:, None]), cu[:-1, None] + j[None, :], T)
    return out.at[dest.reshape(-1)].set(merged.astype(q.dtype), mode="drop", unique_indices=True)


def supports(q, k_pages, v_pages, cu_q_lens, kv_lens, page_table, *, spec: AttentionSpec) -> str | None:
    del cu_q_lens, kv_lens, page_table, spec
    if jnp.dtype(q.dtype) not in _DTYPES:
        return f"dtype {jnp.dtype(q.dtype).name} is not one of float32/bfloat16/float16"
    if max(q.shape[2], v_pages.shape[3]) > _MAX_HEAD_DIM:
        return f"head_dim {max(q.shape[2], v_pages.shape[3])} > {_MAX_HEAD_DIM}"
    return None


RAGGED_PAGED_ATTENTION = Implementation(
    fn=ragged_paged_attention, platforms={"gpu"}, interpretable=True, supports=supports,
    config_type=RaggedPagedAttentionConfig, heuristic_config=heuristic_config,
    candidate_configs=lambda *a, **kw: _candidates(heuristic_config(*a, **kw)),
)
