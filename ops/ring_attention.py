"""Sequence-parallel attention inside `shard_map`: `ring_attention` and its layout helpers.

The sequence axis of q, k and v is sharded over the mesh axis `axis_name` (n shards). Each
device keeps its queries; the key/value shards travel round the ring with `ppermute`, one hop
per step, while the device attends to the shard it holds with the single-device
`ops.attention` (any backend, `return_lse=True`). After n steps every query has seen every key,
and the partial results merge exactly by their log-sum-exp:

    lse = log sum_b exp(lse_b)        out = sum_b exp(lse_b - lse) * out_b

The backward pass is a second ring: the k/v shards travel again together with their dk/dv
accumulators, each block's gradient comes from re-running that block's forward under `jax.vjp`
(so no step's scores or k/v copies are kept between the passes: memory stays one shard), and
after n hops every dk/dv is back on its owner. With the merge above, the cotangents of block
b are d out_b = w_b * d out and d lse_b = w_b * (<d out, out_b - out> + d lse), w_b = exp(lse_b - lse).

Layouts (`layout=`): "contiguous" (shard i holds the i-th of n equal chunks of the sequence,
the natural order) or "zigzag" (shard i holds chunks i and 2n-1-i of 2n, which balances causal
work across the ring; `to_zigzag` / `from_zigzag` permute a whole sequence into and out of it).
Causal attention attends only where a key's global position is at most the query's: whole
blocks above the diagonal are skipped, blocks on it run the causal kernel, blocks below it the
unmasked one. A window becomes an explicit boolean mask per block (so backends that refuse
masks, pallas_gpu and cudnn, are skipped by the selection). A global length that n does not
divide: pad it with `pad_to_ring` and give the padding its own segment id. The ring loop itself
(kernels/common/ring.py) is shared with sequence-sharded `ops.attention` under plain jit.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Integer

from forgeax.kernels.common.batching import ManualAxes
from forgeax.kernels.common.ring import merge, ring_backward, ring_forward
from forgeax.ops.attention import attention

LAYOUTS = ("contiguous", "zigzag")

# Relation of a query chunk to a key chunk under causal attention.
_FULL, _DIAGONAL, _SKIP = 0, 1, 2


def chunk_ids(shard: jax.Array | int, n: int, layout: str) -> tuple:
    """Global chunk ids held by `shard` (chunks of equal length, n of them or 2n for zigzag)."""
    return (shard,) if layout == "contiguous" else (shard, 2 * n - 1 - shard)


def to_zigzag(x: jax.Array, n: int, axis: int = 1) -> jax.Array:
    """A whole sequence reordered so that its n equal shards along `axis` are the zigzag layout
    (shard i = chunks i and 2n-1-i of 2n). The length must be a multiple of 2n."""
    length = x.shape[axis]
    if length % (2 * n):
        raise ValueError(f"x: length {length} along axis {axis} must be a multiple of 2 * {n} for the zigzag layout")
    chunks = jnp.split(x, 2 * n, axis=axis)
    order = [c for i in range(n) for c in (i, 2 * n - 1 - i)]
    return jnp.concatenate([chunks[c] for c in order], axis=axis)


def from_zigzag(x: jax.Array, n: int, axis: int = 1) -> jax.Array:
    """The inverse of `to_zigzag`."""
    chunks = jnp.split(x, 2 * n, axis=axis)
    order = [c for i in range(n) for c in (i, 2 * n - 1 - i)]
    natural = [None] * (2 * n)
    for position, c in enumerate(order):
        natural[c] = chunks[position]
    return jnp.concatenate(natural, axis=axis)


def pad_to_ring(x: jax.Array, multiple: int, axis: int = 1) -> tuple[jax.Array, jax.Array]:
    """(x zero-padded along `axis` to a multiple of `multiple`, segment ids [*B, T_padded] that
    are 0 for real tokens and 1 for padding). Pass the ids as `segment_ids=(ids, ids)` so no
    real query sees a padded key; padded queries see only padding and are dropped by the caller."""
    length = x.shape[axis]
    padded = -(-length // multiple) * multiple
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, padded - length)
    lead = x.shape[:axis]
    ids = (jnp.arange(padded) >= length).astype(jnp.int32)
    return jnp.pad(x, widths), jnp.broadcast_to(ids, lead + (padded,))


class _Ring:
    """The static description of one ring call (what the forward and backward passes share)."""

    def __init__(self, axis_name, n, layout, causal, window, options, backend):
        self.axis_name, self.n, self.layout = axis_name, n, layout
        self.causal, self.window, self.options, self.backend = causal, window, options, backend

    def varying(self, x):
        """A constant typed as varying over the ring axis, as every branch of a switch must be."""
        return ManualAxes((self.axis_name,)).apply(x)

    def block(self, q, k, v, q_seg, kv_seg, me, src):
        """(out f32, lse) of the local queries against the key shard of device `src`."""
        m = len(chunk_ids(0, self.n, self.layout))
        q_chunks = jnp.split(q, m, axis=1) if m > 1 else [q]
        k_chunks = jnp.split(k, m, axis=1) if m > 1 else [k]
        v_chunks = jnp.split(v, m, axis=1) if m > 1 else [v]
        qs_chunks = jnp.split(q_seg, m, axis=1) if (q_seg is not None and m > 1) else [q_seg] * m
        ks_chunks = jnp.split(kv_seg, m, axis=1) if (kv_seg is not None and m > 1) else [kv_seg] * m
        outs, lses = [], []
        for qc, q_id in zip(range(m), chunk_ids(me, self.n, self.layout)):
            out = jnp.zeros(q_chunks[qc].shape[:-1] + (v.shape[-1],), jnp.float32)
            lse = jnp.full(q_chunks[qc].shape[:3], -jnp.inf, jnp.float32)
            for kc, k_id in zip(range(m), chunk_ids(src, self.n, self.layout)):
                seg = None if qs_chunks[qc] is None else (qs_chunks[qc], ks_chunks[kc])
                out_b, lse_b = self._pair(q_chunks[qc], k_chunks[kc], v_chunks[kc], seg, q_id, k_id)
                out, lse = merge(out, lse, out_b, lse_b)
            outs.append(out)
            lses.append(lse)
        return jnp.concatenate(outs, axis=1), jnp.concatenate(lses, axis=1)

    def _pair(self, q, k, v, seg, q_id, k_id):
        """One query chunk against one key chunk of equal length, by global chunk ids."""
        length = q.shape[1]

        def run(causal=False, mask=None):
            # Typed varying already (the kernels' custom_vjp restores the type): casting here would
            # differentiate into a psum of the cotangents.
            out, lse = attention(q, k, v, causal=causal, mask=mask, segment_ids=seg, return_lse=True,
                                 backend=self.backend, **self.options)
            return out.astype(jnp.float32), lse

        def skip():
            return (self.varying(jnp.zeros(q.shape[:-1] + (v.shape[-1],), jnp.float32)),
                    self.varying(jnp.full(q.shape[:3], -jnp.inf, jnp.float32)))

        if self.window is not None:
            left, right = self.window
            t = q_id * length + jnp.arange(length)[:, None]
            s = k_id * length + jnp.arange(length)[None, :]
            allowed = jnp.ones((length, length), bool)
            if left is not None:
                allowed &= s >= t - left
            if right is not None:
                allowed &= s <= t + right
            if self.causal:
                allowed &= s <= t
            return run(mask=allowed[None, None])
        if not self.causal:
            return run()
        relation = jnp.where(k_id < q_id, _FULL, jnp.where(k_id == q_id, _DIAGONAL, _SKIP))
        return jax.lax.switch(relation, [run, functools.partial(run, causal=True), skip])


def _forward(ring: _Ring, q, k, v, q_seg, kv_seg):
    block = lambda step, me, src, kv: ring.block(q, kv[0], kv[1], q_seg, kv[2], me, src)  # noqa: E731
    return ring_forward(block, ring.axis_name, ring.n, q.shape[:-1] + (v.shape[-1],), q.shape[:3], (k, v, kv_seg))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _ring(ring: _Ring, q, k, v, q_seg, kv_seg):
    out, lse = _forward(ring, q, k, v, q_seg, kv_seg)
    return out.astype(q.dtype), lse


def _ring_fwd(ring, q, k, v, q_seg, kv_seg):
    out, lse = _forward(ring, q, k, v, q_seg, kv_seg)
    out = out.astype(q.dtype)
    return (out, lse), (q, k, v, q_seg, kv_seg, out, lse)


def _ring_bwd(ring, residuals, cotangents):
    q, k, v, q_seg, kv_seg, out, lse = residuals
    d_out, d_lse = cotangents
    d_out = d_out.astype(jnp.float32)
    out32 = out.astype(jnp.float32)
    finite = jnp.isfinite(lse)
    safe_lse = jnp.where(finite, lse, 0.0)

    def block_grad(step, me, src, kv):
        k, v, kv_seg = kv
        (out_b, lse_b), pull = jax.vjp(lambda q, k, v: ring.block(q, k, v, q_seg, kv_seg, me, src), q, k, v)
        w = jnp.where(finite, jnp.exp(lse_b - safe_lse), 0.0)
        d_out_b = w[..., None] * d_out
        d_lse_b = w * (jnp.sum(d_out * (out_b - out32), axis=-1) + d_lse)
        return pull((d_out_b, d_lse_b))

    # Every shard and its dk / dv accumulators move on; after n hops each dk / dv is home.
    dq, (dk, dv) = ring_backward(block_grad, ring.axis_name, ring.n, q.shape, (k, v, kv_seg), (k.shape, v.shape))
    zero_seg = lambda s: None if s is None else jnp.zeros(s.shape, jax.dtypes.float0)  # noqa: E731
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), zero_seg(q_seg), zero_seg(kv_seg)


_ring.defvjp(_ring_fwd, _ring_bwd)


def ring_attention(
    q: Float[Array, "B T N H"],
    k: Float[Array, "B S K H"],
    v: Float[Array, "B S K Hv"],
    *,
    axis_name: str,
    causal: bool = False,
    window: tuple[int | None, int | None] | None = None,
    segment_ids: tuple[Integer[Array, "B T"], Integer[Array, "B S"]] | None = None,
    logit_soft_cap: float | None = None,
    scale: float | None = None,
    layout: str = "contiguous",
    return_lse: bool = False,
    backend: str | None = None,
) -> Float[Array, "B T N Hv"] | tuple[Float[Array, "B T N Hv"], Float[Array, "B T N"]]:
    """Attention over a sequence sharded along `axis_name`; call it inside `shard_map`.

    Args are the local shards: q `[B, T, N, H]`, k `[B, S, K, H]`, v `[B, S, K, Hv]` with
    T == S on every device (the sequence split into equal shards in `layout` order) and the
    semantics of `ops.attention` on the whole sequence: `causal` by global position (query t
    sees keys s <= t), `window=(left, right)` by global position, `segment_ids` as the local
    shards of the whole sequence's ids, `logit_soft_cap`, `scale` (default 1/sqrt(H)).
    `backend` is the local `ops.attention` backend (None: the selection's choice per block).

    Returns the local shard of the output `[B, T, N, Hv]` (and of lse `[B, T, N]`), equal to
    `ops.attention` on the gathered sequence, forward and gradients.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout: expected one of {LAYOUTS}, got {layout!r}")
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError(f"q, k, v: expected [B, T, heads, head_dim] local shards, got {q.shape}, {k.shape}, {v.shape}")
    if q.shape[1] != k.shape[1]:
        raise ValueError(f"k: its local length {k.shape[1]} must equal q's {q.shape[1]} (equal shards of one sequence)")
    n = jax.lax.axis_size(axis_name)
    if layout == "zigzag" and q.shape[1] % 2:
        raise ValueError(f"q: local length {q.shape[1]} must be even for the zigzag layout (two chunks per shard)")
    if window is not None:
        if not (isinstance(window, (tuple, list)) and len(window) == 2):
            raise TypeError(f"window: expected (left, right), got {window!r}")
        window = (window[0], 0 if causal else window[1])
    options = {"logit_soft_cap": logit_soft_cap, "scale": scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])}
    q_seg = kv_seg = None
    if segment_ids is not None:
        q_seg, kv_seg = (jnp.asarray(s, jnp.int32) for s in segment_ids)
    ring = _Ring(axis_name, n, layout, bool(causal), None if window is None else tuple(window), options, backend)
    out, lse = _ring(ring, q, k, v, q_seg, kv_seg)
    return (out, lse) if return_lse else out
