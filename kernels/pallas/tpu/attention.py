"""Flash attention as Mosaic TPU Pallas kernels (forward and backward).

NOT RUN ON A TPU: no TPU was available while writing this. Numerics are proven in Pallas' TPU
interpreter (`pltpu.InterpretParams()`, FORGEAX_INTERPRET=1) against the XLA reference, and the
Mosaic lowering by cross-lowering on CPU. Block sizes are reasoned about (VMEM budget), not
measured. The contract (math, mask order, T != S alignment, fully masked rows, dropout hash) is
the module docstring of kernels/common/attention.py; the kernels are in attention_kernels.py.

Layout: Mosaic blocks need their last two dims to be multiples of (8, 128) or the full array
dims, so a [B, T, N, H] block of one head ((1, H) last dims) is illegal. The wrapper therefore
transposes to heads-major [B, N, T, H] / [B, K, S, H] (one XLA copy, fused with the padding
below) and the BlockSpecs take (block_q, H) / (block_k, H) tiles of one head. T is padded to a
multiple of block_q and S to a multiple of block_k (block_k a multiple of 128), so no block
reads past an array: padded keys are masked with an iota (s < S), padded queries are garbage
rows sliced off (in the backward their lse is +inf, so p = 0 and they add nothing to dk, dv,
dbias). Per-row vectors (lse, D, q segment ids) are [.., Tp, 1] columns, kv segment ids a
[B, 1, Sp] row, so the kernel never relayouts a vector. GQA: the k/v index_map reads kv head
n // G. bias/mask tiles come from [Bb|1, Nb|1, Tp, Sp] by index_map (0 on a broadcast axis);
mask travels as int8 (rows are 32-aligned for it). f16 inputs (and an f16 bias) are computed
as f32 (no f16 MXU path on TPU); bf16 feeds the MXU in bf16 with f32 accumulation (p and dz are
rounded to bf16 for their matmuls); f32 uses HIGHEST.

Head dims that are not multiples of 64 run zero-padded to the next (`_heads_major`: H 96 as
128, MLA's 192 stays, v 128 stays). Refused (`supports` says why): head dims past 256, dtypes
other than f32/bf16/f16, empty T or S. Block sizes: `PallasTpuAttentionConfig`.
"""

from __future__ import annotations

import dataclasses
import functools

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from forgeax.core.config import KernelConfig
from forgeax.core.registry import Implementation
from forgeax.core.runtime import interpret_enabled
from forgeax.kernels.common.attention import AttentionKernels, AttentionSpec, differentiable_attention, segment_ranges
from forgeax.kernels.pallas.tpu.attention_kernels import (
    Layout, bias_dtype, dbias_call, dkv_call, dq_call, fwd_call, round_up, total_bytes,
)

__all__ = ["ATTENTION", "PallasTpuAttentionConfig", "attention", "candidate_configs", "heuristic_config"]

_F32 = jnp.float32
_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


@dataclasses.dataclass(frozen=True, kw_only=True)
class PallasTpuAttentionConfig(KernelConfig):
    """Largest query / key block of the forward (`block_q`, `block_k`) and of the backward kernels
    (`bwd_block_q`, `bwd_block_k`). A call takes as many blocks as these caps need, each as small
    as covers its sequence (T = 600 under a cap of 512 runs 2 blocks of 304), query blocks rounded
    up to the dtypes' row alignment (16 rows of bf16, 32 with a mask). Query blocks are multiples
    of 8 (sublanes), key blocks of 128 (lanes)."""

    block_q: int
    block_k: int
    bwd_block_q: int
    bwd_block_k: int

    def validate(self) -> None:
        super().validate()
        for field, multiple in (("block_q", 8), ("block_k", 128), ("bwd_block_q", 8), ("bwd_block_k", 128)):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0 or value % multiple:
                raise ValueError(f"{type(self).__name__}.{field}: expected a positive multiple of {multiple}, got {value!r}")


