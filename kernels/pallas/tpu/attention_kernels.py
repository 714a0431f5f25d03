"""The pallas_tpu attention kernels (Mosaic TPU) and their launchers.

Per (batch b, query head n, query block i, key block j), all in f32:

    z  = scale * q_i k_j^T ; z = cap * tanh(z / cap) ; z += bias ; z = -inf where not allowed
    forward (online softmax over j, "arbitrary"; m, l, acc live in VMEM scratch):
        m' = max(m, rowmax z);  a = exp(m - m');  p = exp(z - m')
        l  = a l + rowsum p;    acc = a acc + (p * keep / (1 - rate)) v_j
        last j: out = acc / l, lse = m + log l   (l == 0: out 0, lse -inf)
    backward (p recomputed from lse; D = rowsum(dout * out) - dlse in XLA):
        p = exp(z - lse), dp = dout v^T (* keep / (1 - rate)), dz = p (dp - D)
        dv += pd^T dout, dk += scale dz'^T q, dq += scale dz' k, dbias = dz,
        with dz' = dz * (1 - tanh^2) under the soft cap.

Kernels: `_fwd_kernel`, grid (B, N, Tp/bq, Sp/bk), key axis "arbitrary"; `_dkv_kernel`, grid
(B, K, Sp/bk, G, Tp/bq): for a key block, loops (both "arbitrary") over the G query heads of its
kv head and over query blocks, dk, dv in f32 scratch, and with a bias of the full [B, N, T, S]
extent also writes dz (= dbias); `_dbias_kernel`, grid (Bb, Nb, Tp/bq, Sp/bk, B|1, N|1), for a
bias broadcast over batch or heads: sums dz over the broadcast axes in its output tile
(recomputing the scores and dO V^T); `_dq_kernel`, grid (B, N, Tp/bq, Sp/bk).
Blocks with no allowed (t, s) under causal/window are skipped with pl.when, and their index maps
are clamped into the live range so the skipped steps fetch nothing new. Segment ids narrow that
range too (splash-style): a per-block table of the first and last block of the streamed axis its
ids may reach and the first and last sharing its one id throughout, scalar-prefetched into SMEM.
Tiles that every (t, s) passes run a body without those masks (`_tile`, `_on_live_tiles`).
Dropout recomputes the contract's hash (`dropout_keep`) from the global (b, n, t, s).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from forgeax.kernels.common.attention import AttentionSpec, allowed_positions, dropout_keep
from forgeax.kernels.pallas.interpret import without_effects

_F32 = jnp.float32
# The scoped VMEM limit each kernel asks Mosaic for (the block sizes are budgeted under it).
_VMEM_LIMIT = 48 << 20


def round_up(x: int, m: int) -> int:
    return -(-x // m) * m


@dataclasses.dataclass(frozen=True)
class Layout:
    """Static shapes, block sizes and which optional inputs one call carries."""

    B: int
    T: int
    S: int
    N: int
    K: int
    H: int
    Hv: int
    bq: int
    bk: int
    dtype: jnp.dtype  # the compute dtype of q, k, v (f16 -> f32)
    bias: tuple[int, int] | None  # (Bb, Nb)
    mask: tuple[int, int] | None  # (Bm, Nm)
    segments: bool

    @property
    def G(self) -> int:
        return self.N // self.K

    @property
    def Tp(self) -> int:
        return round_up(self.T, self.bq)

    @property
    def Sp(self) -> int:
        return round_up(self.S, self.bk)

    @property
    def nq(self) -> int:
        return self.Tp // self.bq

    @property
    def nk(self) -> int:
        return self.Sp // self.bk

    @property
    def dz_from_dkv(self) -> bool:
        """A bias of the full [B, N] extent takes dz from the dK/dV kernel; a broadcast one from
        `_dbias_kernel`, which sums over the broadcast axes instead of materialising B*N*T*S."""
        return self.bias == (self.B, self.N)


def bias_dtype(bias):
    return jnp.dtype(_F32 if bias.dtype == jnp.float16 else bias.dtype)


# ----------------------------------------------------------------------------- kernel pieces


def _dot(a, b, dims):
    """f32-accumulated a . b over `dims`; exact (HIGHEST) for f32 operands."""
    precision = lax.Precision.HIGHEST if a.dtype == _F32 else None
    return lax.dot_general(a, b, (dims, ((), ())), precision=precision, preferred_element_type=_F32)


_NT = ((1,), (1,))  # a @ b.T
_NN = ((1,), (0,))  # a @ b


def _live(L: Layout, spec: AttentionSpec, i, j):
    """Whether query block i and key block j share any position-allowed (t, s) (True if unrestricted)."""
    live = True
    shift = L.S - L.T  # query t sits at key position t + S - T
    if spec.right is not None:  # some s <= t + shift + right: the block's first key vs its last query
        live = jnp.logical_and(live, j * L.bk <= (i + 1) * L.bq - 1 + shift + spec.right)
    if spec.window_left is not None:  # some s >= t + shift - left: its last key vs its first query
        live = jnp.logical_and(live, (j + 1) * L.bk - 1 >= i * L.bq + shift - spec.window_left)
    return live


def _full(L: Layout, spec: AttentionSpec, i, j):
    """Whether every (t, s) of query block i and key block j is position-allowed and a real key
    (s < S): such a tile needs no position or tail mask (True if always)."""
    full = True
    shift = L.S - L.T
    if spec.right is not None:  # its last key vs its first query
        full = jnp.logical_and(full, (j + 1) * L.bk - 1 <= i * L.bq + shift + spec.right)
    if spec.window_left is not None:  # its first key vs its last query
        full = jnp.logical_and(full, j * L.bk >= (i + 1) * L.bq - 1 + shift - spec.window_left)
    if L.Sp != L.S:
        full = jnp.logical_and(full, j < L.nk - 1)
    return full


def _reach(reach_ref, b, row, rows: int):
    """(first, last, first full, last full) streamed block of block `row` of batch b
    (`_segment_reach`)."""
    at = 4 * (b * rows + row)
    return tuple(reach_ref[at + c] for c in range(4))


def _within(x, lo, hi):
    return jnp.logical_and(x >= lo, x <= hi)


def _tile(L: Layout, spec: AttentionSpec, reach_ref, b, i, j, *, rows_are_keys: bool):
    """(live, full) of the tile (query block i, key block j): live = some (t, s) allowed by position
    and segment ids, full = every (t, s) allowed and s < S, so `_scores` may skip those masks.
    The reach table is per query block (forward, dq) or per key block (dkv: rows_are_keys)."""
    live, full = _live(L, spec, i, j), _full(L, spec, i, j)
    if reach_ref is not None:
        row, streamed, rows = (j, i, L.nk) if rows_are_keys else (i, j, L.nq)
        lo, hi, full_lo, full_hi = _reach(reach_ref, b, row, rows)
        live = jnp.logical_and(live, _within(streamed, lo, hi))
        full = jnp.logical_and(full, _within(streamed, full_lo, full_hi))
    return live, full


def _on_live_tiles(live, full, step):
    """Runs step(masked) where live: unmasked on full tiles, masked on the others."""
    if full is True:  # no position mask, no key tail, no segments
        pl.when(live)(lambda: step(False))
        return
    pl.when(jnp.logical_and(live, full))(lambda: step(False))
    pl.when(jnp.logical_and(live, jnp.logical_not(full)))(lambda: step(True))


def _split_reach(L: Layout, refs):
    """(segment reach ref or None, the other refs): the scalar-prefetched table comes first."""
    return (refs[0], refs[1:]) if L.segments else (None, refs)


def _scores(L: Layout, spec: AttentionSpec, q, k, opt, b, n, i, j, masked: bool):
    """(z masked with -inf, tanh of the soft cap or None, dropout keep or None) for one (bq, bk)
    tile; `masked` False skips the position, key-tail and segment masks (a full tile, `_tile`)."""
    z = _dot(q, k, _NT) * spec.scale
    th = None
    if spec.logit_soft_cap is not None:
        th = jnp.tanh(z * (1.0 / spec.logit_soft_cap))
        z = spec.logit_soft_cap * th
    if opt.bias is not None:
        z = z + opt.bias[...].astype(_F32)
    # A (bq, 1) column of query and a (1, bk) row of key indices: the dropout hash's per-row
    # round then runs on bq elements, not bq * bk.
    t = i * L.bq + lax.broadcasted_iota(jnp.int32, (L.bq, 1), 0)
    s = j * L.bk + lax.broadcasted_iota(jnp.int32, (1, L.bk), 1)
    allowed = []
    if masked:
        if L.Sp != L.S:
            allowed.append(s < L.S)
        positions = allowed_positions(spec, t, s, L.T, L.S)
        if positions is not None:
            allowed.append(positions)
        if L.segments:
            allowed.append(opt.qseg[...] == opt.kvseg[...])  # (bq, 1) == (1, bk)
    if opt.mask is not None:
        allowed.append(opt.mask[...] != 0)
    if allowed:
        z = jnp.where(functools.reduce(jnp.logical_and, allowed), z, -jnp.inf)
    keep = None
    if spec.dropout_rate > 0:
        seed = jnp.full((1, 1), opt.seed[0], jnp.int32).astype(jnp.uint32)
        keep = dropout_keep(seed, b, n, t, s, L.N, spec.dropout_threshold)
    return z, th, keep


@dataclasses.dataclass
class _Optional:
    bias: object = None
    mask: object = None
    qseg: object = None
    kvseg: object = None
    seed: object = None


def _take_optional(L: Layout, spec: AttentionSpec, refs):
    """Splits the optional input refs (in `_optional_inputs` order) off the front of `refs`."""
    refs = list(refs)
    opt = _Optional()
    if L.bias is not None:
        opt.bias = refs.pop(0)
    if L.mask is not None:
        opt.mask = refs.pop(0)
    if L.segments:
        opt.qseg, opt.kvseg = refs.pop(0), refs.pop(0)
    if spec.dropout_rate > 0:
        opt.seed = refs.pop(0)
    return opt, refs


def _dropped(p, keep, spec):
    return p if keep is None else jnp.where(keep, p * (1.0 / (1.0 - spec.dropout_rate)), 0.0)


# ----------------------------------------------------------------------------- kernels


def _fwd_kernel(*refs, L: Layout, spec: AttentionSpec):
    reach_ref, (q_ref, k_ref, v_ref, *refs) = _split_reach(L, refs)
    opt, (o_ref, lse_ref, m_sc, l_sc, acc_sc) = _take_optional(L, spec, refs)
    b, n, i, j = (pl.program_id(a) for a in range(4))

    @pl.when(j == 0)
    def _init():
        m_sc[...] = jnp.full(m_sc.shape, -jnp.inf, _F32)
        l_sc[...] = jnp.zeros(l_sc.shape, _F32)
        acc_sc[...] = jnp.zeros(acc_sc.shape, _F32)

    def step(masked):
        z, _, keep = _scores(L, spec, q_ref[...], k_ref[...], opt, b, n, i, j, masked)
        m_old = m_sc[...]
        m_new = jnp.maximum(m_old, jnp.max(z, axis=1, keepdims=True))
        m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # an all-masked row so far: exp(-inf) = 0
        alpha = jnp.exp(m_old - m_safe)
        p = jnp.exp(z - m_safe)
        l_sc[...] = alpha * l_sc[...] + jnp.sum(p, axis=1, keepdims=True)
        m_sc[...] = m_new
        v = v_ref[...]
        acc_sc[...] = alpha * acc_sc[...] + _dot(_dropped(p, keep, spec).astype(v.dtype), v, _NN)

    _on_live_tiles(*_tile(L, spec, reach_ref, b, i, j, rows_are_keys=False), step)

    @pl.when(j == pl.num_programs(3) - 1)
    def _finish():
        l = l_sc[...]
        nonempty = l > 0
        inv = 1.0 / jnp.where(nonempty, l, 1.0)
        o_ref[...] = jnp.where(nonempty, acc_sc[...] * inv, 0.0).astype(o_ref.dtype)
        lse_ref[...] = jnp.where(nonempty, m_sc[...] + jnp.log(jnp.where(nonempty, l, 1.0)), -jnp.inf)


def _grad_tile(L, spec, q, k, v, do, lse, delta, opt, b, n, i, j, masked):
    """(pd, dz before the soft-cap factor, dz after it) of one tile, all f32."""
    z, th, keep = _scores(L, spec, q, k, opt, b, n, i, j, masked)
    p = jnp.exp(z - lse)  # lse is +inf on empty and padded rows: p = 0
    dp = _dropped(_dot(do, v, _NT), keep, spec)
    dz = p * (dp - delta)
    dz_capped = dz if th is None else dz * (1.0 - th * th)
    return _dropped(p, keep, spec), dz, dz_capped


def _dkv_kernel(*refs, L: Layout, spec: AttentionSpec):
    reach_ref, (q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *refs) = _split_reach(L, refs)
    opt, rest = _take_optional(L, spec, refs)
    dk_ref, dv_ref = rest[:2]
    dz_ref = rest[2] if L.dz_from_dkv else None
    dk_sc, dv_sc = rest[-2:]
    b, kh, j, g, i = (pl.program_id(a) for a in range(5))
    n = kh * L.G + g
    first = jnp.logical_and(g == 0, i == 0)
    last = jnp.logical_and(g == pl.num_programs(3) - 1, i == pl.num_programs(4) - 1)

    @pl.when(first)
    def _init():
        dk_sc[...] = jnp.zeros(dk_sc.shape, _F32)
        dv_sc[...] = jnp.zeros(dv_sc.shape, _F32)

    live, full = _tile(L, spec, reach_ref, b, i, j, rows_are_keys=True)

    def step(masked):
        q, do = q_ref[...], do_ref[...]
        pd, dz, dz_capped = _grad_tile(
            L, spec, q, k_ref[...], v_ref[...], do, lse_ref[...], delta_ref[...], opt, b, n, i, j, masked)
        dv_sc[...] += _dot(pd.T.astype(do.dtype), do, _NN)
        dk_sc[...] += spec.scale * _dot(dz_capped.T.astype(q.dtype), q, _NN)
        if dz_ref is not None:
            dz_ref[...] = dz

    _on_live_tiles(live, full, step)

    if dz_ref is not None:
        @pl.when(jnp.logical_not(live))
        def _skipped():
            dz_ref[...] = jnp.zeros(dz_ref.shape, _F32)

    @pl.when(last)
    def _finish():
        dk_ref[...] = dk_sc[...].astype(dk_ref.dtype)
        dv_ref[...] = dv_sc[...].astype(dv_ref.dtype)


def _dbias_kernel(*refs, L: Layout, spec: AttentionSpec):
    """dbias of a bias broadcast over batch and/or heads. Grid (Bb, Nb, nq, nk, Rb, Rn): the last
    two ("arbitrary") walk the broadcast batch (Rb = B when Bb = 1) and heads (Rn = N when
    Nb = 1), and dz accumulates in the resident f32 output tile. Costs the scores and dO V^T
    matmuls once more per (b, n) tile, but never holds more than the bias' own size."""
    reach_ref, (q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *refs) = _split_reach(L, refs)
    opt, (dbias_ref,) = _take_optional(L, spec, refs)
    gb, gn, i, j, rb, rn = (pl.program_id(a) for a in range(6))
    b, n = gb + rb, gn + rn  # one of each pair is always 0

    @pl.when(jnp.logical_and(rb == 0, rn == 0))
    def _init():
        dbias_ref[...] = jnp.zeros(dbias_ref.shape, _F32)

    def step(masked):
        _, dz, _ = _grad_tile(
            L, spec, q_ref[...], k_ref[...], v_ref[...], do_ref[...], lse_ref[...], delta_ref[...], opt, b, n, i, j, masked)
        dbias_ref[...] += dz

    _on_live_tiles(*_tile(L, spec, reach_ref, b, i, j, rows_are_keys=False), step)


