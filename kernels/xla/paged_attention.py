"""Paged and contiguous decode attention in plain XLA: the references (the oracles).

One decode step per request (kernels/common/paged.py has the layout and the position rule):
    q [B, N, H];  keys k[b, s], values v[b, s] for s < L = lengths[b];  GQA: query head n reads kv
    head n // (N // KV).  Per (b, n), in f32:
        z[s]  = scale * <q, k[s]>;  z = cap * tanh(z / cap) with a soft cap;  z = -inf where not allowed
        lse   = log(sum_s exp(z[s]))   (-inf when no key is allowed)
        out   = sum_s exp(z[s] - lse) v[s]   (0 when no key is allowed)
This is `forgeax.ops.attention` with T = 1, the query at the last key (position L - 1).

* `paged_reference` gathers each request's pages into a contiguous [B, max_pages * page_size,
  KV, H] cache (`gather_pages`, page ids clamped) and attends over it.
* `decode_reference` attends over a contiguous cache k, v [B, S, KV, H] (lengths clamped to S).
Backend signature: fn(q, k_pages, v_pages, lengths, page_table, *, spec) / fn(q, k, v, lengths,
*, spec) -> (out [B, N, Hv] in q's dtype, lse [B, N] f32 or None). Forward only (decoding is
inference): the ops refuse jax.grad (ops/paged_attention.py).
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from forgeax.core.registry import Implementation
from forgeax.kernels.common.attention import masked_softmax
from forgeax.kernels.common.paged import PagedSpec, allowed_keys, clamp_lengths, gather_pages

HIGHEST = lax.Precision.HIGHEST


def attend(q, k, v, lengths, spec: PagedSpec):
    """Masked softmax attention of one query per request over k, v [B, S, KV, H] (f32 math)."""
    B, N, _ = q.shape
    S, KV = k.shape[1], k.shape[2]
    G = N // KV
    qf = q.astype(jnp.float32).reshape(B, KV, G, -1)
    z = spec.scale * jnp.einsum("bkgh,bskh->bkgs", qf, k.astype(jnp.float32), precision=HIGHEST)
    if spec.logit_soft_cap is not None:
        z = spec.logit_soft_cap * jnp.tanh(z / spec.logit_soft_cap)
    ok = allowed_keys(spec, lengths, jnp.arange(S, dtype=jnp.int32))[:, None, None, :]
    z = jnp.where(ok, z, -jnp.inf)
    p, lse = masked_softmax(z)
    out = jnp.einsum("bkgs,bskh->bkgh", p, v.astype(jnp.float32), precision=HIGHEST)
    out = out.reshape(B, N, -1).astype(q.dtype)
    return out, (lse.reshape(B, N) if spec.return_lse else None)


def paged_reference(q, k_pages, v_pages, lengths, page_table, *, spec: PagedSpec):
    max_pages, page_size = page_table.shape[1], k_pages.shape[1]
    lengths = clamp_lengths(lengths, max_pages, page_size)
    return attend(q, gather_pages(k_pages, page_table), gather_pages(v_pages, page_table), lengths, spec)


def decode_reference(q, k, v, lengths, *, spec: PagedSpec):
    return attend(q, k, v, jnp.clip(lengths.astype(jnp.int32), 0, k.shape[1]), spec)


PAGED_ATTENTION = Implementation(fn=paged_reference, interpretable=True)
DECODE_ATTENTION = Implementation(fn=decode_reference, interpretable=True)
