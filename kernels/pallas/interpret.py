"""Running Pallas kernels (Mosaic TPU, Mosaic GPU) in their CPU interpreters under every JAX transformation."""

from __future__ import annotations

import jax


def without_effects(call, out_shape):
    """Runs the interpreted `call` in its own jit, behind an effect-free `pure_callback`.

    The Pallas interpreters simulate memory with ordered io_callbacks, and JAX
    refuses to differentiate `jax.checkpoint` around effects ("Effects not
    supported in AD of checkpoint/remat"). The kernel is pure, so hiding the
    interpreter behind a pure_callback is sound, lets interpret mode run
    everything the compiled kernel supports, and (with lru_caches around the
    kernel builders) compiles each interpreted kernel once per process, not
    once per trace. CPU interpreters only; the compiled paths call the
    kernels directly.
    """
    jitted = jax.jit(call)

    def run(*args):
        # "sequential": a vmap that reaches the kernel un-folded (nested vmaps) loops over it.
        return jax.pure_callback(jitted, out_shape, *args, vmap_method="sequential")

    return run
