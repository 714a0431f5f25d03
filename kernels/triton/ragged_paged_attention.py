"""Ragged paged attention in Triton: mixed prefill + decode over a paged KV cache (forward only).

Semantics: kernels/common/ragged_paged_attention.py (query j of a sequence at key position
kv_len - q_len + j; causal / window / soft cap as ops.attention; GQA).

An XLA prologue cuts every sequence's query rows into tiles of at most BQ rows (`work_items`, a
static-size table; rows of no sequence form tiles that store zeros) and orders the tiles by the
keys they walk, most first, so the long decodes and late prefill tiles start early.
Grid (tiles, KV): program (tile, kv head) holds the BQ tokens x G = N // KV query heads that share
the kv head as one [MP, H] tile (row m: token m // G, head m % G; MP = BQ * G padded to a power of
two >= 16), so each K/V byte it reads serves all G heads. It walks the keys [lo, hi) that any of
its rows may see (causal: up to its last token's position; a left window: from its first token's
reach) in blocks of BK keys, a block possibly spanning several pages: key s is row
(table[seq, s // PAGE] * PAGE + s % PAGE) * KV + kv_head of the pages viewed as [P * PAGE * KV, H]
(page ids and kv_lens clamped in the prologue). Online softmax in log2 units, f32:
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
from forgeax.core.runtime import interpret_enabled
from forgeax.kernels.common.attention import AttentionSpec
from forgeax.kernels.common.ragged_paged_attention import clamped_tables, work_items
from forgeax.kernels.triton.attention_tiles import LOG2E, dot
from forgeax.kernels.triton.elementwise import tanh
from forgeax.kernels.triton.launch import triton_call

_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
_MAX_HEAD_DIM = 256  # an [MP, H] q tile plus [BK, H] K/V tiles per stage in registers / shared memory


@triton.jit
def _kernel(Q, K, V, CU, LENS, TABLE, ITEM_SEQ, ITEM_ROW0, ITEM_ROW1, O,
            N: tl.constexpr, KV: tl.constexpr, G: tl.constexpr, H: tl.constexpr, HP: tl.constexpr,
            HV: tl.constexpr, HVP: tl.constexpr, PAGE: tl.constexpr, MAXP: tl.constexpr,
            BQ: tl.constexpr, MP: tl.constexpr, BK: tl.constexpr, SCALE: tl.constexpr, CAP: tl.constexpr,
            LEFT: tl.constexpr, RIGHT: tl.constexpr, DOT: tl.constexpr):
    w = tl.program_id(0)
    kvh = tl.program_id(1)
    seq = tl.load(ITEM_SEQ + w)
    r0 = tl.load(ITEM_ROW0 + w)
    r1 = tl.load(ITEM_ROW1 + w)
    m = tl.arange(0, MP)
    tok = r0 + m // G
    heads = kvh * G + m % G
    row_ok = (m < BQ * G) & (tok < r1)
    seq_c = tl.maximum(seq, 0)
    L = tl.where(seq >= 0, tl.load(LENS + seq_c), 0)
    q_start = tl.load(CU + seq_c)
    shift = L - (tl.load(CU + seq_c + 1) - q_start) - q_start  # key position of row r: r + shift
    pos = tok + shift
    lo = 0
    hi = tl.where(r1 > r0, L, 0)
    if RIGHT >= 0:
        hi = tl.minimum(hi, tl.maximum(r1 - 1 + shift + RIGHT + 1, 0))
    if LEFT >= 0:
        lo = tl.maximum(r0 + shift - LEFT, 0)

    h = tl.arange(0, HP)
    hv = tl.arange(0, HVP)
    tok64 = tok.to(tl.int64)
    q = tl.load(Q + tok64[:, None] * (N * H) + heads[:, None] * H + h[None, :],
                mask=row_ok[:, None] & (h[None, :] < H), other=0.0)
    acc = tl.zeros([MP, HVP], dtype=tl.float32)
    m_i = tl.full([MP], float("-inf"), tl.float32)
    l_i = tl.zeros([MP], dtype=tl.float32)
    for start in range((lo // BK) * BK, hi, BK):
        s = start + tl.arange(0, BK)
        s_ok = s < hi
        page = tl.load(TABLE + seq_c * MAXP + s // PAGE, mask=s_ok, other=0).to(tl.int64)
        row = (page * PAGE + s % PAGE) * KV + kvh
        kt = tl.load(K + row[None, :] * H + h[:, None], mask=s_ok[None, :] & (h[:, None] < H), other=0.0)
        qk = dot(q, kt, DOT)
        if CAP > 0:
            z = tanh(qk * (SCALE / CAP)) * (CAP * LOG2E)
        else:
            z = qk * (SCALE * LOG2E)
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
        vt = tl.load(V + row[:, None] * HV + hv[None, :], mask=s_ok[:, None] & (hv[None, :] < HV), other=0.0)
        acc = acc * alpha[:, None] + dot(p.to(vt.dtype), vt, DOT)
        m_i = m_new
    nonempty = l_i > 0.0
    out = acc * tl.where(nonempty, 1.0 / tl.where(nonempty, l_i, 1.0), 0.0)[:, None]
    tl.store(O + tok64[:, None] * (N * HV) + heads[:, None] * HV + hv[None, :], out.to(O.dtype.element_ty),
             mask=row_ok[:, None] & (hv[None, :] < HV))


@dataclasses.dataclass(frozen=True, kw_only=True)
class RaggedPagedAttentionConfig(KernelConfig):
    """block_q: query tokens per tile (a power of two; block_q x G query rows share each K/V load);
    block_k: keys per loop step (a power of two >= 16; it may span several pages);
    num_warps / num_stages: Triton's launch and pipelining."""

    block_q: int = 16
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 3

    def validate(self) -> None:
        super().validate()
        if self.block_q & (self.block_q - 1):
            raise ValueError(f"RaggedPagedAttentionConfig.block_q: expected a power of two, got {self.block_q}")
        if self.block_k < 16 or self.block_k & (self.block_k - 1):
            raise ValueError(f"RaggedPagedAttentionConfig.block_k: expected a power of two >= 16, got {self.block_k}")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"RaggedPagedAttentionConfig.num_warps: expected 1, 2, 4, 8 or 16, got {self.num_warps}")


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def _pow2_at_most(n: int) -> int:
    return 1 << (max(1, int(n)).bit_length() - 1)


