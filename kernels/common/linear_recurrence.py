"""What the linear-recurrence kernels (h_t = a_t * h_{t-1} + x_t; Triton, Mosaic TPU) share."""

from __future__ import annotations

import jax.numpy as jnp

KERNEL_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def kernel_supports(x, a, initial_state, *, reverse: bool) -> str | None:
    """The kernels' `supports`: any shape and direction, the three float dtypes (f32 math inside)."""
    del reverse
    for name, v in (("x", x), ("a", a), ("initial_state", initial_state)):
        if v is not None and jnp.dtype(v.dtype) not in KERNEL_DTYPES:
            return f"{name}: dtype {jnp.dtype(v.dtype).name} is not one of float32/bfloat16/float16"
    return None
