"""Flash attention as Pallas Mosaic GPU kernels (Hopper: TMA, wgmma, warp specialisation).

Contract: kernels/common/attention.py (q [B,T,N,H], k/v [B,S,K,H], lse [B,N,T] f32, GQA head
n -> kv head n // G with G = N // K, causal/window aligned so the last query sits at the last key:
query t is at key position t + off, off = S - T). Scope: bf16/f16, kernels at head dim 64, 96,
128, 192 and 256 (other head dims up to 256 zero-padded to the next; a narrower v at its own,
`kernel_head_dims`), causal / window / logit soft cap / segment ids; everything else is refused
by `supports` (the op then falls back to Triton or XLA). Lengths that are not multiples of 128
run as whole tiles over the arrays in place (TMA zero-fills past their end).

Modules: this one holds the config (`AttentionConfig`: which schedule and block sizes a call
runs; `heuristic_config` is the measured default, `candidate_configs` the variants worth
timing), `supports` and the custom_vjp entry; attention_forward.py the forward schedules;
attention_backward.py which backward kernels a call runs (and the dz^T tiles' head chunks),
attention_backward_kernels.py the dQ, dK/dV and dq-from-dz^T kernels; attention_tiles.py the
block ranges, masks, padding and kernel pieces they share; warpgroups.py the warpgroup machinery
(named barriers, rings, persistent schedules, wgmma forms, launch).

Interpret mode (FORGEAX_INTERPRET / interpret_mode()): the interpreter cannot run wgmma with a
register LHS nor `run_state` with `ACC.init`, so there the 16-bit probabilities are staged
through a per-WG SMEM buffer and every product is added to the register accumulator, the named
barriers (which it lacks) become mbarriers or, for the ping-pong (scheduling only), nothing; the
TMA/loop structure is the same as on the GPU.
"""

from __future__ import annotations

import dataclasses
import functools

import jax.numpy as jnp

from forgeax.core.config import KernelConfig
from forgeax.core.registry import Implementation
from forgeax.kernels.common.attention import AttentionKernels, AttentionSpec, differentiable_attention
from forgeax.kernels.pallas.gpu import gpu_refusal
from forgeax.kernels.pallas.gpu.attention_backward import backward
from forgeax.kernels.pallas.gpu.attention_forward import forward
from forgeax.kernels.pallas.gpu.attention_tiles import HEAD_DIMS, kernel_head_dims

_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
_HEAD_DIMS = HEAD_DIMS  # the kernels' head dims (ops/attention.py reads them)
# With segment ids a persistent grid deals the tiles round robin at equal weights, which aliases
# with the documents below about this many heads (the heuristic keeps one CTA per tile there).
_PERSISTENT_SEGMENTED_MIN_HEADS = 32


