"""Sequence-parallel attention inside `shard_map`: `ring_attention` and its layout helpers.

The sequence axis of q, k and v is sharded over the mesh axis `axis_name` (n shards). Each
device keeps its queries; the key/value shards travel round the ring with `ppermute`, one hop
per step, while the device attends to the shard it holds with the single-device
`ops.attention` (any backend, `return_lse=True`). After n steps every query has seen every key,
and the partial results merge exactly by their log-sum-exp:

    lse = log sum_b exp(lse_b)        out = sum_b exp(lse_b - lse) * out_b

The backward pass is a second ring: the k/v shards travel again together with their dk/dv
accumulators and after n hops every dk/dv is back on its owner. Each block's gradient is the
backend's backward kernel given the GLOBAL out and lse (then p = exp(z - lse) is the global
probability and the block's dq, dk, dv are its exact share: no block forward is recomputed);
a backend without raw kernels (the XLA reference) re-runs the block's forward under `jax.vjp`
with its cotangents weighed by w_b = exp(lse_b - lse): d out_b = w_b * d out and
d lse_b = w_b * (<d out, out_b - out> + d lse). Memory stays one shard either way. The ring's
steps are one `fori_loop` (and a last step), so each kernel is compiled twice whatever n is.

Layouts (`layout=`): "contiguous" (shard i holds the i-th of n equal chunks of the sequence,
the natural order) or "zigzag" (shard i holds chunks i and 2n-1-i of 2n, which balances causal
work across the ring; `to_zigzag` / `from_zigzag` permute a whole sequence into and out of it).
Causal attention attends only where a key's global position is at most the query's: whole
blocks above the diagonal are skipped, blocks on it run the causal kernel, blocks below it the
unmasked one (zigzag: one kernel call per step, on the part of the queries and keys that
meet). A window becomes an explicit boolean mask per block (so backends that refuse masks,
pallas_gpu and cudnn, are skipped by the selection). cuDNN's backward takes no lse cotangent: it
serves the blocks only when the ring's own lse is not returned. A global length that n does not
divide: pad it with `pad_to_ring` and give the padding its own segment id. The ring loop itself
(kernels/common/ring.py) is shared with sequence-sharded `ops.attention` under plain jit.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Integer

from forgeax.core import xla_gpu_deterministic_ops
from forgeax.kernels.common.attention import AttentionSpec
from forgeax.kernels.common.batching import ManualAxes
from forgeax.kernels.common.ring import merge, ring_backward, ring_forward
from forgeax.ops.attention import ATTENTION, attention

LAYOUTS = ("contiguous", "zigzag")

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


# Which part of the local queries meets which part of the key shard held at a step, per causal
# relation (the index a `lax.switch` takes): the key shard is the device's own (DIAGONAL), an
# earlier device's (0) or a later one's (2). Parts: "all", or the "first" / "second" of the two
# zigzag chunks; None: nothing (above the diagonal). Contiguous: whole shards below the diagonal
# are seen in full, the own shard causally. Zigzag (shard i holds chunks i and 2n-1-i, so its own
# two chunks are in global order): an earlier shard's first chunk is seen in full by every local
# query and its second chunk by none; a later shard is seen in full by the local second chunk only.
_DIAGONAL = 1
_CAUSAL_PARTS = {
    "contiguous": (("all", "all", False), ("all", "all", True), None),
    "zigzag": (("all", "first", False), ("all", "all", True), ("second", "all", False)),
}


def _part(x, which: str):
    """The queries' / keys' `which` part along the sequence axis (1)."""
    if x is None or which == "all":
        return x
    half = x.shape[1] // 2
    return x[:, :half] if which == "first" else x[:, half:]


def _place(x, which: str, length: int, fill: float):
    """x ([B, t, ...], a part) as the whole local length, `fill` where the part is not."""
    if which == "all":
        return x
    pad = [(0, 0)] * x.ndim
    pad[1] = (length - x.shape[1], 0) if which == "second" else (0, length - x.shape[1])
    return jnp.pad(x, pad, constant_values=fill)


class _Local:
    """How the ring attends one query block to one key block. With the raw kernels of the
    backend chosen for the block (`Implementation.kernels`), the backward is the kernel's
    backward given the GLOBAL out and lse: p = exp(z - lse) is then the global probability, so
    the block's dq, dk, dv are its exact share and no block forward is recomputed. Otherwise (a
    backend without them, e.g. the XLA reference) `ops.attention`, whose block gradient re-runs
    the block's forward under `jax.vjp` and weighs its cotangents by w = exp(lse_b - lse):
    d out_b = w d out, d lse_b = w (<d out, out_b - out> + d lse)."""

    def __init__(self, spec: AttentionSpec, backend, axes: ManualAxes):
        self.spec, self.backend, self.axes = spec, backend, axes

    def _spec(self, causal: bool) -> AttentionSpec:
        return dataclasses.replace(self.spec, causal=causal)

    @staticmethod
    def _ids(seg):
        """(q segment ids, kv segment ids), or (None, None)."""
        return seg if seg is not None else (None, None)

    def _kernels(self, q, k, v, seg, causal, mask, backward: bool):
        """The raw kernels of the backend (and config) ops.attention picks for this block's
        forward or backward, as its own call (its shapes and causality; a forward-only rule may
        pick another backend for the forward: the backward takes any out and lse), or None where
        that backend has none."""
        qs, ks = self._ids(seg)
        choice = ATTENTION.select((q, k, v, None, mask, qs, ks, None), {"spec": self._spec(causal)}, self.backend)
        impl, config = choice.impl, choice.config
        if backward and choice.gradient_impl is not None:
            impl, config = choice.gradient_impl, choice.gradient_config
        return None if impl.kernels is None else impl.kernels(config)

    def forward(self, q, k, v, seg, causal, mask):
        """(out f32 [B, t, N, Hv], lse f32 [B, t, N]) of queries q against keys k, values v."""
        kernels = self._kernels(q, k, v, seg, causal, mask, backward=False)
        if kernels is None:
            out, lse = attention(q, k, v, causal=causal, mask=mask, segment_ids=seg, return_lse=True, backend=self.backend,
                                 scale=self.spec.scale, logit_soft_cap=self.spec.logit_soft_cap)
            return out.astype(jnp.float32), lse
        qs, ks = self._ids(seg)
        out, lse = kernels.forward(q, k, v, None, mask, qs, ks, None, spec=self._spec(causal))
        # The kernels drop shard_map's varying-axes type: restored, as every switch branch needs it.
        return self.axes.apply(out.astype(jnp.float32)), self.axes.apply(jnp.swapaxes(lse, 1, 2))

    def gradient(self, q, k, v, seg, causal, mask, out, lse, d_out, d_lse):
        """(dq, dk, dv) f32: this block's share of the gradient, given the global out (q's dtype),
        lse [B, t, N] and their cotangents for these queries."""
        kernels = self._kernels(q, k, v, seg, causal, mask, backward=True)
        if kernels is not None:
            qs, ks = self._ids(seg)
            dq, dk, dv, _ = kernels.backward(q, k, v, None, mask, qs, ks, None, out, jnp.swapaxes(lse, 1, 2),
                                             d_out.astype(out.dtype), jnp.swapaxes(d_lse, 1, 2), spec=self._spec(causal))
            return tuple(self.axes.apply(g.astype(jnp.float32)) for g in (dq, dk, dv))
        (out_b, lse_b), pull = jax.vjp(lambda q, k, v: self.forward(q, k, v, seg, causal, mask), q, k, v)
        finite = jnp.isfinite(lse)
        w = jnp.where(finite, jnp.exp(lse_b - jnp.where(finite, lse, 0.0)), 0.0)
        d_out = d_out.astype(jnp.float32)
        d_lse_b = w * (jnp.sum(d_out * (out_b - out.astype(jnp.float32)), axis=-1) + d_lse)
        return tuple(g.astype(jnp.float32) for g in pull((w[..., None] * d_out, d_lse_b)))


class _Ring:
    """The static description of one ring call (what the forward and backward passes share)."""

    def __init__(self, axis_name, n, layout, causal, window, local: _Local):
        self.axis_name, self.n, self.layout = axis_name, n, layout
        self.causal, self.window, self.local = causal, window, local

    def _empty(self, shape, fill):
        return self.local.axes.apply(jnp.full(shape, fill, jnp.float32))

    def _switch(self, me, src, branch):
        """branch(part)() for this step's (query part, key part, causal) (part None: skip): the one
        unmasked part without causality, else a switch on src's key shard's causal relation."""
        if not self.causal:
            return branch(("all", "all", False))()
        relation = jnp.where(src < me, 0, jnp.where(src == me, _DIAGONAL, 2))
        return jax.lax.switch(relation, [branch(part) for part in _CAUSAL_PARTS[self.layout]])

    def block(self, q, k, v, q_seg, kv_seg, me, src):
        """(out f32, lse) of the local queries against the key shard of device `src`."""
        if self.window is not None:
            return self._window_block(q, k, v, q_seg, kv_seg, me, src)
        L, out_shape = q.shape[1], q.shape[:3] + (v.shape[-1],)

        def branch(part):
            if part is None:
                return lambda: (self._empty(out_shape, 0.0), self._empty(q.shape[:3], -jnp.inf))
            qp, kp, causal = part

            def run():
                seg = None if q_seg is None else (_part(q_seg, qp), _part(kv_seg, kp))
                out, lse = self.local.forward(_part(q, qp), _part(k, kp), _part(v, kp), seg, causal, None)
                return _place(out, qp, L, 0.0), _place(lse, qp, L, -jnp.inf)
            return run

        return self._switch(me, src, branch)

    def block_grad(self, q, k, v, q_seg, kv_seg, out, lse, d_out, d_lse, me, src):
        """(dq, dk, dv) f32 of the local queries' share against the key shard of device `src`."""
        if self.window is not None:
            return self._window_block_grad(q, k, v, q_seg, kv_seg, out, lse, d_out, d_lse, me, src)
        L = q.shape[1]

        def branch(part):
            if part is None:
                return lambda: tuple(self._empty(a.shape, 0.0) for a in (q, k, v))
            qp, kp, causal = part

            def run():
                seg = None if q_seg is None else (_part(q_seg, qp), _part(kv_seg, kp))
                dq, dk, dv = self.local.gradient(_part(q, qp), _part(k, kp), _part(v, kp), seg, causal, None,
                                                 _part(out, qp), _part(lse, qp), _part(d_out, qp), _part(d_lse, qp))
                return _place(dq, qp, L, 0.0), _place(dk, kp, L, 0.0), _place(dv, kp, L, 0.0)
            return run

        return self._switch(me, src, branch)

    def _pairs(self, q, me, src):
        """Windowed calls: per chunk of this device's queries (one contiguous, two zigzag), a list of
        (its slice, a key chunk's slice, the boolean mask by global position) over src's chunks."""
        m = len(chunk_ids(0, self.n, self.layout))
        length = q.shape[1] // m
        left, right = self.window
        rows = []
        for qc, q_id in enumerate(chunk_ids(me, self.n, self.layout)):
            row = []
            for kc, k_id in enumerate(chunk_ids(src, self.n, self.layout)):
                t = q_id * length + jnp.arange(length)[:, None]
                s = k_id * length + jnp.arange(length)[None, :]
                allowed = jnp.ones((length, length), bool)
                if left is not None:
                    allowed &= s >= t - left
                if right is not None:
                    allowed &= s <= t + right
                if self.causal:
                    allowed &= s <= t
                row.append((slice(qc * length, (qc + 1) * length), slice(kc * length, (kc + 1) * length), allowed[None, None]))
            rows.append(row)
        return rows

    def _window_block(self, q, k, v, q_seg, kv_seg, me, src):
        outs, lses = [], []
        for row in self._pairs(q, me, src):
            out = lse = None
            for qs, ks, mask in row:
                seg = None if q_seg is None else (q_seg[:, qs], kv_seg[:, ks])
                out_p, lse_p = self.local.forward(q[:, qs], k[:, ks], v[:, ks], seg, False, mask)
                out, lse = (out_p, lse_p) if out is None else merge(out, lse, out_p, lse_p)
            outs.append(out)
            lses.append(lse)
        return jnp.concatenate(outs, axis=1), jnp.concatenate(lses, axis=1)

    def _window_block_grad(self, q, k, v, q_seg, kv_seg, out, lse, d_out, d_lse, me, src):
        m = len(chunk_ids(0, self.n, self.layout))
        dqs, dks, dvs = [], [0.0] * m, [0.0] * m
        for row in self._pairs(q, me, src):
            dq = 0.0
            for kc, (qs, ks, mask) in enumerate(row):
                seg = None if q_seg is None else (q_seg[:, qs], kv_seg[:, ks])
                g = self.local.gradient(q[:, qs], k[:, ks], v[:, ks], seg, False, mask,
                                        out[:, qs], lse[:, qs], d_out[:, qs], d_lse[:, qs])
                dq, dks[kc], dvs[kc] = dq + g[0], dks[kc] + g[1], dvs[kc] + g[2]
            dqs.append(dq)
        return tuple(jnp.concatenate(parts, axis=1) for parts in (dqs, dks, dvs))


