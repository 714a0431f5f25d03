"""Split-K flash decoding in Triton over a paged or a contiguous KV cache (forward only).

Semantics: kernels/common/paged.py and kernels/xla/paged_attention.py (one query per request at
its last key; window, soft cap; GQA).

Grid (B * KV, SPLITS). Program (b, kv head, split) holds the G = N // KV query heads that share
the kv head as one [GP, H] tile (GP = G padded to 16, what tl.dot needs), so every K/V byte is
read once for all G heads. Request b's allowed keys [lo, L) (lo > 0 only under a left window)
are cut into blocks of BK keys; the blocks are dealt out in SPLITS contiguous ranges (sized per
request from its own length, so short requests finish early), and each program runs an online
softmax (log2 units, f32) over its range:
    z = log2(e) * scale <q, k>   (or cap * tanh(scale <q, k> / cap) * log2(e))
    m' = max(m, rowmax z);  l = l 2^(m - m') + rowsum 2^(z - m');  acc = acc 2^(m - m') + p @ v
and writes its partial (acc / l, lse) in f32 ([B, KV, SPLITS, G, Hv] and [B, KV, SPLITS, G]).
XLA merges the splits by their lse: lse = logsumexp_s lse_s, out = sum_s exp(lse_s - lse) out_s;
an empty split (lse_s = -inf) weighs 0 and a request of length 0 gives out 0, lse -inf.

Paged: key s of request b is row (table[b, s // PAGE] * PAGE + s % PAGE) * KV + kv_head of
k_pages viewed as [P * PAGE * KV, H]; page ids are clamped into [0, P). Contiguous
(decode_attention): row (b * S + s) * KV + kv_head of the cache as it is (no copy, no table).
Each K/V row is H contiguous elements, so a BK-key block is BK coalesced row loads.
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
from forgeax.kernels.common.batching import fold_vmap_into_rows
from forgeax.kernels.common.paged import PagedSpec, cdiv, split_decode_launch
from forgeax.kernels.triton.attention_tiles import LN2, LOG2E, dot
from forgeax.kernels.triton.elementwise import tanh
from forgeax.kernels.triton.launch import triton_call

_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
_MAX_HEAD_DIM = 256  # a [GP, H] q tile plus [BK, H] K/V tiles per stage stay in registers / shared memory


@triton.jit
def _split_kernel(Q, K, V, LENS, TABLE, O, LSE,
                  N: tl.constexpr, KV: tl.constexpr, G: tl.constexpr, GP: tl.constexpr,
                  H: tl.constexpr, HP: tl.constexpr, HV: tl.constexpr, HVP: tl.constexpr,
                  PAGED: tl.constexpr, PAGE: tl.constexpr, M: tl.constexpr, P: tl.constexpr,
                  MAX_LEN: tl.constexpr, SPLITS: tl.constexpr, BK: tl.constexpr,
                  SCALE: tl.constexpr, CAP: tl.constexpr, LEFT: tl.constexpr, DOT: tl.constexpr):
    bk = tl.program_id(0)
    split = tl.program_id(1)
    b = bk // KV
    kvh = bk % KV
    L = tl.minimum(tl.maximum(tl.load(LENS + b), 0), MAX_LEN)
    lo = 0
    if LEFT >= 0:
        lo = tl.maximum(L - 1 - LEFT, 0)
    first = lo // BK
    blocks = tl.cdiv(L, BK) - first
    per = tl.cdiv(blocks, SPLITS)
    b0 = first + split * per
    b1 = tl.minimum(b0 + per, first + blocks)

    g = tl.arange(0, GP)
    h = tl.arange(0, HP)
    hv = tl.arange(0, HVP)
    q_rows = b.to(tl.int64) * (N * H) + (kvh * G + g) * H
    q = tl.load(Q + q_rows[:, None] + h[None, :], mask=(g < G)[:, None] & (h < H)[None, :], other=0.0)
    acc = tl.zeros([GP, HVP], dtype=tl.float32)
    m_i = tl.full([GP], float("-inf"), tl.float32)
    l_i = tl.zeros([GP], dtype=tl.float32)
    for blk in range(b0, b1):
        s = blk * BK + tl.arange(0, BK)
        inside = (s < L) & (s >= lo)
        if PAGED:
            page = tl.load(TABLE + b * M + s // PAGE, mask=s < L, other=0)
            page = tl.minimum(tl.maximum(page, 0), P - 1)
            row = (page.to(tl.int64) * PAGE + s % PAGE) * KV + kvh
        else:
            row = (b.to(tl.int64) * MAX_LEN + s) * KV + kvh
        if H == HP:
            kt = tl.load(K + row[:, None] * H + h[None, :], mask=inside[:, None], other=0.0)
        else:
            kt = tl.load(K + row[:, None] * H + h[None, :], mask=inside[:, None] & (h < H)[None, :], other=0.0)
        qk = dot(q, tl.trans(kt), DOT)
        if CAP > 0:
            z = tanh(qk * (SCALE / CAP)) * (CAP * LOG2E)
        else:
            z = qk * (SCALE * LOG2E)
        z = tl.where(inside[None, :], z, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(z, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(z - m_safe[:, None])
        alpha = tl.math.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        if HV == HVP:
            vt = tl.load(V + row[:, None] * HV + hv[None, :], mask=inside[:, None], other=0.0)
        else:
            vt = tl.load(V + row[:, None] * HV + hv[None, :], mask=inside[:, None] & (hv < HV)[None, :], other=0.0)
        acc = acc * alpha[:, None] + dot(p.to(vt.dtype), vt, DOT)
        m_i = m_new
    nonempty = l_i > 0.0
    out = acc * tl.where(nonempty, 1.0 / tl.where(nonempty, l_i, 1.0), 0.0)[:, None]
    part = bk.to(tl.int64) * SPLITS + split
    tl.store(O + (part * G + g)[:, None] * HV + hv[None, :], out, mask=(g < G)[:, None] & (hv < HV)[None, :])
    m_safe = tl.where(m_i == float("-inf"), 0.0, m_i)
    lse = tl.where(nonempty, (m_safe + tl.math.log2(tl.where(nonempty, l_i, 1.0))) * LN2, float("-inf"))
    tl.store(LSE + part * G + g, lse, mask=g < G)


# ----------------------------------------------------------------------------- config


@dataclasses.dataclass(frozen=True, kw_only=True)
class PagedAttentionConfig(KernelConfig):
    """block_k: keys per loop step (a power of two >= 16; it may span several pages);
    num_splits: key ranges per (request, kv head), i.e. programs per (b, kv head) (decode_attention's
    num_splits argument overrides it); num_warps / num_stages: Triton's launch and pipelining."""

    block_k: int = 64
    num_splits: int = 1
    num_warps: int = 4
    num_stages: int = 3

    def validate(self) -> None:
        super().validate()
        if self.block_k < 16 or self.block_k & (self.block_k - 1):
            raise ValueError(f"PagedAttentionConfig.block_k: expected a power of two >= 16, got {self.block_k}")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"PagedAttentionConfig.num_warps: expected 1, 2, 4, 8 or 16, got {self.num_warps}")


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def _max_len(k, page_table) -> int:
    return page_table.shape[1] * k.shape[1] if page_table is not None else k.shape[1]


