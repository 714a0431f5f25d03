"""Block-sparse attention in plain XLA: the reference (the oracle every backend is tested against).

Builds the dense [B, K, T, S] boolean mask of the contract (kernels/common/sparse_attention.py)
from block_indices and runs masked softmax attention in f32 over all T x S scores; its gradient
is JAX's autodiff. O(T * S) memory: for checking, and for short sequences.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from forgeax.core.registry import Implementation
from forgeax.kernels.common.attention import masked_softmax
from forgeax.kernels.common.sparse_attention import SparseAttentionSpec, dense_mask

HIGHEST = lax.Precision.HIGHEST


def reference(q, k, v, block_indices, *, spec: SparseAttentionSpec):
    """(out [B, T, N, Hv] in q's dtype, lse [B, N, T] f32 or None) of the contract."""
    B, T, N, H = q.shape
    S, K = k.shape[1], k.shape[2]
    G = N // K
    f32 = jnp.float32
    q5 = q.astype(f32).reshape(B, T, K, G, H)
    z = spec.scale * jnp.einsum("btkgh,bskh->bkgts", q5, k.astype(f32), precision=HIGHEST)
    if spec.logit_soft_cap is not None:
        z = spec.logit_soft_cap * jnp.tanh(z / spec.logit_soft_cap)
    allowed = dense_mask(block_indices, spec, T, S)[:, :, None]  # [B, K, 1, T, S]
    z = jnp.where(allowed, z, -jnp.inf)
    p, lse = masked_softmax(z)
    out = jnp.einsum("bkgts,bskh->btkgh", p, v.astype(f32), precision=HIGHEST)
    out = out.reshape(B, T, N, v.shape[3]).astype(q.dtype)
    return out, (lse.reshape(B, N, T) if spec.return_lse else None)


SPARSE_ATTENTION = Implementation(fn=reference, platforms=("cpu", "gpu", "tpu"))
