"""Block-sparse attention (Native Sparse Attention's selected branch): `sparse_attention`."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Integer

from forgeax.core import KernelConfig, Selection, define_op
from forgeax.kernels.common.sparse_attention import SparseAttentionSpec, num_blocks
from forgeax.ops import checks

SPARSE_ATTENTION = define_op(
    "sparse_attention",
    {
        "xla": "forgeax.kernels.xla.sparse_attention:SPARSE_ATTENTION",
        "triton": "forgeax.kernels.triton.sparse_attention:SPARSE_ATTENTION",
        "pallas_tpu": "forgeax.kernels.pallas.tpu.sparse_attention:SPARSE_ATTENTION",
    },
    selection=Selection.load("forgeax.ops", "rules/sparse_attention.json"),
)


def sparse_attention(
    q: Float[Array, "B T N H"],
    k: Float[Array, "B S K H"],
    v: Float[Array, "B S K Hv"],
    *,
    block_indices: Integer[Array, "B K Tb W"],
    block_size: int,
    causal: bool = False,
    scale: float | None = None,
    logit_soft_cap: float | None = None,
    return_lse: bool = False,
    backend: str | None = None,
    config: KernelConfig | None = None,
) -> Float[Array, "B T N Hv"] | tuple[Float[Array, "B T N Hv"], Float[Array, "B T N"]]:
    """Attention where each block of `block_size` queries reads only the key blocks it names.

    Query block i = queries [i * block_size, (i + 1) * block_size), key block j likewise over the
    keys (the last block of each may be short). `block_indices[b, h, i]` lists the key blocks
    query block i reads for every query head of kv head h (shared by the N // K heads of a GQA
    group, as NSA's selection is). Within the selected blocks the math is `ops.attention`'s:

        z[t, s] = scale * <q[t], k[s]>    (cap * tanh(z / cap) with logit_soft_cap)
        z = -inf unless s lies in a block selected for t's block (and s <= t + S - T with causal)
        out[t] = softmax(z[t]) @ v,  lse[t] = log sum_s exp z[t, s]

    Semantics:
      * Slots holding -1 are padding and select nothing. So does any id outside [0, cdiv(S,
        block_size)); with concrete (non-traced) block_indices such an id other than -1 is a
        ValueError. A block named twice in one row is selected once.
      * `causal` masks, inside the selected blocks, the keys after the query (the last query
        aligned with the last key when T != S, as in ops.attention).
      * A query row with no allowed key returns 0, its lse is -inf, and it adds no gradient.

    Args:
      q: `[B, T, N, H]`; k: `[B, S, K, H]`; v: `[B, S, K, Hv]`, N % K == 0; f32/bf16/f16, one dtype.
      block_indices: `[B, K, cdiv(T, block_size), W]` integer key-block ids (W slots per query
        block, any W >= 1). Not differentiable.
      block_size: queries and keys per block (an int >= 1; the Triton kernels take powers of two
        from 16 to 128, the Mosaic TPU ones multiples of 16).
      return_lse: also return lse `[B, T, N]` f32 (differentiable), e.g. to merge with NSA's other
        branches.
      backend: None (the selection of ops/rules/sparse_attention.json, then the platform
        priority), "xla" (the dense reference: T x S scores), "triton", "pallas_tpu".
      config: a kernel config of the chosen backend.

    Returns:
      out `[B, T, N, Hv]` in q's dtype, or (out, lse) with return_lse.
    """
    for name, a in (("q", q), ("k", k), ("v", v)):
        checks.floating_array(name, a)
        if a.ndim != 4:
            raise ValueError(f"{name}: expected rank 4 ([B, T|S, heads, head_dim]), got shape {tuple(a.shape)}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v: expected one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    B, T, N, H = q.shape
    S, K = k.shape[1], k.shape[2]
    if k.shape[0] != B or v.shape[0] != B:
        raise ValueError(f"k, v: batch {k.shape[0]}, {v.shape[0]} must equal q's {B}")
    if k.shape[3] != H:
        raise ValueError(f"k: head_dim {k.shape[3]} must equal q's head_dim {H}")
    if tuple(v.shape[1:3]) != (S, K):
        raise ValueError(f"v: expected [B, S={S}, K={K}, Hv], got {tuple(v.shape)}")
    checks.kv_heads_divide("k", N, K)
    if isinstance(block_size, bool) or not isinstance(block_size, (int, np.integer)) or block_size < 1:
        raise ValueError(f"block_size: expected an int >= 1, got {block_size!r}")
    block_size = int(block_size)
    if not (hasattr(block_indices, "shape") and hasattr(block_indices, "dtype")):
        raise TypeError(f"block_indices: expected an integer array, got {type(block_indices).__name__}")
    if not jnp.issubdtype(block_indices.dtype, jnp.integer):
        raise TypeError(f"block_indices: expected an integer dtype, got {jnp.dtype(block_indices.dtype).name}")
    nq, nk = num_blocks(T, block_size), num_blocks(S, block_size)
    shape = tuple(block_indices.shape)
    if len(shape) != 4 or shape[:3] != (B, K, nq) or shape[3] < 1:
        raise ValueError(f"block_indices: expected shape [B={B}, K={K}, cdiv(T, block_size)={nq}, W >= 1], got {shape}")
    if not isinstance(block_indices, jax.core.Tracer):
        values = np.asarray(block_indices)
        bad = (values != -1) & ((values < 0) | (values >= nk))
        if bad.any():
            raise ValueError(f"block_indices: ids must be -1 (unused) or key blocks in [0, {nk}) "
                             f"(S={S}, block_size={block_size}); got {int(values[bad].flat[0])}")
    scale, logit_soft_cap = checks.scale_and_soft_cap(scale, logit_soft_cap, H)
    if not isinstance(causal, (bool, np.bool_)):
        raise TypeError(f"causal: expected a bool, got {causal!r}")
    spec = SparseAttentionSpec(block_size=block_size, causal=bool(causal), scale=float(scale),
                               logit_soft_cap=logit_soft_cap, return_lse=bool(return_lse))
    idx = jnp.asarray(block_indices).astype(jnp.int32)
    out, lse = SPARSE_ATTENTION(q, k, v, idx, spec=spec, backend=backend, config=config)
    if not return_lse:
        return out
    return out, jnp.swapaxes(lse, 1, 2)
