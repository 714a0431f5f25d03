"""Scaled dot-product attention with masks, windows, soft cap, segments, bias and dropout: `attention`."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Integer

from forgeax.kernels.common.attention import AttentionSpec, dropout_seed_from_key
from forgeax.ops import checks
from forgeax.core import define_op, xla_gpu_deterministic_ops

# Priority on each platform, best first (xla is always the fallback); `_training_order` goes first
# for the calls it names, and for calls that are not differentiated `_inference_order` before that. The xla entry on CPU/GPU/TPU is the materialised
# reference; "xla_chunked" is the linear-memory XLA version.
# GPU: cuDNN (through XLA) first for the calls it computes exactly (see its supports(): no bias,
# mask, segments, dropout, soft cap, lse, or deterministic backward): on an H200 its fwd+bwd was
# faster than pallas_gpu's on every shape of benchmarks/results/attention_H200_overlapped_forward.json
# (causal B4 T4096 N32 H128: 4.07 vs 4.41 ms; non-causal 7.20 vs 8.00; GQA 3.79 vs 4.31; H64 2.60
# vs 2.84; H256 2.46 vs 5.50, and 2.48 vs 3.04 since pallas_gpu's own head_dim-256 backward,
# results/attention_H200_2026-11-26_h256_backward.json), though pallas_gpu's forward alone is
# faster at head_dim 128 causal (0.985 vs 1.052 ms). Mosaic GPU next (it beat Triton on every
# shape), then Triton, which covers every feature.
_PRIORITY = {"gpu": ("cudnn", "pallas_gpu", "triton"), "tpu": ("pallas_tpu",), "cpu": ()}
# pallas_gpu's kernel head dims (`_HEAD_DIMS` in kernels/pallas/gpu/attention.py, which //ops cannot
# import: the kernels depend on it; test_pallas_gpu_head_dims_match keeps the two equal).
_PALLAS_GPU_HEAD_DIMS = (64, 96, 128, 192, 256)
# Causal GQA at head_dim 128 tries pallas_gpu first while a [B, N, T, S] array of 16-bit scores
# would fit this (`_pallas_gpu_gqa_first`): the lengths where it was measured faster than cuDNN.
_PALLAS_GPU_GQA_MAX_SCORES_BYTES = 4 << 30
# pallas_gpu's q/k head dims whose forward runs one pipeline across each CTA's tiles
# (`_FLAT_FORWARD_HEAD_DIMS` in kernels/pallas/gpu/attention.py; test_pallas_gpu_head_dims_match
# keeps the two equal): its forward kernel is faster than cuDNN's there (`_inference_order`).
_PALLAS_GPU_FLAT_FORWARD_HEAD_DIMS = (128,)


def _inference_order(platform: str, args, kwargs) -> tuple[str, ...]:
    """Forward-only calls (not differentiated) that try pallas_gpu before cuDNN: causal/window with
    GQA, or a window, where its forward kernel was measured at least as fast as cuDNN's and the
    call faster (H200, benchmarks/results/attention_H200_kernel_times.json, kernel / wall ms
    against cuDNN's: GQA T8192 0.823 / 0.868 against 0.883 / 0.971; window 4096 T16384 1.562 /
    1.625 against 1.598 / 1.693), and side by side in tools/bench.py's rounds (GQA 1.15-1.16x,
    window 1.15-1.18x: results/attention_H200_2026-11-25_segments.json,
    results/attention_H200_2026-11-25_in_place_table.json). Head_dim 256 stays on cuDNN: its kernel
    times were even (0.447 against 0.450 ms) and the same bench rounds had pallas_gpu at 0.99x and
    0.96x, the default (then pallas_gpu) at 0.90x. Plain causal at head_dim <= 128 without GQA
    stays on cuDNN: the evidence is mixed and inside the noise between two timings of one
    computation (4-5%). cuDNN's kernel is 1-2% faster by CUPTI (0.924-
    0.934 against the persistent pallas_gpu forward's 0.942 ms, H200,
    results/attention_persistent_forward_in_order.json), while whole calls favour pallas_gpu
    (1.08-1.13x in alternating-order rounds, results/attention_H200_2026-11-25_abba.json; 1.05x per
    call in one program of 8, results/attention_in_program.json). Attention without a position
    mask stays on cuDNN too (1.593 against 1.720 ms). A differentiated call keeps the training
    priority above for its forward and backward (interface._split).

    Since pallas_gpu's forward runs one pipeline across each CTA's tiles at head_dim 128
    (`_PALLAS_GPU_FLAT_FORWARD_HEAD_DIMS`), plain causal there goes to pallas_gpu too: its kernel
    took 0.920 and 0.926 ms against cuDNN's 0.955 and 0.953 in two H100 runs (CUPTI, causal B4
    T4096 N32), the call 1.06-1.12x cuDNN's in three sets of rounds
    (results/attention_H100_2026-11-26_flat_forward_{causal,bench}.json,
    attention_H100_2026-11-26_flat_forward_repeat_causal.json), and even inside a program of 8
    forwards (1.032 against 1.028 ms per call, attention_H100_2026-11-26_flat_forward_program_fwd.json)."""
    q, k, v = args[0], args[1], args[2]
    spec = kwargs["spec"]
    if platform == "gpu" and _pallas_gpu_pads_head_dims(args):
        return ("cudnn", "triton")
    if platform != "gpu" or not spec.has_position_mask or not _aligned(args):
        return ()
    flat = q.shape[3] in _PALLAS_GPU_FLAT_FORWARD_HEAD_DIMS and v.shape[3] == q.shape[3]
    if q.shape[2] > k.shape[2] or spec.window_left is not None or flat:
        return ("pallas_gpu",)
    return ()


def _training_order(platform: str, args, kwargs) -> tuple[str, ...]:
    """Calls that try pallas_gpu before cuDNN, for the forward and the backward: causal attention
    without a window at head_dim 64, 96 or 192 (v's equal). At 96, B4 T4096 N32 on an H200,
    fwd 0.816 against cuDNN's 0.996 ms and fwd+bwd 3.271 against 3.975 (1.22x) in tools/bench.py's
    rounds, fwd 0.840 against 1.055 and fwd+bwd 3.411 against 4.021 in tune_attention.py's
    (results/attention_H200_2026-11-26_head_dim_96.json). At 192, B4 T4096 N16 on an H200, fwd+bwd
    3.807 against cuDNN's 4.364 ms (1.15x; fwd 0.718 against 0.759) in tools/bench.py's rounds
    and 3.942 against 4.389 in benchmarks/tune_attention.py's on another H200
    (results/attention_H200_2026-11-26_head_dim_192.json); on a third, fwd+bwd 4.057 against
    4.346 (1.07x) with the forward at 0.97x (0.790 against 0.763,
    results/attention_H200_2026-11-26_new_head_dims_persistence.json): even at worst. Since its
    backward streams 64-wide blocks at 192, fwd+bwd 3.326 against 4.475 (1.35x; fwd 0.735 against
    0.728) in tools/bench.py's rounds (results/attention_H200_2026-11-26_h192_blocks_bench.json). At 64 its
    fwd+bwd measured (causal B4 T4096 N32, against cuDNN's): 1.09x in tools/bench.py's alternating
    rounds on an H100 (2.459 against 2.689 ms, results/attention_H100_2026-11-25_persistent_bwd.json) and 1.06x on an H200 (2.502 against
    2.648, results/attention_H200_2026-11-25_final.json); CUPTI kernels 2.408 against 2.467 ms
    (H100, results/attention_H100_persistent_backward.json); inside a program of 4 layers 1.01x
    (H100) and 0.99x (H200, results/attention_in_program_fwd_bwd.json): at least even, and its
    backward is deterministic. At head_dim 128 cuDNN stays first: pallas_gpu's kernels take longer
    (3.889 against 3.782 ms) and in a program it measured 0.92-0.94x (its 7-matmul backward draws
    more power per call and runs at a lower clock under the power cap,
    results/attention_power_fwd_bwd_H100.json). Since its backward takes dq from the dK/dV kernel's
    dz^T tiles (5 matmuls, `_DZ_TILES_HEAD_DIMS` in kernels/pallas/gpu/attention.py), head_dim 128
    under GQA goes to pallas_gpu too, up to Llama-3-8B's length (`_pallas_gpu_gqa_first`):
    Llama-3-8B's B1 T8192 N32 KV8 on an H100, fwd+bwd 1.09x cuDNN in tune_attention.py's rounds
    (3.856 against 4.214 ms, results/attention_H100_2026-11-26_pallas_gpu_dq_from_dz_tiles_gqa.json)
    and 1.02x inside a program of 4 layers (3.847 against 3.940 ms per call,
    results/attention_H100_2026-11-26_in_program_gqa.json). Without GQA cuDNN stays first: 1.05-1.13x
    in the rounds, but 0.96x in the program on the H100 (4.312 against 4.158,
    results/attention_H100_2026-11-26_in_program.json) and even on an H200 (4.002 against 4.026,
    results/attention_H200_2026-11-26_in_program.json)."""
    spec = kwargs["spec"]
    q, k, v = args[0], args[1], args[2]
    if platform != "gpu" or not spec.causal or spec.window_left is not None or v.shape[3] != q.shape[3]:
        return ()
    if not _aligned(args):
        return ()
    if q.shape[3] in (64, 96, 192):
        return ("pallas_gpu",)
    if q.shape[3] == 128 and q.shape[-2] > k.shape[-2] and _pallas_gpu_gqa_first(q, k):
        return ("pallas_gpu",)
    return ()


def _pallas_gpu_gqa_first(q, k) -> bool:
    """Whether a causal GQA call at head_dim 128 is short enough to try pallas_gpu first: while
    [B, N, T, S] in 16 bits (lengths rounded up to 128) fits `_PALLAS_GPU_GQA_MAX_SCORES_BYTES`,
    4 GiB, as at Llama-3-8B's B1 T8192 N32, where its kernels (with the dz^T backward, which every
    such call takes: `_dz_tiles` in kernels/pallas/gpu/attention.py packs the tiles into about
    half of that) took 3.505 ms against cuDNN's 3.661 (H100, CUPTI,
    results/attention_H100_2026-11-26_packed_dz_tiles_gqa.json). Longer calls stay on cuDNN: at
    B1 T11264 N32 KV8, where the packed tiles still fit, pallas_gpu's kernels took 7.063 ms against
    cuDNN's 6.755 (1.02x only in tools/bench.py-style rounds,
    results/attention_H100_2026-11-26_packed_dz_tiles_gqa_T11264.json)."""
    whole = lambda n: -(-n // 128) * 128
    batch_heads = math.prod(q.shape[:-3]) * q.shape[-2]
    nbytes = batch_heads * whole(q.shape[-3]) * whole(k.shape[-3]) * 2
    return nbytes <= _PALLAS_GPU_GQA_MAX_SCORES_BYTES


def _pallas_gpu_pads_head_dims(args) -> bool:
    """A q/k head dim pallas_gpu's kernels lack (not in `_PALLAS_GPU_HEAD_DIMS`), which it
    zero-pads to the next (`Tails` in kernels/pallas/gpu/attention_tiles.py; a v head dim that differs,
    like MLA's 128 beside 192, runs at its own, `_kernel_head_dims`). Padded, its forward measured
    slower than Triton's and its forward+backward faster (H200, bf16, causal, 96 padded to 128
    before the 96 kernels, packed 8x2048, B1 T16384 N32, ms against Triton's: fwd 0.910 against
    0.860, fwd+bwd 2.970 against 3.132; results/attention_H200_2026-11-26_padded_head_dims.json).
    So a call that is not differentiated tries cuDNN and then Triton; under a gradient the
    training priority stands (cuDNN, then pallas_gpu)."""
    return args[0].shape[3] not in _PALLAS_GPU_HEAD_DIMS


def _aligned(args) -> bool:
    """T and S that pallas_gpu runs in place: at least 128 and multiples of 8 (`Tails` in
    kernels/pallas/gpu/attention_tiles.py). The measurements behind the orders above are at multiples of
    128; in place, T4000 ran like T4096 (soft cap B4 N32 H128 on an H100: fwd 1.153 against 1.140
    ms, fwd+bwd 5.19 against 5.24; causal fwd 0.975 against cuDNN's 1.071,
    results/attention_H100_unaligned_in_place.json). Other lengths copy the arrays padded, which
    cost about 0.35 ms per forward at that size (1.508 ms), so they keep cuDNN first where it
    computes the call."""
    return all(n >= 128 and n % 8 == 0 for n in (args[0].shape[1], args[1].shape[1]))


ATTENTION = define_op(
    "attention",
    {
        "xla": "forgeax.kernels.xla.attention:ATTENTION",
        "xla_chunked": "forgeax.kernels.xla.attention:ATTENTION_CHUNKED",
        "cudnn": "forgeax.kernels.xla.attention:ATTENTION_CUDNN",
        "triton": "forgeax.kernels.triton.attention:ATTENTION",
        "pallas_gpu": "forgeax.kernels.pallas.gpu.attention:ATTENTION",
        "pallas_tpu": "forgeax.kernels.pallas.tpu.attention:ATTENTION",
    },
    _PRIORITY,
)


def _check_pair_mask(name: str, a, lead: tuple[int, ...], heads: int, T: int, S: int) -> None:
    """bias/mask: rank 4 after the leading batch dims, [B|1, N|1, T, S]."""
    shape = tuple(a.shape)
    batch = lead
    if len(shape) != len(batch) + 3:
        raise ValueError(f"{name}: expected shape [batch|1, heads|1, T, S] = {(*batch, heads, T, S)} up to broadcasting, got {shape}")
    for got, want in zip(shape[:len(batch)], batch):
        if got not in (1, want):
            raise ValueError(f"{name}: batch dims {shape[:len(batch)]} do not broadcast to {batch}")
    if shape[-3] not in (1, heads) or shape[-2:] != (T, S):
        raise ValueError(f"{name}: expected [..., {heads}|1, {T}, {S}], got {shape}")


def _window(window, causal: bool) -> tuple[int | None, int | None]:
    if window is None:
        return None, None
    if not (isinstance(window, (tuple, list)) and len(window) == 2):
        raise TypeError(f"window: expected (left, right) with ints >= 0 or None, got {window!r}")
    out = []
    for side, w in zip(("left", "right"), window):
        if w is None:
            out.append(None)
            continue
        if isinstance(w, bool) or not isinstance(w, (int, jnp.integer)):
            raise TypeError(f"window: {side} size must be an int >= 0 or None, got {w!r}")
        if w < 0:
            raise ValueError(f"window: {side} size must be >= 0, got {int(w)}")
        out.append(int(w))
    return out[0], (0 if causal else out[1])


def attention(
    q: Float[Array, "*B T N H"],
    k: Float[Array, "*B S K H"],
    v: Float[Array, "*B S K Hv"],
    *,
    causal: bool = False,
    scale: float | None = None,
    window: tuple[int | None, int | None] | None = None,
    logit_soft_cap: float | None = None,
    segment_ids: tuple[Integer[Array, "*B T"], Integer[Array, "*B S"]] | None = None,
    bias: Float[Array, "*#B #N T S"] | None = None,
    mask: Bool[Array, "*#B #N T S"] | None = None,
    dropout_rate: float = 0.0,
    dropout_key: jax.Array | None = None,
    return_lse: bool = False,
    deterministic: bool | None = None,
    backend: str | None = None,
) -> Float[Array, "*B T N Hv"] | tuple[Float[Array, "*B T N Hv"], Float[Array, "*B T N"]]:
    """Multi-head scaled dot-product attention (flash attention on GPU/TPU backends).

    Per batch, query head n (reading kv head n // (N // K)), query t and key s, in f32:

        z[t, s]  = scale * <q[t], k[s]>               scale defaults to 1 / sqrt(H)
        z        = cap * tanh(z / cap)                 with logit_soft_cap (before the bias)
        z        = z + bias[t, s]                      with bias
        z        = -inf where (t, s) is not allowed    (causal, window, segment_ids, mask)
        out[t]   = sum_s softmax(z[t])[s] * v[s]       (dropout: p * keep / (1 - rate))
        lse[t]   = log(sum_s exp(z[t, s]))

    Semantics:
      * `causal` with T != S aligns the LAST query with the LAST key: query t sees keys
        s <= t + (S - T) (so T < S is decoding/chunked prefill over a longer cache).
      * `window=(left, right)`: query t (at key position t + S - T) sees keys in
        [pos - left, pos + right]; None on a side means unbounded. With causal=True right is 0.
      * `segment_ids=(q_segment_ids [*B, T], kv_segment_ids [*B, S])`: tokens attend only within
        equal ids (packed sequences); any int values.
      * `mask`: boolean, True = may attend, broadcastable as [*B|1, N|1, T, S]. `bias`: additive, same
        broadcasting, differentiable (its gradient is summed over broadcast axes).
      * A query row with no allowed key returns 0 (never NaN), its lse is -inf, and it contributes
        zero gradient.
      * `dropout_rate` > 0 needs `dropout_key`; the keep-mask is a fixed hash of (key, b, n, t, s)
        (kernels/common/attention.py), identical on every backend and deterministic given the key.

    Args:
      q: `[*B, T, N, H]`; k: `[*B, S, K, H]`; v: `[*B, S, K, Hv]` with N % K == 0 (GQA/MQA) and Hv
        allowed to differ from H. f32/bf16/f16, all the same dtype.
      return_lse: also return lse `[*B, T, N]` f32 (differentiable), e.g. to merge partial results.
      deterministic: True guarantees bitwise-reproducible gradients on every backend. False also
        allows cudnn, whose backward sums dq with float atomics in any order (equal up to
        rounding, not bit for bit; measured in benchmarks/results/attention_backward_determinism_H200.json). None (default) follows XLA's `--xla_gpu_deterministic_ops` flag (off unless
        set in XLA_FLAGS), like jax.nn.dot_product_attention's cuDNN path. The forward is always
        deterministic; xla, xla_chunked, triton and pallas_tpu always are.
      backend: None (fastest measured for this device and shape; on Hopper a forward-only call may
        run pallas_gpu's forward while a differentiated one runs cuDNN's forward and backward, see
        `_inference_order`), "xla" (materialised reference),
        "xla_chunked" (linear memory), "triton", "pallas_gpu", "pallas_tpu" ("pallas"), "cudnn"
        (XLA's cuDNN fused attention, for the calls whose semantics it shares).

    Returns:
      out `[*B, T, N, Hv]` in q's dtype, or (out, lse) with return_lse.
    """
    for name, a in (("q", q), ("k", k), ("v", v)):
        checks.floating_array(name, a, min_rank=4)
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v: expected one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    lead = tuple(q.shape[:-3])
    T, N, H = q.shape[-3:]
    S, K, Hk = k.shape[-3:]
    if tuple(k.shape[:-3]) != lead or tuple(v.shape[:-3]) != lead:
        raise ValueError(f"k, v: batch dims {tuple(k.shape[:-3])}, {tuple(v.shape[:-3])} must equal q's {lead}")
    if Hk != H:
        raise ValueError(f"k: head_dim {Hk} must equal q's head_dim {H}")
    if tuple(v.shape[-3:-1]) != (S, K):
        raise ValueError(f"v: expected [..., S={S}, K={K}, Hv], got {tuple(v.shape)}")
    if K == 0 or N % K != 0:
        raise ValueError(f"k: query heads N={N} must be a multiple of kv heads K={K}")
    if scale is None:
        scale = 1.0 / math.sqrt(H)
    else:
        checks.positive_float("scale", scale)
    if logit_soft_cap is not None:
        checks.positive_float("logit_soft_cap", logit_soft_cap)
        logit_soft_cap = float(logit_soft_cap)
    left, right = _window(window, bool(causal))
    rate = float(dropout_rate)
    if not 0.0 <= rate < 1.0:
        raise ValueError(f"dropout_rate: expected a number in [0, 1), got {dropout_rate!r}")
    if rate > 0 and dropout_key is None:
        raise ValueError("dropout_key: required when dropout_rate > 0 (dropout must be deterministic given a key)")

    B = math.prod(lead)
    q3, k3, v3 = (a.reshape((B,) + tuple(a.shape[-3:])) for a in (q, k, v))

    q_seg = kv_seg = None
    if segment_ids is not None:
        if not (isinstance(segment_ids, (tuple, list)) and len(segment_ids) == 2):
            raise TypeError("segment_ids: expected a pair (q_segment_ids [*B, T], kv_segment_ids [*B, S])")
        for name, ids, want in (("segment_ids[0]", segment_ids[0], lead + (T,)), ("segment_ids[1]", segment_ids[1], lead + (S,))):
            if not (hasattr(ids, "dtype") and jnp.issubdtype(ids.dtype, jnp.integer)):
                raise TypeError(f"{name}: expected an integer array")
            if tuple(ids.shape) != want:
                raise ValueError(f"{name}: expected shape {want}, got {tuple(ids.shape)}")
        q_seg = segment_ids[0].reshape(B, T).astype(jnp.int32)
        kv_seg = segment_ids[1].reshape(B, S).astype(jnp.int32)

    def pairwise(name, a, want_bool):
        if a is None:
            return None
        if want_bool:
            if not (hasattr(a, "dtype") and a.dtype == jnp.bool_):
                raise TypeError(f"{name}: expected a boolean array (True = may attend)")
        else:
            checks.floating_array(name, a)
        _check_pair_mask(name, a, lead, N, T, S)
        batch, rest = tuple(a.shape[:len(lead)]), tuple(a.shape[len(lead):])
        if all(b == 1 for b in batch):  # shared by the whole batch: keep it so (Bb = 1)
            return a.reshape((1,) + rest)
        return jnp.broadcast_to(a, lead + rest).reshape((B,) + rest)

    bias3 = pairwise("bias", bias, False)
    mask3 = pairwise("mask", mask, True)
    seed = dropout_seed_from_key(dropout_key) if rate > 0 else None
    if deterministic is None:
        deterministic = xla_gpu_deterministic_ops()
    elif not isinstance(deterministic, bool):
        raise TypeError(f"deterministic: expected True, False or None, got {deterministic!r}")
    spec = AttentionSpec(
        causal=bool(causal), scale=float(scale), window_left=left, window_right=right,
        logit_soft_cap=logit_soft_cap, dropout_rate=rate, deterministic=deterministic,
        return_lse=bool(return_lse),
    )
    out, lse = ATTENTION(q3, k3, v3, bias3, mask3, q_seg, kv_seg, seed, spec=spec, backend=backend)
    out = out.reshape(lead + tuple(out.shape[1:]))
    if not return_lse:
        return out
    return out, jnp.swapaxes(lse, -1, -2).reshape(lead + (T, N))
