"""softcap's XLA reference: cap * tanh(x / cap), in f32, output in x's dtype.

The logit soft-capping of Gemma 2 and Grok. Plain jax.numpy, obviously right; its autodiff
is the gradient oracle the conformance tests compare the kernel's backward against.
"""

from __future__ import annotations

import jax.numpy as jnp

from forgeax import Implementation


def softcap(x, *, cap: float):
    y = cap * jnp.tanh(x.astype(jnp.float32) / cap)
    return y.astype(x.dtype)


SOFTCAP = Implementation(fn=softcap)  # every platform; no config
