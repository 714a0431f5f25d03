"""The attention contract every backend implements, and its shared shell.

Layout (after `forgeax.ops.attention` has normalised the call):
    q [B, T, N, H]     k [B, S, K, H]     v [B, S, K, Hv]     N % K == 0 (GQA: query head n reads
    kv head n // (N // K));  q_segment_ids [B, T] int32 and kv_segment_ids [B, S] int32 (both or
    neither);  bias [Bb, Nb, T, S] float with Bb in {1, B}, Nb in {1, N};  mask [Bm, Nm, T, S] bool
    (True = may attend), same broadcasting;  dropout_seed: uint32 scalar array iff dropout_rate > 0.

Math, per batch b, query head n, query t and key s (all in f32):
    z[t, s] = scale * <q[t], k[s]>
    z       = cap * tanh(z / cap)                       if logit_soft_cap (applied BEFORE bias, so a
                                                         large negative bias still masks)
    z       = z + bias[t, s]                            if bias
    z       = -inf where not allowed(t, s)              (see `allowed_positions` and the masks below)
    lse[t]  = log(sum_s exp(z[t, s]))                   (-inf when every key is masked)
    p[t, s] = exp(z[t, s] - lse[t])                     (0 on a fully masked row)
    p       = p * keep[t, s] / (1 - dropout_rate)       if dropout (lse is not affected)
    out[t]  = sum_s p[t, s] v[s]                        (0 on a fully masked row)

allowed(t, s) is the AND of: the position rules (causal / window, aligned so that the LAST query
sits at the LAST key: query t has position t + S - T in key coordinates); q_segment_ids[t] ==
kv_segment_ids[s]; mask[t, s].

Backend signature (the `fn` of its Implementation):
    fn(q, k, v, bias, mask, q_segment_ids, kv_segment_ids, dropout_seed, *, spec) -> (out, lse)
with out [B, T, N, Hv] in q's dtype and lse [B, N, T] f32 when spec.return_lse, else None (so
every backend's output has one structure: the op may run one backend's forward and differentiate
another's); differentiable in q, k, v, bias (and through lse too: d lse / d z = p before
dropout). `supports` takes the same arguments.

Build one from two kernels with `differentiable_attention(AttentionKernels(forward, backward))`:
    forward(q, k, v, bias, mask, qseg, kvseg, seed, spec)                  -> (out, lse)
    backward(q, k, v, bias, mask, qseg, kvseg, seed, out, lse, dout, dlse, spec)
                                                                           -> (dq, dk, dv, dbias)
The backward gradient math, with D[t] = sum_h dout[t, h] * out[t, h] - dlse[t] and pd = the
dropped-out probabilities (p * keep / (1 - rate)):
    dv[s]   = sum_t pd[t, s] dout[t]
    dp[t,s] = <dout[t], v[s]> * keep[t, s] / (1 - rate)
    dz[t,s] = p[t, s] * (dp[t, s] - D[t])              (p before dropout)
    dbias   = dz summed over broadcast axes;  dz *= (1 - tanh^2) if soft cap, i.e. 1 - (z_cap / cap)^2
    dq[t]   = scale * sum_s dz[t, s] k[s];   dk[s] = scale * sum_t dz[t, s] q[t]   (summed over the
              query heads that share a kv head)
dq, dk, dv come back in the dtypes of q, k, v; dbias in bias's dtype with bias's shape (None
without bias). Fully masked rows have p = 0, so they contribute nothing.

Dropout keep-mask (every backend computes exactly this, so they agree bit for bit), in uint32
arithmetic that wraps modulo 2^32, `>>` logical:
    fmix(x)  = x ^= x >> 16; x *= 0x85EBCA6B; x ^= x >> 13; x *= 0xC2B2AE35; x ^= x >> 16
    h_bn     = fmix(seed ^ ((b * N + n) * 0x9E3779B1))
    h_t      = fmix(h_bn ^ (t * 0x85EBCA77))
    h        = fmix(h_t ^ (s * 0xC2B2AE3D))
    keep     = (h >> 8) >= round(dropout_rate * 2^24)
(b, n, t, s are the global batch, query-head, query and key indices of the normalised call.)
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from forgeax.kernels.common.batching import ManualAxes, fold_vmap_into_rows
from forgeax.kernels.common.partitioning import split_launch

Array = jax.Array

GOLDEN_BN = 0x9E3779B1
GOLDEN_T = 0x85EBCA77
GOLDEN_S = 0xC2B2AE3D
FMIX_1 = 0x85EBCA6B
FMIX_2 = 0xC2B2AE35


@dataclasses.dataclass(frozen=True)
class AttentionSpec:
    """The static options of one attention call (hashable: a jit/custom_vjp static argument).

    window_left / window_right: how many keys before / after the query's aligned position it may
    see (None = unbounded). `causal` sets window_right to 0 (the op does that when normalising).
    """

    causal: bool = False
    scale: float = 1.0
    window_left: int | None = None
    window_right: int | None = None
    logit_soft_cap: float | None = None
    dropout_rate: float = 0.0
    deterministic: bool = False  # the backward must be bitwise reproducible (no float atomics)
    return_lse: bool = False  # the caller uses lse (and may differentiate through it)

    @property
    def right(self) -> int | None:
        """The effective right reach: 0 when causal, else window_right."""
        if self.causal:
            return 0 if self.window_right is None else min(0, self.window_right)
        return self.window_right

    @property
    def has_position_mask(self) -> bool:
        return self.right is not None or self.window_left is not None

    @property
    def dropout_threshold(self) -> int:
        """Keep an element iff (hash >> 8) >= this (24-bit threshold)."""
        return int(round(self.dropout_rate * (1 << 24)))


def allowed_positions(spec: AttentionSpec, t: Array, s: Array, T: int, S: int) -> Array | None:
    """Causal/window rule for query indices t and key indices s (broadcast), or None if unrestricted.

    Query t sits at key position t + (S - T), so the last query aligns with the last key.
    """
    if not spec.has_position_mask:
        return None
    pos = t + (S - T)
    ok = jnp.ones(jnp.broadcast_shapes(jnp.shape(t), jnp.shape(s)), bool)
    if spec.right is not None:
        ok = ok & (s <= pos + spec.right)
    if spec.window_left is not None:
        ok = ok & (s >= pos - spec.window_left)
    return ok


def segment_ranges(row_ids: Array, col_ids: Array, block: int) -> Array:
    """Per block of `block` consecutive rows, the columns [lo, hi) its segment ids may reach.

    row_ids [B, R], col_ids [B, C] (int32) -> [B, cdiv(R, block), 3] int32 (lo, hi, uniform): lo
    is the first and hi - 1 the last column whose id lies in [min, max] of the block's row ids.
    That covers every column any row of the block shares a segment with, so a kernel may skip
    the column blocks outside it. When the column ids are sorted (packed sequences), every column
    in [lo, hi) has an id in that span, so a block-diagonal layout visits only the blocks near
    its diagonal; unsorted ids give a correct but looser range. No such column: lo = C, hi = 0.
    uniform = 1 iff the block's rows share one id and the columns of that id are exactly
    [lo, hi): column blocks inside [lo, hi) then need no segment mask.
    Costs one pass over B x cdiv(R, block) x C comparisons (fused into reductions).
    """
    B, R = row_ids.shape
    C = col_ids.shape[1]
    nb = -(-R // block)
    info = jnp.iinfo(jnp.int32)
    padded = lambda fill: jnp.pad(row_ids.astype(jnp.int32), ((0, 0), (0, nb * block - R)), constant_values=fill)
    lo_id = padded(info.max).reshape(B, nb, block).min(axis=-1)
    hi_id = padded(info.min).reshape(B, nb, block).max(axis=-1)
    cols = col_ids.astype(jnp.int32)[:, None, :]
    reach = (cols >= lo_id[..., None]) & (cols <= hi_id[..., None])  # [B, nb, C]
    col = jnp.arange(C, dtype=jnp.int32)
    lo = jnp.min(jnp.where(reach, col, C), axis=-1)
    hi = jnp.max(jnp.where(reach, col + 1, 0), axis=-1)
    same = jnp.sum((cols == lo_id[..., None]).astype(jnp.int32), axis=-1)
    uniform = (lo_id == hi_id) & (same == hi - lo)
    return jnp.stack([lo, hi, uniform.astype(jnp.int32)], axis=-1).astype(jnp.int32)


def _fmix(x: Array) -> Array:
    x = x ^ (x >> 16)
    x = x * jnp.uint32(FMIX_1)
    x = x ^ (x >> 13)
    x = x * jnp.uint32(FMIX_2)
    return x ^ (x >> 16)


def dropout_keep(seed: Array, b: Array, n: Array, t: Array, s: Array, num_heads: int, threshold: int) -> Array:
    """The keep mask of the module docstring (bool, broadcast over b, n, t, s)."""
    u32 = lambda a: jnp.asarray(a).astype(jnp.uint32)
    h = _fmix(u32(seed) ^ ((u32(b) * jnp.uint32(num_heads) + u32(n)) * jnp.uint32(GOLDEN_BN)))
    h = _fmix(h ^ (u32(t) * jnp.uint32(GOLDEN_T)))
    h = _fmix(h ^ (u32(s) * jnp.uint32(GOLDEN_S)))
    return (h >> 8) >= jnp.uint32(threshold)


def dropout_seed_from_key(key: Array) -> Array:
    """The uint32 seed of the keep mask, drawn from a JAX PRNG key (deterministic given the key)."""
    return jax.random.bits(key, (), jnp.uint32)


def dropout_keep_numpy(seed: int, b, n, t, s, num_heads: int, threshold: int) -> np.ndarray:
    """NumPy twin of `dropout_keep`, for tests and kernel authors."""
    with np.errstate(over="ignore"):
        u = lambda a: np.asarray(a, dtype=np.uint64) & 0xFFFFFFFF

        def fmix(x):
            x = x ^ (x >> 16)
            x = (x * FMIX_1) & 0xFFFFFFFF
            x = x ^ (x >> 13)
            x = (x * FMIX_2) & 0xFFFFFFFF
            return x ^ (x >> 16)

        h = fmix(u(seed) ^ (((u(b) * num_heads + u(n)) * GOLDEN_BN) & 0xFFFFFFFF))
        h = fmix(h ^ ((u(t) * GOLDEN_T) & 0xFFFFFFFF))
        h = fmix(h ^ ((u(s) * GOLDEN_S) & 0xFFFFFFFF))
        return (h >> 8) >= threshold


# ----------------------------------------------------------------------------- the shell

@dataclasses.dataclass(frozen=True)
class AttentionKernels:
    """A backend's forward and backward (see the module docstring for their signatures)."""

    forward: Callable[..., tuple[Array, Array]]
    backward: Callable[..., tuple[Array, Array, Array, Array | None]]


