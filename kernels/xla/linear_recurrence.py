"""First-order linear recurrence: the reference (a sequential scan) and XLA's associative scan.

x, a: [B, T, D]; initial_state h0: [B, D] or None (zeros). Over the time axis 1:

    forward:  h_t = a_t * h_{t-1} + x_t,   t = 0 .. T-1,   h_{-1} = h0
    reverse:  h_t = a_t * h_{t+1} + x_t,   t = T-1 .. 0,   h_T = h0

Output h: [B, T, D] in x's dtype; the state is carried in f32 whatever the input dtypes.

`linear_recurrence` (backend "xla") is `lax.scan` in f32, obviously right; its autodiff is the
gradient oracle. `linear_recurrence_scan` (backend "xla_scan") is `lax.associative_scan` over
the pairs (a, x) with the combine (a1, x1) . (a2, x2) = (a1 a2, a2 x1 + x2), h0 folded into
x_0, and a custom_vjp whose backward is itself a linear recurrence run the other way
(forward op; g the cotangent of h):

    dh_t = g_t + a_{t+1} dh_{t+1}   (dh_T = 0),   dx_t = dh_t,   da_t = dh_t h_{t-1},   dh0 = a_0 dh_0

(reverse op: the same with t+1 and t-1 exchanged and dh0 = a_{T-1} dh_{T-1}).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from forgeax.core.registry import Implementation

_F32 = jnp.float32


def linear_recurrence(x: Float[Array, "B T D"], a: Float[Array, "B T D"], initial_state: Float[Array, "B D"] | None,
                      *, reverse: bool = False) -> Float[Array, "B T D"]:
    """The reference: a sequential scan over time in f32."""
    h0 = jnp.zeros((x.shape[0], x.shape[2]), _F32) if initial_state is None else initial_state.astype(_F32)

    def step(h, xa):
        xt, at = xa
        h = at * h + xt
        return h, h

    xs = (jnp.swapaxes(x.astype(_F32), 0, 1), jnp.swapaxes(a.astype(_F32), 0, 1))
    _, h = jax.lax.scan(step, h0, xs, reverse=reverse)
    return jnp.swapaxes(h, 0, 1).astype(x.dtype)


def _combine(left, right):
    a1, x1 = left
    a2, x2 = right
    return a1 * a2, a2 * x1 + x2


def associative_recurrence(x, a, h0, *, reverse: bool):
    """h in f32 (x, a f32 [B, T, D], h0 f32 [B, D] or None) by XLA's associative scan over axis 1."""
    if h0 is not None:
        first = x.shape[1] - 1 if reverse else 0
        x = x.at[:, first].add(a[:, first] * h0)
    return jax.lax.associative_scan(_combine, (a, x), reverse=reverse, axis=1)[1]


def shift_in(v, fill, *, reverse: bool):
    """v shifted one step along time so that entry t holds v's previous step (t-1 forward, t+1
    reverse); the entry with no previous step is `fill` ([B, D], or zeros when None)."""
    edge = jnp.zeros_like(v[:, :1]) if fill is None else fill[:, None].astype(v.dtype)
    return jnp.concatenate([v[:, 1:], edge], axis=1) if reverse else jnp.concatenate([edge, v[:, :-1]], axis=1)


def shift_out(v, *, reverse: bool):
    """v shifted one step against the time direction: entry t holds v's next step (t+1 forward,
    t-1 reverse), zero past the end."""
    return shift_in(v, None, reverse=not reverse)


@functools.cache
def _scan_vjp(reverse: bool, has_h0: bool):
    @jax.custom_vjp
    def run(x, a, h0):
        return associative_recurrence(x.astype(_F32), a.astype(_F32), h0.astype(_F32) if has_h0 else None,
                                      reverse=reverse).astype(x.dtype)

    def run_fwd(x, a, h0):
        h = run(x, a, h0)
        return h, (a, h, h0)

    def run_bwd(residuals, g):
        a, h, h0 = residuals
        a32 = a.astype(_F32)
        # The backward recurrence runs the other way, each step decayed by the next step's a.
        dh = associative_recurrence(g.astype(_F32), shift_out(a32, reverse=reverse), None, reverse=not reverse)
        h_prev = shift_in(h.astype(_F32), h0.astype(_F32) if has_h0 else None, reverse=reverse)
        da = (dh * h_prev).astype(a.dtype)
        first = a.shape[1] - 1 if reverse else 0
        dh0 = (a32[:, first] * dh[:, first]).astype(h0.dtype) if has_h0 else None
        return dh.astype(g.dtype), da, dh0

    run.defvjp(run_fwd, run_bwd)
    return run


def linear_recurrence_scan(x, a, initial_state, *, reverse: bool = False):
    """The production XLA path: associative scan forward, associative scan backward."""
    return _scan_vjp(reverse, initial_state is not None)(x, a, initial_state)


LINEAR_RECURRENCE = Implementation(fn=linear_recurrence)
LINEAR_RECURRENCE_SCAN = Implementation(fn=linear_recurrence_scan)