def _forward(ring: _Ring, q, k, v, q_seg, kv_seg):
    block = lambda step, me, src, kv: ring.block(q, kv[0], kv[1], q_seg, kv[2], me, src)  # noqa: E731
    return ring_forward(block, ring.axis_name, ring.n, q.shape[:-1] + (v.shape[-1],), q.shape[:3], (k, v, kv_seg),
                        loop=True)


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

    def block_grad(step, me, src, kv):
        return ring.block_grad(q, kv[0], kv[1], q_seg, kv[2], out, lse, d_out, d_lse.astype(jnp.float32), me, src)

    # Every shard and its dk / dv accumulators move on; after n hops each dk / dv is home.
    dq, (dk, dv) = ring_backward(block_grad, ring.axis_name, ring.n, q.shape, (k, v, kv_seg), (k.shape, v.shape),
                                 loop=True)
    zero_seg = lambda s: None if s is None else jnp.zeros(s.shape, jax.dtypes.float0)  # noqa: E731
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), zero_seg(q_seg), zero_seg(kv_seg)


_ring.defvjp(_ring_fwd, _ring_bwd)


def _local(causal: bool, options: dict, backend, axis_name, lse_gradient: bool) -> _Local:
    """The block runner: per block, the backend ops.attention picks for it (or `backend`).
    `lse_gradient`: whether the ring's lse is returned, so that it may take a cotangent."""
    spec = AttentionSpec(causal=causal, scale=options["scale"], logit_soft_cap=options["logit_soft_cap"],
                         deterministic=xla_gpu_deterministic_ops(), return_lse=True, lse_gradient=lse_gradient)
    return _Local(spec, backend, ManualAxes((axis_name,)))


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
    window = None if window is None else tuple(window)
    local = _local(bool(causal), options, backend, axis_name, lse_gradient=bool(return_lse))
    ring = _Ring(axis_name, n, layout, bool(causal), window, local)
    out, lse = _ring(ring, q, k, v, q_seg, kv_seg)
    return (out, lse) if return_lse else out
