"""What the linear-recurrence kernels (h_t = a_t * h_{t-1} + x_t; Triton, Mosaic TPU) share."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from forgeax.kernels.common.batching import fold_vmap_into_rows
from forgeax.kernels.common.partitioning import split_launch

KERNEL_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def kernel_supports(x, a, initial_state, *, reverse: bool) -> str | None:
    """The kernels' `supports`: any shape and direction, the three float dtypes (f32 math inside)."""
    del reverse
    for name, v in (("x", x), ("a", a), ("initial_state", initial_state)):
        if v is not None and jnp.dtype(v.dtype) not in KERNEL_DTYPES:
            return f"{name}: dtype {jnp.dtype(v.dtype).name} is not one of float32/bfloat16/float16"
    return None


_SEQ = ("b", None, "d")  # x, a, h, g, dx, da [B, T, D]: batch and channels may be split, time stays whole
_STATE = ("b", "d")  # h0, dh0 [B, D]


def with_vjp(forward, backward):
    """h = forward(x, a, h0) as a custom_vjp that saves (a, h, h0) and returns
    backward(g, a, h, h0) = (dx, da, dh0): the one residual choice both kernels make (h is what
    da needs; x is not needed, since dx_t = dh_t). Both are launches on whole sequences: vmap
    folds into the batch axis, and under jit with batch- and/or channel-sharded arrays each
    device runs them on its own batch rows and channels (kernels/common/partitioning.py
    `split_launch`; every channel's scan stays whole on one device)."""
    split = split_launch(lambda *args: (forward(*args),), (_SEQ, _SEQ, _STATE), ((_SEQ, ()),))
    local_forward = fold_vmap_into_rows(lambda *args: split(*args)[0], row_args=(0, 1, 2))
    local_backward = fold_vmap_into_rows(
        split_launch(backward, (_SEQ, _SEQ, _SEQ, _STATE), ((_SEQ, ()), (_SEQ, ()), (_STATE, ()))), row_args=(0, 1, 2, 3))

    @jax.custom_vjp
    def run(x, a, h0):
        return local_forward(x, a, h0)

    def run_fwd(x, a, h0):
        h = local_forward(x, a, h0)
        return h, (a, h, h0)

    def run_bwd(residuals, g):
        a, h, h0 = residuals
        return local_backward(g, a, h, h0)

    run.defvjp(run_fwd, run_bwd)
    return run