@dataclasses.dataclass(frozen=True, kw_only=True)
class AttentionConfig(KernelConfig):
    """Which schedules and block sizes one pallas_gpu attention call runs (every field is that
    call's decision; `heuristic_config` makes them per call). Structural limits stay with the
    kernels: the flat forward needs a persistent grid of several tiles per CTA and SMEM for two
    Q buffers; delta in the dQ kernel needs dq_block_kv >= 128, equal head dims, no left window
    and no segment ids; the dz^T tiles need head_dim <= 128, v no wider than q/k, and must fit
    dz_tiles_max_bytes.

    Forward:
      overlap: FA3's intra-warpgroup overlap (softmax of block j beside P_{j-1} V_{j-1}).
      persistent: one CTA per SM running balanced tiles, instead of one CTA per tile.
      flat_forward: the overlapped schedule as one pipeline over a CTA's tiles (needs overlap
        and persistent).
    Backward:
      dz_tiles: dq from the dz^T tiles the dK/dV kernel stores, instead of the dQ kernel.
      dz_tiles_max_bytes: the most memory those tiles may take for all heads (beyond: the dQ kernel).
      dz_chunk_bytes: the most memory the tiles of one chunk of query heads may take: the
        backward runs the dK/dV and dq-from-dz^T launches per chunk, the chunks reusing one
        buffer (dk/dv sums of a split GQA group carried in f32). The default takes every head at
        once, the faster backward on an H100; 320 << 20 takes Llama-3-8B's causal T8192 (N32 /
        KV8) in 8 chunks of 4 query heads, 260 MiB of tiles instead of 2.03 GiB, at about 10%
        of the backward's speed (docs/performance.md): the trade for memory-bound training.
      dz_chunk_min_tiles: the fewest dK/dV tiles (128 keys of one kv head) a chunk that splits
        the kv heads may keep: 256, two per SM of a Hopper, keeps the causal imbalance covered.
      dq_from_dz_block_kv: keys per step of the dq-from-dz^T kernel.
      persistent_dq_from_dz: its grid is persistent.
      delta_in_dq_kernel: delta = rowsum(dO * O) - dlse in the dQ kernel instead of XLA.
      dq_block_kv: keys per step of the dQ kernel.
      persistent_dq, persistent_dkv: the dQ / dK/dV kernels' grids are persistent.
      dkv_fa3_order: the dK/dV step order of FA3 (both score wgmmas, then both gradient ones).
      one_dkv_launch: dk and dv in one dK/dV launch (else one launch each).
      dk_query_block: query rows per step of the dk-only launch (head_dim > 128).
    """

    overlap: bool
    persistent: bool
    flat_forward: bool
    dz_tiles: bool
    dz_tiles_max_bytes: int = 4 << 30
    dz_chunk_bytes: int = 4 << 30
    dz_chunk_min_tiles: int = 256
    dq_from_dz_block_kv: int = 64
    persistent_dq_from_dz: bool = False
    delta_in_dq_kernel: bool = True
    dq_block_kv: int
    persistent_dq: bool
    persistent_dkv: bool
    dkv_fa3_order: bool
    one_dkv_launch: bool = True
    dk_query_block: int = 32

    def validate(self) -> None:
        super().validate()
        for name in ("dq_block_kv", "dq_from_dz_block_kv"):
            if getattr(self, name) not in (32, 64, 128):
                raise ValueError(f"AttentionConfig.{name}: expected 32, 64 or 128, got {getattr(self, name)}")
        if self.dk_query_block not in (32, 64):
            raise ValueError(f"AttentionConfig.dk_query_block: expected 32 or 64, got {self.dk_query_block}")
        for name in ("dz_tiles_max_bytes", "dz_chunk_bytes", "dz_chunk_min_tiles"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"AttentionConfig.{name}: expected a positive int, got {value!r}")
        if self.flat_forward and not (self.overlap and self.persistent):
            raise ValueError("AttentionConfig.flat_forward: needs overlap=True and persistent=True")


def _call_dims(q, k, v, q_segment_ids, spec: AttentionSpec):
    H, Hv = kernel_head_dims(q.shape[3], v.shape[3]) or (HEAD_DIMS[-1],) * 2
    return H, Hv, q.shape[2], k.shape[2], q_segment_ids is not None, spec.window_left is not None


def heuristic_config(q, k, v, bias=None, mask=None, q_segment_ids=None, kv_segment_ids=None, dropout_seed=None,
                     *, spec: AttentionSpec) -> AttentionConfig:
    """The measured default for a call (H, Hv: the kernels' head dims; measurements behind each
    choice in docs/performance.md):
      * overlap at H = 128 only (slower at 64 and 96; no registers at 192 and 256);
      * persistent forward at H = 64, 96, 128 and 192 beside a narrower v; with segment ids at
        H = 64 with at least 32 query heads; flat at H = 128 where persistent without segments;
      * dz^T tiles at H = 128 without a left window (slower with one); delta in the dQ kernel
        except under a left window; dQ key blocks of 128 (64 at H = 192, 32 at 256, whose SMEM
        holds no more); persistent dQ at H = 192 and 256 without segment ids;
      * persistent dK/dV without a left window (with segment ids: H = 64 and 128 with at least
        32 kv heads); FA3's dK/dV order at H = 64; one dK/dV launch at H <= 128 and for MLA's
        192 / 128, 64-query dk blocks at H = 192."""
    del bias, mask, kv_segment_ids, dropout_seed
    H, Hv, N, K, segmented, windowed = _call_dims(q, k, v, q_segment_ids, spec)
    overlap = H == 128
    if segmented:
        persistent = H == 64 and N >= _PERSISTENT_SEGMENTED_MIN_HEADS
        persistent_dkv = not windowed and H in (64, 128) and K >= _PERSISTENT_SEGMENTED_MIN_HEADS
    else:
        persistent = H in (64, 96, 128) or (Hv < H and H == 192)
        persistent_dkv = not windowed
    return AttentionConfig(
        overlap=overlap,
        persistent=persistent,
        flat_forward=overlap and persistent and not segmented,
        dz_tiles=H == 128 and not windowed,
        delta_in_dq_kernel=not windowed,
        dq_block_kv=128 if H <= 128 else 64 if H == 192 else 32,
        persistent_dq=H in (192, 256) and not segmented,
        persistent_dkv=persistent_dkv,
        dkv_fa3_order=H == 64,
        one_dkv_launch=H <= 128 or (Hv < H and H == 192),
        dk_query_block=64 if H == 192 else 32,
    )


