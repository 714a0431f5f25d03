"""Shared pieces of the ragged (grouped) matmul backends.

    out[r] = lhs[r] @ rhs[g(r)]          r in group g's rows, 0 for rows past sum(group_sizes)
    tr[g]  = lhs[rows of g]^T @ dout[rows of g]      (ragged_dot_transposed, [G, K, N])

Groups are consecutive row ranges of lhs: group g holds rows [offset_g, offset_g + size_g),
offset_g = size_0 + ... + size_{g-1}. A group_sizes sum past M is clipped at M (jax.lax.ragged_dot
leaves it undefined).

`RaggedDotSpec` is the normalised option set; `row_tiles` builds, on device, the tile table the
grouped-GEMM kernels walk (each group's rows cut into BLOCK_M tiles, empty groups get none, the
rows past the sum form one more "group" G whose tiles are written as zeros);
`differentiable_ragged_dot` is the custom_vjp shell of a kernel backend:

    d lhs = ragged_dot(dout, rhs^T)     (the forward kernel with rhs read transposed)
    d rhs = ragged_dot_transposed(lhs, dout)
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from forgeax.kernels.common.batching import ManualAxes
from forgeax.kernels.common.partitioning import split_launch, split_multiple_of


@dataclasses.dataclass(frozen=True)
class RaggedDotSpec:
    """out_dtype: the result's dtype name (preferred_element_type, else lhs's dtype)."""

    out_dtype: str


def group_bounds(group_sizes: jax.Array, m: int) -> tuple[jax.Array, jax.Array]:
    """(starts, ends) of each group's rows, int32 [G], clipped to [0, M]."""
    ends = jnp.minimum(jnp.cumsum(jnp.maximum(group_sizes.astype(jnp.int32), 0)), m).astype(jnp.int32)
    starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends[:-1]])
    return starts, ends


