"""Ragged paged attention in plain XLA: the reference (the oracle).

The contract is kernels/common/ragged_paged_attention.py's. Per query row r (all in f32): find its
sequence i (cu_q_lens[i] <= r < cu_q_lens[i + 1]), gather that sequence's keys and values from its
pages (`paged.gather_pages`), and run ops.attention's masked softmax over them with query
j = r - cu_q_lens[i] at key position kv_len - q_len + j. Rows are processed in chunks
(`lax.map`) so that the gathered [chunk, max_pages * page_size, KV, H] copies stay bounded;
obviously right, not fast. Differentiable by JAX autodiff as a function (the op itself is forward-only).
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, Float, Int

from forgeax.core.registry import Implementation
from forgeax.kernels.common.attention import AttentionSpec, allowed_positions, masked_softmax
from forgeax.kernels.common.paged import gather_pages
from forgeax.kernels.common.ragged_paged_attention import clamped_tables

HIGHEST = lax.Precision.HIGHEST
# Bytes of gathered f32 keys + values one chunk of rows may hold.
_CHUNK_BYTES = 1 << 30


def _rows(q, k_rows, v_rows, j, q_len, kv_len, valid, spec: AttentionSpec):
    """out [C, N, Hv] f32 for C query rows against their own gathered keys k_rows [C, L, KV, H]."""
    C, N, H = q.shape
    L, KV = k_rows.shape[1], k_rows.shape[2]
    qg = q.astype(jnp.float32).reshape(C, KV, N // KV, H)
    z = spec.scale * jnp.einsum("ckgh,clkh->ckgl", qg, k_rows.astype(jnp.float32), precision=HIGHEST)
    if spec.logit_soft_cap is not None:
        z = spec.logit_soft_cap * jnp.tanh(z / spec.logit_soft_cap)
    s = jnp.arange(L, dtype=jnp.int32)[None, :]
    allowed = (s < kv_len[:, None]) & valid[:, None]
    positions = allowed_positions(spec, j[:, None], s, q_len[:, None], kv_len[:, None])
    if positions is not None:
        allowed = allowed & positions
    z = jnp.where(allowed[:, None, None, :], z, -jnp.inf)
    p, _ = masked_softmax(z)
    out = jnp.einsum("ckgl,clkh->ckgh", p, v_rows.astype(jnp.float32), precision=HIGHEST)
    return out.reshape(C, N, v_rows.shape[-1])


def ragged_paged_attention(q: Float[Array, "T N H"], k_pages: Float[Array, "P PS KV H"], v_pages: Float[Array, "P PS KV Hv"],
                           cu_q_lens: Int[Array, "S1"], kv_lens: Int[Array, "S"], page_table: Int[Array, "S M"], *,
                           spec: AttentionSpec) -> Float[Array, "T N Hv"]:
    T, N, _ = q.shape
    P, PS, KV, H = k_pages.shape
    S, M = page_table.shape
    kv_lens, page_table = clamped_tables(kv_lens, page_table, P, PS)
    cu = cu_q_lens.astype(jnp.int32)
    rows = jnp.arange(T, dtype=jnp.int32)
    seq = jnp.searchsorted(cu, rows, side="right").astype(jnp.int32) - 1  # cu[seq] <= r < cu[seq + 1]
    valid = (seq >= 0) & (seq < S)
    seq = jnp.clip(seq, 0, S - 1)
    q_len = cu[seq + 1] - cu[seq]
    j = rows - cu[seq]
    kv_len = kv_lens[seq]

    per_row = M * PS * KV * (H + v_pages.shape[3]) * 4
    chunk = max(1, min(T, _CHUNK_BYTES // per_row))
    padded = -(-T // chunk) * chunk

    def pad(a):  # [T, ...] -> [chunks, chunk, ...], rows past T invalid (valid pads with False)
        a = jnp.pad(a, ((0, padded - T),) + ((0, 0),) * (a.ndim - 1))
        return a.reshape((padded // chunk, chunk) + a.shape[1:])

    def one_chunk(args):
        qc, seqc, jc, qlc, kvc, validc = args
        tables = page_table[seqc]  # [C, M]
        return _rows(qc, gather_pages(k_pages, tables), gather_pages(v_pages, tables), jc, qlc, kvc, validc, spec)

    out = lax.map(one_chunk, tuple(pad(a) for a in (q, seq, j, q_len, kv_len, valid)))
    out = out.reshape((padded,) + out.shape[2:])[:T]
    return out.astype(q.dtype)


RAGGED_PAGED_ATTENTION = Implementation(fn=ragged_paged_attention)