def candidate_configs(*args, **kwargs) -> list[AttentionConfig]:
    """The heuristic config and its one-switch variants that build a different valid kernel for
    the call: the search space benchmarks/tune_attention.py times."""
    base = heuristic_config(*args, **kwargs)
    H = kernel_head_dims(args[0].shape[3], args[2].shape[3]) or (HEAD_DIMS[-1],)
    flips = [dict(persistent=not base.persistent, flat_forward=False), dict(persistent_dq=not base.persistent_dq),
             dict(persistent_dkv=not base.persistent_dkv)]
    if base.dz_tiles:
        flips.append(dict(persistent_dq_from_dz=not base.persistent_dq_from_dz))
        flips.append(dict(dz_chunk_bytes=320 << 20))  # the tiles of a few heads at a time (memory)
    if base.one_dkv_launch:
        flips.append(dict(dkv_fa3_order=not base.dkv_fa3_order))
    if H[0] <= 128:
        flips += [dict(overlap=not base.overlap, flat_forward=False), dict(dz_tiles=not base.dz_tiles),
                  dict(delta_in_dq_kernel=not base.delta_in_dq_kernel),
                  dict(dq_block_kv=64 if base.dq_block_kv == 128 else 128)]
        if base.overlap and base.persistent:
            flips.append(dict(flat_forward=not base.flat_forward))
    elif H[0] < HEAD_DIMS[-1]:  # at 256 one launch or 64-query dk blocks exceed the registers / SMEM
        flips += [dict(one_dkv_launch=not base.one_dkv_launch),
                  dict(dk_query_block=64 if base.dk_query_block == 32 else 32)]
    configs = [base]
    for change in flips:
        try:
            config = base.replace(**change)
        except ValueError:
            continue
        if config not in configs:
            configs.append(config)
    return configs


def _supports(q, k, v, bias, mask, q_segment_ids, kv_segment_ids, dropout_seed, *, spec) -> str | None:
    del dropout_seed
    _, T, _, H = q.shape
    S, Hv = k.shape[1], v.shape[3]
    if jnp.dtype(q.dtype) not in _DTYPES:
        return f"dtype {jnp.dtype(q.dtype).name} not supported: needs bf16 or f16"
    if bias is not None or mask is not None:
        return "bias/mask not supported"
    if spec.dropout_rate > 0:
        return "dropout not supported"
    if kernel_head_dims(H, Hv) is None:
        return f"head_dim {H} (v {Hv}) not supported: needs both at most {HEAD_DIMS[-1]}"
    if T == 0 or S == 0:
        return f"T={T}, S={S}: empty"
    return gpu_refusal(wgmma=True)


@functools.cache
def _kernels(config: AttentionConfig) -> AttentionKernels:
    return AttentionKernels(forward=functools.partial(forward, config=config),
                            backward=functools.partial(backward, config=config))


@functools.cache
def _differentiable(config: AttentionConfig):
    return differentiable_attention(_kernels(config))


def attention(q, k, v, bias, mask, q_segment_ids, kv_segment_ids, dropout_seed, *, spec: AttentionSpec,
              config: AttentionConfig | None = None):
    """The contract's `fn` (kernels/common/attention.py) with `config` (default: `heuristic_config`)."""
    if config is None:
        config = heuristic_config(q, k, v, bias, mask, q_segment_ids, kv_segment_ids, dropout_seed, spec=spec)
    return _differentiable(config)(q, k, v, bias, mask, q_segment_ids, kv_segment_ids, dropout_seed, spec=spec)


ATTENTION = Implementation(
    fn=attention,
    platforms=("gpu",),
    interpretable=True,
    supports=_supports,
    config_type=AttentionConfig,
    heuristic_config=heuristic_config,
    candidate_configs=candidate_configs,
    kernels=_kernels,
)