def _dq_kernel(*refs, L: Layout, spec: AttentionSpec):
    reach_ref, (q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *refs) = _split_reach(L, refs)
    opt, (dq_ref, dq_sc) = _take_optional(L, spec, refs)
    b, n, i, j = (pl.program_id(a) for a in range(4))

    @pl.when(j == 0)
    def _init():
        dq_sc[...] = jnp.zeros(dq_sc.shape, _F32)

    def step(masked):
        k = k_ref[...]
        _, _, dz_capped = _grad_tile(
            L, spec, q_ref[...], k, v_ref[...], do_ref[...], lse_ref[...], delta_ref[...], opt, b, n, i, j, masked)
        dq_sc[...] += spec.scale * _dot(dz_capped.astype(k.dtype), k, _NN)

    _on_live_tiles(*_tile(L, spec, reach_ref, b, i, j, rows_are_keys=False), step)

    @pl.when(j == pl.num_programs(3) - 1)
    def _finish():
        dq_ref[...] = dq_sc[...].astype(dq_ref.dtype)


# ----------------------------------------------------------------------------- launchers
# Index maps see the grid's indices through an `ids` function that names them (b, n, i, j):
# the forward / dq grid is (B, N, nq, nk), the dkv grid (B, K, nk, G, nq). Under causal/window
# the streamed axis is clamped into the live range, so a skipped step asks for the block the
# previous step already holds and the pipeline issues no DMA for it (the body does not run).
# Bounds: floor divisions of possibly negative numbers, done with lax.div (truncation; jnp's
# // lowers through `sign`, which needs a TPU to lower); they differ only below 0, where the
# clamp to [0, n - 1] makes them agree.


