"""The block-sparse attention contract (NSA's selected branch) every backend implements.

Layout (after `forgeax.ops.sparse_attention` has checked the call):
    q [B, T, N, H]   k [B, S, K, H]   v [B, S, K, Hv]   N % K == 0 (query head n reads kv head
    n // G, G = N // K)   block_indices [B, K, cdiv(T, bs), W] int32, bs = spec.block_size.
Query block i holds queries [i*bs, (i+1)*bs), key block j keys [j*bs, (j+1)*bs) (the last ones
may be short). Slot w of block_indices[b, h, i] names a key block j that every query of block i
reads, for each query head of kv head h (shared by the G heads, as in NSA).

selected(b, h, i, j) = some slot of block_indices[b, h, i] equals j, 0 <= j < cdiv(S, bs). Slots
holding anything else (-1 is the padding) select nothing; a block named twice is selected once
(the set of named blocks counts, not the slots).
allowed(t, s) = selected(b, h, t // bs, s // bs) and, with causal, s <= t + (S - T) (the last
query sits at the last key, as in ops.attention).
Then, per query head n and query t, in f32, exactly `ops.attention`'s math and edge rules:
    z[t, s] = scale * <q[t], k[s]>;  z = cap * tanh(z / cap) with a soft cap;  -inf where not allowed
    lse[t] = log sum_s exp z[t, s] (-inf on a row with no allowed key);  out[t] = sum_s exp(z - lse) v[s]
A row with no allowed key has out 0, lse -inf and contributes zero gradient.

Backend fn: fn(q, k, v, block_indices, *, spec) -> (out [B, T, N, Hv] in q's dtype, lse [B, N, T]
f32 when spec.return_lse else None), differentiable in q, k, v (block_indices gets a float0
zero). Kernels are built from `forward(q, k, v, idx, spec) -> (out, lse)` and `backward(q, k, v,
idx, out, lse, dout, dlse, spec) -> (dq, dk, dv)` by `differentiable_sparse_attention`; the
backward math is kernels/common/attention.py's (D = rowsum(dout * out) - dlse, dz = p (dp - D)).

Kernels walk tables built here by XLA (static sizes): `forward_table` (per query block its key
blocks, ascending, and how many) and `transposed_table` (per key block the query blocks that
read it), both from `block_mask`, which also drops, under causal, the key blocks no query of the
block may see; each also counts the pairs that need no position mask (`full_blocks`).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from forgeax.kernels.common.batching import fold_vmap_into_rows
from forgeax.kernels.common.partitioning import split_launch

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class SparseAttentionSpec:
    """The static options of one sparse_attention call (hashable)."""

    block_size: int
    causal: bool = False
    scale: float = 1.0
    logit_soft_cap: float | None = None
    return_lse: bool = False


def num_blocks(n: int, block_size: int) -> int:
    return -(-n // block_size)


def block_mask(block_indices: Array, spec: SparseAttentionSpec, T: int, S: int) -> Array:
    """[B, K, nq, nk] bool: whether query block i reads key block j (see the module docstring;
    under causal also: the block's first key is visible to the block's last query)."""
    B, K, nq, W = block_indices.shape
    bs = spec.block_size
    nk = num_blocks(S, bs)
    idx = block_indices.astype(jnp.int32)
    idx = jnp.where((idx >= 0) & (idx < nk), idx, nk)  # unused slots land in a dropped column
    b, h, i = (jnp.arange(n, dtype=jnp.int32).reshape(shape) for n, shape in
               ((B, (B, 1, 1, 1)), (K, (1, K, 1, 1)), (nq, (1, 1, nq, 1))))
    b, h, i = (jnp.broadcast_to(a, idx.shape) for a in (b, h, i))
    mask = jnp.zeros((B, K, nq, nk + 1), bool).at[b, h, i, idx].set(True)[..., :nk]
    if spec.causal:
        last_query = jnp.minimum(jnp.arange(nq) * bs + bs, T) - 1
        first_key = jnp.arange(nk) * bs
        mask = mask & (first_key[None, :] <= last_query[:, None] + (S - T))
    return mask


def dense_mask(block_indices: Array, spec: SparseAttentionSpec, T: int, S: int) -> Array:
    """[B, K, T, S] bool: allowed(t, s) of the module docstring (the reference's mask)."""
    bs = spec.block_size
    blocks = block_mask(block_indices, spec, T, S)
    allowed = jnp.repeat(jnp.repeat(blocks, bs, axis=2), bs, axis=3)[:, :, :T, :S]
    if spec.causal:
        allowed = allowed & (jnp.arange(S)[None, :] <= jnp.arange(T)[:, None] + (S - T))
    return allowed


def _compact(mask: Array, width: int) -> tuple[Array, Array]:
    """(the indices of mask's True entries along the last axis, ascending, in the first `width`
    columns (the rest are don't-cares), their count), int32."""
    order = jnp.argsort(~mask, axis=-1, stable=True)[..., :width].astype(jnp.int32)
    return order, jnp.sum(mask, axis=-1, dtype=jnp.int32)


def full_blocks(spec: SparseAttentionSpec, T: int, S: int) -> Array:
    """[nq, nk] bool: every query of block i may see every key of block j by position (j holds
    bs keys below S; with causal, its last key is visible to the block's first query). For a
    fixed i these are the smallest j, for a fixed j (not the key tail) the largest i: in the
    tables' ascending order they form a prefix (forward) or a suffix (transposed)."""
    bs = spec.block_size
    nq, nk = num_blocks(T, bs), num_blocks(S, bs)
    key_end = jnp.arange(nk) * bs + bs
    full = jnp.broadcast_to((key_end <= S)[None, :], (nq, nk))
    if spec.causal:
        full = full & (key_end[None, :] - 1 <= jnp.arange(nq)[:, None] * bs + (S - T))
    return full


def forward_table(block_indices: Array, spec: SparseAttentionSpec, T: int, S: int) -> tuple[Array, Array, Array]:
    """(cols [B, K, nq, W], counts [B, K, nq], full [B, K, nq]): query block i reads key blocks
    cols[..., i, :counts] (ascending, each once), the first `full` of them `full_blocks` (no
    position mask needed). W = min(block_indices' slot count, nk)."""
    width = min(max(1, block_indices.shape[-1]), num_blocks(S, spec.block_size))
    mask = block_mask(block_indices, spec, T, S)
    cols, counts = _compact(mask, width)
    full = jnp.sum(mask & full_blocks(spec, T, S), axis=-1, dtype=jnp.int32)
    return cols, counts, full


def transposed_table(block_indices: Array, spec: SparseAttentionSpec, T: int, S: int) -> tuple[Array, Array, Array]:
    """(rows [B, K, nk, nq], counts [B, K, nk], masked [B, K, nk]): key block j is read by query
    blocks rows[..., j, :counts] (ascending), the first `masked` of them not `full_blocks`."""
    mask = jnp.swapaxes(block_mask(block_indices, spec, T, S), -1, -2)
    rows, counts = _compact(mask, mask.shape[-1])
    masked = jnp.sum(mask & ~full_blocks(spec, T, S).T, axis=-1, dtype=jnp.int32)
    return rows, counts, masked


_HEADS = ("b", None, "h", None)  # q, k, v, out, dout [B, T|S, heads, H]: the batch and heads may be split
_TABLE = ("b", "h", None, None)  # block_indices [B, K, nq, W]
_LSE = ("b", "h", None)  # lse, dlse [B, N, T]


def differentiable_sparse_attention(forward: Callable[..., tuple[Array, Array]],
                                    backward: Callable[..., tuple[Array, Array, Array]]) -> Callable[..., tuple[Array, Array | None]]:
    """`fn(q, k, v, block_indices, *, spec) -> (out, lse | None)` with a custom VJP whose backward
    is `backward`; vmap folds into the batch axis (every argument has it first). Under jit with
    batch- and/or heads-sharded arrays each launch runs on its device's batch elements and heads
    (kernels/common/partitioning.py `split_launch`; query and kv heads and block_indices' heads
    split the same number of ways, so each kv head's query group stays on one device)."""

    def fwd_rows(q, k, v, idx, spec):
        split = split_launch(functools.partial(forward, spec=spec), (_HEADS, _HEADS, _HEADS, _TABLE), ((_HEADS, ()), (_LSE, ())))
        return fold_vmap_into_rows(split, (0, 1, 2, 3))(q, k, v, idx)

    @functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
    def attend(q, k, v, idx, spec):
        return fwd_rows(q, k, v, idx, spec)

    def attend_fwd(q, k, v, idx, spec):
        out, lse = fwd_rows(q, k, v, idx, spec)
        return (out, lse), (q, k, v, idx, out, lse)

    def attend_bwd(spec, residuals, cotangents):
        q, k, v, idx, out, lse = residuals
        dout, dlse = cotangents
        split = split_launch(functools.partial(backward, spec=spec), (_HEADS,) * 3 + (_TABLE, _HEADS, _LSE, _HEADS, _LSE),
                             ((_HEADS, ()),) * 3)
        fn = fold_vmap_into_rows(split, tuple(range(8)))
        dq, dk, dv = fn(q, k, v, idx, out, lse, dout.astype(out.dtype), dlse.astype(jnp.float32))
        return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), np.zeros(idx.shape, jax.dtypes.float0)

    attend.defvjp(attend_fwd, attend_bwd)

    def fn(q, k, v, block_indices, *, spec: SparseAttentionSpec):
        out, lse = attend(q, k, v, block_indices, spec)
        return out, (lse if spec.return_lse else None)

    return fn
