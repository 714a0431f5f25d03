"""Multi-head latent attention decode as a Triton split-K kernel (forward only).

q_latent [B, N, L], q_rope [B, N, R]; cache kv_latent / k_rope contiguous [B, S, L|R] or pages
[P, page_size, L|R] with page_table [B, M] (ops/mla_decode.py has the math). Grid
(cdiv(N, BLOCK_H), B, SPLITS), head tiles innermost: the programs of one (request, split) run
together, so a cache tile read from HBM for one head tile is an L2 hit for the others. Program
(h, b, j) takes heads [h*BLOCK_H, ...) of request b and the j-th of SPLITS equal runs of its
lengths[b] keys (rounded up to whole BLOCK_N blocks; a run past the length is empty). Per key
block it loads kv_latent [BLOCK_N, L] and k_rope [BLOCK_N, R] once (paged: each key's row through
its page id) and uses the latent tile twice:
    z2 = log2(e) * scale * (q_latent @ kv^T + q_rope @ k_rope^T)      [BLOCK_H, BLOCK_N]
    online softmax in log2 units; acc += p @ kv                        [BLOCK_H, L] f32
(the q.k products of the latent and rope parts one accumulation chain; whole blocks unmasked,
only a run's partial last block masked).
Each program stores its normalised partial out and lse (natural log; -inf for an empty run). With
SPLITS > 1 the partials are f32 [B, N, SPLITS, L] merged by lse in XLA:
    lse = logsumexp_j lse_j,  out = sum_j exp(lse_j - lse) out_j      (0 / -inf if every run is empty)
With SPLITS = 1 the kernel writes the output in q_latent's dtype directly.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import triton
import triton.language as tl

from forgeax.core.config import KernelConfig
from forgeax.core.registry import Implementation
from forgeax.core.runtime import gpu_sm_count, interpret_enabled
from forgeax.kernels.common.batching import fold_vmap_into_rows
from forgeax.kernels.common.mla_decode import forward_only, spec_reason, split_mla_launch
from forgeax.kernels.common.paged import PagedSpec
from forgeax.kernels.triton.attention_tiles import LN2, dot
from forgeax.kernels.triton.launch import triton_call

_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
_MAX_LATENT = 1024  # the [BLOCK_H, L] f32 accumulator lives in registers
_MAX_ROPE = 256
_SHARED_BYTES = 232448  # an H100/H200 block's shared memory limit (sm_90)


@triton.jit
def _mla_step(ql, qr, acc, m_i, l_i, start, hi, b, KV, KR, PT, L: tl.constexpr, R: tl.constexpr, S: tl.constexpr,
              M: tl.constexpr, PAGED: tl.constexpr, SCALE2: tl.constexpr, BLOCK_N: tl.constexpr, LP: tl.constexpr,
              RP: tl.constexpr, DOT: tl.constexpr, MASKED: tl.constexpr):
    """Keys [start, start + BLOCK_N): MASKED=False when all of them are < hi. The latent tile is
    loaded once and serves as K (with the rope keys) and as V."""
    s = start + tl.arange(0, BLOCK_N)
    lat = tl.arange(0, LP)
    rop = tl.arange(0, RP)
    s_ok = s < hi
    if PAGED:
        if MASKED:
            page = tl.load(PT + b * M + s // S, mask=s_ok, other=0)
        else:
            page = tl.load(PT + b * M + s // S)
        rows = page.to(tl.int64) * S + s % S
    else:
        rows = b.to(tl.int64) * S + s
    if MASKED:
        kv = tl.load(KV + rows[:, None] * L + lat[None, :], mask=s_ok[:, None] & (lat < L)[None, :], other=0.0)
        kr = tl.load(KR + rows[:, None] * R + rop[None, :], mask=s_ok[:, None] & (rop < R)[None, :], other=0.0)
    else:
        if L == LP:
            kv = tl.load(KV + rows[:, None] * L + lat[None, :])
        else:
            kv = tl.load(KV + rows[:, None] * L + lat[None, :], mask=(lat < L)[None, :], other=0.0)
        if R == RP:
            kr = tl.load(KR + rows[:, None] * R + rop[None, :])
        else:
            kr = tl.load(KR + rows[:, None] * R + rop[None, :], mask=(rop < R)[None, :], other=0.0)
    if DOT == 0:  # one accumulation chain for q.k over the latent and rope parts
        z = tl.dot(qr, tl.trans(kr), tl.dot(ql, tl.trans(kv))) * SCALE2
    else:
        z = (dot(ql, tl.trans(kv), DOT) + dot(qr, tl.trans(kr), DOT)) * SCALE2
    if MASKED:
        z = tl.where(s_ok[None, :], z, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(z, 1))  # finite: key `start` is always in the run
    p = tl.math.exp2(z - m_new[:, None])
    alpha = tl.math.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + dot(p.to(kv.dtype), kv, DOT)
    return acc, m_new, l_i


@triton.jit
def _mla_decode_kernel(QL, QR, KV, KR, LEN, PT, O, LSE,
                       N: tl.constexpr, L: tl.constexpr, R: tl.constexpr, S: tl.constexpr, M: tl.constexpr,
                       PAGED: tl.constexpr, SPLITS: tl.constexpr, SCALE2: tl.constexpr,
                       BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, LP: tl.constexpr, RP: tl.constexpr,
                       DOT: tl.constexpr):
    """S: keys per request (contiguous) or page_size (PAGED, with M page-table columns)."""
    b = tl.program_id(1)
    split = tl.program_id(2)
    heads = tl.program_id(0) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = heads < N
    lat = tl.arange(0, LP)
    rop = tl.arange(0, RP)
    l_ok = lat < L
    r_ok = rop < R
    q_rows = b.to(tl.int64) * N + heads
    ql = tl.load(QL + q_rows[:, None] * L + lat[None, :], mask=h_ok[:, None] & l_ok[None, :], other=0.0)
    qr = tl.load(QR + q_rows[:, None] * R + rop[None, :], mask=h_ok[:, None] & r_ok[None, :], other=0.0)
    length = tl.load(LEN + b)
    run = tl.cdiv(tl.cdiv(length, SPLITS), BLOCK_N) * BLOCK_N
    lo = split * run
    hi = tl.minimum(lo + run, length)
    full = lo + tl.maximum(hi - lo, 0) // BLOCK_N * BLOCK_N  # whole blocks first, unmasked
    acc = tl.zeros([BLOCK_H, LP], dtype=tl.float32)
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    for start in range(lo, full, BLOCK_N):
        acc, m_i, l_i = _mla_step(ql, qr, acc, m_i, l_i, start, hi, b, KV, KR, PT, L, R, S, M, PAGED, SCALE2,
                                  BLOCK_N, LP, RP, DOT, False)
    if full < hi:  # the partial last block
        acc, m_i, l_i = _mla_step(ql, qr, acc, m_i, l_i, full, hi, b, KV, KR, PT, L, R, S, M, PAGED, SCALE2,
                                  BLOCK_N, LP, RP, DOT, True)
    nonempty = l_i > 0.0
    inv = tl.where(nonempty, 1.0 / tl.where(nonempty, l_i, 1.0), 0.0)
    o_rows = q_rows * SPLITS + split
    tl.store(O + o_rows[:, None] * L + lat[None, :], (acc * inv[:, None]).to(O.dtype.element_ty),
             mask=h_ok[:, None] & l_ok[None, :])
    lse = tl.where(nonempty, (m_i + tl.math.log2(tl.where(nonempty, l_i, 1.0))) * LN2, float("-inf"))
    tl.store(LSE + o_rows, lse, mask=h_ok)


# ----------------------------------------------------------------------------- config


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


@dataclasses.dataclass(frozen=True, kw_only=True)
class MlaDecodeTritonConfig(KernelConfig):
    """block_h: heads per program (they share each cache tile); block_n: keys per step;
    num_splits: runs of keys per request, each its own program, merged by lse."""

    block_h: int
    block_n: int
    num_splits: int
    num_warps: int = 4
    num_stages: int = 2

    def validate(self) -> None:
        super().validate()
        for name in ("block_h", "block_n"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"MlaDecodeTritonConfig.{name}: expected a power of two >= 16 (tl.dot's minimum), got {value}")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"MlaDecodeTritonConfig.num_warps: expected 1, 2, 4, 8 or 16, got {self.num_warps}")


def _keys(kv_latent, page_table) -> int:
    """The most keys a request can have."""
    return kv_latent.shape[1] * (page_table.shape[1] if page_table is not None else 1)


def _width(q_latent, q_rope) -> int:
    """Bytes of one padded (latent + rope) row."""
    return (_pow2_at_least(q_latent.shape[2]) + _pow2_at_least(q_rope.shape[2])) * jnp.dtype(q_latent.dtype).itemsize


def _fits(block_h: int, block_n: int, stages: int, width: int) -> bool:
    """The q tile (Triton keeps a dot's loop-invariant operand in shared memory) plus one cache
    tile per pipeline stage within Hopper's 227 KB of shared memory (232448 B), less 8 KB slack."""
    return (block_h + max(stages, 1) * block_n) * width <= _SHARED_BYTES - 8 * 1024


def heuristic_config(q_latent, q_rope, kv_latent, k_rope, lengths, page_table, *, spec) -> MlaDecodeTritonConfig:
    """64-head tiles where N allows (M = 64 is what Hopper's wgmma takes), else N rounded up to
    16..32; 8 warps. Key tiles of 64 with 2 stages where the shared memory holds them (at L = 512,
    R = 64 in bf16: the 72 KB q tile plus two 72 KB cache tiles, 216 KB; ptxas: 255 registers, no
    spills for sm_90a), so the per-step softmax, rescale and barrier are paid once per 64 keys;
    else 32 (144 KB, 242 registers). Splits so that the grid covers the SMs about once (1 at B 64,
    N 128: 128 programs; the f32 partials of a merge, written and read back, would add 11% to
    the cache bytes there), each split at least 256 keys."""
    del k_rope, lengths, spec
    B, N, L = q_latent.shape
    block_h = 64 if N >= 64 else min(32, max(16, _pow2_at_least(N)))
    keys = _keys(kv_latent, page_table)
    if interpret_enabled():
        return MlaDecodeTritonConfig(block_h=min(block_h, 16), block_n=16, num_splits=2 if keys > 16 else 1)
    tiles = -(-N // block_h)
    programs = B * tiles
    splits = max(1, min((gpu_sm_count() + programs // 2) // programs, keys // 256, 64))
    width = _width(q_latent, q_rope)
    block_n = next((n for n in (64, 32, 16) if _fits(block_h, n, 2, width)), 16)
    return MlaDecodeTritonConfig(block_h=block_h, block_n=block_n, num_splits=splits,
                                 num_warps=8 if block_h >= 32 else 4, num_stages=2)


def candidate_configs(*args, **kwargs) -> list[MlaDecodeTritonConfig]:
    """Head tiles 16..64, key tiles 16..64, 1..3 stages, the heuristic's splits halved and doubled;
    without the configs whose q tile and pipelined cache tiles pass the shared memory (`_fits`)
    or whose [block_h, L] f32 accumulator would take more than 128 registers a thread."""
    base = heuristic_config(*args, **kwargs)
    q_latent, q_rope = args[0], args[1]
    width = _width(q_latent, q_rope)
    out = [base]
    for block_h, warps in ((16, 4), (32, 4), (32, 8), (64, 8)):
        if block_h * _pow2_at_least(q_latent.shape[2]) > 128 * 32 * warps:
            continue
        for block_n in (16, 32, 64):
            for stages in (1, 2, 3):
                if not _fits(block_h, block_n, stages, width):
                    continue
                for splits in sorted({base.num_splits, max(1, base.num_splits // 2), base.num_splits * 2}):
                    c = base.replace(block_h=block_h, block_n=block_n, num_warps=warps, num_stages=stages, num_splits=splits)
                    if c not in out:
                        out.append(c)
    return out


# ----------------------------------------------------------------------------- launch


def _merge(o_parts, lse_parts, dtype):
    """[B, N, J, L] f32 partials and [B, N, J] lse -> out [B, N, L] in dtype, lse [B, N]."""
    top = jnp.max(lse_parts, axis=-1, keepdims=True)
    top = jnp.where(jnp.isfinite(top), top, 0.0)
    w = jnp.exp(lse_parts - top)  # 0 for an empty run (lse -inf)
    total = jnp.sum(w, axis=-1, keepdims=True)
    nonempty = total > 0
    out = jnp.sum(w[..., None] * o_parts, axis=2) / jnp.where(nonempty, total, 1.0)
    lse = jnp.where(nonempty, top + jnp.log(jnp.where(nonempty, total, 1.0)), -jnp.inf)[..., 0]
    return out.astype(dtype), lse


def _launch(q_latent, q_rope, kv_latent, k_rope, lengths, page_table, *, spec: PagedSpec, config: MlaDecodeTritonConfig):
    B, N, L = q_latent.shape
    R = q_rope.shape[2]
    splits = config.num_splits
    paged = page_table is not None
    part_dtype = q_latent.dtype if splits == 1 else jnp.float32
    block_h = min(config.block_h, max(16, _pow2_at_least(N)))
    o, lse = triton_call(
        q_latent, q_rope, kv_latent, k_rope, lengths.astype(jnp.int32),
        page_table.astype(jnp.int32) if paged else jnp.zeros((1,), jnp.int32),
        kernel=_mla_decode_kernel,
        out_shape=(jax.ShapeDtypeStruct((B, N, splits, L), part_dtype), jax.ShapeDtypeStruct((B, N, splits), jnp.float32)),
        grid=(triton.cdiv(N, block_h), B, splits),
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        N=N, L=L, R=R, S=kv_latent.shape[1], M=page_table.shape[1] if paged else 0, PAGED=paged, SPLITS=splits,
        SCALE2=spec.scale * math.log2(math.e), BLOCK_H=block_h, BLOCK_N=config.block_n,
        LP=max(16, _pow2_at_least(L)), RP=max(16, _pow2_at_least(R)),
        DOT=2 if interpret_enabled() else int(q_latent.dtype == jnp.float32),
    )
    if splits == 1:
        return o[:, :, 0], lse[:, :, 0]
    return _merge(o, lse, q_latent.dtype)


@functools.cache
def _forward(spec: PagedSpec, config: MlaDecodeTritonConfig, paged: bool):
    """The launch behind forward_only; under vmap the vmapped axis folds into the requests (B),
    or, when a page pool itself is vmapped, the launches loop (lax.map)."""
    launch = split_mla_launch(functools.partial(_launch, spec=spec, config=config))  # sharded B / heads: per device
    rows = (0, 1, 4, 5) if paged else (0, 1, 2, 3, 4)
    return forward_only(fold_vmap_into_rows(launch, row_args=rows), "triton")


def mla_decode(q_latent, q_rope, kv_latent, k_rope, lengths, page_table, *, spec: PagedSpec, config: MlaDecodeTritonConfig):
    return _forward(spec, config, page_table is not None)(q_latent, q_rope, kv_latent, k_rope, lengths, page_table)


def supports(q_latent, q_rope, kv_latent, k_rope, lengths, page_table, *, spec: PagedSpec) -> str | None:
    del kv_latent, k_rope, lengths, page_table
    if jnp.dtype(q_latent.dtype) not in _DTYPES:
        return f"dtype {jnp.dtype(q_latent.dtype).name} is not one of float32/bfloat16/float16"
    if q_latent.shape[2] > _MAX_LATENT:
        return f"latent dim {q_latent.shape[2]} > {_MAX_LATENT}: the [block_h, L] f32 accumulator would not fit in registers"
    if q_rope.shape[2] > _MAX_ROPE:
        return f"rope dim {q_rope.shape[2]} > {_MAX_ROPE}"
    return spec_reason(spec)


MLA_DECODE = Implementation(fn=mla_decode, platforms={"gpu"}, interpretable=True, supports=supports,
                            config_type=MlaDecodeTritonConfig, heuristic_config=heuristic_config,
                            candidate_configs=candidate_configs)