def _heuristic(q, k, page_table, spec: PagedSpec) -> PagedAttentionConfig:
    """Enough programs for about four per SM (B * KV * splits >= 4 * SMs), each split at least
    four blocks long; 64-key blocks (4 pages of 16, 16 KB of bf16 K per step at H = 128)."""
    B, KV = q.shape[0], k.shape[2]
    max_len = _max_len(k, page_table)
    block_k = 16 if interpret_enabled() else min(64, max(16, _pow2_at_least(max_len)))
    blocks = cdiv(max_len, block_k)
    splits = max(1, min(cdiv(4 * gpu_sm_count(), B * KV), cdiv(blocks, 4)))
    if interpret_enabled():
        splits = min(2, blocks)  # exercises the merge at interpreter cost
    group = max(16, _pow2_at_least(q.shape[1] // KV))
    # A [group, Hv] f32 accumulator past 32 x 128 takes more registers than 4 warps have.
    warps = 4 if group * max(q.shape[2], 64) <= 32 * 128 else 8
    return PagedAttentionConfig(block_k=block_k, num_splits=splits, num_warps=warps)


def paged_heuristic(q, k_pages, v_pages, lengths, page_table, *, spec: PagedSpec) -> PagedAttentionConfig:
    return _heuristic(q, k_pages, page_table, spec)


def decode_heuristic(q, k, v, lengths, *, spec: PagedSpec) -> PagedAttentionConfig:
    return _heuristic(q, k, None, spec)


def _candidates(base: PagedAttentionConfig) -> list[PagedAttentionConfig]:
    r = base.replace
    return [base, r(block_k=32), r(block_k=128, num_warps=8), r(num_stages=4), r(num_stages=2),
            r(num_splits=max(1, base.num_splits // 2)), r(num_splits=base.num_splits * 2)]


# ----------------------------------------------------------------------------- launch


def _merge(o_part, lse_part, B, N):
    """Merge [B, KV, S, G, Hv] partials by their lse [B, KV, S, G] (module docstring)."""
    lse = jax.nn.logsumexp(lse_part, axis=2)  # -inf when every split is empty
    safe = jnp.where(jnp.isfinite(lse), lse, 0.0)
    w = jnp.where(jnp.isfinite(lse_part), jnp.exp(lse_part - safe[:, :, None]), 0.0)
    out = jnp.einsum("bksg,bksgh->bkgh", w, o_part)
    return out.reshape(B, N, -1), lse.reshape(B, N)


def _run(q, k, v, lengths, page_table, spec: PagedSpec, config: PagedAttentionConfig):
    B, N, H = q.shape
    KV, HV = k.shape[2], v.shape[3]
    G = N // KV
    paged = page_table is not None
    max_len = _max_len(k, page_table)
    splits = spec.num_splits or config.num_splits
    o_part, lse_part = triton_call(
        q, k, v, lengths, page_table if paged else lengths,
        kernel=_split_kernel,
        out_shape=(jax.ShapeDtypeStruct((B, KV, splits, G, HV), jnp.float32),
                   jax.ShapeDtypeStruct((B, KV, splits, G), jnp.float32)),
        grid=(B * KV, splits),
        num_warps=config.num_warps, num_stages=config.num_stages,
        N=N, KV=KV, G=G, GP=max(16, _pow2_at_least(G)), H=H, HP=max(16, _pow2_at_least(H)), HV=HV,
        HVP=max(16, _pow2_at_least(HV)), PAGED=paged, PAGE=k.shape[1] if paged else 1,
        M=page_table.shape[1] if paged else 1, P=k.shape[0], MAX_LEN=max_len, SPLITS=splits, BK=config.block_k,
        SCALE=spec.scale, CAP=spec.logit_soft_cap or 0.0,
        LEFT=-1 if spec.window_left is None else spec.window_left,
        DOT=2 if interpret_enabled() else int(q.dtype == jnp.float32),
    )
    out, lse = _merge(o_part, lse_part, B, N)
    return out.astype(q.dtype), (lse if spec.return_lse else None)


def paged_attention(q, k_pages, v_pages, lengths, page_table, *, spec: PagedSpec, config: PagedAttentionConfig):
    # vmap folds into the requests (q, lengths, page_table) over a shared page pool; a vmapped
    # pool loops (lax.map). Sharded requests / heads launch per device (split_decode_launch).
    run = split_decode_launch(lambda q, kp, vp, lens, table: _run(q, kp, vp, lens, table, spec, config))
    return fold_vmap_into_rows(run, row_args=(0, 3, 4))(q, k_pages, v_pages, lengths, page_table)


def decode_attention(q, k, v, lengths, *, spec: PagedSpec, config: PagedAttentionConfig):
    split = split_decode_launch(lambda q, k, v, lens, _: _run(q, k, v, lens, None, spec, config))
    run = lambda q, k, v, lens: split(q, k, v, lens, None)  # noqa: E731
    return fold_vmap_into_rows(run, row_args=(0, 1, 2, 3))(q, k, v, lengths)


def _supports(q, k, v) -> str | None:
    if jnp.dtype(q.dtype) not in _DTYPES:
        return f"dtype {jnp.dtype(q.dtype).name} is not one of float32/bfloat16/float16"
    if max(q.shape[2], v.shape[3]) > _MAX_HEAD_DIM:
        return f"head_dim {max(q.shape[2], v.shape[3])} > {_MAX_HEAD_DIM}"
    if q.shape[0] == 0 or q.shape[1] == 0:
        return "empty batch or heads"
    return None


PAGED_ATTENTION = Implementation(
    fn=paged_attention, platforms={"gpu"}, interpretable=True,
    supports=lambda q, k, v, lengths, table, *, spec: _supports(q, k, v),
    config_type=PagedAttentionConfig, heuristic_config=paged_heuristic,
    candidate_configs=lambda *a, **kw: _candidates(paged_heuristic(*a, **kw)),
)
DECODE_ATTENTION = Implementation(
    fn=decode_attention, platforms={"gpu"}, interpretable=True,
    supports=lambda q, k, v, lengths, *, spec: _supports(q, k, v),
    config_type=PagedAttentionConfig, heuristic_config=decode_heuristic,
    candidate_configs=lambda *a, **kw: _candidates(decode_heuristic(*a, **kw)),
)
