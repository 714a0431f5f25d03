"""Attention as Triton kernels: a FlashAttention-2 forward and a fused, atomic-free backward.

The contract (math, masks, causal alignment, dropout hash) is the docstring of
kernels/common/attention.py. Arrays arrive normalised: q [B,T,N,H], k [B,S,K,H], v [B,S,K,Hv]
(contiguous, read in place: every stride is a constexpr derived from the static shape, so loads
vectorise and nothing is transposed in HBM); query head n reads kv head n // G, G = N // K.

Files: attention_forward.py (the online-softmax forward), attention_backward.py (delta, the
fused dK/dV + dQ launch, dq from stored dz^T tiles, dbias of a broadcast bias),
attention_tiles.py (tile math, masks and block-sparse bounds both share). This module holds
the `Implementation`: what it supports, its config and where the config comes from.

Head dims are padded to powers of two (>= 16) with masked loads; f32 inputs use tf32x3 dots
(`dot` in attention_tiles.py) so f32 results meet the f32 tolerance. Optional inputs are passed
as 1-element dummies with a constexpr flag.

Config (`TritonAttentionConfig`): for a call, the one passed (`ops.attention(...,
backend="triton", config=...)`), else a tuned entry of tuned/attention.json for the device kind
and `tuning_key` of the call, else `heuristic_config` (by element width and padded head dim).
"""

from __future__ import annotations

import dataclasses
import functools

import jax.numpy as jnp

from forgeax.core.config import KernelConfig, TunedConfigs
from forgeax.core.registry import Implementation
from forgeax.core.runtime import interpret_enabled
from forgeax.kernels.common.attention import AttentionKernels, AttentionSpec, differentiable_attention
from forgeax.kernels.triton.attention_backward import DZ_TILES_MAX_BYTES, backward
from forgeax.kernels.triton.attention_forward import forward
from forgeax.kernels.triton.attention_tiles import padded_dim

__all__ = ["ATTENTION", "TritonAttentionConfig", "attention", "candidate_configs", "heuristic_config", "tuning_key"]

_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)
MAX_HEAD_DIM = 256
_WARPS = (1, 2, 4, 8, 16, 32)
_BLOCKS = ("block_m", "block_n", "block_m1", "block_n1", "block_m2", "block_n2")