def heuristic_config(q, k, v, bias, mask, q_segment_ids, kv_segment_ids, dropout_seed, *,
                     spec: AttentionSpec) -> PallasTpuAttentionConfig:
    """Compiled: a 512 x 512 f32 score tile is 1 MiB; the forward holds q, k, v tiles
    (double-buffered, <= 256 KiB each at H = 256 bf16) and ~4 score-sized temporaries. The backward
    holds more temporaries (p, dp, dz and casts), so it takes 256-row query blocks. Interpreted:
    small blocks (the interpreter pays per grid step) that still make the test suite's T, S <= 200
    cross block boundaries (several query blocks, two key blocks at S = 200)."""
    del q, k, v, bias, mask, q_segment_ids, kv_segment_ids, dropout_seed, spec
    if interpret_enabled():
        return PallasTpuAttentionConfig(block_q=64, block_k=128, bwd_block_q=64, bwd_block_k=128)
    return PallasTpuAttentionConfig(block_q=512, block_k=512, bwd_block_q=256, bwd_block_k=512)


def candidate_configs(q, k, v, bias, mask, q_segment_ids, kv_segment_ids, dropout_seed, *,
                      spec: AttentionSpec) -> tuple[PallasTpuAttentionConfig, ...]:
    """The search space, the heuristic's config first: forward and backward blocks from 128 to
    1024 queries and 128 to 1024 keys, each half varied with the other at the heuristic's, score
    tiles of at most 512 x 1024 (forward) and 256 x 1024 (backward) f32 (VMEM)."""
    base = heuristic_config(q, k, v, bias, mask, q_segment_ids, kv_segment_ids, dropout_seed, spec=spec)
    if interpret_enabled():
        sizes = [(bq, bk) for bq in (32, 64, 128) for bk in (128, 256)]
        fwd_limit = bwd_limit = 128 * 256
    else:
        sizes = [(bq, bk) for bq in (128, 256, 512, 1024) for bk in (128, 256, 512, 1024)]
        fwd_limit, bwd_limit = 512 * 1024, 256 * 1024
    configs = [base]
    configs += [base.replace(block_q=bq, block_k=bk) for bq, bk in sizes if bq * bk <= fwd_limit]
    configs += [base.replace(bwd_block_q=bq, bwd_block_k=bk) for bq, bk in sizes if bq * bk <= bwd_limit]
    return tuple(dict.fromkeys(configs))


