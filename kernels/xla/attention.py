"""Attention in plain XLA: the materialised reference (the oracle) and a chunked online-softmax version.

Both implement the contract in `forgeax.kernels.common.attention` (math, masks, dropout hash).

* `reference`: materialises the [B, N, T, S] scores in f32, softmax, gradient by autodiff. Readable,
  O(T * S) memory: the oracle every backend is tested against.
* `chunked`: scans over key chunks with an online softmax (forward) and recomputes each chunk's
  probabilities from the saved log-sum-exp (backward), so memory is O(T * chunk) per batch and
  head; runs on any device and is the fallback for long sequences.
* `cudnn`: XLA's cuDNN fused attention (`jax.nn.dot_product_attention(implementation="cudnn")`),
  only for the calls where its semantics are the contract's (see `_cudnn_supports`); GPU only.
  Its raw kernels (`CUDNN_KERNELS`: the forward with its softmax statistics, the backward given
  any out and lse) serve ring attention, where lse must come out but takes no cotangent.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
# cuDNN's fused attention primitives (jax 0.11.2, pinned): the public jax.nn path returns lse
# cast to the output's dtype and its backward recomputes nothing from a given lse.
from jax._src.cudnn import fused_attention_stablehlo as cudnn_sdpa

from forgeax.kernels.common.attention import (
    AttentionKernels,
    AttentionSpec,
    allowed_positions,
    differentiable_attention,
    dropout_keep,
    masked_softmax,
    reduce_bias_grad,
)
from forgeax.kernels.common.batching import ManualAxes
from forgeax.core.registry import Implementation
from forgeax.core.runtime import current_compute_capability, current_compute_capability_major, xla_gpu_deterministic_ops

HIGHEST = lax.Precision.HIGHEST


def reference(q, k, v, bias, mask, q_segment_ids, kv_segment_ids, dropout_seed, *, spec: AttentionSpec):
    """Materialised attention (see the module docstring of kernels/common/attention.py)."""
    B, T, N, _ = q.shape
    S, K = k.shape[1], k.shape[2]
    k = jnp.repeat(k, N // K, axis=2).astype(jnp.float32)
    v = jnp.repeat(v, N // K, axis=2).astype(jnp.float32)
    z = spec.scale * jnp.einsum("btnh,bsnh->bnts", q.astype(jnp.float32), k, precision=HIGHEST)
    if spec.logit_soft_cap is not None:
        z = spec.logit_soft_cap * jnp.tanh(z / spec.logit_soft_cap)
    if bias is not None:
        z = z + bias.astype(jnp.float32)
    allowed = jnp.ones((1, 1, T, S), bool)
    positions = allowed_positions(spec, jnp.arange(T)[:, None], jnp.arange(S)[None, :], T, S)
    if positions is not None:
        allowed = allowed & positions
    if q_segment_ids is not None:
        allowed = allowed & (q_segment_ids[:, None, :, None] == kv_segment_ids[:, None, None, :])
    if mask is not None:
        allowed = allowed & mask
    z = jnp.where(allowed, z, -jnp.inf)
    p, lse = masked_softmax(z)
    if spec.dropout_rate > 0:
        idx = jnp.arange
        keep = dropout_keep(
            dropout_seed,
            idx(B)[:, None, None, None],
            idx(N)[None, :, None, None],
            idx(T)[None, None, :, None],
            idx(S)[None, None, None, :],
            N,
            spec.dropout_threshold,
        )
        p = jnp.where(keep, p / (1.0 - spec.dropout_rate), 0.0)
    out = jnp.einsum("bnts,bsnh->btnh", p, v, precision=HIGHEST)
    return out.astype(q.dtype), (lse if spec.return_lse else None)


# ----------------------------------------------------------------------------- chunked


def default_chunk(S: int) -> int:
    return min(512, S)


def _chunk_scores(spec, q5, k_c, bias_c, mask_c, qseg, kvseg_c, seed, s0, T, S, N):
    """One key chunk: (z [B,K,G,T,C] f32 masked with -inf, z before masking for the soft-cap chain rule,
    keep-mask or None). q5 is q as [B, T, K, G, H] in f32, s0 the chunk's first key index."""
    B, _, K, G, _ = q5.shape
    C = k_c.shape[1]
    z = spec.scale * jnp.einsum("btkgh,bskh->bkgts", q5, k_c.astype(jnp.float32), precision=HIGHEST)
    if spec.logit_soft_cap is not None:
        z = spec.logit_soft_cap * jnp.tanh(z / spec.logit_soft_cap)
    capped = z
    if bias_c is not None:
        z = z + _heads5(bias_c.astype(jnp.float32), K, G)
    s_idx = s0 + jnp.arange(C)
    allowed = (s_idx < S)[None, None, None, None, :]
    positions = allowed_positions(spec, jnp.arange(T)[:, None], s_idx[None, :], T, S)
    if positions is not None:
        allowed = allowed & positions
    if qseg is not None:
        allowed = allowed & (qseg[:, None, None, :, None] == kvseg_c[:, None, None, None, :])
    if mask_c is not None:
        allowed = allowed & _heads5(mask_c, K, G)
    keep = None
    if spec.dropout_rate > 0:
        n = jnp.arange(N).reshape(1, K, G, 1, 1)
        keep = dropout_keep(
            seed, jnp.arange(B).reshape(B, 1, 1, 1, 1), n, jnp.arange(T).reshape(1, 1, 1, T, 1),
            s_idx.reshape(1, 1, 1, 1, C), N, spec.dropout_threshold,
        )
    return jnp.where(allowed, z, -jnp.inf), capped, keep