def _key_range(L: Layout, spec: AttentionSpec, i):
    """(first, last) key block with allowed positions for query block i (unclamped)."""
    shift = L.S - L.T
    lo = 0 if spec.window_left is None else lax.div(i * L.bq + shift - spec.window_left, L.bk)
    hi = L.nk - 1 if spec.right is None else lax.div((i + 1) * L.bq - 1 + shift + spec.right, L.bk)
    return lo, hi


def _query_range(L: Layout, spec: AttentionSpec, j):
    """(first, last) query block with allowed positions for key block j (unclamped)."""
    shift = L.S - L.T
    lo = 0 if spec.right is None else lax.div(j * L.bk - shift - spec.right, L.bq)
    hi = L.nq - 1 if spec.window_left is None else lax.div((j + 1) * L.bk - 1 - shift + spec.window_left, L.bq)
    return lo, hi


def _clamp(x, lo, hi, n):
    return jnp.minimum(jnp.maximum(jnp.minimum(jnp.maximum(x, lo), hi), 0), n - 1)


def _narrowed(bounds, reach):
    """Position bounds (lo, hi) intersected with the segment reach (`_reach`) when there is one."""
    if reach is None:
        return bounds
    lo, hi, _, _ = reach
    return jnp.maximum(bounds[0], lo), jnp.minimum(bounds[1], hi)


