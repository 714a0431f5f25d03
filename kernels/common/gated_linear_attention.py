"""Gated linear attention: the call spec and the chunk layout every chunked backend shares.

The chunked backends (XLA's chunked form, Triton) run on a *chunk layout*: arrays
[R, Tp, N, *] whose length Tp is a multiple of the chunk size C, where every sequence starts
on a chunk boundary and padded positions hold q = k = v = 0, g = 0 (no contribution, decay 1).
  * without cu_seqlens: R = B rows, one sequence each, padded at the end to Tp = ceil(T/C) C;
  * with cu_seqlens (B == 1): R = 1 row, sequence i moved to start at chunk-aligned offset
    sum_{j<i} ceil(len_j / C) C (Tp a static bound: ceil((T + S (C - 1)) / C) C).
Two int32 tables say where the recurrent state resets: starts[r, n] = the sequence that begins
at chunk n of row r (its initial state is loaded there), else -1; ends[r, n] = the sequence
that ends just before chunk boundary n (its final state is read there), else -1. Empty
sequences appear in neither (their final state is their initial state).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from forgeax.kernels.common.partitioning import split_launch

SUB_CHUNK = 16  # rows of one intra-chunk block: the tl.dot granularity of the chunked kernels


@dataclasses.dataclass(frozen=True)
class GLASpec:
    """Static options of one call: the output scale, the chunk size of the chunked forms, and
    whether an initial state is given / a final state returned."""

    scale: float
    chunk_size: int = 64


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where the tokens of [B, T] sit in the chunk layout (module docstring)."""

    rows: int
    padded_length: int
    chunk: int
    starts: jax.Array  # [rows, NC] int32
    ends: jax.Array  # [rows, NC + 1] int32
    dest: jax.Array | None  # [T] int32 position in the single row (cu_seqlens), else None
    lengths: jax.Array  # [S] int32 sequence lengths

    @property
    def chunks(self) -> int:
        return self.padded_length // self.chunk


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def make_layout(batch: int, length: int, chunk: int, cu_seqlens: jax.Array | None) -> Layout:
    if cu_seqlens is None:
        tp = max(_round_up(length, chunk), chunk)
        nc = tp // chunk
        rows = jnp.arange(batch, dtype=jnp.int32)
        starts = jnp.full((batch, nc), -1, jnp.int32).at[:, 0].set(rows)
        ends = jnp.full((batch, nc + 1), -1, jnp.int32).at[:, -(-length // chunk)].set(rows)
        return Layout(batch, tp, chunk, starts, ends, None, jnp.full((batch,), length, jnp.int32))
    cu = cu_seqlens.astype(jnp.int32)
    seqs = cu.shape[0] - 1
    tp = max(_round_up(length + seqs * (chunk - 1), chunk), chunk)
    nc = tp // chunk
    lengths = cu[1:] - cu[:-1]
    padded = (lengths + chunk - 1) // chunk * chunk
    pstart = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(padded)[:-1]])
    pos = jnp.arange(length, dtype=jnp.int32)
    seq = jnp.clip(jnp.searchsorted(cu, pos, side="right") - 1, 0, seqs - 1)
    dest = pstart[seq] + pos - cu[seq]
    ids = jnp.arange(seqs, dtype=jnp.int32)
    live = lengths > 0
    # Empty sequences write to a dummy slot past the table, dropped.
    first = jnp.where(live, pstart // chunk, nc)
    last = jnp.where(live, (pstart + padded) // chunk, nc + 1)
    starts = jnp.full((nc + 1,), -1, jnp.int32).at[first].set(ids)[:nc]
    ends = jnp.full((nc + 2,), -1, jnp.int32).at[last].set(ids)[: nc + 1]
    return Layout(1, tp, chunk, starts[None], ends[None], dest, lengths)


def to_layout(x: jax.Array, layout: Layout) -> jax.Array:
    """[B, T, ...] -> [rows, Tp, ...], zeros at padded positions."""
    if layout.dest is None:
        pad = [(0, 0)] * x.ndim
        pad[1] = (0, layout.padded_length - x.shape[1])
        return jnp.pad(x, pad)
    out = jnp.zeros((1, layout.padded_length) + x.shape[2:], x.dtype)
    return out.at[0, layout.dest].set(x[0], unique_indices=True)


def from_layout(y: jax.Array, layout: Layout, length: int) -> jax.Array:
    """[rows, Tp, ...] -> [B, T, ...]."""
    if layout.dest is None:
        return y[:, :length]
    return y[0, layout.dest][None]


def chunk_cumsum(g: jax.Array, chunk: int) -> jax.Array:
    """b: the f32 cumulative sum of the log gates within each chunk, [R, Tp, N, K]."""
    r, tp = g.shape[:2]
    b = jnp.cumsum(g.astype(jnp.float32).reshape(r, tp // chunk, chunk, *g.shape[2:]), axis=2)
    return b.reshape(g.shape)


def _later_chunks(totals: jax.Array, starts: jax.Array) -> jax.Array:
    """after[:, n] = the sum of totals[:, m] over the later chunks m > n of chunk n's sequence
    (a sequence starts at chunk m where starts[:, m] >= 0): a segmented reverse scan over the
    NC chunks, as log-depth array ops (no sequential loop). totals: [R, NC, ...] f32."""
    heads = starts >= 0
    # fresh[m]: chunk m+1 starts another sequence (or m is the last chunk): m's suffix stops at m.
    fresh = jnp.concatenate([heads[:, 1:], jnp.ones_like(heads[:, :1])], axis=1)
    fresh = jnp.broadcast_to(fresh.reshape(fresh.shape + (1,) * (totals.ndim - 2)), totals.shape)

    def combine(a, b):  # a: the later chunks' suffix, b: an earlier chunk's
        return a[0] | b[0], jnp.where(b[0], b[1], a[1] + b[1])

    _, suffix = jax.lax.associative_scan(combine, (jnp.flip(fresh, 1), jnp.flip(totals, 1)), axis=1)
    suffix = jnp.flip(suffix, 1)  # suffix[m] = totals[m] + the later chunks of m's sequence
    shifted = jnp.concatenate([suffix[:, 1:], jnp.zeros_like(suffix[:, :1])], axis=1)
    return jnp.where(fresh, 0.0, shifted)


def _with_later_chunks(within: jax.Array, starts: jax.Array, chunk: int) -> jax.Array:
    """within: [R, Tp, N, K] reverse sums inside each chunk -> reverse sums inside each sequence."""
    r, tp = within.shape[:2]
    blocks = within.reshape(r, tp // chunk, chunk, *within.shape[2:])
    return (blocks + _later_chunks(blocks[:, :, 0], starts)[:, :, None]).reshape(within.shape)


def gate_gradient(db: jax.Array, starts: jax.Array, chunk: int) -> jax.Array:
    """dg from db = d loss / d b (b = the gates' running sum within each sequence): the reverse
    cumulative sum of db within each sequence of the chunk layout. db: [R, Tp, N, K] f32."""
    r, tp = db.shape[:2]
    blocks = db.reshape(r, tp // chunk, chunk, *db.shape[2:])
    within = jnp.flip(jnp.cumsum(jnp.flip(blocks, 2), axis=2), 2)
    return _with_later_chunks(within.reshape(db.shape), starts, chunk)


def _final_term(final, dfinal, ends) -> jax.Array:
    """sum_v dfinal * final of the sequence ending at each chunk's end, else 0: [R, NC, N, K]
    (the final state is exp(b_T) times the rest: its part of d loss / d b_T)."""
    ends_here = ends[:, 1:]
    term = jnp.sum(dfinal * final, axis=-1)[jnp.maximum(ends_here, 0)]
    return jnp.where((ends_here >= 0)[..., None, None], term, 0.0)


def gate_gradient_from(q, k, dq, dk, final, dfinal, starts, ends, chunk: int) -> jax.Array:
    """dg on the chunk layout from dq, dk (f32, [R, Tp, N, K]) and the final states' cotangent:
    d loss / d b_t = q_t dq_t - k_t dk_t, plus, at each sequence's end, sum_v dfinal * final
    (the final state is exp(b_T) times the rest), reverse-summed within each sequence."""
    db = q.astype(jnp.float32) * dq - k.astype(jnp.float32) * dk
    r, tp = q.shape[:2]
    term = _final_term(final, dfinal, ends)
    db = db.reshape(r, tp // chunk, chunk, *db.shape[2:]).at[:, :, -1].add(term).reshape(db.shape)
    return gate_gradient(db, starts, chunk)


def gate_gradient_from_within(within, final, dfinal, starts, ends, chunk: int) -> jax.Array:
    """gate_gradient_from, given within = the reverse sums of q dq - k dk inside each chunk
    ([R, Tp, N, K] f32, as a kernel computes them): adds the final-state term (to every row of
    the chunk where a sequence ends) and the later chunks' sums."""
    r, tp = within.shape[:2]
    blocks = within.reshape(r, tp // chunk, chunk, *within.shape[2:]) + _final_term(final, dfinal, ends)[:, :, None]
    return _with_later_chunks(blocks.reshape(within.shape), starts, chunk)


# The axes of the chunked kernels' arrays that a sharded call may split (split_by_sequences):
LAYOUT = ("b", None, "h", None)  # [R, Tp, N, *] chunk-layout arrays (q, k, v, g, b, o, do, A)
STATES = ("b", "h", None, None)  # [S, N, K, V] initial / final states and their gradients
PER_CHUNK = ("b", "h", None, None, None)  # [R, N, NC, *, *] per-chunk states
TABLE = ("b", None)  # starts / ends [R, *]


def split_by_sequences(fn, arg_dims, out_dims):
    """fn(*args) -> tuple on the chunk layout as a launch the SPMD partitioner splits over rows
    and heads (kernels/common/partitioning.py `split_launch`): under jit with batch- and/or
    heads-sharded arrays each device runs fn on its own rows (sequences) and heads, every head's
    recurrence whole. arg_dims / out_dims: LAYOUT, STATES, PER_CHUNK or TABLE per
    argument / output (None arguments allowed). Without cu_seqlens (S = R) row r is sequence r:
    fn gets tables renumbered to its local rows. Packed sequences (S != R, R = 1): heads only."""

    def call(*args):
        rows = next(a.shape[0] for a, d in zip(args, arg_dims) if d == LAYOUT)
        packed = any(a is not None and d == STATES and a.shape[0] != rows for a, d in zip(args, arg_dims))

        def local(*xs):
            if not packed:  # the sequence ids in starts / ends are the global row numbers
                here = lambda t: jnp.where(t >= 0, jnp.arange(t.shape[0], dtype=t.dtype)[:, None], -1)  # noqa: E731
                xs = [here(x) if d == TABLE else x for x, d in zip(xs, arg_dims)]
            return fn(*xs)

        heads_only = lambda dims: tuple(None if lab == "b" else lab for lab in dims) if packed else dims  # noqa: E731
        return split_launch(local, [heads_only(d) for d in arg_dims], [(heads_only(d), ()) for d in out_dims])(*args)

    return call


def on_layout(run, q, k, v, g, initial_state, cu_seqlens, chunk: int):
    """(o [B, T, N, V], final states [S, N, K, V] f32) of a chunked kernel `run(q, k, v, g, init,
    starts, ends) -> (o, final)` on the chunk layout (arrays moved there and back by XLA)."""
    b, t, n, kd = q.shape
    layout = make_layout(b, t, chunk, cu_seqlens)
    seqs = b if cu_seqlens is None else cu_seqlens.shape[0] - 1
    init = jnp.zeros((seqs, n, kd, v.shape[3]), jnp.float32) if initial_state is None else initial_state.astype(jnp.float32)
    o, final = run(*(to_layout(x, layout) for x in (q, k, v, g)), init, layout.starts, layout.ends)
    # An empty sequence's state passes through (its final-state slot is never written).
    final = jnp.where((layout.lengths > 0)[:, None, None, None], final, init)
    return from_layout(o, layout, t), final


KERNEL_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def lightning_gates(q: jax.Array, decay: jax.Array) -> jax.Array:
    """Lightning Attention's per-head decay rates [N] as GLA log gates [B, T, N, K] (f32)."""
    return jnp.broadcast_to(-decay.astype(jnp.float32)[:, None], q.shape)


def kernel_supports(q: jax.Array, v: jax.Array, max_head_dim: int) -> str | None:
    """Why a chunked GLA kernel (Triton, Mosaic TPU) cannot take q/v, or None: both backends hold
    whole K / V rows per tile, so they share the dtype list and a head-dim limit."""
    if jnp.dtype(q.dtype) not in KERNEL_DTYPES:
        return f"dtype {jnp.dtype(q.dtype).name} is not one of float32/bfloat16/float16"
    if q.shape[3] > max_head_dim or v.shape[3] > max_head_dim:
        return f"head dims K={q.shape[3]}, V={v.shape[3]}: this kernel takes up to {max_head_dim}"
    return None