def _heads5(a, K, G):
    """[Bb, Nb, T, C] -> [Bb, K|1, G|1, T, C] (heads split as n = kv_head * G + g)."""
    if a.shape[1] == 1:
        return a[:, :, None]
    return a.reshape(a.shape[0], K, G, *a.shape[2:])


def _pad_keys(chunk, S, *arrays_axis):
    """Pads each (array, axis) to a multiple of chunk along axis, then splits it into chunks (leading axis)."""
    n = -(-S // chunk)
    out = []
    for a, axis in arrays_axis:
        if a is None:
            out.append(None)
            continue
        pad = [(0, 0)] * a.ndim
        pad[axis] = (0, n * chunk - S)
        a = jnp.pad(a, pad)
        a = a.reshape(a.shape[:axis] + (n, chunk) + a.shape[axis + 1:])
        out.append(jnp.moveaxis(a, axis, 0))
    return n, out


def chunked_forward(q, k, v, bias, mask, qseg, kvseg, seed, spec, chunk=None):
    B, T, N, _ = q.shape
    S, K, Hv = k.shape[1], k.shape[2], v.shape[3]
    G = N // K
    C = chunk or default_chunk(S)
    q5 = q.astype(jnp.float32).reshape(B, T, K, G, -1)
    n, (k_c, v_c, bias_c, mask_c, kvseg_c) = _pad_keys(
        C, S, (k, 1), (v, 1), (bias, 3), (mask, 3), (kvseg, 1)
    )

    def step(carry, xs):
        m, l, acc = carry
        i, kc, vc, bc, mc, sc = xs
        z, _, keep = _chunk_scores(spec, q5, kc, bc, mc, qseg, sc, seed, i * C, T, S, N)
        m_new = jnp.maximum(m, z.max(-1))
        m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
        alpha = jnp.exp(jnp.where(jnp.isfinite(m), m, m_safe) - m_safe)
        p = jnp.exp(z - m_safe[..., None])
        l = l * alpha + p.sum(-1)
        if keep is not None:
            p = jnp.where(keep, p / (1.0 - spec.dropout_rate), 0.0)
        acc = acc * alpha[..., None] + jnp.einsum("bkgts,bskh->bkgth", p, vc.astype(jnp.float32), precision=HIGHEST)
        return (m_new, l, acc), None

    typed = ManualAxes.of(q, k, v, qseg, kvseg).apply  # inside shard_map the carry varies like the inputs
    init = (
        typed(jnp.full((B, K, G, T), -jnp.inf, jnp.float32)),
        typed(jnp.zeros((B, K, G, T), jnp.float32)),
        typed(jnp.zeros((B, K, G, T, Hv), jnp.float32)),
    )
    (m, l, acc), _ = lax.scan(step, init, (jnp.arange(n), k_c, v_c, bias_c, mask_c, kvseg_c))
    nonempty = l > 0
    out = acc / jnp.where(nonempty, l, 1.0)[..., None]
    lse = jnp.where(nonempty, jnp.where(jnp.isfinite(m), m, 0.0) + jnp.log(jnp.where(nonempty, l, 1.0)), -jnp.inf)
    out = jnp.moveaxis(out.reshape(B, N, T, Hv), 1, 2).astype(q.dtype)
    return out, lse.reshape(B, N, T)


def chunked_backward(q, k, v, bias, mask, qseg, kvseg, seed, out, lse, dout, dlse, spec, chunk=None):
    B, T, N, H = q.shape
    S, K, Hv = k.shape[1], k.shape[2], v.shape[3]
    G = N // K
    C = chunk or default_chunk(S)
    f32 = jnp.float32
    q5 = q.astype(f32).reshape(B, T, K, G, H)
    do5 = dout.astype(f32).reshape(B, T, K, G, Hv)
    lse5 = lse.reshape(B, K, G, T)
    lse_safe = jnp.where(jnp.isfinite(lse5), lse5, jnp.inf)  # exp(z - inf) = 0 on empty rows
    delta = jnp.einsum("btkgh,btkgh->bkgt", do5, out.astype(f32).reshape(B, T, K, G, Hv)) - dlse.reshape(B, K, G, T)
    n, (k_c, v_c, bias_c, mask_c, kvseg_c) = _pad_keys(C, S, (k, 1), (v, 1), (bias, 3), (mask, 3), (kvseg, 1))
    bias_heads = None if bias is None else bias.shape[:2]

    def step(dq, xs):
        i, kc, vc, bc, mc, sc = xs
        kc32, vc32 = kc.astype(f32), vc.astype(f32)
        z, capped, keep = _chunk_scores(spec, q5, kc, bc, mc, qseg, sc, seed, i * C, T, S, N)
        p = jnp.exp(z - lse_safe[..., None])
        pd = p if keep is None else jnp.where(keep, p / (1.0 - spec.dropout_rate), 0.0)
        dv = jnp.einsum("bkgts,btkgh->bskh", pd, do5, precision=HIGHEST)
        dp = jnp.einsum("btkgh,bskh->bkgts", do5, vc32, precision=HIGHEST)
        if keep is not None:
            dp = jnp.where(keep, dp / (1.0 - spec.dropout_rate), 0.0)
        dz = p * (dp - delta[..., None])
        dbias = None
        if bias_heads is not None:
            dbias = reduce_bias_grad(dz.reshape(B, N, T, C), bias_heads)
        if spec.logit_soft_cap is not None:
            dz = dz * (1.0 - jnp.square(capped / spec.logit_soft_cap))
        dq = dq + spec.scale * jnp.einsum("bkgts,bskh->btkgh", dz, kc32, precision=HIGHEST)
        dk = spec.scale * jnp.einsum("bkgts,btkgh->bskh", dz, q5, precision=HIGHEST)
        return dq, (dk, dv, dbias)

    dq0 = ManualAxes.of(q, k, v, qseg, kvseg, out, dout).apply(jnp.zeros(q5.shape, f32))
    dq, (dk, dv, dbias) = lax.scan(step, dq0, (jnp.arange(n), k_c, v_c, bias_c, mask_c, kvseg_c))
    unchunk = lambda a, axis: jnp.moveaxis(a, 0, axis).reshape(a.shape[1:axis + 1] + (n * C,) + a.shape[axis + 2:])
    dk = unchunk(dk, 1)[:, :S]
    dv = unchunk(dv, 1)[:, :S]
    if dbias is not None:
        dbias = unchunk(dbias, 3)[..., :S]
    return dq.reshape(B, T, N, H), dk, dv, dbias


CHUNKED_KERNELS = AttentionKernels(forward=chunked_forward, backward=chunked_backward, ring="shift")
chunked = differentiable_attention(CHUNKED_KERNELS)

ATTENTION = Implementation(fn=reference, platforms=("cpu", "gpu", "tpu"))
ATTENTION_CHUNKED = Implementation(fn=chunked, platforms=("cpu", "gpu", "tpu"), kernels=lambda config: CHUNKED_KERNELS)


def cudnn(q, k, v, bias, mask, q_segment_ids, kv_segment_ids, dropout_seed, *, spec: AttentionSpec):
    """cuDNN's flash attention through XLA: (out, lse [B, N, T] f32 with return_lse, else None)."""
    if spec.return_lse:  # only with no lse cotangent (_cudnn_supports), which jax's cuDNN rule drops
        return cudnn_forward(q, k, v, bias, mask, q_segment_ids, kv_segment_ids, dropout_seed, spec=spec)
    del bias, mask, q_segment_ids, kv_segment_ids, dropout_seed  # refused by _cudnn_supports
    window = None if spec.window_left is None else (spec.window_left, 0)
    out = jax.nn.dot_product_attention(
        q, k, v, scale=spec.scale, is_causal=spec.causal, local_window_size=window, implementation="cudnn",
    )
    return out, None


def _cudnn_statics(spec: AttentionSpec) -> dict:
    """The static arguments of cuDNN's primitives for a call `_cudnn_supports` accepted: causal, or
    causal with a left window (cuDNN's sliding window counts the query itself), or unmasked."""
    window = None if spec.window_left is None else spec.window_left + 1
    mask_type = cudnn_sdpa.MaskType.CAUSAL if spec.causal else cudnn_sdpa.MaskType.NO_MASK
    return {"mask_type": mask_type, "sliding_window_length": window}


def cudnn_forward(q, k, v, bias, mask, q_segment_ids, kv_segment_ids, dropout_seed, *, spec: AttentionSpec):
    """(out [B, T, N, Hv] in q's dtype, lse [B, N, T] f32): cuDNN's forward and its softmax statistics,
    log(sum_s exp(scale * q.k_s)) per query (natural log)."""
    del bias, mask, q_segment_ids, kv_segment_ids, dropout_seed  # refused by _cudnn_supports
    statics = _cudnn_statics(spec)
    return cudnn_sdpa.dot_product_attention(q, k, v, scale=spec.scale, return_residual=True, **statics)


def cudnn_backward(q, k, v, bias, mask, q_segment_ids, kv_segment_ids, dropout_seed, out, lse, d_out, d_lse, *,
                   spec: AttentionSpec):
    """(dq, dk, dv, None) of this call given ANY out and lse [B, N, T] (the ring gives the global ones):
    cuDNN recomputes p = exp(scale * q.k - lse) and rowsum(d_out * out) from them. It cannot take
    lse's cotangent: `_cudnn_supports` accepts return_lse only with spec.lse_gradient False."""
    del bias, mask, q_segment_ids, kv_segment_ids, dropout_seed, d_lse
    statics = _cudnn_statics(spec)
    unused = jnp.zeros(0, q.dtype)  # bias, sequence lengths, offsets and page tables: none
    residuals = (q, k, v) + (unused,) * 7 + (lse, out)
    dq, dk, dv = cudnn_sdpa._dot_product_attention_bwd_rule(
        spec.scale, 0, 0.0, (False, False), statics["mask_type"], cudnn_sdpa.AttentionLayout.BTNH.value,
        statics["sliding_window_length"], True, False, residuals, d_out)[:3]
    return dq, dk, dv, None


# Windows inside a ring become shifted windows or masks, neither of which cuDNN takes: gathered.
CUDNN_KERNELS = AttentionKernels(forward=cudnn_forward, backward=cudnn_backward, ring="no_window")


def _cudnn_supports(q, k, v, bias, mask, q_segment_ids, kv_segment_ids, dropout_seed, *, spec) -> str | None:
    """The calls where cuDNN computes exactly the contract; everything else falls back."""
    del dropout_seed
    T, H = q.shape[1], q.shape[3]
    S, Hv = k.shape[1], v.shape[3]
    if jnp.dtype(q.dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return f"dtype {jnp.dtype(q.dtype).name}: cuDNN flash attention needs bf16 or f16"
    if bias is not None or mask is not None or q_segment_ids is not None or kv_segment_ids is not None:
        return "bias/mask/segment ids are not routed to cuDNN"
    if spec.dropout_rate > 0:
        return "dropout: cuDNN's RNG is not the contract's hash"
    if spec.logit_soft_cap is not None:
        return "logit soft cap: not in cuDNN"
    if spec.return_lse and spec.lse_gradient:
        return "return_lse: cuDNN's backward takes no lse cotangent"
    if spec.deterministic and not xla_gpu_deterministic_ops():
        return "deterministic: cuDNN's backward adds dq with atomics unless XLA_FLAGS has --xla_gpu_deterministic_ops"
    if not spec.causal and (spec.window_left is not None or spec.window_right is not None):
        # jax.nn's cuDNN path ignores a left window without causal: it attends to every later key
        # where XLA's reference gives the banded result (docs/backends.md).
        return "window without causal: cuDNN's sliding window is causal-only"
    if spec.has_position_mask and T != S:
        return f"causal/window with T={T} != S={S}: cuDNN aligns the first query with the first key"
    if T % 8 or S % 8:
        # Measured on an H200: T or S of 1 or 17 failed conformance, 128 and 1000 passed.
        return f"T={T}, S={S}: routed to cuDNN only when both are multiples of 8"
    if Hv != H or H % 8 or H > 256:
        return f"head_dim {H} (v {Hv}): cuDNN needs H == Hv, a multiple of 8, at most 256"
    major = current_compute_capability_major()
    if major < 8 or (H > 128 and major < 9):
        return f"compute capability {current_compute_capability() or '?'}: too old for head_dim {H}"
    return None


ATTENTION_CUDNN = Implementation(fn=cudnn, platforms=("gpu",), supports=_cudnn_supports,
                                 kernels=lambda config: CUDNN_KERNELS)
