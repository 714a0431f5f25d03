"""What the linear-recurrence kernels (h_t = a_t * h_{t-1} + x_t; Triton, Mosaic TPU) share."""

from __future__ import annotations

import jax
import jax.numpy as jnp

KERNEL_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def kernel_supports(x, a, initial_state, *, reverse: bool) -> str | None:
    """The kernels' `supports`: any shape and direction, the three float dtypes (f32 math inside)."""
    del reverse
    for name, v in (("x", x), ("a", a), ("initial_state", initial_state)):
        if v is not None and jnp.dtype(v.dtype) not in KERNEL_DTYPES:
            return f"{name}: dtype {jnp.dtype(v.dtype).name} is not one of float32/bfloat16/float16"
    return None


def with_vjp(forward, backward):
    """h = forward(x, a, h0) as a custom_vjp that saves (a, h, h0) and returns
    backward(g, a, h, h0) = (dx, da, dh0): the one residual choice both kernels make (h is what
    da needs; x is not needed, since dx_t = dh_t)."""

    @jax.custom_vjp
    def run(x, a, h0):
        return forward(x, a, h0)

    def run_fwd(x, a, h0):
        h = forward(x, a, h0)
        return h, (a, h, h0)

    def run_bwd(residuals, g):
        a, h, h0 = residuals
        return backward(g, a, h, h0)

    run.defvjp(run_fwd, run_bwd)
    return run
