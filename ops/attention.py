"""Scaled dot-product attention with masks, windows, soft cap, segments, bias and dropout: `attention`."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Integer

from forgeax.core import KernelConfig, Selection, define_op, xla_gpu_deterministic_ops
from forgeax.kernels.common.attention import AttentionSpec, dropout_seed_from_key
from forgeax.ops import checks


def _features(args, kwargs) -> dict:
    """What the selection rules (rules/attention.json) read of a call, from the normalised
    arguments (q, k, v `[B, T|S, N|K, H]`, bias, mask, segment ids, dropout seed) and the spec."""
    q, k, v = args[0], args[1], args[2]
    spec: AttentionSpec = kwargs["spec"]
    from forgeax.kernels.pallas.gpu import attention as pallas_gpu  # noqa: PLC0415 - a kernel fact, read only on GPUs

    B, T, N, H = q.shape
    S, K = k.shape[1], k.shape[2]
    whole = lambda n: -(-n // 128) * 128  # noqa: E731 - lengths as the kernels' 128-row tiles cover them
    return {
        "head_dim": H,
        "v_head_dim": v.shape[3],
        "same_v_head_dim": v.shape[3] == H,
        "gqa": N > K,
        "causal": spec.causal,
        "window": spec.window_left is not None,
        "position_mask": spec.has_position_mask,
        # Lengths pallas_gpu runs in place (at least 128, multiples of 8); others are copied padded.
        "aligned": all(n >= 128 and n % 8 == 0 for n in (T, S)),
        "pallas_gpu_pads_head_dim": H not in pallas_gpu._HEAD_DIMS,
        # [B, N, T, S] scores in 16 bits: what pallas_gpu's dz^T backward tiles take about half of.
        "scores_bytes": B * N * whole(T) * whole(S) * 2,
        "dtype": q.dtype.name,
        "bias": args[3] is not None,
        "mask": args[4] is not None,
        "segments": args[5] is not None,
        "dropout": args[7] is not None,
    }


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
    selection=Selection.load("forgeax.ops", "rules/attention.json"),
    features=_features,
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
    config: KernelConfig | None = None,
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
        rounding, not bit for bit; measured in benchmarks/results/attention_H200_2026-11-22_backward_determinism.json). None (default) follows XLA's `--xla_gpu_deterministic_ops` flag (off unless
        set in XLA_FLAGS), like jax.nn.dot_product_attention's cuDNN path. The forward is always
        deterministic; xla, xla_chunked, triton and pallas_tpu always are.
      backend: None (the selection rules of ops/rules/attention.json, then the platform priority;
        on Hopper a forward-only call may run pallas_gpu's forward while a differentiated one
        runs cuDNN's forward and backward: `forgeax.explain` shows which), "xla" (materialised reference),
        "xla_chunked" (linear memory), "triton", "pallas_gpu", "pallas_tpu" ("pallas"), "cudnn"
        (XLA's cuDNN fused attention, for the calls whose semantics it shares).
      config: a kernel config of the chosen backend (e.g. the Triton or Mosaic GPU attention
        config); with backend=None only backends taking that config type are considered.

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
    checks.kv_heads_divide("k", N, K)
    scale, logit_soft_cap = checks.scale_and_soft_cap(scale, logit_soft_cap, H)
    left, right = checks.window(window, bool(causal))
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
    out, lse = ATTENTION(q3, k3, v3, bias3, mask3, q_seg, kv_seg, seed, spec=spec, backend=backend, config=config)
    out = out.reshape(lead + tuple(out.shape[1:]))
    if not return_lse:
        return out
    return out, jnp.swapaxes(lse, -1, -2).reshape(lead + (T, N))