def _batch_args(q: Array, bias: Array | None, mask: Array | None, dropout: bool) -> tuple[int, ...]:
    """Positional arguments of forward/backward whose axis 0 is the batch axis B (foldable under vmap).

    Dropout hashes the batch index, so a vmapped call must not renumber batches: never fold then.
    bias/mask broadcast over the batch (leading 1) cannot be folded either when B > 1.
    """
    if dropout:
        return ()
    B = q.shape[0]
    rows = [0, 1, 2, 5, 6]
    if bias is not None and (bias.shape[0] == B):
        rows.append(3)
    if mask is not None and (mask.shape[0] == B):
        rows.append(4)
    return tuple(rows)


def _by_batch(fn: Callable[..., Any], spec: "AttentionSpec", backward: bool) -> Callable[..., Any]:
    """fn as a launch the SPMD partitioner splits over the batch and heads axes
    (kernels/common/partitioning.py `split_launch`): a batch- and/or heads-sharded call runs each
    device's own batch elements and heads (query and kv heads split the same number of ways, so
    GQA groups stay on one device). A bias / mask with the batch (heads) axis is split with it;
    one broadcast over it is replicated and its gradient summed over devices. Dropout hashes the
    global batch and head indices: not split."""
    if spec.dropout_rate > 0:
        return fn

    def launch(*args):
        q, _, _, bias, mask = args[:5]
        heads = ("b", None, "h", None)  # q, k, v, out, dout [B, T, N, H]
        rows = ("b", "h", None)  # lse, dlse [B, N, T]

        def table(a):  # bias / mask [Bb, Nb, T, S]
            if a is None:
                return ()
            return ("b" if a.shape[0] == q.shape[0] else None, "h" if a.shape[1] == q.shape[2] else None, None, None)

        seed = () if args[7] is None else (None,) * jnp.ndim(args[7])
        dims = (heads, heads, heads, table(bias), table(mask), ("b", None), ("b", None), seed)
        if backward:
            dims += (heads, rows, heads, rows)
            summed = tuple(lab for lab in ("b", "h") if bias is not None and lab not in table(bias))
            outs = ((heads, ()), (heads, ()), (heads, ()), (table(bias) or (None,) * 4, summed))
        else:
            outs = ((heads, ()), (rows, ()))
        return split_launch(fn, dims, outs)(*args)

    return launch


