"""First-order linear recurrence h_t = a_t h_{t-1} + x_t as a Mosaic TPU Pallas kernel.

x, a: [B, T, D]; h0: [B, D] or none. Grid (B, D / block_d, T / block_t), the time axis last and
sequential ("arbitrary"): each step owns a (block_t, block_d) tile and carries the state of its
channels in an f32 VMEM scratch row from tile to tile (a reverse recurrence visits the tiles,
and the rows inside a tile, from the end). Inside a tile the scan is vectorised, log2(block_t)
Hillis-Steele steps over whole vregs with sublane rotations (`pltpu.roll`):

    (A, X)_t <- (A_t A_{t-k}, A_t X_{t-k} + X_t)   for k = 1, 2, 4, ...   (rows t < k unchanged)

then h = A * carry + X and the carry becomes h's last row. Rows past T (a partial last tile)
are the identity pair (1, 0), so a reverse walk that starts there carries h0 through them.

The backward is the same kernel run the other way on the cotangent, decayed by the next
step's a (dh_t = g_t + a_{t+1} dh_{t+1}); da = dh * h_{t-1} and dh0 = a_0 dh_0 are XLA
elementwise work around it.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from forgeax.core.config import KernelConfig
from forgeax.core.registry import Implementation
from forgeax.core.runtime import interpret_enabled
from forgeax.kernels.common.linear_recurrence import kernel_supports, with_vjp

_F32 = jnp.float32


@dataclasses.dataclass(frozen=True, kw_only=True)
class LinearRecurrenceTpuConfig(KernelConfig):
    """block_t: time steps per tile, a multiple of 8 (sublanes) unless it covers T; block_d:
    channels per tile, a multiple of 128 (lanes) unless it covers D."""

    block_t: int
    block_d: int

    def validate(self) -> None:
        super().validate()
        if self.block_t % 8:
            raise ValueError(f"LinearRecurrenceTpuConfig.block_t: expected a multiple of 8, got {self.block_t}")
        if self.block_d % 128:
            raise ValueError(f"LinearRecurrenceTpuConfig.block_d: expected a multiple of 128, got {self.block_d}")


def heuristic_config(x, a, initial_state=None, **kwargs) -> LinearRecurrenceTpuConfig:
    """256 x 512 f32 tiles (512 KiB each; a few live at once plus the double-buffered inputs fit
    v5e's 16 MiB scoped VMEM)."""
    del a, initial_state, kwargs
    return LinearRecurrenceTpuConfig(block_t=256, block_d=512)


def candidate_configs(x, a, initial_state=None, **kwargs) -> list[LinearRecurrenceTpuConfig]:
    base = heuristic_config(x, a, initial_state, **kwargs)
    return [base, base.replace(block_t=128), base.replace(block_d=1024), base.replace(block_t=512, block_d=256)]


def _kernel(x_ref, a_ref, h0_ref, o_ref, carry_ref, *, t_total, block_t, n_tiles, backwards):
    c = pl.program_id(2)

    @pl.when(c == 0)
    def _():
        carry_ref[...] = h0_ref[...].astype(_F32)

    tile = (n_tiles - 1 - c) if backwards else c
    rows = jax.lax.broadcasted_iota(jnp.int32, x_ref.shape, 0)
    valid = tile * block_t + rows < t_total
    x = jnp.where(valid, x_ref[...].astype(_F32), 0.0)
    a = jnp.where(valid, a_ref[...].astype(_F32), 1.0)
    k = 1
    while k < block_t:  # Hillis-Steele: after this step each row holds its last 2k steps
        shift = block_t - k if backwards else k  # roll moves row i to row i + shift (mod block_t)
        has_prev = rows < block_t - k if backwards else rows >= k
        x_prev = jnp.where(has_prev, pltpu.roll(x, shift, 0), 0.0)
        a_prev = jnp.where(has_prev, pltpu.roll(a, shift, 0), 1.0)
        x = a * x_prev + x
        a = a * a_prev
        k *= 2
    h = a * carry_ref[...] + x
    o_ref[...] = h.astype(o_ref.dtype)
    carry_ref[...] = h[0:1] if backwards else h[block_t - 1:block_t]


def _fit(size: int, block: int) -> int:
    """The block along an axis of `size`: `block` (aligned by the config; the last block may be
    partial), or the whole axis when that is smaller (a full axis is always a legal block)."""
    return size if size <= block else block


def _scan(x, a, h0, *, backwards: bool, config: LinearRecurrenceTpuConfig):
    """h (x's dtype) of the recurrence over axis 1 walking backwards or forwards; h0 [B, D] or None."""
    b, t, d = x.shape
    bt, bd = _fit(t, config.block_t), _fit(d, config.block_d)
    n_tiles = pl.cdiv(t, bt)
    h0 = jnp.zeros((b, 1, d), _F32) if h0 is None else h0.reshape(b, 1, d)

    def tile_index(i, j, c):
        return (i, (n_tiles - 1 - c) if backwards else c, j)

    tile = pl.BlockSpec((None, bt, bd), tile_index)
    return pl.pallas_call(
        functools.partial(_kernel, t_total=t, block_t=bt, n_tiles=n_tiles, backwards=backwards),
        grid=(b, pl.cdiv(d, bd), n_tiles),
        in_specs=[tile, tile, pl.BlockSpec((None, 1, bd), lambda i, j, c: (i, 0, j))],
        out_specs=tile,
        out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
        scratch_shapes=[pltpu.VMEM((1, bd), _F32)],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary")),
        cost_estimate=pl.CostEstimate(flops=2 * x.size, transcendentals=0,
                                      bytes_accessed=x.size * (2 * x.dtype.itemsize + a.dtype.itemsize)),
        interpret=pltpu.InterpretParams() if interpret_enabled() else False,
    )(x, a, h0)


def _shift(v, fill, *, later: bool):
    """v moved one step along time: entry t holds v[t+1] (later) or v[t-1]; the entry with no
    neighbour is `fill` ([B, D]) or zero."""
    edge = jnp.zeros_like(v[:, :1]) if fill is None else fill[:, None].astype(v.dtype)
    return jnp.concatenate([v[:, 1:], edge], axis=1) if later else jnp.concatenate([edge, v[:, :-1]], axis=1)


@functools.cache
def _differentiable(reverse: bool, config: LinearRecurrenceTpuConfig):
    scan = functools.partial(_scan, config=config)
    forward = functools.partial(scan, backwards=reverse)

    def backward(g, a, h, h0):
        # dh_t = g_t + a_{t+1} dh_{t+1} (t-1 for a reverse op): the recurrence walking the other way.
        a_next = _shift(a.astype(_F32), None, later=not reverse)
        dh = scan(g.astype(_F32), a_next, None, backwards=not reverse)
        h_prev = _shift(h.astype(_F32), None if h0 is None else h0.astype(_F32), later=reverse)
        da = (dh * h_prev).astype(a.dtype)
        first = a.shape[1] - 1 if reverse else 0
        dh0 = None if h0 is None else (a[:, first].astype(_F32) * dh[:, first]).astype(h0.dtype)
        return dh.astype(g.dtype), da, dh0

    return with_vjp(forward, backward)


def linear_recurrence(x, a, initial_state, *, reverse: bool = False, config: LinearRecurrenceTpuConfig):
    if x.size == 0:
        return jnp.zeros_like(x)
    return _differentiable(reverse, config)(x, a, initial_state)


LINEAR_RECURRENCE = Implementation(fn=linear_recurrence, platforms={"tpu"}, interpretable=True, supports=kernel_supports,
                                   config_type=LinearRecurrenceTpuConfig, heuristic_config=heuristic_config,
                                   candidate_configs=candidate_configs)
