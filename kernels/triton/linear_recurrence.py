"""First-order linear recurrence h_t = a_t h_{t-1} + x_t as Triton kernels (forward and backward).

x, a: [B, T, D]; h0: [B, D] or none. Program (b, j) owns channels [j*BLOCK_D, (j+1)*BLOCK_D) of
batch row b and walks the whole time axis, BLOCK_T steps per tile, the state in f32 registers:

  1. the tile's x and a ([BLOCK_T, BLOCK_D], rows in the order the walk visits them, so a
     reverse recurrence is the same code with the rows flipped) were loaded one iteration
     earlier: the next tile's loads are issued before this tile's arithmetic, so each program
     keeps a tile in flight while it computes (the op is bandwidth-bound and has only B*D
     independent lanes: latency must hide behind loads already issued);
  2. `tl.associative_scan` of the pairs (a, x) down the tile with (a1, x1).(a2, x2) =
     (a1 a2, a2 x1 + x2) gives each row's (A, X) from the tile start; h = A * carry + X;
  3. h is stored, and its last row is the next tile's carry (rows past T are the identity
     pair (1, 0), so the last row holds the last real step).
Every input element is read once and every output element written once: the op's floor.

The backward walks the other way with the same scan: dh_t = g_t + a_{t+1} dh_{t+1} (a read one
step ahead of g), dx_t = dh_t, da_t = dh_t h_{t-1} (h read one step behind, h0 at the edge),
and dh0 = a_0 dh_0 from the final carry (the reverse recurrence swaps t+1 and t-1): read g, a,
h, write dx, da. Sizes are constexprs (alignment proofs; the interpreter needs constexpr loop
bounds).
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
from forgeax.core.runtime import gpu_sm_count, interpret_enabled
from forgeax.kernels.common.batching import fold_vmap_into_rows
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
def _last_row(tile, BLOCK_T: tl.constexpr):
    rows = tl.arange(0, BLOCK_T)[:, None]
    return tl.sum(tl.where(rows == BLOCK_T - 1, tile, 0.0), axis=0)


@triton.jit
def _forward_kernel(
    X, A, H0,  # x, a [B, T, D]; h0 [B, D] (unused unless HAS_H0)
    H,  # output h [B, T, D], x's dtype
    T: tl.constexpr, D: tl.constexpr, HAS_H0: tl.constexpr, REVERSE: tl.constexpr, TILES: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, WIDE: tl.constexpr, SEQUENTIAL: tl.constexpr,
):
    b = tl.program_id(0)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
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
    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, WIDE: tl.constexpr, SEQUENTIAL: tl.constexpr,
    WALK_BACK: tl.constexpr, AHEAD: tl.constexpr,
):
    # REVERSE is the forward op's direction; this walk runs the other way (WALK_BACK = not
    # REVERSE). AHEAD (+1 for a forward op, -1 reversed) is the offset of the step the walk
    # visited just before t; t - AHEAD is the step after it.
    b = tl.program_id(0)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
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


# ----------------------------------------------------------------------------- config


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


@dataclasses.dataclass(frozen=True, kw_only=True)
class LinearRecurrenceConfig(KernelConfig):
    """block_t: time steps per tile (one scan, one tile of loads in flight); block_d: channels
    per program (B * D / block_d programs); num_warps, num_stages: Triton's launch options;
    tile_scan: "tree" (`tl.associative_scan`) or "sequential" (row by row, for the interpreter)."""

    block_t: int
    block_d: int
    num_warps: int = 4
    num_stages: int = 1
    tile_scan: str = "tree"

    def validate(self) -> None:
        super().validate()
        for name in ("block_t", "block_d"):
            value = getattr(self, name)
            if value & (value - 1):
                raise ValueError(f"LinearRecurrenceConfig.{name}: expected a power of two, got {value}")
        if self.tile_scan not in ("tree", "sequential"):
            raise ValueError(f"LinearRecurrenceConfig.tile_scan: expected 'tree' or 'sequential', "
                             f"got {self.tile_scan!r}")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"LinearRecurrenceConfig.num_warps: expected 1, 2, 4, 8 or 16, got {self.num_warps}")


def heuristic_config(x, a, initial_state=None, **kwargs) -> LinearRecurrenceConfig:
    """Every program walks all of T, so the grid should fit in one wave: the narrowest channel
    block (32..128) whose B * D / block_d programs fit two per SM (at [8, *, 4096] on 132 SMs:
    128 channels, 256 programs). A 32 x 128 tile at 4 warps is 32 elements per thread per array
    (160 registers by ptxas for sm_90, no spills: three programs fit an SM) and keeps 16 KiB of
    x and a in flight per program. Narrower blocks (small B * D) take 64-step tiles. The
    interpreter pays per program and per tile, so there it takes wide channel blocks and scans
    rows one by one (its tree scan is one Python call per element)."""
    del a, initial_state, kwargs
    b, t, d = x.shape
    if interpret_enabled():
        return LinearRecurrenceConfig(block_t=min(16, _pow2_at_least(t)), block_d=min(128, _pow2_at_least(d)),
                                      tile_scan="sequential")
    block_d = next((w for w in (32, 64) if b * triton.cdiv(d, w) <= 2 * gpu_sm_count()), 128)
    block_d = min(block_d, max(16, _pow2_at_least(d)))
    block_t = 32 if block_d >= 128 else 64
    return LinearRecurrenceConfig(block_t=min(block_t, _pow2_at_least(t)), block_d=block_d, num_warps=4)


def candidate_configs(x, a, initial_state=None, **kwargs) -> list[LinearRecurrenceConfig]:
    base = heuristic_config(x, a, initial_state, **kwargs)
    r = base.replace
    return [base, r(block_t=64), r(block_t=16), r(block_d=64, block_t=64), r(block_d=64, block_t=32, num_warps=2),
            r(block_d=256, block_t=16, num_warps=8), r(block_d=128, block_t=64, num_warps=8), r(num_stages=2)]


# ----------------------------------------------------------------------------- launch


def _common(config: LinearRecurrenceConfig, b: int, t: int, d: int, reverse: bool, has_h0: bool) -> dict:
    return dict(grid=(b, triton.cdiv(d, config.block_d)), num_warps=config.num_warps, num_stages=config.num_stages,
                T=t, D=d, HAS_H0=has_h0, REVERSE=reverse, TILES=triton.cdiv(t, config.block_t),
                BLOCK_T=config.block_t, BLOCK_D=config.block_d,
                WIDE=b * t * d >= 2**31 - 2 * d, SEQUENTIAL=config.tile_scan == "sequential")


def _forward(x, a, h0, *, reverse: bool, config: LinearRecurrenceConfig):
    b, t, d = x.shape
    if x.size == 0:
        return jnp.zeros_like(x)
    return triton_call(x, a, x if h0 is None else h0, kernel=_forward_kernel,
                       out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                       **_common(config, b, t, d, reverse, h0 is not None))


def _backward(g, a, h, h0, *, reverse: bool, config: LinearRecurrenceConfig):
    b, t, d = g.shape
    if g.size == 0:
        return jnp.zeros_like(g), jnp.zeros_like(a), None if h0 is None else jnp.zeros_like(h0)
    dx, da, dh0 = triton_call(
        g, a, h, g if h0 is None else h0, kernel=_backward_kernel,
        out_shape=(jax.ShapeDtypeStruct(g.shape, g.dtype), jax.ShapeDtypeStruct(a.shape, a.dtype),
                   jax.ShapeDtypeStruct((b, d) if h0 is not None else (1,), jnp.float32)),
        WALK_BACK=not reverse, AHEAD=-1 if reverse else 1, **_common(config, b, t, d, reverse, h0 is not None))
    return dx, da, None if h0 is None else dh0.astype(h0.dtype)


@functools.cache
def _differentiable(reverse: bool, config: LinearRecurrenceConfig):
    """The recurrence with a custom_vjp; vmap folds into the batch axis (rows are independent)."""
    forward = fold_vmap_into_rows(functools.partial(_forward, reverse=reverse, config=config), row_args=(0, 1, 2))
    backward = fold_vmap_into_rows(functools.partial(_backward, reverse=reverse, config=config), row_args=(0, 1, 2, 3))
    return with_vjp(forward, backward)


def linear_recurrence(x, a, initial_state, *, reverse: bool = False, config: LinearRecurrenceConfig):
    return _differentiable(reverse, config)(x, a, initial_state)


LINEAR_RECURRENCE = Implementation(fn=linear_recurrence, platforms={"gpu"}, interpretable=True, supports=kernel_supports,
                                   config_type=LinearRecurrenceConfig, heuristic_config=heuristic_config,
                                   candidate_configs=candidate_configs)