def _fwd_grid_ids(L: Layout, spec: AttentionSpec):
    def ids(b, n, i, j, *reach_ref):
        if spec.has_position_mask or reach_ref:
            reach = _reach(reach_ref[0], b, i, L.nq) if reach_ref else None
            j = _clamp(j, *_narrowed(_key_range(L, spec, i), reach), L.nk)
        return b, n, i, j
    return ids


def _dkv_grid_ids(L: Layout, spec: AttentionSpec):
    def ids(b, kh, j, g, i, *reach_ref):
        if spec.has_position_mask or reach_ref:
            reach = _reach(reach_ref[0], b, j, L.nk) if reach_ref else None
            i = _clamp(i, *_narrowed(_query_range(L, spec, j), reach), L.nq)
        return b, kh * L.G + g, i, j
    return ids


def _specs(L: Layout, spec: AttentionSpec, ids, *, grad: bool):
    """BlockSpecs of (q, k, v, [do, lse, delta], optional inputs); `ids` maps grid indices (and
    the scalar-prefetched segment reach) to (b, n, i, j)."""
    at = lambda f: (lambda *g: f(*ids(*g)))  # noqa: E731
    row_block = lambda width: pl.BlockSpec((None, None, L.bq, width), at(lambda b, n, i, j: (b, n, i, 0)))  # noqa: E731
    kv_block = lambda width: pl.BlockSpec((None, None, L.bk, width), at(lambda b, n, i, j: (b, lax.div(n, L.G), j, 0)))  # noqa: E731
    specs = [row_block(L.H), kv_block(L.H), kv_block(L.Hv)]
    if grad:
        specs += [row_block(L.Hv), row_block(1), row_block(1)]
    for shape in (L.bias, L.mask):
        if shape is not None:
            bb, nb = shape
            specs.append(pl.BlockSpec(
                (None, None, L.bq, L.bk),
                at(lambda b, n, i, j, bb=bb, nb=nb: (b if bb > 1 else 0, n if nb > 1 else 0, i, j)),
            ))
    if L.segments:
        specs.append(pl.BlockSpec((None, L.bq, 1), at(lambda b, n, i, j: (b, i, 0))))
        specs.append(pl.BlockSpec((None, 1, L.bk), at(lambda b, n, i, j: (b, 0, j))))
    if spec.dropout_rate > 0:
        specs.append(pl.BlockSpec(memory_space=pltpu.SMEM))
    return specs


