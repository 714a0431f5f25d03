"""Gated MLP reference: plain jax.numpy, f32 accumulation.

    gate = x @ w_gate,  up = x @ w_up  (f32),  h = act(gate) * up,
    y = h                      (no down projection), or
    y = round(h) @ w_down      (h rounded to x's dtype first, as the kernels keep it)

x `[..., K]`, w_gate/w_up `[K, N]` (or w_gate a fused `[K, 2, N]` with w_up None: `[:, 0]` gate,
`[:, 1]` up), w_down `[N, K_out]`; output in x's dtype. Activations: silu, gelu (erf), gelu_tanh,
relu. Its gradient is JAX autodiff: the oracle for every backward kernel.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from forgeax.core.registry import Implementation
from forgeax.kernels.common.gated_mlp import GatedMLPSpec, activate, split_weights


def _dot(a, b):
    return jnp.matmul(a, b, precision=jax.lax.Precision.HIGHEST, preferred_element_type=jnp.float32)


def gated_mlp(
    x: Float[Array, "*B K"],
    w_gate: Float[Array, "K N"] | Float[Array, "K 2 N"],
    w_up: Float[Array, "K N"] | None,
    w_down: Float[Array, "N K_out"] | None,
    *,
    spec: GatedMLPSpec,
) -> Float[Array, "*B D"]:
    w_gate, w_up = split_weights(w_gate, w_up)
    h = activate(_dot(x, w_gate), spec.activation) * _dot(x, w_up)
    if w_down is None:
        return h.astype(x.dtype)
    return _dot(h.astype(x.dtype), w_down).astype(x.dtype)


GATED_MLP = Implementation(fn=gated_mlp)
