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
dq, dk, dv come back in the dtypes of q, k, v (or f32: xla_chunked's backward, whose callers
sum block gradients in f32 anyway); dbias in bias's dtype with bias's shape (None without
bias). Fully masked rows have p = 0, so they contribute nothing.

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
from forgeax.kernels.common.ring import ring_backward, ring_forward

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
    # With return_lse: False where the caller knows lse's cotangent is zero (ring attention when
    # its own caller takes no lse), so a backward that cannot take one (cuDNN's) may serve.
    lse_gradient: bool = True

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
    # Sequence-sharded calls under jit (`_ring_launch`): "shift" rings windows as per-block shifted
    # windows (the kernels take any int, negative too), "mask" as boolean mask blocks where a
    # shifted value would be negative, "no_window" gathers windowed calls, None gathers every call.
    ring: str | None = "no_window"


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


def _by_batch(kernels: AttentionKernels, spec: "AttentionSpec", backward: bool) -> Callable[..., Any]:
    """fn as a launch the SPMD partitioner splits over the batch and heads axes
    (kernels/common/partitioning.py `split_launch`): a batch- and/or heads-sharded call runs each
    device's own batch elements and heads (query and kv heads split the same number of ways, so
    GQA groups stay on one device). A bias / mask with the batch (heads) axis is split with it;
    one broadcast over it is replicated and its gradient summed over devices. Dropout hashes the
    global batch and head indices: not split. A sequence-sharded call runs as ring attention
    (`_ring_launch`) when `_ring_serves` it; else its sequence axes are gathered."""
    fn = functools.partial(kernels.backward if backward else kernels.forward, spec=spec)
    if spec.dropout_rate > 0:
        return fn

    def launch(*args):
        q, k, _, bias, mask = args[:5]
        seq = "t" if _ring_serves(kernels, spec, q, k, bias, mask) else None
        heads = ("b", seq, "h", None)  # q, k, v, out, dout [B, T, N, H]
        rows = ("b", "h", seq)  # lse, dlse [B, N, T]

        def table(a):  # bias / mask [Bb, Nb, T, S]
            if a is None:
                return ()
            return ("b" if a.shape[0] == q.shape[0] else None, "h" if a.shape[1] == q.shape[2] else None, None, None)

        seed = () if args[7] is None else (None,) * jnp.ndim(args[7])
        dims = (heads, heads, heads, table(bias), table(mask), ("b", seq), ("b", seq), seed)
        if backward:
            dims += (heads, rows, heads, rows)
            summed = tuple(lab for lab in ("b", "h") if bias is not None and lab not in table(bias))
            outs = ((heads, ()), (heads, ()), (heads, ()), (table(bias) or (None,) * 4, summed))
        else:
            outs = ((heads, ()), (rows, ()))
        if seq is None:
            return split_launch(fn, dims, outs)(*args)
        return split_launch(functools.partial(_ring_launch, kernels, spec, backward), dims, outs, pass_split=True)(*args)

    return launch


def _ring_serves(kernels: AttentionKernels, spec: AttentionSpec, q, k, bias, mask) -> bool:
    """Whether a sequence-sharded call may run as ring attention: equal query and key lengths, no
    bias / mask arrays (dropout never reaches here), windows only where the kernels ring them."""
    window = spec.window_left is not None or spec.window_right is not None
    return (kernels.ring is not None and q.shape[1] == k.shape[1] and bias is None and mask is None
            and not (window and kernels.ring == "no_window"))


def _ring_block(spec: AttentionSpec, L: int, j: int, ring: str) -> tuple[AttentionSpec, Any] | None:
    """(spec, mask or None) of L local queries against the key block j blocks behind them (j < 0:
    ahead) in global order, or None when no query may see any of its keys. Key s of that block
    sits at s - j * L in the queries' coordinates, so the causal / window reach shifts by j * L."""
    if j == 0:
        return spec, None
    d = j * L
    left, right = spec.window_left, spec.right
    if (right is not None and right + d < 1 - L) or (left is not None and left - d < 1 - L):
        return None
    right = None if right is None or right + d >= L - 1 else right + d  # None: reaches every key
    left = None if left is None or left - d >= L - 1 else left - d
    plain = dataclasses.replace(spec, causal=False, window_left=None, window_right=None)
    if ring == "shift" or all(x is None or x >= 0 for x in (left, right)):
        return dataclasses.replace(plain, window_left=left, window_right=right), None
    t, s = np.arange(L)[:, None], np.arange(L)[None, :]
    ok = np.ones((L, L), bool)
    if right is not None:
        ok &= s <= t + right
    if left is not None:
        ok &= s >= t - left
    return plain, jnp.asarray(ok[None, None])