def differentiable_attention(kernels: AttentionKernels) -> Callable[..., tuple[Array, Array]]:
    """`fn(q, k, v, bias, mask, qseg, kvseg, seed, *, spec) -> (out, lse)` with a custom VJP and vmap."""

    def forward(args, spec):
        q, _, _, bias, mask = args[:5]
        rows = _batch_args(q, bias, mask, spec.dropout_rate > 0)
        return fold_vmap_into_rows(_by_batch(functools.partial(kernels.forward, spec=spec), spec, False), rows)(*args)

    def backward(args, out, lse, dout, dlse, spec):
        q, _, _, bias, mask = args[:5]
        rows = _batch_args(q, bias, mask, spec.dropout_rate > 0)
        if bias is not None and bias.shape[0] != q.shape[0]:
            rows = ()  # dbias sums over the batch: one launch per vmapped element
        rows = rows + tuple(range(8, 12)) if rows else ()
        fn = _by_batch(functools.partial(kernels.backward, spec=spec), spec, True)
        return fold_vmap_into_rows(fn, rows)(*args, out, lse, dout, dlse)

    def typed_forward(args, spec):
        # Inside shard_map the kernels' outputs lose their varying-axes type. It is restored here,
        # inside the custom_vjp, so that no cast is differentiated: a cast outside would transpose
        # to a psum of the cotangents (wrong gradients, and a collective that devices taking
        # different branches of a switch, as ring attention's causal blocks do, never all reach).
        axes = ManualAxes.of(*args[:4])
        out, lse = forward(args, spec)
        return (axes.apply(out), axes.apply(lse)), axes

    @functools.partial(jax.custom_vjp, nondiff_argnums=(8,))
    def attention(q, k, v, bias, mask, qseg, kvseg, seed, spec):
        return typed_forward((q, k, v, bias, mask, qseg, kvseg, seed), spec)[0]

    def attention_fwd(q, k, v, bias, mask, qseg, kvseg, seed, spec):
        args = (q, k, v, bias, mask, qseg, kvseg, seed)
        (out, lse), axes = typed_forward(args, spec)
        return (out, lse), (args, out, lse, axes)

    def attention_bwd(spec, residuals, cotangents):
        args, out, lse, axes = residuals
        dout, dlse = cotangents
        dq, dk, dv, dbias = backward(args, out, lse, dout.astype(out.dtype), dlse.astype(jnp.float32), spec)
        q, k, v, bias, mask, qseg, kvseg, seed = args
        zero_int = lambda a: None if a is None else np.zeros(a.shape, jax.dtypes.float0)
        dbias = None if bias is None else dbias.astype(bias.dtype)
        return (
            axes.apply(dq.astype(q.dtype)),
            axes.apply(dk.astype(k.dtype)),
            axes.apply(dv.astype(v.dtype)),
            axes.apply(dbias),
            zero_int(mask),
            zero_int(qseg),
            zero_int(kvseg),
            zero_int(seed),
        )

    attention.defvjp(attention_fwd, attention_bwd)

    def fn(q, k, v, bias, mask, q_segment_ids, kv_segment_ids, dropout_seed, *, spec: AttentionSpec):
        out, lse = attention(q, k, v, bias, mask, q_segment_ids, kv_segment_ids, dropout_seed, spec)
        return out, (lse if spec.return_lse else None)

    return fn