def max_row_tiles(m: int, g: int, block_m: int) -> int:
    """An upper bound on the row tiles of any group_sizes: each group (and the tail) adds at most
    one partial tile to cdiv(M, block_m)."""
    return -(-m // block_m) + g + 1


def row_tiles(group_sizes: jax.Array, m: int, block_m: int) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """The tile table: (group [T], row start [T], row end [T], number of tiles [1]), int32.

    T = max_row_tiles(...); entries past the number of tiles are never read. Tile t covers rows
    [start, end) (end - start <= block_m) of group `group` (G: the zero tail)."""
    g = group_sizes.shape[0]
    starts, ends = group_bounds(group_sizes, m)
    starts = jnp.concatenate([starts, ends[-1:]])  # the tail rows [sum, M) as group G
    ends = jnp.concatenate([ends, jnp.full((1,), m, jnp.int32)])
    tiles = (ends - starts + block_m - 1) // block_m
    tile_end = jnp.cumsum(tiles).astype(jnp.int32)
    t = jnp.arange(max_row_tiles(m, g, block_m), dtype=jnp.int32)
    group = jnp.minimum(jnp.searchsorted(tile_end, t, side="right"), g).astype(jnp.int32)
    first = tile_end[group] - tiles[group]
    row0 = starts[group] + (t - first) * block_m
    row1 = jnp.minimum(row0 + block_m, ends[group])
    return group, row0.astype(jnp.int32), row1.astype(jnp.int32), tile_end[-1:]


def rows_group_sizes(group_sizes: jax.Array, m_total: int, row0: jax.Array, m: int) -> jax.Array:
    """The group sizes of rows [row0, row0 + m) of an M = m_total row lhs: each group's rows cut
    to that range (int32 [G]); the whole range (row0 = 0, m = m_total) gives the clipped sizes."""
    starts, ends = group_bounds(group_sizes, m_total)
    return (jnp.clip(ends, row0, row0 + m) - jnp.clip(starts, row0, row0 + m)).astype(jnp.int32)


def _split(kernel, m_total: int, arg_dims, out_dims, guards):
    """kernel(a, b, group_sizes, **kw) as a launch the SPMD partitioner splits
    (kernels/common/partitioning.py `split_launch`) over the labelled axes: rows "m" of a (and
    b) get their shard's group sizes from the global offsets (a [M] row index rides along,
    split like the rows, for the shard's first row)."""

    def local(a, b, group_sizes, rows, *guard, **kw):
        del guard
        return (kernel(a, b, rows_group_sizes(group_sizes, m_total, rows[0], a.shape[0]), **kw),)

    def call(a, b, group_sizes, **kw):
        dims = arg_dims + ((None,), ("m",)) + tuple((label,) for label, _ in guards)
        launch = split_launch(functools.partial(local, **kw), dims, (out_dims,))
        extra = tuple(split_multiple_of(size, multiple) for _, (size, multiple) in guards)
        return launch(a, b, group_sizes, jnp.arange(m_total, dtype=jnp.int32), *extra)[0]

    return call


def split_kernels(forward, transposed, multiple: int = 1):
    """The two kernels as launches split under sharding (`_split`): rows M of lhs, the output
    axis of rhs (N, or K read transposed) and the contraction axis (partial products all-reduced
    over its shards); `transposed` over rows (its [G, K, N] summed over the row shards), K and N.
    K and N are split only into multiples of `multiple` (the kernels' tile granule)."""

    def forward_split(lhs, rhs, group_sizes, *, out_dtype, config, transpose_rhs):
        c, o = (2, 1) if transpose_rhs else (1, 2)
        rhs_dims = (None, "c", "o") if not transpose_rhs else (None, "o", "c")
        guards = (("c", (int(rhs.shape[c]), multiple)), ("o", (int(rhs.shape[o]), multiple)))
        call = _split(forward, int(lhs.shape[0]), (("m", "c"), rhs_dims), (("m", "o"), ("c",)), guards)
        return call(lhs, rhs, group_sizes, out_dtype=out_dtype, config=config, transpose_rhs=transpose_rhs)

    def transposed_split(lhs, dout, group_sizes, *, out_dtype, config):
        guards = (("a", (int(lhs.shape[1]), multiple)), ("b", (int(dout.shape[1]), multiple)))
        call = _split(transposed, int(lhs.shape[0]), (("m", "a"), ("m", "b")), ((None, "a", "b"), ("m",)), guards)
        return call(lhs, dout, group_sizes, out_dtype=out_dtype, config=config)

    return forward_split, transposed_split


def differentiable_ragged_dot(forward, transposed, *, multiple: int = 1):
    """(ragged_dot, ragged_dot_transposed) with custom VJPs from two kernels:

    forward(lhs, rhs, group_sizes, *, out_dtype, config, transpose_rhs) -> [M, N] (or [M, K]
    with rhs read as [G, N, K]); transposed(lhs, dout, group_sizes, *, out_dtype, config) ->
    [G, K, N]. Under jit with sharded arrays each device runs them on its own rows and K / N
    columns (`split_kernels`, K and N split only into multiples of `multiple`)."""
    forward, transposed = split_kernels(forward, transposed, multiple)

    # Inside shard_map the kernels' outputs lose their varying-axes type; it is restored inside
    # the custom_vjps (never differentiated), and each gradient is typed like its primal.
    def typed(kernel, a, b, group_sizes, **kwargs):
        axes = ManualAxes.of(a, b, group_sizes)
        return axes.apply(kernel(a, b, group_sizes, **kwargs)), axes

    @functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
    def ragged_dot(lhs, rhs, group_sizes, out_dtype, config):
        return typed(forward, lhs, rhs, group_sizes, out_dtype=out_dtype, config=config, transpose_rhs=False)[0]

    def ragged_dot_fwd(lhs, rhs, group_sizes, out_dtype, config):
        out, axes = typed(forward, lhs, rhs, group_sizes, out_dtype=out_dtype, config=config, transpose_rhs=False)
        return out, (lhs, rhs, group_sizes, axes)

    def ragged_dot_bwd(out_dtype, config, residuals, dout):
        del out_dtype
        lhs, rhs, group_sizes, axes = residuals
        dout = dout.astype(lhs.dtype)
        dlhs = forward(dout, rhs, group_sizes, out_dtype=lhs.dtype, config=config, transpose_rhs=True)
        drhs = transposed(lhs, dout, group_sizes, out_dtype=rhs.dtype, config=config)
        return axes.cotangent(dlhs, lhs), axes.cotangent(drhs, rhs), None

    ragged_dot.defvjp(ragged_dot_fwd, ragged_dot_bwd)

    @functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
    def ragged_dot_t(lhs, dout, group_sizes, out_dtype, config):
        return typed(transposed, lhs, dout, group_sizes, out_dtype=out_dtype, config=config)[0]

    def ragged_dot_t_fwd(lhs, dout, group_sizes, out_dtype, config):
        out, axes = typed(transposed, lhs, dout, group_sizes, out_dtype=out_dtype, config=config)
        return out, (lhs, dout, group_sizes, axes)

    def ragged_dot_t_bwd(out_dtype, config, residuals, dt):
        del out_dtype
        lhs, dout, group_sizes, axes = residuals
        dt = dt.astype(lhs.dtype)
        dlhs = forward(dout.astype(lhs.dtype), dt, group_sizes, out_dtype=lhs.dtype, config=config, transpose_rhs=True)
        ddout = forward(lhs, dt, group_sizes, out_dtype=dout.dtype, config=config, transpose_rhs=False)
        return axes.cotangent(dlhs, lhs), axes.cotangent(ddout, dout), None

    ragged_dot_t.defvjp(ragged_dot_t_fwd, ragged_dot_t_bwd)
    return ragged_dot, ragged_dot_t
