"""First-order linear recurrence h_t = a_t h_{t-1} + x_t as Triton kernels (forward and backward).

x, a: [B, T, D]; h0: [B, D] or none. A tile is BLOCK_T steps x BLOCK_D channels of one batch row,
its rows in the order the walk visits them (a reverse recurrence is the same code, rows flipped).
`tl.associative_scan` of the pairs (a, x) down a tile with (a1, x1).(a2, x2) = (a1 a2, a2 x1 + x2)
gives each row's (A, X) from the tile start, so h = A * carry + X (rows past T are the identity
(1, 0)). Two schedules:

  * "chained" (one pass, every tile its own program): each program loads its chunk (chunk_tiles
    tiles), scans it, then waits for the carry the previous chunk of the same row published,
    publishes its own end state (A_chunk * carry + X_chunk) and writes h. The loads of every
    resident program are in flight at once, so the op streams like a copy. Programs take chunks
    in order from an atomic counter, so a chunk waits only on one that already runs (no
    deadlock). A carry is one int64 word per channel (its chunk's tag and the f32 value: flag
    and data in one store) in a small ring per row that stays in L2: no bytes beyond the floor
    reach memory. chunk_tiles > 1 scans the chunk twice, the second read from L2.
  * "walk": program (b, j) walks all of T for its channels, the carry in registers, the next
    tile's loads issued before this tile's arithmetic (only B * D / BLOCK_D programs).
Every input element is read once from memory and every output element written once. With
block_d = 32 * vector * num_warps each thread holds `vector` whole columns of a tile, so the scan
runs in its registers (see _lanes).

The backward is the same recurrence run the other way: dh_t = g_t + a_{t+1} dh_{t+1} (a read one
step ahead of g), dx_t = dh_t, da_t = dh_t h_{t-1} (h read one step behind, h0 at the edge), and
dh0 = a_0 dh_0 (the reverse op swaps t+1 and t-1): one fused pass reading g, a, h and writing
dx, da. Sizes are constexprs (alignment proofs; the interpreter needs constexpr loop bounds).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import triton
import triton.language as tl

from forgeax.core.config import KernelConfig
from forgeax.core.registry import Implementation
from forgeax.core.runtime import interpret_enabled
from forgeax.kernels.common.linear_recurrence import kernel_supports, with_vjp
from forgeax.kernels.triton.launch import triton_call


# ----------------------------------------------------------------------------- kernels


@triton.jit
def _combine(a1, x1, a2, x2):
    return a1 * a2, a2 * x1 + x2


@triton.jit
def _steps(c, T: tl.constexpr, BLOCK_T: tl.constexpr, BACKWARDS: tl.constexpr, WIDE: tl.constexpr):
    """Time indices of tile c of a walk (forwards from 0, or backwards from T-1) and their mask
    (int64 when element offsets reach 2^31: t * D would overflow int32)."""
    step = c * BLOCK_T + tl.arange(0, BLOCK_T)
    if WIDE:
        step = step.to(tl.int64)
    if BACKWARDS:
        return T - 1 - step, step < T
    return step, step < T


@triton.jit
def _scan_tile(a, x, carry, BLOCK_T: tl.constexpr, SEQUENTIAL: tl.constexpr):
    """h of one tile from the carry: a tree scan of (a, x) pairs, or (SEQUENTIAL) row after row
    through masked row sums (O(BLOCK_T^2) work: Triton's interpreter runs a non-builtin scan one
    element at a time in Python, which this avoids)."""
    if SEQUENTIAL:
        rows = tl.arange(0, BLOCK_T)[:, None]
        h = tl.zeros_like(x)
        for i in tl.static_range(BLOCK_T):
            here = rows == i
            carry = tl.sum(tl.where(here, a, 0.0), axis=0) * carry + tl.sum(tl.where(here, x, 0.0), axis=0)
            h = tl.where(here, carry[None, :], h)
        return h
    a_cum, x_cum = tl.associative_scan((a, x), 0, _combine)
    return a_cum * carry[None, :] + x_cum


@triton.jit
def _lanes(BLOCK_D: tl.constexpr, VEC: tl.constexpr):
    """A channel block's offsets, claimed contiguous only in runs of VEC. Triton gives each
    thread VEC adjacent channels of a tile, a warp 32 * VEC of them, then spreads warps over
    channels first: with BLOCK_D >= 32 * VEC * num_warps a thread holds whole columns and the scan
    down time runs in its registers. Wider vectors (16 bytes) put warps along time, and the
    scan crosses warps through shared memory (~7x the instructions per element on sm_90)."""
    return tl.max_contiguous(tl.arange(0, BLOCK_D), VEC)


@triton.jit
def _last_row(tile, BLOCK_T: tl.constexpr):
    rows = tl.arange(0, BLOCK_T)[:, None]
    return tl.sum(tl.where(rows == BLOCK_T - 1, tile, 0.0), axis=0)


@triton.jit
def _forward_kernel(
    X, A, H0,  # x, a [B, T, D]; h0 [B, D] (unused unless HAS_H0)
    H,  # output h [B, T, D], x's dtype
    T: tl.constexpr, D: tl.constexpr, HAS_H0: tl.constexpr, REVERSE: tl.constexpr, TILES: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, VEC: tl.constexpr, WIDE: tl.constexpr, SEQUENTIAL: tl.constexpr,
):
    b = tl.program_id(0)
    d = tl.program_id(1) * BLOCK_D + _lanes(BLOCK_D, VEC)
    d_ok = d < D
    if WIDE:  # element offsets reach 2^31
        b = b.to(tl.int64)
    base = b * T * D
    if HAS_H0:
        carry = tl.load(H0 + b * D + d, mask=d_ok, other=0.0).to(tl.float32)
    else:
        carry = tl.zeros([BLOCK_D], tl.float32)
    t, ok = _steps(0, T, BLOCK_T, REVERSE, WIDE)
    m = ok[:, None] & d_ok[None, :]
    offs = base + t[:, None] * D + d[None, :]
    x_next = tl.load(X + offs, mask=m, other=0.0)
    a_next = tl.load(A + offs, mask=m, other=1.0)
    for c in range(TILES):
        x = x_next.to(tl.float32)
        a = a_next.to(tl.float32)
        offs_here = offs
        m_here = m
        # Issue the next tile's loads before this tile's arithmetic (fully masked past the end).
        t, ok = _steps(c + 1, T, BLOCK_T, REVERSE, WIDE)
        m = ok[:, None] & d_ok[None, :]
        offs = base + t[:, None] * D + d[None, :]
        x_next = tl.load(X + offs, mask=m, other=0.0)
        a_next = tl.load(A + offs, mask=m, other=1.0)
        h = _scan_tile(a, x, carry, BLOCK_T, SEQUENTIAL)
        tl.store(H + offs_here, h.to(H.dtype.element_ty), mask=m_here)
        carry = _last_row(h, BLOCK_T)


@triton.jit
def _backward_kernel(
    G, A, H, H0,  # g (cotangent of h), a, h [B, T, D]; h0 [B, D] (unused unless HAS_H0)
    DX, DA, DH0,  # outputs: dx (g's dtype), da (a's dtype) [B, T, D]; dh0 [B, D] f32
    T: tl.constexpr, D: tl.constexpr, HAS_H0: tl.constexpr, REVERSE: tl.constexpr, TILES: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, VEC: tl.constexpr, WIDE: tl.constexpr, SEQUENTIAL: tl.constexpr,
    WALK_BACK: tl.constexpr, AHEAD: tl.constexpr,
):
    # REVERSE is the forward op's direction; this walk runs the other way (WALK_BACK = not
    # REVERSE). AHEAD (+1 for a forward op, -1 reversed) is the offset of the step the walk
    # visited just before t; t - AHEAD is the step after it.
    b = tl.program_id(0)
    d = tl.program_id(1) * BLOCK_D + _lanes(BLOCK_D, VEC)
    d_ok = d < D
    if WIDE:
        b = b.to(tl.int64)
    base = b * T * D
    if HAS_H0:
        h0 = tl.load(H0 + b * D + d, mask=d_ok, other=0.0).to(tl.float32)
    else:
        h0 = tl.zeros([BLOCK_D], tl.float32)
    carry = tl.zeros([BLOCK_D], tl.float32)
    t, ok = _steps(0, T, BLOCK_T, WALK_BACK, WIDE)
    ahead_ok = ok & (t + AHEAD >= 0) & (t + AHEAD < T)
    m = ok[:, None] & d_ok[None, :]
    offs = base + t[:, None] * D + d[None, :]
    g_next = tl.load(G + offs, mask=m, other=0.0)
    a_next = tl.load(A + offs + AHEAD * D, mask=ahead_ok[:, None] & d_ok[None, :], other=0.0)
    for c in range(TILES):
        g = g_next.to(tl.float32)
        # Rows past the end are the identity (1, 0); the first step has no step ahead (0).
        a = tl.where(ok[:, None], a_next.to(tl.float32), 1.0)
        t_here = t
        offs_here = offs
        m_here = m
        t, ok = _steps(c + 1, T, BLOCK_T, WALK_BACK, WIDE)
        ahead_ok = ok & (t + AHEAD >= 0) & (t + AHEAD < T)
        m = ok[:, None] & d_ok[None, :]
        offs = base + t[:, None] * D + d[None, :]
        g_next = tl.load(G + offs, mask=m, other=0.0)
        a_next = tl.load(A + offs + AHEAD * D, mask=ahead_ok[:, None] & d_ok[None, :], other=0.0)
        dh = _scan_tile(a, g, carry, BLOCK_T, SEQUENTIAL)
        tl.store(DX + offs_here, dh.to(DX.dtype.element_ty), mask=m_here)
        behind = t_here - AHEAD
        behind_ok = (behind >= 0) & (behind < T)
        h_prev = tl.load(H + offs_here - AHEAD * D, mask=m_here & behind_ok[:, None], other=0.0).to(tl.float32)
        h_prev = tl.where(behind_ok[:, None], h_prev, h0[None, :])
        tl.store(DA + offs_here, (dh * h_prev).to(DA.dtype.element_ty), mask=m_here)
        carry = _last_row(dh, BLOCK_T)
    if HAS_H0:  # dh0 = a_first dh_first: the carry is dh at the walk's last step (the op's first)
        first = (T - 1) if REVERSE else 0
        a_first = tl.load(A + base + first * D + d, mask=d_ok, other=0.0).to(tl.float32)
        tl.store(DH0 + b * D + d, a_first * carry, mask=d_ok)


# ----------------------------------------------------------------------------- chained schedule

# A published carry is one int64 word per channel: (chunk index + 1) << 32 | f32 bits, so word
# and flag land in one store (aligned 64-bit accesses are single-copy atomic). Row r's chunk k
# writes slot k % _RING of the row: its previous occupant (chunk k - _RING) was read by chunk
# k - _RING + 1 before that chunk published the carry chunk k waited for, so a ring of 2 is
# enough. The ring (B * D * _RING words) stays in L2: no carry traffic to memory.
_RING = tl.constexpr(4)


@triton.jit
def _pairs(X, A, base, c, d, d_ok, T: tl.constexpr, D: tl.constexpr, BLOCK_T: tl.constexpr,
           BACKWARDS: tl.constexpr, WIDE: tl.constexpr, SHIFT: tl.constexpr):
    """Tile c of a walk: (a, x) in f32, rows past T the identity (1, 0); a is read SHIFT steps
    from x (the backward's a of the step after; 0 where that step is outside [0, T))."""
    t, ok = _steps(c, T, BLOCK_T, BACKWARDS, WIDE)
    m = ok[:, None] & d_ok[None, :]
    offs = base + t[:, None] * D + d[None, :]
    x = tl.load(X + offs, mask=m, other=0.0).to(tl.float32)
    if SHIFT == 0:
        a = tl.load(A + offs, mask=m, other=1.0).to(tl.float32)
    else:
        there = ok & (t + SHIFT >= 0) & (t + SHIFT < T)
        a = tl.load(A + offs + SHIFT * D, mask=there[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
        a = tl.where(ok[:, None], a, 1.0)
    return a, x, t, offs, m


@triton.jit
def _scan_pairs(a, x, BLOCK_T: tl.constexpr, SEQUENTIAL: tl.constexpr):
    """(A, X) of every row of a tile from its start: h_row = A * carry + X."""
    if SEQUENTIAL:  # row by row through masked row sums (see _scan_tile)
        rows = tl.arange(0, BLOCK_T)[:, None]
        a_cum = tl.zeros_like(a)
        x_cum = tl.zeros_like(x)
        a_run = tl.sum(tl.where(rows == 0, a, 0.0), axis=0)
        x_run = tl.sum(tl.where(rows == 0, x, 0.0), axis=0)
        for i in tl.static_range(BLOCK_T):
            here = rows == i
            if i > 0:
                a_i = tl.sum(tl.where(here, a, 0.0), axis=0)
                x_run = a_i * x_run + tl.sum(tl.where(here, x, 0.0), axis=0)
                a_run = a_i * a_run
            a_cum = tl.where(here, a_run[None, :], a_cum)
            x_cum = tl.where(here, x_run[None, :], x_cum)
        return a_cum, x_cum
    return tl.associative_scan((a, x), 0, _combine)


@triton.jit
def _publish(slot, h, k, d_ok, BLOCK_T: tl.constexpr):
    """Stores the last row of h (chunk k's end state) to its slot: only the threads that hold
    that row store, so no reduction across the tile."""
    last = (tl.arange(0, BLOCK_T) == BLOCK_T - 1)[:, None] & d_ok[None, :]
    word = h.to(tl.uint32, bitcast=True).to(tl.int64) | ((k + 1).to(tl.int64) << 32)
    tl.store(slot[None, :] + tl.zeros([BLOCK_T, 1], tl.int32), word, mask=last)


@triton.jit
def _wait(slot, k, ok):
    """The carry chunk k published, once every channel of it is there (volatile loads: each
    poll reads L2, never a stale L1 line)."""
    tag = (k + 1).to(tl.int64)
    word = tl.load(slot, mask=ok, other=tag << 32, volatile=True)
    while tl.max(((word >> 32) != tag).to(tl.int32), axis=0) > 0:
        word = tl.load(slot, mask=ok, other=tag << 32, volatile=True)
    return (word & 0xFFFFFFFF).to(tl.uint32).to(tl.float32, bitcast=True)


@triton.jit
def _emit(OUT, OUT2, H, A, DH0, h, h0, t, offs, m, b, d, d_ok, c,
          T: tl.constexpr, D: tl.constexpr, BLOCK_T: tl.constexpr, HAS_H0: tl.constexpr, REVERSE: tl.constexpr,
          GRAD: tl.constexpr, SHIFT: tl.constexpr, LAST_TILE: tl.constexpr):
    """Writes tile c's h (forward), or dx = h, da = h h_prev and at the op's first step dh0
    (backward)."""
    tl.store(OUT + offs, h.to(OUT.dtype.element_ty), mask=m)
    if GRAD:
        behind = t - SHIFT
        behind_ok = (behind >= 0) & (behind < T)
        h_prev = tl.load(H + offs - SHIFT * D, mask=m & behind_ok[:, None], other=0.0).to(tl.float32)
        h_prev = tl.where(behind_ok[:, None], h_prev, h0[None, :])
        tl.store(OUT2 + offs, (h * h_prev).to(OUT2.dtype.element_ty), mask=m)
        if HAS_H0:
            if c == LAST_TILE:  # the walk's last step is the op's first: dh0 = a_first dh_first
                first = (t == ((T - 1) if REVERSE else 0))[:, None] & d_ok[None, :]
                a_first = tl.load(A + offs, mask=first, other=0.0).to(tl.float32)
                tl.store(DH0 + b * D + d[None, :] + tl.zeros([BLOCK_T, 1], tl.int32), a_first * h, mask=first)


@triton.jit
def _chained(
    X, A, H, H0, OUT, OUT2, DH0, COUNTER, RING,
    T: tl.constexpr, D: tl.constexpr, HAS_H0: tl.constexpr, REVERSE: tl.constexpr, TILES: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, VEC: tl.constexpr, WIDE: tl.constexpr, SEQUENTIAL: tl.constexpr,
    ROWS: tl.constexpr, NDB: tl.constexpr, CHUNKS: tl.constexpr, CHUNK_TILES: tl.constexpr,
    DYNAMIC: tl.constexpr, GRAD: tl.constexpr, BACKWARDS: tl.constexpr, SHIFT: tl.constexpr,
):
    """One chunk of one row (b, channel block): see the module docstring. The forward is
    (X, A) = (x, a) walked in the op's direction; the backward (GRAD) is (g, a SHIFT steps
    ahead) walked the other way, with h read for da."""
    if DYNAMIC:  # chunks in the order programs start: a chunk's predecessor already runs
        order = tl.atomic_add(COUNTER, 1)
    else:  # the interpreter runs programs one after another in grid order
        order = tl.program_id(0)
    row = order % ROWS
    k = order // ROWS
    lanes = _lanes(BLOCK_D, VEC)
    d = (row % NDB) * BLOCK_D + lanes
    d_ok = d < D
    b = row // NDB
    if WIDE:
        b = b.to(tl.int64)
        row = row.to(tl.int64)
        k = k.to(tl.int64)
    base = b * T * D
    ring = RING.to(tl.pointer_type(tl.int64)) + row * (_RING * BLOCK_D) + lanes
    slot = ring + (k % _RING) * BLOCK_D
    if HAS_H0:
        h0 = tl.load(H0 + b * D + d, mask=d_ok, other=0.0).to(tl.float32)
    else:
        h0 = tl.zeros([BLOCK_D], tl.float32)
    c0 = k * CHUNK_TILES
    a, x, t, offs, m = _pairs(X, A, base, c0, d, d_ok, T, D, BLOCK_T, BACKWARDS, WIDE, SHIFT)
    a_cum, x_cum = _scan_pairs(a, x, BLOCK_T, SEQUENTIAL)
    if CHUNK_TILES > 1:  # the chunk's end state from all its tiles (read again below, from L2)
        a_chunk = _last_row(a_cum, BLOCK_T)
        x_chunk = _last_row(x_cum, BLOCK_T)
        for i in range(1, CHUNK_TILES):
            a_i, x_i, _, _, _ = _pairs(X, A, base, c0 + i, d, d_ok, T, D, BLOCK_T, BACKWARDS, WIDE, SHIFT)
            a_i_cum, x_i_cum = _scan_pairs(a_i, x_i, BLOCK_T, SEQUENTIAL)
            a_chunk, x_chunk = _combine(a_chunk, x_chunk, _last_row(a_i_cum, BLOCK_T), _last_row(x_i_cum, BLOCK_T))
    if k == 0:
        if GRAD:
            carry = tl.zeros([BLOCK_D], tl.float32)
        else:
            carry = h0
    else:
        carry = _wait(ring + ((k - 1) % _RING) * BLOCK_D, k - 1, d_ok)
    h = a_cum * carry[None, :] + x_cum
    if k < CHUNKS - 1:
        if CHUNK_TILES > 1:
            end = a_chunk * carry + x_chunk
            _publish(slot, tl.broadcast_to(end[None, :], (BLOCK_T, BLOCK_D)), k, d_ok, BLOCK_T)
        else:
            _publish(slot, h, k, d_ok, BLOCK_T)
    _emit(OUT, OUT2, H, A, DH0, h, h0, t, offs, m, b, d, d_ok, c0, T, D, BLOCK_T, HAS_H0, REVERSE, GRAD, SHIFT,
          TILES - 1)
    for i in range(1, CHUNK_TILES):
        carry = _last_row(h, BLOCK_T)
        a_i, x_i, t_i, offs_i, m_i = _pairs(X, A, base, c0 + i, d, d_ok, T, D, BLOCK_T, BACKWARDS, WIDE, SHIFT)
        a_i_cum, x_i_cum = _scan_pairs(a_i, x_i, BLOCK_T, SEQUENTIAL)
        h = a_i_cum * carry[None, :] + x_i_cum
        _emit(OUT, OUT2, H, A, DH0, h, h0, t_i, offs_i, m_i, b, d, d_ok, c0 + i, T, D, BLOCK_T, HAS_H0, REVERSE,
              GRAD, SHIFT, TILES - 1)


@triton.jit
def _chained_forward_kernel(X, A, H0, H, COUNTER, RING, T: tl.constexpr, D: tl.constexpr, HAS_H0: tl.constexpr,
                            REVERSE: tl.constexpr, TILES: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
                            VEC: tl.constexpr, WIDE: tl.constexpr, SEQUENTIAL: tl.constexpr, ROWS: tl.constexpr,
                            NDB: tl.constexpr, CHUNKS: tl.constexpr, CHUNK_TILES: tl.constexpr, DYNAMIC: tl.constexpr):
    _chained(X, A, X, H0, H, H, H, COUNTER, RING, T, D, HAS_H0, REVERSE, TILES, BLOCK_T, BLOCK_D, VEC, WIDE,
             SEQUENTIAL, ROWS, NDB, CHUNKS, CHUNK_TILES, DYNAMIC, False, REVERSE, 0)


@triton.jit
def _chained_backward_kernel(G, A, H, H0, DX, DA, DH0, COUNTER, RING, T: tl.constexpr, D: tl.constexpr,
                             HAS_H0: tl.constexpr, REVERSE: tl.constexpr, TILES: tl.constexpr, BLOCK_T: tl.constexpr,
                             BLOCK_D: tl.constexpr, VEC: tl.constexpr, WIDE: tl.constexpr, SEQUENTIAL: tl.constexpr,
                             ROWS: tl.constexpr, NDB: tl.constexpr, CHUNKS: tl.constexpr, CHUNK_TILES: tl.constexpr,
                             DYNAMIC: tl.constexpr, WALK_BACK: tl.constexpr, AHEAD: tl.constexpr):
    # The walk runs against the op's direction (WALK_BACK = not REVERSE); a is read AHEAD steps
    # from g (the step the op visits after t: +1 forward, -1 reversed), h AHEAD steps behind.
    _chained(G, A, H, H0, DX, DA, DH0, COUNTER, RING, T, D, HAS_H0, REVERSE, TILES, BLOCK_T, BLOCK_D, VEC, WIDE,
             SEQUENTIAL, ROWS, NDB, CHUNKS, CHUNK_TILES, DYNAMIC, True, WALK_BACK, AHEAD)


# ----------------------------------------------------------------------------- config


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


@dataclasses.dataclass(frozen=True, kw_only=True)
class LinearRecurrenceConfig(KernelConfig):
    """block_t, block_d: a tile's time steps and channels (one scan); vector: adjacent channels
    per thread (2, 4 or 8; see _lanes: block_d = 32 * vector * num_warps keeps the scan in
    registers); schedule: "chained" (a program per chunk of chunk_tiles tiles, carries passed
    between chunks) or "walk" (a program per B x block_d channels walks all of T; chunk_tiles
    unused); num_warps, num_stages: Triton's launch options; tile_scan: "tree"
    (`tl.associative_scan`) or "sequential" (row by row, for the interpreter)."""

    block_t: int
    block_d: int
    vector: int = 8
    num_warps: int = 4
    num_stages: int = 1
    tile_scan: str = "tree"
    schedule: str = "chained"
    chunk_tiles: int = 1

    def validate(self) -> None:
        super().validate()
        for name in ("block_t", "block_d"):
            value = getattr(self, name)
            if value & (value - 1):
                raise ValueError(f"LinearRecurrenceConfig.{name}: expected a power of two, got {value}")
        if self.vector not in (2, 4, 8):  # 1: Triton lays threads along time (uncoalesced loads)
            raise ValueError(f"LinearRecurrenceConfig.vector: expected 2, 4 or 8, got {self.vector}")
        if self.tile_scan not in ("tree", "sequential"):
            raise ValueError(f"LinearRecurrenceConfig.tile_scan: expected 'tree' or 'sequential', "
                             f"got {self.tile_scan!r}")
        if self.schedule not in ("chained", "walk"):
            raise ValueError(f"LinearRecurrenceConfig.schedule: expected 'chained' or 'walk', got {self.schedule!r}")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"LinearRecurrenceConfig.num_warps: expected 1, 2, 4, 8 or 16, got {self.num_warps}")


def heuristic_config(x, a, initial_state=None, **kwargs) -> LinearRecurrenceConfig:
    """Chained 32 x 128 tiles, 2 channels per thread, 2 warps: each thread scans 32 steps of its
    2 channels in registers (188 registers forward, 198 backward by ptxas for sm_90, no spills;
    ~0.45 / 0.8 instructions per element and warp, against ~2.2 for a 16-byte-vector tile whose
    scan crosses 8 warps), and the whole tile's loads are in flight before the program waits on
    anything. Small problems take smaller blocks. The interpreter pays per program and per tile,
    so there it takes wide channel blocks and scans rows one by one (its tree scan is one Python
    call per element)."""
    del a, initial_state, kwargs
    _, t, d = x.shape
    if interpret_enabled():
        return LinearRecurrenceConfig(block_t=min(16, _pow2_at_least(t)), block_d=min(128, _pow2_at_least(d)),
                                      tile_scan="sequential")
    block_d = min(128, max(16, _pow2_at_least(d)))
    return LinearRecurrenceConfig(block_t=min(32, max(16, _pow2_at_least(t))), block_d=block_d, vector=2,
                                  num_warps=max(1, block_d // 64))


# (schedule, block_t, block_d, vector, num_warps, chunk_tiles): rows-in-registers tiles of 32 or
# 16 steps (64 or 32 elements per thread per array; 64-step ones spill on sm_90), a chunk of two tiles,
# the 16-byte tree-scan tiles, and the walk with the same tiles.
_CANDIDATES = (
    ("chained", 32, 128, 2, 2, 1), ("chained", 32, 64, 2, 1, 1), ("chained", 32, 256, 2, 4, 1),
    ("chained", 16, 256, 4, 2, 1), ("chained", 16, 128, 4, 1, 1), ("chained", 16, 512, 4, 4, 1),
    ("chained", 16, 128, 2, 2, 1), ("chained", 16, 256, 2, 4, 1), ("chained", 32, 128, 2, 2, 2),
    ("chained", 64, 128, 8, 8, 1), ("chained", 32, 128, 8, 4, 1),
    ("walk", 32, 64, 2, 1, 1), ("walk", 16, 128, 4, 1, 1), ("walk", 32, 128, 2, 2, 1), ("walk", 32, 128, 8, 4, 1),
)


def candidate_configs(x, a, initial_state=None, **kwargs) -> list[LinearRecurrenceConfig]:
    base = heuristic_config(x, a, initial_state, **kwargs)
    _, t, d = x.shape
    configs = [base] + [
        LinearRecurrenceConfig(schedule=schedule, block_t=min(block_t, max(16, _pow2_at_least(t))),
                               block_d=min(block_d, max(16, _pow2_at_least(d))), vector=vector, num_warps=warps,
                               chunk_tiles=chunk, tile_scan=base.tile_scan)
        for schedule, block_t, block_d, vector, warps, chunk in _CANDIDATES]
    return list(dict.fromkeys(configs))


# ----------------------------------------------------------------------------- launch


def _common(config: LinearRecurrenceConfig, b: int, t: int, d: int, reverse: bool, has_h0: bool) -> dict:
    """The launch options and constexprs both schedules share."""
    common = dict(num_warps=config.num_warps, num_stages=config.num_stages, T=t, D=d, HAS_H0=has_h0, REVERSE=reverse,
                  TILES=triton.cdiv(t, config.block_t), BLOCK_T=config.block_t, BLOCK_D=config.block_d,
                  VEC=config.vector, WIDE=b * t * d >= 2**31 - 2 * d, SEQUENTIAL=config.tile_scan == "sequential")
    if config.schedule == "walk":
        return dict(common, grid=(b, triton.cdiv(d, config.block_d)))
    blocks = triton.cdiv(d, config.block_d)
    return dict(common, grid=(b * blocks * triton.cdiv(common["TILES"], config.chunk_tiles),), ROWS=b * blocks,
                NDB=blocks, CHUNKS=triton.cdiv(common["TILES"], config.chunk_tiles), CHUNK_TILES=config.chunk_tiles,
                DYNAMIC=not interpret_enabled())


def _state(options: dict, first: int) -> tuple[tuple[jax.ShapeDtypeStruct, ...], dict]:
    """The chained schedule's outputs `first` and `first + 1`: the chunk counter and the carry
    ring (_RING slots of BLOCK_D words per row), zeroed by the launch on a GPU. The interpreter
    runs programs in grid order (no counter) and its fill, -1, is no slot's tag. The ring is
    int32 pairs here (JAX without x64 has no int64 arrays); the kernel reads it as int64."""
    ring = options["ROWS"] * _RING.value * options["BLOCK_D"]
    zeroed = {} if interpret_enabled() else {"zeroed_outputs": (first, first + 1)}
    return (jax.ShapeDtypeStruct((1,), jnp.int32), jax.ShapeDtypeStruct((2 * ring,), jnp.int32)), zeroed


def _forward(x, a, h0, *, reverse: bool, config: LinearRecurrenceConfig):
    b, t, d = x.shape
    if x.size == 0:
        return jnp.zeros_like(x)
    options = _common(config, b, t, d, reverse, h0 is not None)
    out = jax.ShapeDtypeStruct(x.shape, x.dtype)
    if config.schedule == "walk":
        return triton_call(x, a, x if h0 is None else h0, kernel=_forward_kernel, out_shape=out, **options)
    state, zeroed = _state(options, 1)
    return triton_call(x, a, x if h0 is None else h0, kernel=_chained_forward_kernel, out_shape=(out, *state),
                       **zeroed, **options)[0]


def _backward(g, a, h, h0, *, reverse: bool, config: LinearRecurrenceConfig):
    b, t, d = g.shape
    if g.size == 0:
        return jnp.zeros_like(g), jnp.zeros_like(a), None if h0 is None else jnp.zeros_like(h0)
    options = dict(_common(config, b, t, d, reverse, h0 is not None), WALK_BACK=not reverse, AHEAD=-1 if reverse else 1)
    outs = (jax.ShapeDtypeStruct(g.shape, g.dtype), jax.ShapeDtypeStruct(a.shape, a.dtype),
            jax.ShapeDtypeStruct((b, d) if h0 is not None else (1,), jnp.float32))
    args = (g, a, h, g if h0 is None else h0)
    if config.schedule == "walk":
        dx, da, dh0 = triton_call(*args, kernel=_backward_kernel, out_shape=outs, **options)
    else:
        state, zeroed = _state(options, 3)
        dx, da, dh0, _, _ = triton_call(*args, kernel=_chained_backward_kernel, out_shape=(*outs, *state), **zeroed,
                                        **options)
    return dx, da, None if h0 is None else dh0.astype(h0.dtype)


@functools.cache
def _differentiable(reverse: bool, config: LinearRecurrenceConfig):
    """The recurrence with a custom_vjp (vmap and sharded arrays: kernels/common/linear_recurrence.py)."""
    return with_vjp(functools.partial(_forward, reverse=reverse, config=config),
                    functools.partial(_backward, reverse=reverse, config=config))


def linear_recurrence(x, a, initial_state, *, reverse: bool = False, config: LinearRecurrenceConfig):
    return _differentiable(reverse, config)(x, a, initial_state)


LINEAR_RECURRENCE = Implementation(fn=linear_recurrence, platforms={"gpu"}, interpretable=True, supports=kernel_supports,
                                   config_type=LinearRecurrenceConfig, heuristic_config=heuristic_config,
                                   candidate_configs=candidate_configs)
