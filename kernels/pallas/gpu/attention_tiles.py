"""What the pallas_gpu attention kernels (attention_forward.py, attention_backward_kernels.py) share.

Which column blocks a tile visits and which positions it masks (`Band`, `Tile`, `three_loops`,
segment ids), how calls whose lengths or head dims are not the kernels' run over whole tiles
(`Tails`), and the kernels' common pieces: the log2-domain logits, ring stages under the SMEM
budget, swizzles, barriers, the key-block producer and the tile schedule. A tile is 128 rows of
one (batch, head): queries, or keys in the dK/dV kernel; its columns are the looped axis."""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental.pallas import mosaic_gpu as plgpu

from forgeax.kernels.common.attention import AttentionSpec, segment_ranges
from forgeax.kernels.pallas.gpu.warpgroups import CTA, ROWS, WGS, Schedule, bcast, i32, transforms, unravel

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)
# The kernels' head dims (others are zero-padded to the next, `Tails`).
HEAD_DIMS = (64, 96, 128, 192, 256)
SMEM_BUDGET = 200 * 1024  # a kernel's buffers; the rest of Hopper's SMEM is barriers and Pallas scratch
SMEM_LIMIT = 227 * 1024  # Hopper's largest allocation per CTA (Mosaic GPU refuses more when lowering)


def within_reach(lo, full_lo, full_hi, hi, col_lo, col_hi, uniform, blk: int):
    """Narrows a tile's column blocks (lo, full_lo, full_hi, hi) to the columns [col_lo, col_hi)
    its segment ids may reach (`segment_ranges`). The unmasked blocks keep only those inside one
    segment every row shares (uniform), none otherwise: the masked steps compare segment ids."""
    div = lambda x: lax.div(x, i32(blk))
    lo = jnp.maximum(lo, div(col_lo))
    hi = jnp.maximum(jnp.minimum(hi, div(col_hi + blk - 1)), lo)
    full_lo = jnp.where(uniform != 0, jnp.maximum(full_lo, div(col_lo + blk - 1)), hi)
    full_hi = jnp.where(uniform != 0, jnp.minimum(full_hi, div(col_hi)), hi)
    full_lo = jnp.minimum(jnp.maximum(full_lo, lo), hi)
    full_hi = jnp.minimum(jnp.maximum(full_hi, full_lo), hi)
    return lo, full_lo, full_hi, hi


def segment_inputs(row_ids, col_ids) -> tuple:
    """A kernel's segment inputs: row ids [B, R], column ids [B, C] (int32) and the reach of each
    128-row tile (`segment_ranges`); 1-element placeholders without segment ids."""
    if row_ids is None:
        return jnp.zeros((1, 1), jnp.int32), jnp.zeros((1, 1), jnp.int32), jnp.zeros((1, 1, 3), jnp.int32)
    row_ids, col_ids = row_ids.astype(jnp.int32), col_ids.astype(jnp.int32)
    return row_ids, col_ids, segment_ranges(row_ids, col_ids, CTA)


def segment_ids(buf, index, axis: int):
    """Segment ids staged in SMEM buf[index], loaded in WGMMA row (axis 1) or column (axis 0)
    layout; None when the call has none (buf is then None)."""
    return None if buf is None else plgpu.load(buf.at[index], layout=plgpu.Layout.WGMMA.reduce(axis))


def allowed(band: Band, x0, y0, shape, row_ids=None, col_ids=None):
    """Position rule AND same segment over a (rows, cols) WGMMA tile at (x0, y0), or None if
    neither applies; row_ids / col_ids: the tile's segment ids in WGMMA row / column layout."""
    ok = band.mask(x0, y0, shape)
    if row_ids is None:
        return ok
    same = bcast(row_ids, shape, 0) == bcast(col_ids, shape, 1)
    return same if ok is None else ok & same