def reduce_bias_grad(dz: Array, bias_shape: tuple[int, ...]) -> Array:
    """Sum dz [B, N, T, S] down to a broadcast bias shape [Bb, Nb, T, S]."""
    axes = tuple(i for i in range(2) if bias_shape[i] == 1 and dz.shape[i] != 1)
    return dz.sum(axis=axes, keepdims=True) if axes else dz



def masked_softmax(z: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Softmax over the last axis of f32 scores z that hold -inf at disallowed keys, and its lse.

    A row with no allowed key gives p = 0 and lse = -inf, never NaN (its max is replaced by 0
    before the exp). The max is a stop_gradient shift: it cancels in p and lse. This is the XLA
    references' shared rule for empty rows (attention, paged, ragged paged, sparse)."""
    row_max = jnp.max(z, axis=-1, keepdims=True)
    row_max = jax.lax.stop_gradient(jnp.where(jnp.isfinite(row_max), row_max, 0.0))
    e = jnp.exp(z - row_max)
    total = jnp.sum(e, axis=-1, keepdims=True)
    nonempty = total > 0
    p = e / jnp.where(nonempty, total, 1.0)
    lse = jnp.where(nonempty, row_max + jnp.log(jnp.where(nonempty, total, 1.0)), -jnp.inf)[..., 0]
    return p, lse