def _call(kernel, L: Layout, *, grid, in_specs, out_specs, out_shape, scratch, semantics, cost, interpret):
    """The pallas_call; with segment ids its first argument is the segment reach table, prefetched
    into SMEM so index maps and kernel bodies can read it."""
    call = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=int(L.segments), grid=grid, in_specs=in_specs, out_specs=out_specs,
            scratch_shapes=scratch,
        ),
        out_shape=out_shape,
        compiler_params=pltpu.CompilerParams(dimension_semantics=semantics, vmem_limit_bytes=_VMEM_LIMIT),
        cost_estimate=cost,
        interpret=pltpu.InterpretParams() if interpret else False,
    )
    return without_effects(call, out_shape) if interpret else call


def _cost(L: Layout, spec: AttentionSpec, matmuls: int, nbytes: int):
    pairs = L.B * L.N * L.T * L.S * (0.5 if spec.causal and L.T == L.S else 1.0)
    return pl.CostEstimate(
        flops=int(2 * pairs * (matmuls[0] * L.H + matmuls[1] * L.Hv)),
        transcendentals=int(pairs * (2 if spec.logit_soft_cap else 1)), bytes_accessed=int(nbytes),
    )


def total_bytes(*arrays):
    return sum(a.size * a.dtype.itemsize for a in arrays if a is not None)