def _layout(q, k, v, bias, mask, qseg, config: PallasTpuAttentionConfig, *, backward: bool) -> Layout:
    B, T, N, H = q.shape
    S, K, Hv = k.shape[1], k.shape[2], v.shape[3]
    H, Hv = round_up(H, 64), round_up(Hv, 64)  # the kernels' head dims (`_heads_major` pads)
    dtype = jnp.dtype(_F32 if q.dtype == jnp.float16 else q.dtype)
    bq, bk = (config.bwd_block_q, config.bwd_block_k) if backward else (config.block_q, config.block_k)
    # Rows: 8 sublanes of 32 bits -> 16 rows of bf16, 32 of int8 (the mask tile).
    row_dtypes = [dtype] + ([] if bias is None else [bias_dtype(bias)])
    align = 32 if mask is not None else max(32 // jnp.dtype(d).itemsize for d in row_dtypes)
    # As many blocks as the cap needs, each as small as covers the sequence: padding stays
    # under one alignment unit per block (T = 600 runs 2 blocks of 304, not 2 of 512).
    bq = round_up(pl.cdiv(T, pl.cdiv(T, bq)), align)
    bk = round_up(pl.cdiv(S, pl.cdiv(S, bk)), 128)
    return Layout(
        B, T, S, N, K, H, Hv, bq, bk, dtype,
        None if bias is None else tuple(bias.shape[:2]),
        None if mask is None else tuple(mask.shape[:2]),
        qseg is not None,
    )


# ----------------------------------------------------------------------------- host side


def _pad_axis(a, axis, size, value=0):
    if a.shape[axis] == size:
        return a
    pad = [(0, 0)] * a.ndim
    pad[axis] = (0, size - a.shape[axis])
    return jnp.pad(a, pad, constant_values=value)


def _heads_major(a, length, dtype, width):
    """[B, T, N, H] -> [B, N, length, width] in `dtype` (one fused transpose + pad). Head dims
    that are not multiples of 64 get zero columns: they add nothing to q k^T (the scale is the
    caller's, from the real head dim), and v's give output columns that are sliced off."""
    return _pad_axis(_pad_axis(jnp.swapaxes(a, 1, 2).astype(dtype), 2, length), 3, width)


def _token_major(a, length, width):
    """[B, N, padded length, padded width] -> [B, length, N, width]: a result's real part."""
    return jnp.swapaxes(a[:, :, :length, :width], 1, 2)


def _rows(a, L: Layout, value=0.0):
    """[B, N, T] per-row vector -> [B, N, Tp, 1] column."""
    return _pad_axis(a, 2, L.Tp, value)[..., None]


def _segment_reach(row_ids, col_ids, row_block: int, col_block: int):
    """[B * row blocks * 4] int32: per block of `row_block` rows, the first and last block of
    `col_block` columns its segment ids may reach (`segment_ranges` [lo, hi); first > last: none),
    then the first and last block whose columns all share the one id of every row (the block's
    ids uniform: blocks inside [lo, hi); else none). Flat, as SMEM pads 2-D arrays' minor dim."""
    lo, hi, uniform = jnp.moveaxis(segment_ranges(row_ids, col_ids, row_block), -1, 0)
    uniform = uniform != 0
    full_lo = jnp.where(uniform, -(-lo // col_block), 1)
    full_hi = jnp.where(uniform, hi // col_block - 1, 0)
    return jnp.stack([lo // col_block, (hi - 1) // col_block, full_lo, full_hi], axis=-1).reshape(-1)


def _optional_inputs(L: Layout, spec: AttentionSpec, bias, mask, qseg, kvseg, seed):
    extra = []
    if bias is not None:
        extra.append(_pad_axis(_pad_axis(bias.astype(bias_dtype(bias)), 2, L.Tp), 3, L.Sp))
    if mask is not None:
        extra.append(_pad_axis(_pad_axis(mask.astype(jnp.int8), 2, L.Tp), 3, L.Sp))
    if L.segments:
        extra.append(_pad_axis(qseg.astype(jnp.int32), 1, L.Tp)[:, :, None])
        extra.append(_pad_axis(kvseg.astype(jnp.int32), 1, L.Sp)[:, None, :])
    if spec.dropout_rate > 0:
        extra.append(lax.bitcast_convert_type(jnp.asarray(seed, jnp.uint32), jnp.int32).reshape(1))
    return extra


def _forward(q, k, v, bias, mask, q_segment_ids, kv_segment_ids, dropout_seed, spec: AttentionSpec, *,
             config: PallasTpuAttentionConfig):
    L = _layout(q, k, v, bias, mask, q_segment_ids, config, backward=False)
    args = [_heads_major(q, L.Tp, L.dtype, L.H), _heads_major(k, L.Sp, L.dtype, L.H),
            _heads_major(v, L.Sp, L.dtype, L.Hv)]
    args += _optional_inputs(L, spec, bias, mask, q_segment_ids, kv_segment_ids, dropout_seed)
    if L.segments:
        args.insert(0, _segment_reach(q_segment_ids, kv_segment_ids, L.bq, L.bk))
    out_dtype = jnp.dtype(L.dtype if q.dtype == jnp.float16 else q.dtype)
    call = fwd_call(L, spec, out_dtype, interpret_enabled(), total_bytes(*args) + L.B * L.N * L.T * L.Hv * out_dtype.itemsize)
    out, lse = call(*args)
    out = _token_major(out, L.T, v.shape[3]).astype(q.dtype)
    return out, lse[:, :, :L.T, 0]


def _backward(q, k, v, bias, mask, q_segment_ids, kv_segment_ids, dropout_seed, out, lse, dout, dlse,
              spec: AttentionSpec, *, config: PallasTpuAttentionConfig):
    L = _layout(q, k, v, bias, mask, q_segment_ids, config, backward=True)
    delta = jnp.einsum("btnh,btnh->bnt", dout.astype(_F32), out.astype(_F32)) - dlse.astype(_F32)
    lse_safe = jnp.where(jnp.isfinite(lse), lse, jnp.inf)  # empty rows: p = exp(z - inf) = 0
    args = [
        _heads_major(q, L.Tp, L.dtype, L.H), _heads_major(k, L.Sp, L.dtype, L.H),
        _heads_major(v, L.Sp, L.dtype, L.Hv), _heads_major(dout, L.Tp, L.dtype, L.Hv),
        _rows(lse_safe, L, jnp.inf), _rows(delta, L),
    ]
    args += _optional_inputs(L, spec, bias, mask, q_segment_ids, kv_segment_ids, dropout_seed)
    interpret = interpret_enabled()
    nbytes = total_bytes(*args)
    dkv_args, dq_args = args, args
    if L.segments:  # the dkv grid streams query blocks per key block, the dq grid the reverse
        dkv_args = [_segment_reach(kv_segment_ids, q_segment_ids, L.bk, L.bq), *args]
        dq_args = [_segment_reach(q_segment_ids, kv_segment_ids, L.bq, L.bk), *args]
    dk, dv, *dz = dkv_call(L, spec, interpret, nbytes)(*dkv_args)
    dq = dq_call(L, spec, interpret, nbytes)(*dq_args)
    dbias = None
    if bias is not None:
        dz = dz[0] if L.dz_from_dkv else dbias_call(L, spec, interpret, nbytes)(*dq_args)
        dbias = dz[:, :, :L.T, :L.S].astype(bias.dtype)
    H, Hv = q.shape[3], v.shape[3]
    return (_token_major(dq, L.T, H).astype(q.dtype), _token_major(dk, L.S, H).astype(k.dtype),
            _token_major(dv, L.S, Hv).astype(v.dtype), dbias)


def _supports(q, k, v, bias, mask, q_segment_ids, kv_segment_ids, dropout_seed, *, spec: AttentionSpec):
    del bias, mask, q_segment_ids, kv_segment_ids, dropout_seed, spec
    if jnp.dtype(q.dtype) not in _DTYPES:
        return f"dtype {jnp.dtype(q.dtype).name} is not one of float32/bfloat16/float16"
    for name, h in (("head_dim", q.shape[3]), ("value head_dim", v.shape[3])):
        if h > 256:
            return f"{name} {h} not supported: needs at most 256"
    if q.shape[1] == 0 or k.shape[1] == 0:
        return "empty query or key sequence"
    return None


@functools.cache
def _differentiable(config: PallasTpuAttentionConfig):
    kernels = AttentionKernels(ring=None,  # sequence-sharded calls gathered: the ring is not checked on TPUs
                               forward=functools.partial(_forward, config=config),
                               backward=functools.partial(_backward, config=config))
    return differentiable_attention(kernels)


def attention(q, k, v, bias, mask, q_segment_ids, kv_segment_ids, dropout_seed, *, spec: AttentionSpec,
              config: PallasTpuAttentionConfig | None = None):
    """The backend's `fn` (signature: kernels/common/attention.py); `config` None: the heuristic's."""
    args = (q, k, v, bias, mask, q_segment_ids, kv_segment_ids, dropout_seed)
    if config is None:
        config = heuristic_config(*args, spec=spec)
    return _differentiable(config)(*args, spec=spec)


ATTENTION = Implementation(
    fn=attention,
    platforms=("tpu",),
    interpretable=True,
    supports=_supports,
    config_type=PallasTpuAttentionConfig,
    heuristic_config=heuristic_config,
    candidate_configs=candidate_configs,
)
