"""Block-sparse attention (NSA's selected branch) as Triton kernels: forward and one backward launch.

The contract is kernels/common/sparse_attention.py: q [B,T,N,H], k [B,S,K,H], v [B,S,K,Hv] read in
place (constexpr strides), block_indices [B,K,cdiv(T,bs),W]. XLA first turns block_indices into
tables of static size (`forward_table`: per query block its key blocks, ascending, deduplicated,
and their count; `transposed_table`: per key block the query blocks reading it), so every kernel
loops over exactly the selected pairs, with the loop bound loaded from the table.

  * `_fwd_kernel`, grid (cdiv(T, bs), B*K*(G/g)): a program holds `g` query heads of one kv head
    for one query block (g*bs rows: the heads share the block's selection, so each K/V tile is
    loaded once for all of them), online softmax over the selected key blocks in log2 units;
    out = acc / l (0 when l == 0), lse = ln 2 (m + log2 l) (-inf when l == 0).
  * `_bwd_kernel`, a 1-D grid: first the dK/dV programs, one per (key block, kv head), key block
    0 (the most readers under causal selection) first. Each walks (reader query block, tile of
    g' query heads) pairs in one loop, with p = 2^(z - lse), dz = p (dp - D), D = rowsum(dout *
    out) - dlse (one XLA reduction), summing dk^T += q^T dz, dv^T += dout^T p in f32 registers;
    stored once. Then the dQ programs, the forward's grid (last query blocks first), recompute p
    and dp per selected block: dq = scale dz k. 7 products per pair, not 5: a 5-product backward
    needs dq summed across the dK/dV programs (float atomics: nondeterministic, and at T 32k
    about 17 GB of f32 read-modify-writes) or dz tiles kept in memory (4 GB at T 32k). No
    atomics: deterministic. `fused_backward=False` runs the two halves as two launches.
Tiles apply the key tail (s < S) and, with causal, s <= t + S - T, except the pairs of
`full_blocks` (every row sees every key), which the tables count and the loops take first
(forward, dQ) or last (dK/dV) without masks; rows past T load lse = -inf, so p = 0 there.
Head dims are padded to powers of two (>= 16) with masked loads; f32 uses tf32x3 dots, the
interpreter f32 dots (`attention_tiles.dot`).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import triton
import triton.language as tl

from forgeax.core.config import KernelConfig
from forgeax.core.registry import Implementation
from forgeax.core.runtime import interpret_enabled
from forgeax.kernels.common.sparse_attention import (
    SparseAttentionSpec, differentiable_sparse_attention, forward_table, num_blocks, transposed_table,
)
from forgeax.kernels.triton.attention_tiles import LN2, LOG2E, dot, padded_dim
from forgeax.kernels.triton.elementwise import tanh
from forgeax.kernels.triton.launch import triton_call

__all__ = ["SPARSE_ATTENTION", "TritonSparseAttentionConfig", "candidate_configs", "heuristic_config"]

_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
_BLOCK_SIZES = (16, 32, 64, 128)
MAX_HEAD_DIM = 256
_WARPS = (1, 2, 4, 8, 16)
# Shared memory one program may ask for on sm_90 (227 KB; the launch fails above it).
SHARED_MEMORY_BYTES = 232448


@dataclasses.dataclass(frozen=True, kw_only=True)
class TritonSparseAttentionConfig(KernelConfig):
    """Launch shape of one call. `heads` / `dq_heads`: query heads per forward / dQ program (each
    holds heads * block_size rows); `bwd_heads`: query heads per dK/dV tile ([block_size keys,
    bwd_heads * block_size queries]). A call uses the largest power of two <= the field that
    divides its G = N // K. `fused_backward`: dK/dV and dQ programs in one launch (sharing
    bwd_warps / bwd_stages) rather than two."""

    heads: int
    fwd_warps: int
    fwd_stages: int
    dq_heads: int
    bwd_heads: int
    bwd_warps: int
    bwd_stages: int
    fused_backward: bool = True

    def validate(self) -> None:
        super().validate()
        name = type(self).__name__
        for field in ("heads", "dq_heads", "bwd_heads"):
            value = getattr(self, field)
            if value & (value - 1):
                raise ValueError(f"{name}.{field}: expected a power of two, got {value}")
        for field in ("fwd_warps", "bwd_warps"):
            if getattr(self, field) not in _WARPS:
                raise ValueError(f"{name}.{field}: expected one of {_WARPS}, got {getattr(self, field)}")
        if not isinstance(self.fused_backward, bool):
            raise ValueError(f"{name}.fused_backward: expected a bool, got {self.fused_backward!r}")


def _heads(wanted: int, group: int) -> int:
    """The largest power of two <= wanted dividing group."""
    g = 1
    while g * 2 <= wanted and group % (g * 2) == 0:
        g *= 2
    return g


def shared_memory(q, v, spec: SparseAttentionSpec, config: TritonSparseAttentionConfig) -> dict[str, int]:
    """Bytes of shared memory each kernel asks for (Triton's pipeliner keeps `stages` copies of
    the tiles loaded in the loop, plus the tiles loaded once): forward, dQ, dK/dV; the fused
    backward takes the larger of the last two. An estimate fitted to Triton 3.6's sm_90 lowering
    (exact at block 64, head dim 128); tests/lowering_sparse_attention_test.py checks the sizes
    Triton really asks for."""
    size = jnp.dtype(q.dtype).itemsize
    bs = spec.block_size
    hp, hvp = padded_dim(q.shape[3]), padded_dim(v.shape[3])
    group = q.shape[2] // v.shape[2]
    fwd_rows = _heads(config.heads, group) * bs
    dq_rows = _heads(config.dq_heads, group) * bs
    dkdv_rows = _heads(config.bwd_heads, group) * bs
    twice = 2 if size == 4 else 1  # f32 (tf32x3 dots) keeps the q (and dout) tiles twice, K and V once more
    return {
        "forward": size * (config.fwd_stages * bs * (hp + hvp) + fwd_rows * hp * twice),
        "dq": size * (config.bwd_stages * bs * (hp + hvp) + dq_rows * (hp + hvp) * twice),
        "dkdv": size * (bs * (hp + hvp) * twice + dkdv_rows * ((config.bwd_stages - 1) * (hp + hvp) + bs))
        + dkdv_rows * (config.bwd_stages - 1) * 8,
    }


def _fits(q, v, spec: SparseAttentionSpec, config: TritonSparseAttentionConfig) -> bool:
    return max(shared_memory(q, v, spec, config).values()) <= SHARED_MEMORY_BYTES


def heuristic_config(q, k, v, block_indices, *, spec: SparseAttentionSpec) -> TritonSparseAttentionConfig:
    """128 rows per dQ program and per dK/dV tile where the GQA group allows (the dense kernels'
    128 x 64 shape at block_size 64), 256 forward rows on 16 warps where the group holds them
    (16-bit inputs, head dim <= 128); 8 warps from 128 rows, 4 below; 3 stages, fewer where
    Hopper's shared memory would not hold them."""
    del block_indices
    if interpret_enabled():
        return TritonSparseAttentionConfig(heads=2, fwd_warps=4, fwd_stages=1, dq_heads=2, bwd_heads=2, bwd_warps=4,
                                           bwd_stages=1)
    heads = max(1, 128 // spec.block_size)
    rows = _heads(heads, q.shape[2] // k.shape[2]) * spec.block_size
    warps = 8 if rows >= 128 and padded_dim(q.shape[3]) >= 64 else 4
    # f32: 64 backward rows (the tf32x3 dQ program holds its q / dout tiles twice: 128 rows at
    # head dim 128 ask 288 KB of shared memory even unpipelined).
    bwd_heads = max(1, 64 // spec.block_size) if jnp.dtype(q.dtype).itemsize == 4 else heads
    fwd_heads, fwd_warps = heads, warps
    if jnp.dtype(q.dtype).itemsize == 2 and padded_dim(q.shape[3]) <= 128 and \
            _heads(2 * heads, q.shape[2] // k.shape[2]) * spec.block_size >= 256:
        # 256 forward rows on 16 warps (128 registers each at head dim 128, no spill): each
        # selected K/V block feeds twice the rows; faster on an H100 (docs/performance.md).
        fwd_heads, fwd_warps = 2 * heads, 16
    config = TritonSparseAttentionConfig(heads=fwd_heads, fwd_warps=fwd_warps, fwd_stages=3, dq_heads=bwd_heads,
                                         bwd_heads=bwd_heads, bwd_warps=warps, bwd_stages=3)
    return _fit_stages(q, v, spec, config)


def _fit_stages(q, v, spec, config: TritonSparseAttentionConfig) -> TritonSparseAttentionConfig:
    """config with fwd_stages / bwd_stages lowered (not below 1) until shared memory holds them."""
    while config.fwd_stages > 1 and shared_memory(q, v, spec, config)["forward"] > SHARED_MEMORY_BYTES:
        config = config.replace(fwd_stages=config.fwd_stages - 1)
    mem = shared_memory(q, v, spec, config)
    while config.bwd_stages > 1 and max(mem["dq"], mem["dkdv"]) > SHARED_MEMORY_BYTES:
        config = config.replace(bwd_stages=config.bwd_stages - 1)
        mem = shared_memory(q, v, spec, config)
    return config


def candidate_configs(q, k, v, block_indices, *, spec: SparseAttentionSpec) -> tuple[TritonSparseAttentionConfig, ...]:
    """The heuristic's config, then one field moved at a time: heads halved / doubled (forward,
    dQ, dK/dV; doubled forward heads also at 16 warps), warps 4 / 8, stages 2..4, the backward
    unfused; those whose shared memory fits."""
    base = heuristic_config(q, k, v, block_indices, spec=spec)
    configs = [base, base.replace(fused_backward=False)]
    for heads in (base.heads // 2, base.heads * 2):
        if heads >= 1:
            configs += [base.replace(heads=heads), base.replace(dq_heads=heads), base.replace(bwd_heads=heads)]
    # 256 forward rows: 16 warps hold them without spilling (128 registers at head dim 128).
    configs.append(base.replace(heads=base.heads * 2, fwd_warps=16))
    for warps in (4, 8):
        for stages in (2, 3, 4):
            configs += [base.replace(fwd_warps=warps, fwd_stages=stages),
                        base.replace(bwd_warps=warps, bwd_stages=stages)]
    return tuple(c for c in dict.fromkeys(configs) if _fits(q, v, spec, c))


# ----------------------------------------------------------------------------- kernels


@triton.jit
def _rows(PTR, b, t, n, L: tl.constexpr, NH: tl.constexpr, D: tl.constexpr, DP: tl.constexpr,
          MASKED: tl.constexpr):
    """[len(t), DP] tile of a [B, L, NH, D] array at rows (b, t[r], n[r]), zeros past L and D.
    MASKED=False where the caller knows every t < L: with DP == D the load then takes no mask
    (row masks cost vectorised loads and ptxas' schedule in the attention kernels)."""
    d = tl.arange(0, DP)
    offs = b.to(tl.int64) * (L * NH * D) + t[:, None] * (NH * D) + n[:, None] * D + d[None, :]
    if MASKED or DP != D:
        return tl.load(PTR + offs, mask=(t[:, None] < L) & (d[None, :] < D), other=0.0)
    return tl.load(PTR + offs)


@triton.jit
def _logits2(qk, t, s, T: tl.constexpr, S: tl.constexpr, SCALE: tl.constexpr, CAP: tl.constexpr,
             CAUSAL: tl.constexpr, MASKED: tl.constexpr):
    """(logits in log2 units, with MASKED -inf where the key is past S or after the query; tanh of
    the cap). Unmasked tiles are `full_blocks` (kernels/common/sparse_attention.py)."""
    th = 0.0
    if CAP > 0:
        th = tanh(qk * (SCALE / CAP))
        z = th * (CAP * LOG2E)
    else:
        z = qk * (SCALE * LOG2E)
    if MASKED:
        ok = s < S
        if CAUSAL:
            ok = ok & (s <= t + (S - T))
        z = tl.where(ok, z, float("-inf"))
    return z, th


@triton.jit
def _query_rows(pid1, KH: tl.constexpr, G: tl.constexpr, GH: tl.constexpr, BS: tl.constexpr):
    """(b, kv head, first query head, r // BS, r % BS) of a forward / dQ program's rows r."""
    GROUPS: tl.constexpr = G // GH
    b = pid1 // (KH * GROUPS)
    kh = (pid1 // GROUPS) % KH
    n0 = kh * G + (pid1 % GROUPS) * GH
    r = tl.arange(0, GH * BS)
    return b, kh, n0, r // BS, r % BS


@triton.jit
def _fwd_step(acc, m_i, l_i, q, j, t, b, kh, K, V, T: tl.constexpr, S: tl.constexpr, KH: tl.constexpr,
              H: tl.constexpr, HV: tl.constexpr, HP: tl.constexpr, HVP: tl.constexpr, SCALE: tl.constexpr,
              CAP: tl.constexpr, CAUSAL: tl.constexpr, BS: tl.constexpr, DOT: tl.constexpr, MASKED: tl.constexpr):
    """The online-softmax update of the forward's rows with key block j."""
    s = j * BS + tl.arange(0, BS)
    kk = _rows(K, b, s, kh + 0 * s, S, KH, H, HP, MASKED)
    z, _ = _logits2(dot(q, tl.trans(kk), DOT), t[:, None], s[None, :], T, S, SCALE, CAP, CAUSAL, MASKED)
    m_new = tl.maximum(m_i, tl.max(z, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.math.exp2(z - m_safe[:, None])
    alpha = tl.math.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    vv = _rows(V, b, s, kh + 0 * s, S, KH, HV, HVP, MASKED)
    acc = acc * alpha[:, None] + dot(p.to(vv.dtype), vv, DOT)
    return acc, m_new, l_i


@triton.jit
def _fwd_kernel(Q, K, V, COLS, COUNTS, FULL, O, LSE, T: tl.constexpr, S: tl.constexpr, N: tl.constexpr,
                KH: tl.constexpr, H: tl.constexpr, HV: tl.constexpr, HP: tl.constexpr, HVP: tl.constexpr,
                SCALE: tl.constexpr, CAP: tl.constexpr, CAUSAL: tl.constexpr, BS: tl.constexpr,
                GH: tl.constexpr, W: tl.constexpr, DOT: tl.constexpr):
    NQ: tl.constexpr = (T + BS - 1) // BS
    i = tl.num_programs(0) - 1 - tl.program_id(0)  # later query blocks see more keys under causal
    b, kh, n0, head, row = _query_rows(tl.program_id(1), KH, N // KH, GH, BS)
    t = i * BS + row
    n = n0 + head
    q = _rows(Q, b, t, n, T, N, H, HP, True)
    acc = tl.zeros([GH * BS, HVP], dtype=tl.float32)
    m_i = tl.full([GH * BS], float("-inf"), tl.float32)
    l_i = tl.zeros([GH * BS], dtype=tl.float32)
    table = (b * KH + kh) * NQ + i
    cols = COLS + table.to(tl.int64) * W
    full = tl.load(FULL + table)
    for w in range(0, full):  # blocks every row sees whole: no masks
        acc, m_i, l_i = _fwd_step(acc, m_i, l_i, q, tl.load(cols + w), t, b, kh, K, V, T, S, KH, H, HV, HP, HVP,
                                  SCALE, CAP, CAUSAL, BS, DOT, False)
    for w in range(full, tl.load(COUNTS + table)):  # the diagonal and the key tail
        acc, m_i, l_i = _fwd_step(acc, m_i, l_i, q, tl.load(cols + w), t, b, kh, K, V, T, S, KH, H, HV, HP, HVP,
                                  SCALE, CAP, CAUSAL, BS, DOT, True)
    nonempty = l_i > 0.0
    out = acc * tl.where(nonempty, 1.0 / tl.where(nonempty, l_i, 1.0), 0.0)[:, None]
    hv = tl.arange(0, HVP)
    o_offs = b.to(tl.int64) * (T * N * HV) + t[:, None] * (N * HV) + n[:, None] * HV + hv[None, :]
    tl.store(O + o_offs, out.to(O.dtype.element_ty), mask=(t[:, None] < T) & (hv[None, :] < HV))
    m_safe = tl.where(m_i == float("-inf"), 0.0, m_i)
    lse = tl.where(nonempty, (m_safe + tl.math.log2(tl.where(nonempty, l_i, 1.0))) * LN2, float("-inf"))
    tl.store(LSE + (b * N + n).to(tl.int64) * T + t, lse, mask=t < T)


@triton.jit
def _row_stats(LSE, DELTA, b, n, t, T: tl.constexpr, N: tl.constexpr):
    """(lse in log2 units, +inf on empty rows and rows past T so that p = 0 there; D)."""
    offs = (b * N + n).to(tl.int64) * T + t
    lse = tl.load(LSE + offs, mask=t < T, other=float("-inf"))
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse * LOG2E)
    return lse2, tl.load(DELTA + offs, mask=t < T, other=0.0)


@triton.jit
def _dq_step(dq, q, do, lse2, d, j, t, b, kh, K, V, T: tl.constexpr, S: tl.constexpr, KH: tl.constexpr,
             H: tl.constexpr, HV: tl.constexpr, HP: tl.constexpr, HVP: tl.constexpr, SCALE: tl.constexpr,
             CAP: tl.constexpr, CAUSAL: tl.constexpr, BS: tl.constexpr, DOT: tl.constexpr, MASKED: tl.constexpr):
    """dq += dz k for key block j (scale applied at the store)."""
    s = j * BS + tl.arange(0, BS)
    kk = _rows(K, b, s, kh + 0 * s, S, KH, H, HP, MASKED)
    vv = _rows(V, b, s, kh + 0 * s, S, KH, HV, HVP, MASKED)
    z, th = _logits2(dot(q, tl.trans(kk), DOT), t[:, None], s[None, :], T, S, SCALE, CAP, CAUSAL, MASKED)
    p = tl.math.exp2(z - lse2[:, None])
    dz = p * (dot(do, tl.trans(vv), DOT) - d[:, None])
    if CAP > 0:
        dz = dz * (1.0 - th * th)
    return dq + dot(dz.to(kk.dtype), kk, DOT)


@triton.jit
def _dq_program(pid, Q, K, V, COLS, COUNTS, FULL, DO, LSE, DELTA, DQ, B: tl.constexpr, T: tl.constexpr,
                S: tl.constexpr, N: tl.constexpr, KH: tl.constexpr, H: tl.constexpr, HV: tl.constexpr,
                HP: tl.constexpr, HVP: tl.constexpr, SCALE: tl.constexpr, CAP: tl.constexpr, CAUSAL: tl.constexpr,
                BS: tl.constexpr, GH: tl.constexpr, W: tl.constexpr, DOT: tl.constexpr):
    """dq of GH query heads of one query block; pid in [0, NQ * B * N / GH), the last (heaviest
    under causal selection) query blocks first."""
    NQ: tl.constexpr = (T + BS - 1) // BS
    PER_BLOCK: tl.constexpr = B * N // GH
    i = NQ - 1 - pid // PER_BLOCK
    b, kh, n0, head, row = _query_rows(pid % PER_BLOCK, KH, N // KH, GH, BS)
    t = i * BS + row
    n = n0 + head
    q = _rows(Q, b, t, n, T, N, H, HP, True)
    do = _rows(DO, b, t, n, T, N, HV, HVP, True)
    lse2, d = _row_stats(LSE, DELTA, b, n, t, T, N)
    dq = tl.zeros([GH * BS, HP], dtype=tl.float32)
    table = (b * KH + kh) * NQ + i
    cols = COLS + table.to(tl.int64) * W
    full = tl.load(FULL + table)
    for w in range(0, full):
        dq = _dq_step(dq, q, do, lse2, d, tl.load(cols + w), t, b, kh, K, V, T, S, KH, H, HV, HP, HVP, SCALE, CAP,
                      CAUSAL, BS, DOT, False)
    for w in range(full, tl.load(COUNTS + table)):
        dq = _dq_step(dq, q, do, lse2, d, tl.load(cols + w), t, b, kh, K, V, T, S, KH, H, HV, HP, HVP, SCALE, CAP,
                      CAUSAL, BS, DOT, True)
    h = tl.arange(0, HP)
    offs = b.to(tl.int64) * (T * N * H) + t[:, None] * (N * H) + n[:, None] * H + h[None, :]
    tl.store(DQ + offs, (dq * SCALE).to(DQ.dtype.element_ty), mask=(t[:, None] < T) & (h[None, :] < H))


@triton.jit
def _dkdv_step(dkt, dvt, kk, vv, it, rows, s, b, kh, Q, DO, LSE, DELTA, T: tl.constexpr, S: tl.constexpr,
               N: tl.constexpr, KH: tl.constexpr, H: tl.constexpr, HV: tl.constexpr, HP: tl.constexpr,
               HVP: tl.constexpr, SCALE: tl.constexpr, CAP: tl.constexpr, CAUSAL: tl.constexpr, BS: tl.constexpr,
               GH: tl.constexpr, DOT: tl.constexpr, MASKED: tl.constexpr):
    """dk^T, dv^T of key block s from step `it` = (reader w, head tile g) of its transposed-table
    row: query block rows[w], query heads g*GH .. g*GH+GH-1 of kv head kh. Tiles are [queries,
    keys] and the accumulators [head dim, keys], so every product has M = GH * BS or the head dim
    (128 rows fill two Hopper warpgroups; M = BS = 64 rows would split N and shuffle operands).
    One flat loop over (w, g) rather than a head loop nested in the reader loop: Triton pipelines
    the innermost loop only, and G / GH is often 2."""
    G: tl.constexpr = N // KH
    GROUPS: tl.constexpr = G // GH
    QTAIL: tl.constexpr = T % BS != 0  # rows past T exist only in the last query block
    i = tl.load(rows + it // GROUPS)
    r = tl.arange(0, GH * BS)
    t = i * BS + r % BS
    n = kh * G + (it % GROUPS) * GH + r // BS
    q = _rows(Q, b, t, n, T, N, H, HP, QTAIL)
    do = _rows(DO, b, t, n, T, N, HV, HVP, QTAIL)
    lse2, d = _row_stats(LSE, DELTA, b, n, t, T, N)
    z, th = _logits2(dot(q, tl.trans(kk), DOT), t[:, None], s[None, :], T, S, SCALE, CAP, CAUSAL, MASKED)
    p = tl.math.exp2(z - lse2[:, None])
    dvt += dot(tl.trans(do), p.to(do.dtype), DOT)
    dz = p * (dot(do, tl.trans(vv), DOT) - d[:, None])
    if CAP > 0:
        dz = dz * (1.0 - th * th)
    dkt += dot(tl.trans(q), dz.to(q.dtype), DOT)
    return dkt, dvt


@triton.jit
def _dkdv_program(pid, Q, K, V, ROWS, COUNTS, MASKS, DO, LSE, DELTA, DK, DV, B: tl.constexpr, T: tl.constexpr,
                  S: tl.constexpr, N: tl.constexpr, KH: tl.constexpr, H: tl.constexpr, HV: tl.constexpr,
                  HP: tl.constexpr, HVP: tl.constexpr, SCALE: tl.constexpr, CAP: tl.constexpr, CAUSAL: tl.constexpr,
                  BS: tl.constexpr, GH: tl.constexpr, DOT: tl.constexpr):
    """dk, dv of one key block of one kv head, summed over its readers and the G query heads in
    f32 registers, stored once; pid in [0, NK * B * KH), the first key blocks (the most readers
    under causal selection) first."""
    NQ: tl.constexpr = (T + BS - 1) // BS
    NK: tl.constexpr = (S + BS - 1) // BS
    GROUPS: tl.constexpr = (N // KH) // GH
    j = pid // (B * KH)
    bk = pid % (B * KH)
    b = bk // KH
    kh = bk % KH
    s = j * BS + tl.arange(0, BS)
    kk = _rows(K, b, s, kh + 0 * s, S, KH, H, HP, True)
    vv = _rows(V, b, s, kh + 0 * s, S, KH, HV, HVP, True)
    dkt = tl.zeros([HP, BS], dtype=tl.float32)
    dvt = tl.zeros([HVP, BS], dtype=tl.float32)
    table = bk * NK + j
    rows = ROWS + table.to(tl.int64) * NQ
    masked = tl.load(MASKS + table) * GROUPS
    for it in range(0, masked):  # the diagonal and the key tail
        dkt, dvt = _dkdv_step(dkt, dvt, kk, vv, it, rows, s, b, kh, Q, DO, LSE, DELTA, T, S, N, KH, H, HV, HP, HVP,
                              SCALE, CAP, CAUSAL, BS, GH, DOT, True)
    for it in range(masked, tl.load(COUNTS + table) * GROUPS):
        dkt, dvt = _dkdv_step(dkt, dvt, kk, vv, it, rows, s, b, kh, Q, DO, LSE, DELTA, T, S, N, KH, H, HV, HP, HVP,
                              SCALE, CAP, CAUSAL, BS, GH, DOT, False)
    h = tl.arange(0, HP)
    hv = tl.arange(0, HVP)
    k_offs = b.to(tl.int64) * (S * KH * H) + s[None, :] * (KH * H) + kh * H + h[:, None]
    v_offs = b.to(tl.int64) * (S * KH * HV) + s[None, :] * (KH * HV) + kh * HV + hv[:, None]
    tl.store(DK + k_offs, (dkt * SCALE).to(DK.dtype.element_ty), mask=(s[None, :] < S) & (h[:, None] < H))
    tl.store(DV + v_offs, dvt.to(DV.dtype.element_ty), mask=(s[None, :] < S) & (hv[:, None] < HV))


@triton.jit
def _bwd_kernel(Q, K, V, COLS, COUNTS, FULL, ROWS, ROW_COUNTS, MASKS, DO, LSE, DELTA, DQ, DK, DV,
                B: tl.constexpr, T: tl.constexpr, S: tl.constexpr, N: tl.constexpr, KH: tl.constexpr,
                H: tl.constexpr, HV: tl.constexpr, HP: tl.constexpr, HVP: tl.constexpr, SCALE: tl.constexpr,
                CAP: tl.constexpr, CAUSAL: tl.constexpr, BS: tl.constexpr, GH: tl.constexpr, KGH: tl.constexpr,
                W: tl.constexpr, DOT: tl.constexpr, DKDV: tl.constexpr, DQ_PART: tl.constexpr):
    """One backward launch, 1-D grid: with DKDV its first NK * B * KH programs do dK/dV, then
    (with DQ_PART) NQ * B * N / GH programs do dQ. Both halves of one launch share warps and
    stages; a launch with one half writes dummies for the other's outputs."""
    NK: tl.constexpr = (S + BS - 1) // BS
    NDKDV: tl.constexpr = NK * B * KH if DKDV else 0
    pid = tl.program_id(0)
    if pid < NDKDV:
        _dkdv_program(pid, Q, K, V, ROWS, ROW_COUNTS, MASKS, DO, LSE, DELTA, DK, DV, B, T, S, N, KH, H, HV, HP,
                      HVP, SCALE, CAP, CAUSAL, BS, KGH, DOT)
    elif DQ_PART:
        _dq_program(pid - NDKDV, Q, K, V, COLS, COUNTS, FULL, DO, LSE, DELTA, DQ, B, T, S, N, KH, H, HV, HP, HVP,
                    SCALE, CAP, CAUSAL, BS, GH, W, DOT)


# ----------------------------------------------------------------------------- host side


def _statics(q, k, v, spec: SparseAttentionSpec) -> dict:
    B, T, N, H = q.shape
    S, KH, HV = k.shape[1], k.shape[2], v.shape[3]
    return dict(T=T, S=S, N=N, KH=KH, H=H, HV=HV, HP=padded_dim(H), HVP=padded_dim(HV), SCALE=float(spec.scale),
                CAP=float(spec.logit_soft_cap or 0.0), CAUSAL=spec.causal, BS=spec.block_size,
                DOT=2 if interpret_enabled() else int(q.dtype == jnp.float32))


def forward(q, k, v, block_indices, *, spec: SparseAttentionSpec, config: TritonSparseAttentionConfig):
    """(out [B, T, N, Hv] in q's dtype, lse [B, N, T] f32)."""
    B, T, N, _ = q.shape
    S, KH, HV = k.shape[1], k.shape[2], v.shape[3]
    gh = _heads(config.heads, N // KH)
    cols, counts, full = forward_table(block_indices, spec, T, S)
    return triton_call(
        q, k, v, cols, counts, full, kernel=_fwd_kernel,
        out_shape=(jax.ShapeDtypeStruct((B, T, N, HV), q.dtype), jax.ShapeDtypeStruct((B, N, T), jnp.float32)),
        grid=(num_blocks(T, spec.block_size), B * N // gh), num_warps=config.fwd_warps, num_stages=config.fwd_stages,
        GH=gh, W=cols.shape[-1], **_statics(q, k, v, spec))


def backward(q, k, v, block_indices, out, lse, dout, dlse, *, spec: SparseAttentionSpec,
             config: TritonSparseAttentionConfig):
    """(dq, dk, dv) accumulated in f32, stored in q's / k's / v's dtypes: one `_bwd_kernel`
    launch (config.fused_backward) or a dK/dV launch and a dQ launch."""
    B, T, N, _ = q.shape
    S, KH = k.shape[1], k.shape[2]
    statics = _statics(q, k, v, spec)
    delta = jnp.einsum("btnh,btnh->bnt", dout.astype(jnp.float32), out.astype(jnp.float32)) - dlse
    cols, counts, full = forward_table(block_indices, spec, T, S)
    rows, row_counts, masked = transposed_table(block_indices, spec, T, S)
    gh, kgh = _heads(config.dq_heads, N // KH), _heads(config.bwd_heads, N // KH)
    n_dkdv = num_blocks(S, spec.block_size) * B * KH
    n_dq = num_blocks(T, spec.block_size) * B * N // gh
    shapes = {"dq": jax.ShapeDtypeStruct(q.shape, q.dtype), "dk": jax.ShapeDtypeStruct(k.shape, k.dtype),
              "dv": jax.ShapeDtypeStruct(v.shape, v.dtype)}
    dummy = jax.ShapeDtypeStruct((1,), q.dtype)

    def launch(dkdv: bool, dq_part: bool):
        out_shape = (shapes["dq"] if dq_part else dummy, shapes["dk"] if dkdv else dummy,
                     shapes["dv"] if dkdv else dummy)
        return triton_call(
            q, k, v, cols, counts, full, rows, row_counts, masked, dout, lse, delta, kernel=_bwd_kernel,
            out_shape=out_shape, grid=(n_dkdv * dkdv + n_dq * dq_part,), num_warps=config.bwd_warps,
            num_stages=config.bwd_stages, B=B, GH=gh, KGH=kgh, W=cols.shape[-1], DKDV=dkdv, DQ_PART=dq_part,
            **statics)

    if config.fused_backward:
        return launch(True, True)
    _, dk, dv = launch(True, False)
    dq, _, _ = launch(False, True)
    return dq, dk, dv


@functools.cache
def _differentiable(config: TritonSparseAttentionConfig):
    return differentiable_sparse_attention(functools.partial(forward, config=config),
                                           functools.partial(backward, config=config))


def sparse_attention(q, k, v, block_indices, *, spec: SparseAttentionSpec, config: TritonSparseAttentionConfig):
    """The backend's `fn` (signature: kernels/common/sparse_attention.py)."""
    return _differentiable(config)(q, k, v, block_indices, spec=spec)


def supports(q, k, v, block_indices, *, spec: SparseAttentionSpec) -> str | None:
    for name, a in (("q", q), ("k", k), ("v", v)):
        if jnp.dtype(a.dtype) not in _DTYPES:
            return f"{name} dtype {jnp.dtype(a.dtype).name} is not one of float32/bfloat16/float16"
    if spec.block_size not in _BLOCK_SIZES:
        return f"block_size {spec.block_size}: the kernels' tiles take {_BLOCK_SIZES}"
    H, HV = q.shape[3], v.shape[3]
    if max(H, HV) > MAX_HEAD_DIM:
        return f"head dims (H={H}, Hv={HV}) above {MAX_HEAD_DIM}"
    if q.dtype == jnp.float32 and max(H, HV) > 128 and not interpret_enabled():
        return f"float32 with head dims (H={H}, Hv={HV}) above 128 spills registers; use bf16/f16"
    if 0 in q.shape or 0 in k.shape:
        return "empty q/k/v"
    B, T, N, _ = q.shape
    S, KH = k.shape[1], k.shape[2]
    if B * N >= 65536:
        return f"B*N={B * N} exceeds the grid's second axis (65535)"
    if max(B * T * N * max(H, HV), B * S * KH * max(H, HV)) >= 2**31:
        return "arrays with >= 2^31 elements (int32 row offsets)"
    del block_indices
    return None


SPARSE_ATTENTION = Implementation(
    fn=sparse_attention, platforms=("gpu",), interpretable=True, supports=supports,
    config_type=TritonSparseAttentionConfig, heuristic_config=heuristic_config, candidate_configs=candidate_configs,
)