@functools.lru_cache(maxsize=None)
def fwd_call(L: Layout, spec: AttentionSpec, out_dtype, interpret: bool, nbytes: int):
    ids = _fwd_grid_ids(L, spec)
    out_shape = [
        jax.ShapeDtypeStruct((L.B, L.N, L.Tp, L.Hv), out_dtype),
        jax.ShapeDtypeStruct((L.B, L.N, L.Tp, 1), _F32),
    ]
    out_specs = [
        pl.BlockSpec((None, None, L.bq, L.Hv), lambda b, n, i, j, *_: (b, n, i, 0)),
        pl.BlockSpec((None, None, L.bq, 1), lambda b, n, i, j, *_: (b, n, i, 0)),
    ]
    return _call(
        functools.partial(_fwd_kernel, L=L, spec=spec), L,
        grid=(L.B, L.N, L.nq, L.nk),
        in_specs=_specs(L, spec, ids, grad=False),
        out_specs=out_specs,
        out_shape=out_shape,
        scratch=[pltpu.VMEM((L.bq, 1), _F32), pltpu.VMEM((L.bq, 1), _F32), pltpu.VMEM((L.bq, L.Hv), _F32)],
        semantics=("parallel", "parallel", "parallel", "arbitrary"),
        cost=_cost(L, spec, (1, 1), nbytes),
        interpret=interpret,
    )