def _is_pow2(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x > 0 and x & (x - 1) == 0


@dataclasses.dataclass(frozen=True, kw_only=True)
class TritonAttentionConfig(KernelConfig):
    """Tiles, launch shape and schedule of one Triton attention call.

    Forward: programs of `block_m` queries loop over blocks of `block_n` keys (`fwd_warps`,
    `fwd_stages`). Backward: dK/dV programs of `block_n1` keys loop over blocks of `block_m1`
    queries; dQ programs of `block_m2` queries loop over blocks of `block_n2` keys (`bwd_warps`
    and `bwd_stages` for both halves, `_dq_kernel` and `_dbias_kernel`); the delta kernel takes
    `delta_block_m` rows per program. `dq_from_dz_tiles`: the dK/dV programs store their dz^T
    tiles and `_dq_kernel` computes dq from them, one matmul per tile (taken only without a bias
    and while the tiles fit `attention_backward.DZ_TILES_MAX_BYTES`; else the dQ programs
    recompute dz). Block sizes are powers of two >= 16 (tl.dot's minimum).
    `dz_chunk_bytes`: the most memory the dz^T tiles of one chunk of query heads may take (the
    two launches run per chunk, the chunks reusing one buffer; 512 MiB: Llama-3-8B's causal
    T8192 N32 / KV8 in 8 chunks of 4 heads instead of 4 GiB at once); `dz_chunk_min_programs`:
    the fewest dK/dV programs a chunk that splits the kv heads may keep (256: two per SM of a
    Hopper, covering the causal imbalance). No chunk fits: the dQ programs recompute dz.
    """

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
    delta_block_m: int
    dq_from_dz_tiles: bool
    dz_chunk_bytes: int = 512 << 20
    dz_chunk_min_programs: int = 256

    def validate(self) -> None:
        super().validate()
        name = type(self).__name__
        for field in _BLOCKS:
            value = getattr(self, field)
            if not _is_pow2(value) or value < 16:
                raise ValueError(f"{name}.{field}: expected a power of two >= 16, got {value!r}")
        if not _is_pow2(self.delta_block_m):
            raise ValueError(f"{name}.delta_block_m: expected a power of two, got {self.delta_block_m!r}")
        for field in ("fwd_warps", "bwd_warps"):
            if getattr(self, field) not in _WARPS or isinstance(getattr(self, field), bool):
                raise ValueError(f"{name}.{field}: expected one of {_WARPS}, got {getattr(self, field)!r}")
        for field in ("fwd_stages", "bwd_stages"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}.{field}: expected an int >= 1, got {value!r}")
        for field in ("dz_chunk_bytes", "dz_chunk_min_programs"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}.{field}: expected a positive int, got {value!r}")
        if not isinstance(self.dq_from_dz_tiles, bool):
            raise ValueError(f"{name}.dq_from_dz_tiles: expected a bool, got {self.dq_from_dz_tiles!r}")


# The heuristic's tiles per (element width in bytes, padded head dim up to 128 or 256).
# 16-bit up to 128: forward key blocks of 64 measured faster than 128 on an H200
# (benchmarks/results/attention_H200_2026-11-24_triton_forward_block.json; an H100 prefers 128:
# tuned/attention.json). 16-bit 256: measured against the ptxas-sized tiles before them
# (benchmarks/results/attention_H200_2026-11-26_triton_h256_tiles.json). f32 (tf32x3 dots):
# sized with ptxas -v (sm_90a) for few spills, not timed; at 256 every config tried spilled
# kilobytes, so `_supports` refuses f32 above 128 on GPU (the interpreter runs it).
_HEURISTIC_TILES = {
    (2, 128): dict(block_m=128, block_n=64, fwd_warps=8, fwd_stages=3,
                   block_m1=64, block_n1=128, block_m2=128, block_n2=64, bwd_warps=8, bwd_stages=3),
    (2, 256): dict(block_m=128, block_n=64, fwd_warps=8, fwd_stages=2,
                   block_m1=64, block_n1=64, block_m2=128, block_n2=32, bwd_warps=8, bwd_stages=2),
    (4, 128): dict(block_m=64, block_n=32, fwd_warps=4, fwd_stages=2,
                   block_m1=32, block_n1=32, block_m2=32, block_n2=32, bwd_warps=8, bwd_stages=2),
    (4, 256): dict(block_m=32, block_n=32, fwd_warps=4, fwd_stages=2,
                   block_m1=16, block_n1=32, block_m2=32, block_n2=16, bwd_warps=8, bwd_stages=2),
}
# The interpreter pays per block operation; small, unequal tiles still exercise the block bounds.
_INTERPRET_TILES = dict(block_m=32, block_n=16, fwd_warps=4, fwd_stages=1,
                        block_m1=16, block_n1=32, block_m2=32, block_n2=16, bwd_warps=4, bwd_stages=1)


def _padded_head_dim(q, v) -> int:
    return max(padded_dim(q.shape[3]), padded_dim(v.shape[3]))


def heuristic_config(q, k, v, bias, mask, q_segment_ids, kv_segment_ids, dropout_seed, *,
                     spec: AttentionSpec) -> TritonAttentionConfig:
    """The default config of a call: tiles by element width and padded head dim; dq from stored
    dz^T tiles at padded head dim 128, where that measured faster on an H100 and an H200
    (benchmarks/results/attention_H100_2026-11-26_triton_dq_from_dz_tiles.json,
    attention_H200_2026-11-26_triton_dq_from_dz_tiles_causal.json) and not at 64
    (attention_H100_2026-11-26_triton_dz_tiles_h64.json)."""
    del k, bias, mask, q_segment_ids, kv_segment_ids, dropout_seed, spec
    padded = _padded_head_dim(q, v)
    dq_from_dz_tiles = padded == 128
    if interpret_enabled():
        return TritonAttentionConfig(**_INTERPRET_TILES, delta_block_m=32, dq_from_dz_tiles=dq_from_dz_tiles)
    width = 4 if jnp.dtype(q.dtype).itemsize == 4 else 2
    tiles = _HEURISTIC_TILES[width, 128 if padded <= 128 else 256]
    return TritonAttentionConfig(**tiles, delta_block_m=64, dq_from_dz_tiles=dq_from_dz_tiles)


def tuning_key(q, k, v, bias, mask, q_segment_ids, kv_segment_ids, dropout_seed, *, spec: AttentionSpec) -> str:
    """The key of a call in tuned/attention.json: element width, padded head dim (at least 64) and
    whether the forward streams bias or mask tiles (its pipeline buffers them too: a tuned key
    block may not fit shared memory then), e.g. '16bit-h128' or 'f32-h64-scores'. 'interpret'
    in interpret mode, which no entry names (the interpreter keeps its small tiles)."""
    del k, q_segment_ids, kv_segment_ids, dropout_seed, spec
    if interpret_enabled():
        return "interpret"
    width = "f32" if jnp.dtype(q.dtype).itemsize == 4 else "16bit"
    scores = "-scores" if bias is not None or mask is not None else ""
    return f"{width}-h{max(_padded_head_dim(q, v), 64)}{scores}"


# Alternatives each half of a 16-bit call up to head dim 128 was timed with on an H100
# (benchmarks/results/attention_H100_2026-11-25_triton_configs.json, attention_H100_2026-11-25_triton_backward_configs.json,
# attention_H100_2026-11-26_triton_forward_configs.json,
# attention_H100_2026-11-26_triton_backward_configs_dz_tiles.json).
_FORWARD_TILES_16BIT = ((128, 128, 8, 3), (128, 128, 8, 2), (128, 64, 8, 4), (128, 64, 8, 3), (64, 128, 4, 3),
                        (128, 32, 8, 4))
_BACKWARD_TILES_16BIT = ((64, 128, 128, 64, 8, 3), (64, 128, 128, 64, 8, 4), (64, 128, 128, 64, 8, 2),
                         (64, 128, 64, 64, 8, 3), (64, 128, 128, 32, 8, 3), (32, 128, 128, 64, 8, 3),
                         (64, 128, 128, 64, 4, 3), (64, 128, 128, 128, 8, 3), (64, 64, 128, 64, 4, 3))


def _neighbours(blocks: tuple[int, ...]) -> list[tuple[int, ...]]:
    """Each block size halved and doubled in turn (within [16, 256])."""
    out = []
    for i, b in enumerate(blocks):
        for nb in (b // 2, b * 2):
            if 16 <= nb <= 256:
                out.append(blocks[:i] + (nb,) + blocks[i + 1:])
    return out


def candidate_configs(q, k, v, bias, mask, q_segment_ids, kv_segment_ids, dropout_seed, *,
                      spec: AttentionSpec) -> tuple[TritonAttentionConfig, ...]:
    """The search space of a call, the heuristic's config first. Each half varies while the other
    keeps the heuristic's tiles (they tune independently: the forward's fields do not reach the
    backward kernels). 16-bit up to head dim 128: the tiles timed on an H100; otherwise each
    block size halved and doubled, and the warps and stages around the heuristic's. Both
    settings of `dq_from_dz_tiles`. A call that streams bias or mask tiles keeps forward key
    blocks <= 64 (shared memory)."""
    base = heuristic_config(q, k, v, bias, mask, q_segment_ids, kv_segment_ids, dropout_seed, spec=spec)
    fwd = (base.block_m, base.block_n, base.fwd_warps, base.fwd_stages)
    bwd = (base.block_m1, base.block_n1, base.block_m2, base.block_n2, base.bwd_warps, base.bwd_stages)
    if not interpret_enabled() and jnp.dtype(q.dtype).itemsize == 2 and _padded_head_dim(q, v) <= 128:
        forwards, backwards = list(_FORWARD_TILES_16BIT), list(_BACKWARD_TILES_16BIT)
    else:
        forwards = [(m, n, fwd[2], fwd[3]) for m, n in _neighbours(fwd[:2])]
        forwards += [(fwd[0], fwd[1], w, s) for w in (4, 8) for s in (2, 3, 4) if (w, s) != fwd[2:]]
        backwards = [(*blocks, bwd[4], bwd[5]) for blocks in _neighbours(bwd[:4])]
        backwards += [(*bwd[:4], w, s) for w in (4, 8) for s in (2, 3) if (w, s) != bwd[4:]]
    if bias is not None or mask is not None:
        forwards = [f for f in forwards if f[1] <= 64]
    configs = [base]
    configs += [base.replace(block_m=m, block_n=n, fwd_warps=w, fwd_stages=s) for m, n, w, s in forwards]
    configs += [base.replace(block_m1=m1, block_n1=n1, block_m2=m2, block_n2=n2, bwd_warps=w, bwd_stages=s)
                for m1, n1, m2, n2, w, s in backwards]
    configs += [base.replace(dq_from_dz_tiles=not base.dq_from_dz_tiles)]
    if base.dq_from_dz_tiles:  # every head's dz^T tiles at once (the most memory, the fewest launches)
        configs += [base.replace(dz_chunk_bytes=DZ_TILES_MAX_BYTES)]
    return tuple(dict.fromkeys(configs))


@functools.cache
def _kernels(config: TritonAttentionConfig) -> AttentionKernels:
    # Sequence-sharded: LEFT / RIGHT = -1 mean "no bound" here, so shifted negative window
    # bounds of the ring's blocks go in as boolean mask blocks.
    return AttentionKernels(forward=functools.partial(forward, config=config),
                            backward=functools.partial(backward, config=config), ring="mask")


@functools.cache
def _differentiable(config: TritonAttentionConfig):
    return differentiable_attention(_kernels(config))


def attention(q, k, v, bias, mask, q_segment_ids, kv_segment_ids, dropout_seed, *, spec: AttentionSpec,
              config: TritonAttentionConfig | None = None):
    """The backend's `fn` (signature: kernels/common/attention.py); `config` None: the heuristic's."""
    args = (q, k, v, bias, mask, q_segment_ids, kv_segment_ids, dropout_seed)
    if config is None:
        config = heuristic_config(*args, spec=spec)
    return _differentiable(config)(*args, spec=spec)


def _supports(q, k, v, bias, mask, q_segment_ids, kv_segment_ids, dropout_seed, *, spec: AttentionSpec):
    del q_segment_ids, kv_segment_ids, dropout_seed, spec
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
    fn=attention,
    platforms=("gpu",),
    interpretable=True,
    supports=_supports,
    config_type=TritonAttentionConfig,
    heuristic_config=heuristic_config,
    candidate_configs=candidate_configs,
    tuned=TunedConfigs("forgeax.kernels.triton", "tuned/attention.json"),
    tuning_key=tuning_key,
    kernels=_kernels,
)
