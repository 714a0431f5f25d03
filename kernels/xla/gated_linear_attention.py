"""Gated linear attention (GLA, Yang et al. 2023) in XLA: the naive recurrence and the chunked form.

q, k, g: [B, T, N, K]; v: [B, T, N, V]; g <= 0 are log decays per key dimension; state [K, V]
per head:

    S_t = diag(exp(g_t)) S_{t-1} + k_t^T v_t,        o_t = scale * q_t S_t

`gated_linear_attention` (backend "xla") is that recurrence, a lax.scan over T in f32: the
oracle, and its autodiff the gradient oracle. `gated_linear_attention_chunked` ("xla_chunked")
is the chunk-parallel form over chunks of C tokens (kernels/common/gated_linear_attention.py
has the chunk layout): with b the running sum of g inside a chunk and B its last row,

    o_t = scale * [ (q_t * exp(b_t)) h_n  +  sum_{s <= t in chunk} (q_t * exp(b_t - b_s)) . k_s  v_s ]
    h_{n+1} = exp(B) * h_n + sum_s (k_s * exp(B - b_s))^T v_s

Every exponent is <= 0: the intra-chunk scores are built from 16-row blocks, an off-diagonal
block (rows i, columns j < i) as (q_i * exp(b_i - r)) (k_j * exp(r - b_j))^T with r = b at
block i's first row (b_t <= r <= b_s), the diagonal blocks elementwise over K.
With cu_seqlens (B == 1) sequences are packed along T and the state restarts at each;
initial and final states are then [num_seqs, N, K, V]. Final states are f32.
`lightning_attention` is GLA with g = -decay[n] for every key dimension.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Integer

from forgeax.core.registry import Implementation
from forgeax.kernels.common.gated_linear_attention import (
    SUB_CHUNK, GLASpec, from_layout, lightning_gates, make_layout, to_layout)

_F32 = jnp.float32


def _initial(initial_state, seqs: int, n: int, kd: int, vd: int) -> Array:
    if initial_state is None:
        return jnp.zeros((seqs, n, kd, vd), _F32)
    return initial_state.astype(_F32)


def gated_linear_attention(
    q: Float[Array, "B T N K"], k: Float[Array, "B T N K"], v: Float[Array, "B T N V"], g: Float[Array, "B T N K"],
    initial_state: Float[Array, "S N K V"] | None, cu_seqlens: Integer[Array, " S1"] | None, *, spec: GLASpec,
) -> tuple[Float[Array, "B T N V"], Float[Array, "S N K V"]]:
    """The recurrence, one token at a time (f32)."""
    b, t, n, kd = q.shape
    vd = v.shape[-1]
    seqs = b if cu_seqlens is None else cu_seqlens.shape[0] - 1
    init = _initial(initial_state, seqs, n, kd, vd)
    xs = tuple(jnp.moveaxis(x.astype(_F32), 1, 0) for x in (q, k, v, g))
    if cu_seqlens is None:
        def step(state, x):
            qt, kt, vt, gt = x
            state = jnp.exp(gt)[..., None] * state + kt[..., None] * vt[..., None, :]
            return state, spec.scale * jnp.einsum("bnk,bnkv->bnv", qt, state)

        final, o = jax.lax.scan(step, init, xs)
        return jnp.moveaxis(o, 0, 1).astype(q.dtype), final
    cu = cu_seqlens.astype(jnp.int32)
    pos = jnp.arange(t, dtype=jnp.int32)
    seq = jnp.clip(jnp.searchsorted(cu, pos, side="right") - 1, 0, seqs - 1)
    first, last = pos == cu[seq], pos == cu[seq + 1] - 1

    def step_varlen(carry, x):
        state, finals = carry
        qt, kt, vt, gt, s, is_first, is_last = x
        state = jnp.where(is_first, init[s][None], state)
        state = jnp.exp(gt)[..., None] * state + kt[..., None] * vt[..., None, :]
        finals = jnp.where(is_last, finals.at[s].set(state[0]), finals)
        return (state, finals), spec.scale * jnp.einsum("bnk,bnkv->bnv", qt, state)

    (_, finals), o = jax.lax.scan(step_varlen, (jnp.zeros((1, n, kd, vd), _F32), init), xs + (seq, first, last))
    return jnp.moveaxis(o, 0, 1).astype(q.dtype), finals


def gated_linear_attention_step(q, k, v, g, state, *, scale: float):
    """One decoding step: q, k, g [B, N, K], v [B, N, V], state [B, N, K, V] -> (o [B, N, V], new state f32)."""
    state = jnp.exp(g.astype(_F32))[..., None] * state.astype(_F32) + k.astype(_F32)[..., None] * v.astype(_F32)[..., None, :]
    return (scale * jnp.einsum("bnk,bnkv->bnv", q.astype(_F32), state)).astype(q.dtype), state


def intra_chunk_scores(qc, kc, bc):
    """A[..., n, t, s] = sum_k q_t k_s exp(b_t - b_s) for s <= t within a chunk, exponents <= 0.
    qc, kc, bc: [R, NC, C, N, K] f32 -> [R, NC, N, C, C]."""
    r, nc, c, n, kd = qc.shape
    sub = min(SUB_CHUNK, c)
    ns = c // sub
    qs, ks, bs = (x.reshape(r, nc, ns, sub, n, kd) for x in (qc, kc, bc))
    ref = bs[:, :, :, :1]  # b at each block's first row
    qe = qs * jnp.exp(bs - ref)
    # Masked with where (not clamped with minimum, whose gradient halves at ties: g = 0 gates).
    i, t = jnp.arange(ns), jnp.arange(sub)
    below = (i[:, None] > i[None, :])[:, :, None, None, None]  # block pairs j < i
    ke = ks[:, :, None] * jnp.exp(jnp.where(below, ref[:, :, :, None] - bs[:, :, None], -jnp.inf))  # [R, NC, i, j, c, N, K]
    off = jnp.einsum("rmicnk,rmijdnk->rmnijcd", qe, ke)
    causal = (t[:, None] >= t[None, :])[:, :, None, None]
    decay = jnp.exp(jnp.where(causal, bs[:, :, :, :, None] - bs[:, :, :, None], -jnp.inf))  # [R, NC, i, t, s, N, K]
    diag = jnp.einsum("rmitnk,rmisnk,rmitsnk->rmnits", qs, ks, decay)
    blocks = jnp.where((i[:, None] > i[None, :])[:, :, None, None], off, 0.0)
    blocks = blocks + jnp.where((i[:, None] == i[None, :])[:, :, None, None], diag[:, :, :, :, None], 0.0)
    scores = jnp.moveaxis(blocks, 4, 5).reshape(r, nc, n, c, c)
    return jnp.where(jnp.tril(jnp.ones((c, c), bool)), scores, 0.0)


def chunked_core(q, k, v, g, init, starts, ends, *, scale: float, chunk: int):
    """The chunked form on the chunk layout: q, k, g [R, Tp, N, K], v [R, Tp, N, V] (any float
    dtype, f32 math), init [S, N, K, V] f32 -> (o [R, Tp, N, V] f32, final states [S, N, K, V] f32)."""
    # f32 inputs get true f32 products (GPUs would round the einsums' operands to TF32).
    with jax.default_matmul_precision("highest" if q.dtype == jnp.float32 else "default"):
        return _chunked_core(q, k, v, g, init, starts, ends, scale=scale, chunk=chunk)


def _chunked_core(q, k, v, g, init, starts, ends, *, scale: float, chunk: int):
    r, tp, n, kd = q.shape
    vd, nc, seqs = v.shape[-1], tp // chunk, init.shape[0]
    qc, kc, vc, gc = (x.astype(_F32).reshape(r, nc, chunk, n, x.shape[-1]) for x in (q, k, v, g))
    bc = jnp.cumsum(gc, axis=2)
    last = bc[:, :, -1]  # [R, NC, N, K]
    o = jnp.einsum("rmnts,rmsnv->rmtnv", intra_chunk_scores(qc, kc, bc), vc)
    updates = jnp.einsum("rmsnk,rmsnv->rmnkv", kc * jnp.exp(last[:, :, None] - bc), vc)

    def step(carry, x):
        state, finals = carry
        update, decay, start, end = x
        finals = finals.at[jnp.where(end >= 0, end, seqs)].set(state)
        state = jnp.where((start >= 0)[:, None, None, None], init[jnp.maximum(start, 0)], state)
        return (jnp.exp(decay)[..., None] * state + update, finals), state

    finals = jnp.zeros((seqs + 1, n, kd, vd), _F32)
    (state, finals), h = jax.lax.scan(step, (jnp.zeros((r, n, kd, vd), _F32), finals),
                                      (jnp.moveaxis(updates, 1, 0), jnp.moveaxis(last, 1, 0), starts.T, ends[:, :nc].T))
    end = ends[:, nc]
    finals = finals.at[jnp.where(end >= 0, end, seqs)].set(state)[:seqs]
    o = o + jnp.einsum("rmtnk,mrnkv->rmtnv", qc * jnp.exp(bc), h)
    return (scale * o).reshape(r, tp, n, vd), finals


def empty_sequences_keep_state(finals, init, lengths):
    return jnp.where((lengths > 0)[:, None, None, None], finals, init)


def gated_linear_attention_chunked(q, k, v, g, initial_state, cu_seqlens, *, spec: GLASpec):
    b, t, n, kd = q.shape
    layout = make_layout(b, t, spec.chunk_size, cu_seqlens)
    seqs = b if cu_seqlens is None else cu_seqlens.shape[0] - 1
    init = _initial(initial_state, seqs, n, kd, v.shape[-1])
    o, finals = chunked_core(*(to_layout(x, layout) for x in (q, k, v, g)), init, layout.starts, layout.ends,
                             scale=spec.scale, chunk=spec.chunk_size)
    return from_layout(o, layout, t).astype(q.dtype), empty_sequences_keep_state(finals, init, layout.lengths)


def _lightning(gla):
    def lightning_attention(q, k, v, decay, initial_state, cu_seqlens, *, spec: GLASpec, **kwargs):
        return gla(q, k, v, lightning_gates(q, decay), initial_state, cu_seqlens, spec=spec, **kwargs)

    return lightning_attention


GATED_LINEAR_ATTENTION = Implementation(fn=gated_linear_attention)
GATED_LINEAR_ATTENTION_CHUNKED = Implementation(fn=gated_linear_attention_chunked)
LIGHTNING_ATTENTION = Implementation(fn=_lightning(gated_linear_attention))
LIGHTNING_ATTENTION_CHUNKED = Implementation(fn=_lightning(gated_linear_attention_chunked))