def _ring_launch(kernels: AttentionKernels, spec: AttentionSpec, backward: bool, *args, split: dict):
    """The forward (backward) kernel of one device's partition; with the sequence axis split
    (`split["t"]`), the ring of kernels/common/ring.py over its mesh axes: device i keeps query
    block i, the key / value blocks (and kv segment ids) travel. Forward: each block's kernel
    forward, merged by lse. Backward: each block's kernel backward given the GLOBAL out and lse
    (p = exp(z - lse) is then the global probability, so the block's dq, dk, dv are its exact
    share of the gradient); dk / dv travel with their blocks and come home after n hops."""
    fn = kernels.backward if backward else kernels.forward
    if "t" not in split:
        return fn(*args, spec=spec)
    # custom_partitioning requires the unsplit launch's result types: the kernel's own dtypes
    # (xla_chunked's backward returns f32 dq, dk, dv for bf16 inputs), not q's.
    types = [None if t is None else t.dtype for t in jax.eval_shape(functools.partial(fn, spec=spec), *args)]
    axes, n = split["t"]
    axes = axes if len(axes) > 1 else axes[0]
    q, k, v, _, _, qseg, kvseg, _ = args[:8]
    B, L, N, _ = q.shape
    Hv = v.shape[3]

    def cases(step):
        """The two relations a step's key block may have: `step` blocks behind the queries (device
        i >= step) or n - step blocks ahead (i < step, wrapped round the ring)."""
        return [_ring_block(spec, L, step, kernels.ring)] + ([_ring_block(spec, L, step - n, kernels.ring)] if step else [])

    def per_case(step, me, run, empty):
        runs = [empty if c is None else functools.partial(run, *c) for c in cases(step)]
        if len(runs) == 1:
            return runs[0]()
        return jax.lax.cond(me >= step, *runs)

    if not backward:
        def block(step, me, src, kv):
            def run(block_spec, block_mask):
                out, lse = kernels.forward(q, kv[0], kv[1], None, block_mask, qseg, kv[2], None, spec=block_spec)
                return out.astype(jnp.float32), jnp.swapaxes(lse, 1, 2)

            empty = lambda: (jnp.zeros((B, L, N, Hv), jnp.float32), jnp.full((B, L, N), -jnp.inf, jnp.float32))  # noqa: E731
            return per_case(step, me, run, empty)

        out, lse = ring_forward(block, axes, n, (B, L, N, Hv), (B, L, N), (k, v, kvseg))
        return out.astype(types[0]), jnp.swapaxes(lse, 1, 2).astype(types[1])

    out, lse, dout, dlse = args[8:12]

    def block_grad(step, me, src, kv):
        def run(block_spec, block_mask):
            dq, dk, dv, _ = kernels.backward(q, kv[0], kv[1], None, block_mask, qseg, kv[2], None, out, lse, dout, dlse,
                                             spec=block_spec)
            return dq.astype(jnp.float32), dk.astype(jnp.float32), dv.astype(jnp.float32)

        empty = lambda: tuple(jnp.zeros(a.shape, jnp.float32) for a in (q, kv[0], kv[1]))  # noqa: E731
        return per_case(step, me, run, empty)

    dq, (dk, dv) = ring_backward(block_grad, axes, n, q.shape, (k, v, kvseg), (k.shape, v.shape))
    return dq.astype(types[0]), dk.astype(types[1]), dv.astype(types[2]), None


def differentiable_attention(kernels: AttentionKernels) -> Callable[..., tuple[Array, Array]]:
    """`fn(q, k, v, bias, mask, qseg, kvseg, seed, *, spec) -> (out, lse)` with a custom VJP and vmap."""

    def forward(args, spec):
        q, _, _, bias, mask = args[:5]
        rows = _batch_args(q, bias, mask, spec.dropout_rate > 0)
        return fold_vmap_into_rows(_by_batch(kernels, spec, False), rows)(*args)

    def backward(args, out, lse, dout, dlse, spec):
        q, _, _, bias, mask = args[:5]
        rows = _batch_args(q, bias, mask, spec.dropout_rate > 0)
        if bias is not None and bias.shape[0] != q.shape[0]:
            rows = ()  # dbias sums over the batch: one launch per vmapped element
        rows = rows + tuple(range(8, 12)) if rows else ()
        fn = _by_batch(kernels, spec, True)
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
