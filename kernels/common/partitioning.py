"""Row-wise kernel launches that XLA's SPMD partitioner splits by rows, not gathers.

A kernel launch (a jax-triton custom call, a Pallas/Mosaic call, an interpreter
callback) has no partitioning rule: under `jax.jit` with sharded inputs, XLA
would all-gather every operand and run the whole kernel on every device.
`rowwise(fn, ...)` wraps a row-wise launch in `jax.experimental.custom_partitioning`
with the rule "rows may be split, everything else is replicated":

  * ROWS arguments/outputs: their first `row_ndim` axes are the rows (e.g. the
    batch and token axes of x [B, T, D]); each device runs `fn` on its own rows.
    The other axes (the normalised feature axis, a vocabulary axis) are forced
    replicated: a caller that shards them pays an all-gather of those axes.
  * WHOLE arguments (weights) are replicated.
  * SUM outputs are sums over all rows (weight gradients, a summed loss): each
    device sums its rows, then one all-reduce over the row-sharding mesh axes.

`fn` sees ROWS arrays flattened to (rows, ...), so one 2-D row kernel serves any
number of leading axes, sharded over any of them. Outside a multi-device
computation the wrapper lowers to `fn` itself: unsharded calls compile to the
same kernels. Inside `shard_map` (values already local) and for interpreted
kernels (see `rowwise`) it is not applied. Differentiate around it (custom_vjp),
not through it: custom_partitioning has no autodiff rule.

Two more launchers, same conventions: `vocab_rowwise` (the losses: rows, plus a vocabulary
axis that, when sharded, is split too; each device then runs the vocabulary-parallel path
with collectives over the mesh axes that split it) and `split_launch` (named axes such as
batch / tokens / heads, e.g. heads-sharded rope and attention).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding, PartitionSpec

from forgeax.core.runtime import interpret_enabled

ROWS = "rows"
WHOLE = "whole"
SUM = "sum"


def rowwise(fn: Callable[..., Any], arg_kinds: Sequence[str], out_kinds: Sequence[str], *, row_ndim: int = 1):
    """`fn(*args) -> tuple` as a launch the SPMD partitioner splits over rows.

    arg_kinds/out_kinds: ROWS, WHOLE (args) or SUM (outputs), one per top-level
    argument / element of fn's output tuple; each may be a pytree (or None) of arrays.
    A single out_kind (a str): fn returns one output, not a tuple.
    row_ndim: how many leading axes of every ROWS array are rows. `fn` receives
    ROWS arrays reshaped to (rows, *rest) and returns ROWS outputs as (rows, *rest).
    Returns the outputs with ROWS ones reshaped back to (*lead, *rest).
    """
    if isinstance(out_kinds, str):  # fn returns one output (an array or pytree), not a tuple
        one = rowwise(lambda *a: (fn(*a),), arg_kinds, (out_kinds,), row_ndim=row_ndim)
        return lambda *args: one(*args)[0]
    arg_kinds, out_kinds = tuple(arg_kinds), tuple(out_kinds)

    def call(*args):
        if len(args) != len(arg_kinds):
            raise TypeError(f"rowwise: expected {len(arg_kinds)} arguments, got {len(args)}")
        leaves, in_tree = jax.tree.flatten(args)
        kinds = _leaf_kinds(args, arg_kinds)
        lead = next((tuple(x.shape[:row_ndim]) for x, k in zip(leaves, kinds) if k == ROWS), None)
        if lead is None:
            raise ValueError("rowwise: no ROWS argument")
        shapes = {}

        def flat_fn(*flat):
            """fn over flat leaves (ROWS with their leading axes, scalars as (1,)), flat outputs."""
            here = tuple(next(x.shape[:row_ndim] for x, k in zip(flat, kinds) if k == ROWS))
            rows = math.prod(here)
            views = [x.reshape((rows,) + x.shape[row_ndim:]) if k == ROWS else x for x, k in zip(flat, kinds)]
            views = [v.reshape(()) if s == () else v for v, s in zip(views, scalar_shapes)]
            outs = fn(*jax.tree.unflatten(in_tree, views))
            outs = tuple(outs) if isinstance(outs, list) else outs
            if not isinstance(outs, tuple) or len(outs) != len(out_kinds):
                raise TypeError(f"rowwise: fn must return a tuple of {len(out_kinds)} outputs")
            out_leaves, out_tree = jax.tree.flatten(outs)
            okinds = _leaf_kinds(outs, out_kinds)
            shapes["out"] = (out_tree, okinds, [o.shape for o in out_leaves])
            return tuple(
                (o.reshape(here + o.shape[1:]) if k == ROWS else o.reshape(o.shape or (1,)))
                for o, k in zip(out_leaves, okinds)
            )

        scalar_shapes = [x.shape if k != ROWS else None for x, k in zip(leaves, kinds)]
        flat_in = [x.reshape(x.shape or (1,)) if k != ROWS else x for x, k in zip(leaves, kinds)]
        if interpret_enabled() or jax.sharding.get_abstract_mesh().manual_axes:
            # Inside shard_map every value is already local: nothing to partition. The CPU
            # interpreters run as host callbacks, and a callback lowered inside a
            # custom_partitioning body loses its registration (executing it crashes), so
            # interpreted kernels are left to XLA (gathered, still correct).
            out = flat_fn(*flat_in)
            out_tree, okinds, out_shapes = shapes["out"]
            return jax.tree.unflatten(out_tree, [o.reshape(s) if k != ROWS else o for o, k, s in zip(out, okinds, out_shapes)])
        # Trace once on the global shapes to learn the outputs (their kinds and ranks). Constants
        # the launch closes over (e.g. tables built with numpy) become replicated operands:
        # custom_partitioning takes none; each shard's lowering re-traces fn and builds its own.
        closed = jax.make_jaxpr(flat_fn)(*flat_in)
        consts = [jnp.asarray(c) for c in closed.consts]
        const_shapes = [c.shape for c in consts]
        consts = [c.reshape(c.shape or (1,)) for c in consts]
        out_tree, okinds, out_shapes = shapes["out"]
        out_ranks = [(row_ndim + len(s) - 1) if k == ROWS else max(len(s), 1) for s, k in zip(out_shapes, okinds)]
        n = len(flat_in)

        def global_fn(*args):
            own = [c.reshape(shape) for c, shape in zip(args[n:], const_shapes)]
            return tuple(jax.core.eval_jaxpr(closed.jaxpr, own, *args[:n]))

        def local_fn(*args):
            return flat_fn(*args[:n])

        all_kinds = kinds + [WHOLE] * len(consts)
        partitioned = _partitioned(global_fn, local_fn, all_kinds, okinds, [x.ndim for x in flat_in + consts],
                                   out_ranks, row_ndim)
        out = partitioned(*flat_in, *consts)
        out = [o.reshape(s) if k != ROWS else o for o, k, s in zip(out, okinds, out_shapes)]
        return jax.tree.unflatten(out_tree, out)

    return call


def batchable(partitioned: Callable[..., Any], whole: Callable[..., Any]) -> Callable[..., Any]:
    """`partitioned` (a custom_partitioning launch) usable under `jax.vmap`, which has no batching
    rule for custom_partitioning: a vmapped call runs `whole`, the same launch unpartitioned,
    whose kernels fold the batch themselves (a vmapped call on sharded arrays is gathered)."""
    launch = jax.custom_batching.custom_vmap(lambda *args: partitioned(*args))

    @launch.def_vmap
    def _(axis_size, in_batched, *args):
        outs = jax.vmap(whole, in_axes=tuple(0 if b else None for b in in_batched), axis_size=axis_size)(*args)
        return outs, jax.tree.map(lambda _: True, outs)

    return launch


def _leaf_kinds(values: tuple, kinds: tuple) -> list[str]:
    out = []
    for value, kind in zip(values, kinds):
        if kind not in (ROWS, WHOLE, SUM):
            raise ValueError(f"rowwise: unknown kind {kind!r}")
        out += [kind] * len(jax.tree.leaves(value))
    return out


def _rule(kinds, okinds, in_ranks, out_ranks, row_ndim):
    """The Shardy rule: shared row factors r0.. on ROWS arrays, a private factor per other axis."""
    rows = [f"r{i}" for i in range(row_ndim)]
    private = []

    def dims(kind, rank, tag):
        n = rank - row_ndim if kind == ROWS else rank
        own = [f"{tag}d{i}" for i in range(n)]
        private.extend(own)
        return " ".join((rows if kind == ROWS else []) + own)

    lhs = ", ".join(dims(k, r, f"i{j}") for j, (k, r) in enumerate(zip(kinds, in_ranks)))
    rhs = ", ".join(dims(k, r, f"o{j}") for j, (k, r) in enumerate(zip(okinds, out_ranks)))
    return f"{lhs} -> {rhs}", tuple(private)


def _row_axes(mesh, arg_shapes, kinds, row_ndim) -> tuple:
    """The mesh axes each row axis is split over, read from the first ROWS operand's sharding.

    An axis whose length the mesh axes do not divide stays whole: padded rows would add to SUM
    outputs."""
    for shape, kind in zip(arg_shapes, kinds):
        if kind == ROWS and isinstance(shape.sharding, NamedSharding):
            spec = (tuple(shape.sharding.spec) + (None,) * row_ndim)[:row_ndim]
            parts = [math.prod(mesh.shape[a] for a in _names((axes,))) for axes in spec]
            return tuple(a if n % p == 0 else None for a, n, p in zip(spec, shape.shape, parts))
    return (None,) * row_ndim


def _names(axes) -> tuple:
    names = []
    for a in axes:
        if a is None:
            continue
        names += list(a) if isinstance(a, tuple) else [a]
    return tuple(names)


def _partitioned(global_fn, local_fn, kinds, okinds, in_ranks, out_ranks, row_ndim):
    cp = custom_partitioning(global_fn)

    def shardings(mesh, row_axes):
        def one(kind, rank):
            spec = row_axes + (None,) * (rank - row_ndim) if kind == ROWS else (None,) * rank
            return NamedSharding(mesh, PartitionSpec(*spec))

        return [one(k, r) for k, r in zip(kinds, in_ranks)], [one(k, r) for k, r in zip(okinds, out_ranks)]

    def infer(mesh, arg_shapes, result_shape):
        del result_shape
        return tuple(shardings(mesh, _row_axes(mesh, arg_shapes, kinds, row_ndim))[1])

    def partition(mesh, arg_shapes, result_shape):
        del result_shape
        row_axes = _row_axes(mesh, arg_shapes, kinds, row_ndim)
        in_sh, out_sh = shardings(mesh, row_axes)
        reduce_over = _names(row_axes)

        def lower(*flat):
            outs = local_fn(*flat)
            if not reduce_over:
                return outs
            return tuple(jax.lax.psum(o, reduce_over) if k == SUM else o for o, k in zip(outs, okinds))

        return mesh, lower, tuple(out_sh), tuple(in_sh)

    rule, private = _rule(kinds, okinds, in_ranks, out_ranks, row_ndim)
    cp.def_partition(partition=partition, infer_sharding_from_operands=infer, sharding_rule=rule,
                     need_replication_factors=private)
    return batchable(cp, global_fn)


# ----------------------------------------------------------------------------- vocabulary split

VOCAB = "vocab"  # a ROWS array whose last axis (the vocabulary) may be split too
VOCAB_COLS = "vocab_cols"  # an argument that is not per row (a weight [H, V], a bias [V]): last axis may be split
VOCAB_SUM = "vocab_sum"  # an output summed over the rows (dW, db) whose last axis may be split


def vocab_rowwise(fn: Callable[..., Any], arg_kinds: Sequence[str], out_kinds: Sequence[str], *, row_ndim: int = 1):
    """`fn(*args, axis_name=...) -> tuple` as a launch split over rows and over the vocabulary.

    Every argument / output is one array. Arguments: ROWS, VOCAB (ROWS plus a last axis that may
    be split), VOCAB_COLS (not per row; last axis may be split), WHOLE. Outputs: ROWS, VOCAB,
    SUM, VOCAB_SUM (summed over the rows: each device sums its own, then one all-reduce over the
    row mesh axes). When the first VOCAB / VOCAB_COLS argument's last axis is sharded evenly
    over mesh axes A (none of them splitting rows), each device gets its slice of every
    vocabulary axis and runs `fn(..., axis_name=A)`, which combines across the slices with
    collectives over A (vocabulary-parallel); otherwise `fn(..., axis_name=None)` on whole
    rows. Rows split as in `rowwise` (fn sees them flat; the first argument is per row).
    Inside shard_map and for interpreted kernels: fn, unsplit."""
    arg_kinds, out_kinds = tuple(arg_kinds), tuple(out_kinds)
    per_row = (ROWS, VOCAB)

    def flat(args, kinds, okinds, axis_name):
        lead = tuple(args[0].shape[:row_ndim])
        rows = math.prod(lead)
        views = [a.reshape((rows,) + a.shape[row_ndim:]) if k in per_row else a for a, k in zip(args, kinds)]
        outs = fn(*views, axis_name=axis_name)
        return tuple(o.reshape(lead + o.shape[1:]) if k in per_row else o for o, k in zip(outs, okinds))

    def call(*args):
        if len(args) != len(arg_kinds):
            raise TypeError(f"vocab_rowwise: expected {len(arg_kinds)} arguments, got {len(args)}")
        if interpret_enabled() or jax.sharding.get_abstract_mesh().manual_axes:  # see rowwise
            return flat(args, arg_kinds, out_kinds, None)
        closed = jax.make_jaxpr(lambda *a: flat(a, arg_kinds, out_kinds, None))(*args)
        consts = [jnp.asarray(c) for c in closed.consts]
        n = len(args)
        kinds = arg_kinds + (WHOLE,) * len(consts)
        in_ranks = [a.ndim for a in args] + [c.ndim for c in consts]
        out_ranks = [o.ndim for o in closed.out_avals]

        def global_fn(*a):
            return tuple(jax.core.eval_jaxpr(closed.jaxpr, list(a[n:]), *a[:n]))

        cp = custom_partitioning(global_fn)

        def axes_of(mesh, arg_shapes):
            rows = _row_axes(mesh, arg_shapes, [ROWS if k == VOCAB else k for k in kinds], row_ndim)
            vocab = None
            for shape, kind in zip(arg_shapes, kinds):
                if kind in (VOCAB, VOCAB_COLS) and isinstance(shape.sharding, NamedSharding):
                    spec = tuple(shape.sharding.spec) + (None,) * len(shape.shape)
                    names = _names((spec[len(shape.shape) - 1],))
                    if names and not set(names) & set(_names(rows)) and shape.shape[-1] % math.prod(mesh.shape[a] for a in names) == 0:
                        vocab = names if len(names) > 1 else names[0]
                    break
            return rows, vocab

        def shardings(mesh, rows, vocab, which_kinds, ranks):
            def one(kind, rank):
                if kind in (WHOLE, SUM):
                    return NamedSharding(mesh, PartitionSpec(*(None,) * rank))
                if kind in (VOCAB_COLS, VOCAB_SUM):
                    return NamedSharding(mesh, PartitionSpec(*((None,) * (rank - 1) + (vocab,))))
                rest = (None,) * (rank - row_ndim)
                if kind == VOCAB and rest:
                    rest = rest[:-1] + (vocab,)
                return NamedSharding(mesh, PartitionSpec(*(rows + rest)))
            return [one(k, r) for k, r in zip(which_kinds, ranks)]

        def infer(mesh, arg_shapes, result_shape):
            del result_shape
            return tuple(shardings(mesh, *axes_of(mesh, arg_shapes), out_kinds, out_ranks))

        def partition(mesh, arg_shapes, result_shape):
            del result_shape
            rows, vocab = axes_of(mesh, arg_shapes)
            reduce_over = _names(rows)

            def lower(*a):
                outs = flat(a[:n], arg_kinds, out_kinds, vocab)
                if not reduce_over:
                    return outs
                return tuple(jax.lax.psum(o, reduce_over) if k in (SUM, VOCAB_SUM) else o for o, k in zip(outs, out_kinds))

            return (mesh, lower, tuple(shardings(mesh, rows, vocab, out_kinds, out_ranks)),
                    tuple(shardings(mesh, rows, vocab, kinds, in_ranks)))

        rule, private, reduced = _vocab_rule(kinds, out_kinds, in_ranks, out_ranks, row_ndim)
        cp.def_partition(partition=partition, infer_sharding_from_operands=infer, sharding_rule=rule,
                         need_replication_factors=private, reduction_factors=reduced)
        return batchable(cp, global_fn)(*args, *consts)

    return call


def _vocab_rule(kinds, okinds, in_ranks, out_ranks, row_ndim):
    """Row factors r0.., a vocabulary factor v on every vocabulary axis (a reduction factor when
    no output has it), a private (replicated) factor per other axis."""
    rows = [f"r{i}" for i in range(row_ndim)]
    private = []
    has_v = (VOCAB, VOCAB_COLS, VOCAB_SUM)

    def dims(kind, rank, tag):
        lead = rows if kind in (ROWS, VOCAB) else []
        n = rank - len(lead) - (kind in has_v)
        own = [f"{tag}d{i}" for i in range(n)]
        private.extend(own)
        return " ".join(lead + own + (["v"] if kind in has_v else []))

    lhs = ", ".join(dims(k, r, f"i{j}") for j, (k, r) in enumerate(zip(kinds, in_ranks)))
    rhs = ", ".join(dims(k, r, f"o{j}") for j, (k, r) in enumerate(zip(okinds, out_ranks)))
    reduced = () if any(k in has_v for k in okinds) or not any(k in has_v for k in kinds) else ("v",)
    return f"{lhs} -> {rhs}", tuple(private), reduced


# ----------------------------------------------------------------------------- named axes (batch, heads)


def split_launch(fn: Callable[..., Any], arg_dims: Sequence[Any], out_dims: Sequence[Any], *, pass_split: bool = False):
    """`fn(*args) -> tuple` as a launch the SPMD partitioner splits along named axes.

    arg_dims: per argument (None arguments allowed, skipped), a tuple naming each axis: a label
    such as "b" (batch), "t" (tokens), "h" (heads), or None (kept whole). A label is split over
    the mesh axes that shard it in the first argument that has it, when every argument and output
    with that label divides evenly (else it stays whole); all arrays with a label are split the
    same way (e.g. GQA: query and kv heads split the same number of ways, so a device's query
    heads read its own kv heads). out_dims: per output, (dims, summed): `summed` the labels the
    output is a sum over (a broadcast bias' gradient), all-reduced over their mesh axes. `fn`
    sees local arrays of the same rank. Unsharded calls lower to fn; inside shard_map and for
    interpreted kernels, fn itself (see `rowwise`).
    pass_split: fn also gets `split={label: (mesh axis names, ways)}` for the labels split in this
    call (empty when unsplit), e.g. to run collectives over a split sequence axis (ring attention)."""
    arg_dims, out_dims = tuple(arg_dims), tuple(out_dims)
    fn_of = (lambda split: functools.partial(fn, split=split)) if pass_split else (lambda split: fn)

    def call(*args):
        if interpret_enabled() or jax.sharding.get_abstract_mesh().manual_axes:
            return fn_of({})(*args)
        present = [i for i, a in enumerate(args) if a is not None]
        scalar = [args[i].ndim == 0 for i in present]
        given = [args[i].reshape(1) if sc else args[i] for i, sc in zip(present, scalar)]  # rules need rank >= 1
        dims = [(None,) if sc else tuple(arg_dims[i]) for i, sc in zip(present, scalar)]

        def full(*xs):
            out = [None] * len(args)
            for i, x, sc in zip(present, xs, scalar):
                out[i] = x.reshape(()) if sc else x
            return out

        closed, out_shape = jax.make_jaxpr(lambda *xs: tuple(fn_of({})(*full(*xs))), return_shape=True)(*given)
        out_avals = closed.out_avals
        live = [j for j, a in enumerate(out_shape) if a is not None]
        odims = [(tuple(out_dims[j][0]), tuple(out_dims[j][1])) for j in live]
        consts = [jnp.asarray(c) for c in closed.consts]
        n = len(given)
        all_dims = dims + [(None,) * c.ndim for c in consts]
        shapes = [a.shape for a in given] + [c.shape for c in consts]

        def global_fn(*xs):
            return tuple(jax.core.eval_jaxpr(closed.jaxpr, list(xs[n:]), *xs[:n]))

        def labels_of(mesh, arg_shapes):
            """label -> mesh axes (a name or tuple) it is split over, None when whole."""
            split, used = {}, set()
            for shape, ds in zip(arg_shapes, all_dims):
                spec = tuple(shape.sharding.spec) if isinstance(shape.sharding, NamedSharding) else ()
                spec = spec + (None,) * (len(ds) - len(spec))
                for axes, label in zip(spec, ds):
                    if label is None or label in split:
                        continue
                    names = _names((axes,))
                    ways = math.prod(mesh.shape[a] for a in names) if names else 1
                    sizes = [s[k] for s, d in zip(shapes, all_dims) for k, lab in enumerate(d) if lab == label]
                    sizes += [a.shape[k] for a, (d, _) in zip(out_avals, odims) for k, lab in enumerate(d) if lab == label]
                    if names and not set(names) & used and all(size % ways == 0 for size in sizes):
                        split[label] = names if len(names) > 1 else names[0]
                        used |= set(names)
                    else:
                        split[label] = None
            return split

        def shardings(mesh, split, which):
            return [NamedSharding(mesh, PartitionSpec(*(split.get(lab) if lab else None for lab in ds))) for ds in which]

        def infer(mesh, arg_shapes, result_shape):
            del result_shape
            return tuple(shardings(mesh, labels_of(mesh, arg_shapes), [d for d, _ in odims]))

        def partition(mesh, arg_shapes, result_shape):
            del result_shape
            split = labels_of(mesh, arg_shapes)

            def lower(*xs):
                ways = {lab: (_names((a,)), math.prod(mesh.shape[x] for x in _names((a,)))) for lab, a in split.items() if a}
                outs = [o for o in fn_of(ways)(*full(*xs[:n])) if o is not None]
                done = []
                for o, (_, summed) in zip(outs, odims):
                    over = _names(tuple(split.get(lab) for lab in summed))
                    done.append(jax.lax.psum(o, over) if over else o)
                return tuple(done)

            return mesh, lower, tuple(shardings(mesh, split, [d for d, _ in odims])), tuple(shardings(mesh, split, all_dims))

        private = []

        def factors(ds, tag):
            names = []
            for k, lab in enumerate(ds):
                if lab is None:
                    names.append(f"{tag}d{k}")
                    private.append(names[-1])
                else:
                    names.append(lab)
            return " ".join(names)

        rule = ", ".join(factors(d, f"i{j}") for j, d in enumerate(all_dims)) + " -> " + \
            ", ".join(factors(d, f"o{j}") for j, (d, _) in enumerate(odims))
        cp = custom_partitioning(global_fn)
        cp.def_partition(partition=partition, infer_sharding_from_operands=infer, sharding_rule=rule,
                         need_replication_factors=tuple(private))
        outs = iter(batchable(cp, global_fn)(*given, *consts))
        flat_out = [next(outs) if j in live else None for j in range(len(out_dims))]
        return tuple(flat_out)

    return call


def split_multiple_of(size: int, multiple: int) -> jax.Array | None:
    """An extra `split_launch` argument for an axis of `size` that a kernel takes only in multiples
    of `multiple` (its tile): give it the axis' label, after the arguments that have it. Its
    `size / multiple` elements must divide too, so the label is split only into multiples of
    `multiple` (else it stays whole). None (no constraint) when `multiple` is 1 or does not
    divide `size` (such a call is refused by the kernel anyway)."""
    if multiple <= 1 or size % multiple:
        return None
    return jnp.zeros((size // multiple,), jnp.int8)