@functools.lru_cache(maxsize=None)
def dkv_call(L: Layout, spec: AttentionSpec, interpret: bool, nbytes: int):
    kv_map = lambda b, kh, j, g, i, *_: (b, kh, j, 0)  # noqa: E731
    out_shape = [
        jax.ShapeDtypeStruct((L.B, L.K, L.Sp, L.H), L.dtype),
        jax.ShapeDtypeStruct((L.B, L.K, L.Sp, L.Hv), L.dtype),
    ]
    out_specs = [pl.BlockSpec((None, None, L.bk, L.H), kv_map), pl.BlockSpec((None, None, L.bk, L.Hv), kv_map)]
    if L.dz_from_dkv:
        out_shape.append(jax.ShapeDtypeStruct((L.B, L.N, L.Tp, L.Sp), _F32))
        out_specs.append(pl.BlockSpec(
            (None, None, L.bq, L.bk), lambda b, kh, j, g, i, *_: (b, kh * L.G + g, i, j)))
    return _call(
        functools.partial(_dkv_kernel, L=L, spec=spec), L,
        grid=(L.B, L.K, L.nk, L.G, L.nq),
        in_specs=_specs(L, spec, _dkv_grid_ids(L, spec), grad=True),
        out_specs=out_specs,
        out_shape=out_shape,
        scratch=[pltpu.VMEM((L.bk, L.H), _F32), pltpu.VMEM((L.bk, L.Hv), _F32)],
        semantics=("parallel", "parallel", "parallel", "arbitrary", "arbitrary"),
        cost=_cost(L, spec, (2, 2), nbytes),
        interpret=interpret,
    )


@functools.lru_cache(maxsize=None)
def dbias_call(L: Layout, spec: AttentionSpec, interpret: bool, nbytes: int):
    Bb, Nb = L.bias
    reduced = (L.B if Bb == 1 else 1, L.N if Nb == 1 else 1)
    ids = lambda gb, gn, i, j, rb, rn, *_: (gb + rb, gn + rn, i, j)  # noqa: E731
    return _call(
        functools.partial(_dbias_kernel, L=L, spec=spec), L,
        grid=(Bb, Nb, L.nq, L.nk, *reduced),
        in_specs=_specs(L, spec, ids, grad=True),
        out_specs=pl.BlockSpec((None, None, L.bq, L.bk), lambda gb, gn, i, j, *_: (gb, gn, i, j)),
        out_shape=jax.ShapeDtypeStruct((Bb, Nb, L.Tp, L.Sp), _F32),
        scratch=[],
        semantics=("parallel",) * 4 + ("arbitrary",) * 2,
        cost=_cost(L, spec, (1, 1), nbytes),
        interpret=interpret,
    )


@functools.lru_cache(maxsize=None)
def dq_call(L: Layout, spec: AttentionSpec, interpret: bool, nbytes: int):
    out_shape = jax.ShapeDtypeStruct((L.B, L.N, L.Tp, L.H), L.dtype)
    return _call(
        functools.partial(_dq_kernel, L=L, spec=spec), L,
        grid=(L.B, L.N, L.nq, L.nk),
        in_specs=_specs(L, spec, _fwd_grid_ids(L, spec), grad=True),
        out_specs=pl.BlockSpec((None, None, L.bq, L.H), lambda b, n, i, j, *_: (b, n, i, 0)),
        out_shape=out_shape,
        scratch=[pltpu.VMEM((L.bq, L.H), _F32)],
        semantics=("parallel", "parallel", "parallel", "arbitrary"),
        cost=_cost(L, spec, (2, 1), nbytes),
        interpret=interpret,
    )


# ----------------------------------------------------------------------------- wrappers