def heuristic_config(q, k_pages, v_pages, cu_q_lens, kv_lens, page_table, *, spec: AttentionSpec) -> RaggedPagedAttentionConfig:
    """About 64 query rows (block_q x G) per tile: a tensor-core tile for prefills, while a decode
    tile (one token) still reads each K/V block once for its G heads; 64-key blocks (32 past
    H = 128, to keep the K/V stages in shared memory)."""
    G = q.shape[1] // k_pages.shape[2]
    block_q = _pow2_at_most(max(1, 64 // G))
    block_k = 64 if max(q.shape[2], v_pages.shape[3]) <= 128 else 32
    if interpret_enabled():  # the interpreter pays per program and per step: fewer, larger tiles
        block_q, block_k = _pow2_at_most(max(1, 128 // G)), 32
    return RaggedPagedAttentionConfig(block_q=block_q, block_k=block_k)


def _candidates(base: RaggedPagedAttentionConfig) -> list[RaggedPagedAttentionConfig]:
    r = base.replace
    return [base, r(block_q=max(1, base.block_q // 2)), r(block_q=base.block_q * 2, num_warps=8), r(block_k=32),
            r(block_k=128, num_warps=8), r(num_stages=2), r(num_stages=4)]


def _keys_walked(seq, row0, row1, cu_q_lens, kv_lens, spec: AttentionSpec):
    """How many keys each tile's program walks: hi - lo of `_kernel`."""
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


def ragged_paged_attention(q, k_pages, v_pages, cu_q_lens, kv_lens, page_table, *, spec: AttentionSpec,
                           config: RaggedPagedAttentionConfig):
    T, N, H = q.shape
    P, PAGE, KV, _ = k_pages.shape
    HV = v_pages.shape[3]
    G = N // KV
    BQ = config.block_q
    kv_lens, page_table = clamped_tables(kv_lens, page_table, P, PAGE)
    seq, row0, row1 = work_items(cu_q_lens, T, BQ)
    # Heaviest tiles first (the keys each one walks, as the kernel bounds them).
    order = jnp.argsort(-_keys_walked(seq, row0, row1, cu_q_lens, kv_lens, spec), stable=True)
    seq, row0, row1 = seq[order], row0[order], row1[order]
    return triton_call(
        q, k_pages, v_pages, cu_q_lens.astype(jnp.int32), kv_lens, page_table, seq, row0, row1,
        kernel=_kernel,
        out_shape=jax.ShapeDtypeStruct((T, N, HV), q.dtype),
        grid=(seq.shape[0], KV),
        num_warps=config.num_warps, num_stages=config.num_stages,
        N=N, KV=KV, G=G, H=H, HP=max(16, _pow2_at_least(H)), HV=HV, HVP=max(16, _pow2_at_least(HV)),
        PAGE=PAGE, MAXP=page_table.shape[1], BQ=BQ, MP=max(16, _pow2_at_least(BQ * G)), BK=config.block_k,
        SCALE=spec.scale, CAP=spec.logit_soft_cap or 0.0,
        LEFT=-1 if spec.window_left is None else spec.window_left,
        RIGHT=-1 if spec.right is None else spec.right,
        DOT=2 if interpret_enabled() else int(q.dtype == jnp.float32),
    )


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