@dataclasses.dataclass(frozen=True)
class Band:
    """Row x (this CTA's axis) sees column y (the looped axis) iff a <= y - x <= b (None =
    unbounded) and y < cols (None: every column exists; else the columns from cols on are padding
    that a real row could otherwise reach, see `Tails`)."""

    a: int | None
    b: int | None
    cols: int | None = None

    @staticmethod
    def forward(spec: AttentionSpec, tails: "Tails") -> "Band":
        T, S = tails.T, tails.S
        off = S - T  # rows are queries, columns keys: s - t in [off - left, off + right]
        # The last real query reaches key S - 1 + right: padded keys only with right > 0 or none.
        reaches_padding = tails.S_padded > S and (spec.right is None or spec.right > 0)
        return Band(None if spec.window_left is None else off - spec.window_left,
                     None if spec.right is None else off + spec.right,
                     S if reaches_padding else None)

    @staticmethod
    def keys_by_query(spec: AttentionSpec, tails: "Tails") -> "Band":
        # Padded queries may stay in: their dO is 0 and lse -inf, so they add exactly 0 (`Tails`).
        off = tails.S - tails.T  # rows are keys, columns queries: t - s in [-off - right, -off + left]
        return Band(None if spec.right is None else -off - spec.right,
                     None if spec.window_left is None else -off + spec.window_left)

    @property
    def masks(self) -> bool:
        return self.a is not None or self.b is not None or self.cols is not None

    def blocks(self, r0, rows: int, blk: int, length: int):
        """(lo, full_lo, full_hi, hi): column blocks [lo, hi) are visible to rows [r0, r0+rows);
        those in [full_lo, full_hi) are visible to every row (no mask needed)."""
        limit = length if self.cols is None else self.cols  # the columns that exist
        clip = lambda x: jnp.minimum(jnp.maximum(x, 0), limit)
        div = lambda x: lax.div(x, i32(blk))
        lo = i32(0) if self.a is None else div(clip(r0 + self.a))
        hi = i32(-(-limit // blk)) if self.b is None else div(clip(r0 + rows + self.b) + blk - 1)
        hi = jnp.maximum(hi, lo)
        full_edge = i32(limit) if self.b is None else clip(r0 + self.b + 1)  # columns below it: every row
        full_hi = jnp.minimum(jnp.maximum(div(full_edge), lo), hi)
        full_lo = lo if self.a is None else div(clip(r0 + rows - 1 + self.a) + blk - 1)
        full_lo = jnp.minimum(jnp.maximum(full_lo, lo), full_hi)
        return lo, full_lo, full_hi, hi

    def mask(self, x0, y0, shape):
        """Allowed (x, y) over a (rows, cols) register tile starting at (x0, y0), WGMMA layout."""
        x = plgpu.broadcasted_iota(jnp.int32, shape, 0, layout=plgpu.Layout.WGMMA)
        y = plgpu.broadcasted_iota(jnp.int32, shape, 1, layout=plgpu.Layout.WGMMA)
        d = (y - x) + (y0 - x0)
        rules = []
        if self.a is not None:
            rules.append(d >= self.a)
        if self.b is not None:
            rules.append(d <= self.b)
        if self.cols is not None:
            rules.append(y < self.cols - y0)
        return functools.reduce(jnp.logical_and, rules) if rules else None


@dataclasses.dataclass(frozen=True)
class PackedTiles:
    """Where the (row tile, column block) pairs of a band lie in an array that holds only those
    pairs: pair (r, j) of row tile r (128 rows) and its visible column block j (`Band.blocks`,
    blocks of blk columns) is entry base[r] + j of the packed axis, which has `count` entries.
    Under causal masking that is about half of all pairs; under a window, the band's width.
    Segment ids only narrow a tile's blocks (`within_reach`), so their pairs keep these places."""

    base: np.ndarray  # [row tiles] int32: entry of the tile's block 0 (its first visible block lo sits at base + lo)
    count: int
    blk: int

    @property
    def entries(self) -> int:
        """Length of the packed axis: `count`, but at least 1 (an array cannot be empty)."""
        return max(self.count, 1)

    @classmethod
    def of(cls, band: Band, tiles: int, blk: int, length: int) -> "PackedTiles":
        with jax.ensure_compile_time_eval():
            lo, _, _, hi = jax.vmap(lambda r: band.blocks(r * CTA, CTA, blk, length))(jnp.arange(tiles, dtype=jnp.int32))
            lo, hi = np.asarray(lo, np.int64), np.asarray(hi, np.int64)
        steps = hi - lo
        first = np.concatenate([[0], np.cumsum(steps)[:-1]])
        return cls((first - lo).astype(np.int32), int(steps.sum()), blk)

    def entry(self, base_ref, r, j):
        """Packed entry of pair (r, j), read from `base_ref` (the kernel's copy of `base`), clamped into
        the array: a pair outside the band (a block one warpgroup never wrote) reads some entry
        that the caller then ignores."""
        return jnp.minimum(jnp.maximum(base_ref[r] + j, 0), self.entries - 1)


def three_loops(lo, full_lo, full_hi, hi, step, carry, band: Band, segmented: bool = False):
    """step(j, carry, masked) over [lo, full_lo) masked, [full_lo, full_hi) unmasked, [full_hi, hi) masked."""
    if not band.masks and not segmented:  # no mask at all: every block is full
        return lax.fori_loop(lo, hi, functools.partial(step, masked=False), carry)
    carry = lax.fori_loop(lo, full_lo, functools.partial(step, masked=True), carry)
    carry = lax.fori_loop(full_lo, full_hi, functools.partial(step, masked=False), carry)
    return lax.fori_loop(full_hi, hi, functools.partial(step, masked=True), carry)


@dataclasses.dataclass(frozen=True)
class Tile:
    """One work item: 128 rows [r0, r0 + 128) (queries; keys in the dK/dV kernel) of head n of
    batch b, and the column blocks [lo, hi) it visits (`Band.blocks`)."""

    b: jax.Array
    n: jax.Array
    r0: jax.Array
    lo: jax.Array
    full_lo: jax.Array
    full_hi: jax.Array
    hi: jax.Array

    @classmethod
    def of(cls, t, dims: tuple[int, int, int], band: Band, blk: int, length: int, last_first: bool,
           reach=None) -> "Tile":
        """Tile t, an id over dims = (heads, row tiles, batch) with heads fastest, or those three
        indices. Under causal masking the longest tiles come first, so the tail of a schedule is
        made of short ones (shortest first measured slower on the forward): the last
        query tiles (`last_first`), the first key tiles otherwise. reach: with segment ids, the
        [B, row tiles, 3] ref of `segment_ranges` that narrows the blocks (`within_reach`)."""
        n, i, b = t if isinstance(t, tuple) else unravel(t, dims)
        row_tile = (dims[1] - 1 - i) if last_first else i
        r0 = row_tile * CTA
        blocks = band.blocks(r0, CTA, blk, length)
        if reach is not None:
            blocks = within_reach(*blocks, *(reach[b, row_tile, f] for f in range(3)), blk)
        return cls(b, n, r0, *blocks)

    @property
    def steps(self):
        return self.hi - self.lo


TMA_TILE_ROWS = 8


@dataclasses.dataclass(frozen=True)
class Tails:
    """A call's real lengths T, S and head dims H, Hv; the whole tiles (multiples of 128) the
    kernels run over, and the head dims they compute with (`head_dim`, `value_head_dim`: the
    kernels' choice, `kernel_head_dims`).

    Lengths that are not multiples of 128 are not copied into padded arrays: the kernels read q, k,
    v, dO, O in place and write out, dq, dk, dv in place, and TMA fills the rows of a box past the
    array's end with zeros on loads and drops them on stores (so does the interpreter). Those
    arrays are padded only when shorter than one tile (a TMA box must fit in its array) or when
    their length is not a multiple of 8 (the rows of a swizzled TMA tile: Mosaic GPU refuses
    such an array when lowering), to the next multiple of 8; the small per-row arrays (lse,
    delta, segment ids) are padded to whole tiles.

    Head dims the kernels lack (80, 160, ...) are zero-padded to the kernels' head dims, in the
    same copy as any row padding: zero columns of q and k add nothing to q k^T (the scale is the
    caller's, from the real H), zero columns of v give zero columns of out that are sliced off,
    and the gradients' padded columns are dropped. It costs the padded FLOPs (H 80 runs as 96).
    v's head dim is padded on its own (MLA's 192/128 runs as it is).

    Real positions keep their indices, so the causal / window band is that of the real call
    (`Band.forward` takes S - T from the real lengths). No real query sees a key past S: the
    band already stops at key S - 1 under causal masking (right = 0), and otherwise `Band.cols`
    masks the columns from S on (the last key block only). Rows past T are computed and dropped;
    in the backward their dO is 0 and lse -inf, so they add nothing to dk, dv. Segment ids are
    padded with their last value (the reach of each tile stays tight, `segment_ranges`)."""

    T: int
    S: int
    H: int
    Hv: int
    head_dim: int  # the kernels' q/k head dim
    value_head_dim: int  # the kernels' v head dim (that of out, dO and dv too)

    @classmethod
    def of(cls, q, k, v, head_dims: tuple[int, int]) -> "Tails":
        """The tails of q [B, T, N, H], k [B, S, K, H], v [B, S, K, Hv] run at kernel head dims
        head_dims (q/k's, v's)."""
        return cls(q.shape[1], k.shape[1], q.shape[3], v.shape[3], *head_dims)

    @property
    def T_padded(self) -> int:
        return -(-self.T // CTA) * CTA

    @property
    def S_padded(self) -> int:
        return -(-self.S // CTA) * CTA

    @staticmethod
    def _pad(x, widths: dict[int, int], **how):
        """x with widths[axis] entries appended along each axis (nothing copied if none)."""
        if not any(n > 0 for n in widths.values()):
            return x
        return jnp.pad(x, [(0, max(widths.get(a, 0), 0)) for a in range(x.ndim)], **how)

    @staticmethod
    def _tma_length(n: int) -> int:
        return max(CTA, -(-n // TMA_TILE_ROWS) * TMA_TILE_ROWS)

    def _width(self, value: bool) -> int:
        return self.value_head_dim if value else self.head_dim

    def tma_rows(self, x, value: bool = False):
        """x [B, T, N, H] (q), or [B, T, N, Hv] with `value` (out, dO), as the kernels read it."""
        return self._pad(x, {1: self._tma_length(self.T) - self.T, 3: self._width(value) - x.shape[3]})

    def tma_cols(self, x, value: bool = False):
        """x [B, S, K, H] (k), or [B, S, K, Hv] with `value` (v), as the kernels read it."""
        return self._pad(x, {1: self._tma_length(self.S) - self.S, 3: self._width(value) - x.shape[3]})

    def real_rows(self, x, head_dim: int):
        """The real part [:, :T, :, :head_dim] of a kernel result [B, T, N, ...] (out, dq)."""
        return x[:, :self.T, :, :head_dim]

    def real_cols(self, x, head_dim: int):
        """The real part [:, :S, :, :head_dim] of a kernel result [B, S, K, ...] (dk, dv)."""
        return x[:, :self.S, :, :head_dim]

    def row_stats(self, x, value=0.0):
        """x [B, N, T] (f32 per-row statistics), padded to whole tiles with `value`."""
        return self._pad(x, {2: self.T_padded - self.T}, constant_values=value)

    def ids(self, q_segment_ids, kv_segment_ids):
        """Segment ids padded to whole tiles (int32), or (None, None)."""
        if q_segment_ids is None:
            return None, None
        edge = lambda ids, n: self._pad(ids.astype(jnp.int32), {1: n}, mode="edge")
        return edge(q_segment_ids, self.T_padded - self.T), edge(kv_segment_ids, self.S_padded - self.S)


# ----------------------------------------------------------------------------- kernel pieces


def tile_schedule(steps_of, dims: tuple[int, int, int], segmented: bool, interpret: bool, persistent: bool) -> Schedule:
    """A kernel's `Schedule` over tiles dims = (heads, row tiles, batch): persistent or one CTA
    per tile, balanced by steps_of (a tile's ring uses). With segment ids a tile's uses depend on
    the data, which the table built here cannot know (the kernel counts them itself): the tiles
    are dealt in tile order at equal weights."""
    if segmented:
        steps_of = lambda t: t * 0 + 1
    return Schedule.of(steps_of, dims, persistent, interpret)



def scores(x, spec: AttentionSpec):
    """Raw q.k products -> (s, c) with log2-domain logits s * c (scale * log2 e, soft cap).

    Without a soft cap s stays raw and c = scale * log2 e, so that `exp2_scaled(s, c, m)` is one FMA
    and an exp2 per element (the softmax's ALU work sits between the matmuls); with
    one, s are the capped logits and c = 1."""
    if spec.logit_soft_cap is None:
        return x, spec.scale * LOG2E
    cap = spec.logit_soft_cap
    return jnp.tanh(x * (spec.scale / cap)) * (cap * LOG2E), 1.0


def exp2_scaled(s, c: float, m):
    """exp2(s * c - m)."""
    return jnp.exp2((s * c if c != 1.0 else s) - m)


def cap_grad(s2, spec: AttentionSpec):
    """d capped / d uncapped = 1 - tanh^2, from the log2-domain capped logits s2."""
    t = s2 * (1.0 / (spec.logit_soft_cap * LOG2E))
    return 1.0 - t * t


def ring_stages(per_stage: int, fixed: int, cap: int = 3) -> int:
    return max(2, min(cap, (SMEM_BUDGET - fixed) // per_stage))


def block_transforms(dt, *widths: int):
    """SMEM transforms of buffers whose rows or columns are wgmma K blocks of these widths (head
    dims, key or query blocks): the widest swizzle (128, 64 or 32 bytes) that divides every width's
    bytes (`transforms`), so 32-wide blocks and head_dim 96 get 64 bytes."""
    nbytes = [w * jnp.dtype(dt).itemsize for w in widths]
    return transforms(dt, next(s for s in (128, 64, 32) if all(n % s == 0 for n in nbytes)))


def staging_and_segment_buffers(dt, blk: int, stages: int, interpret: bool, segmented: bool) -> list:
    """The last scratch entries of every kernel here (None where the call needs none): the
    per-warpgroup (rows, blk) buffer through which interpret mode stages register-LHS wgmma
    operands (`Mma`), the row segment ids of each warpgroup's rows, and the column segment ids
    of each ring slot's blk columns."""
    return [
        plgpu.SMEM((WGS, ROWS, blk), dt, transforms=block_transforms(dt, blk)) if interpret else None,
        plgpu.SMEM((WGS, ROWS), jnp.int32) if segmented else None,
        plgpu.SMEM((stages, blk), jnp.int32) if segmented else None,
    ]


def backward_barriers(tile_copies: int, slot_copies: int, stages: int, segmented: bool) -> list:
    """The dQ and dK/dV kernels' barriers: per consumer warpgroup, its tile's `tile_copies` TMA
    copies landed; per ring slot, the slot's `slot_copies` copies landed, and both consumers
    released it. With segment ids the first two count one more copy each (the ids)."""
    ids = 1 if segmented else 0
    return [
        plgpu.Barrier(num_arrivals=tile_copies + ids, num_barriers=WGS),
        plgpu.Barrier(num_arrivals=slot_copies + ids, num_barriers=stages),
        plgpu.Barrier(num_arrivals=WGS, num_barriers=stages),
    ]


def kernel_head_dims(H: int, Hv: int) -> tuple[int, int] | None:
    """The kernels' (q/k, v) head dims for a call's H and Hv (None past 256): each the smallest of
    `HEAD_DIMS` that holds it. v's may be narrower than q/k's (MLA's 192 / 128 computes P V, dO V^T
    and dv at 128), except beside 256, whose forward has no SMEM for a narrower output buffer; a v
    wider than q/k pads q/k too."""
    fit = lambda n: next((d for d in HEAD_DIMS if d >= n), None)
    dims = fit(H), fit(Hv)
    if None in dims:
        return None
    if dims[1] > dims[0] or dims[0] == HEAD_DIMS[-1]:
        return (max(dims),) * 2
    return dims


def key_block_producer(tile, G: int, stages: int, copy_block):
    """The producer's tile body in the kernels whose ring uses are a query tile's key blocks (the
    forward, `_dq_from_dz`): for block i of tile t (ring use g = base + i, in slot g mod stages)
    copy_block(tile t, its kv head, i, g, slot) waits for the slot and starts its copies."""

    def one_tile(kk, t, base):
        tl = tile(t)
        kh = lax.div(tl.n, i32(G))

        def load(i, c):
            g = base + i
            copy_block(tl, kh, i, g, lax.rem(g, i32(stages)))
            return c

        lax.fori_loop(0, tl.steps, load, None)
        return base + tl.steps

    return one_tile


def tails_of(q, k, v) -> Tails:
    return Tails.of(q, k, v, kernel_head_dims(q.shape[3], v.shape[3]))

