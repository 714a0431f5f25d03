"""Gated MLP reference: plain jax.numpy, f32 accumulation.

    gate = x @ w_gate,  up = x @ w_up  (f32),  h = act(gate) * up,
    y = h                      (no down projection), or
    y = round(h) @ w_down      (h rounded to x's dtype first, as the kernels keep it)

x `[..., K]`, w_gate/w_up `[K, N]` (or w_gate a fused `[K, 2, N]` with w_up None: `[:, 0]` gate,
`[:, 1]` up), w_down `[N, K_out]`; output in x's dtype. Activations: silu, gelu (erf), gelu_tanh,
relu. Its gradient is JAX autodiff: the oracle for every backward kernel.

`GATED_MLP_DOT` ("xla_dot") is what plain JAX code runs: XLA's dots in the input dtype (f32
accumulation; f32 inputs at full precision), the activation in f32 inside XLA's elementwise
fusion, and JAX autodiff for the backward (XLA's rematerialisation and fusion decisions, as in a
user's model). It is what the kernels must beat on a GPU.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from forgeax.core.registry import Implementation
from forgeax.kernels.common.gated_mlp import GatedMLPSpec, activate, matmul_precision, split_weights


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


def gated_mlp_dot(
    x: Float[Array, "*B K"],
    w_gate: Float[Array, "K N"] | Float[Array, "K 2 N"],
    w_up: Float[Array, "K N"] | None,
    w_down: Float[Array, "N K_out"] | None,
    *,
    spec: GatedMLPSpec,
) -> Float[Array, "*B D"]:
    w_gate, w_up = split_weights(w_gate, w_up)
    precision = matmul_precision(x.dtype)
    # Rows flattened: the weight gradients are then dots over one contracting dimension (XLA's CPU
    # emitter rounds a bf16 dot over several contracting dimensions far worse, 2e-2 against 4e-3).
    x2 = x.reshape(-1, x.shape[-1])
    # Dots in x's dtype (cuBLAS writes bf16 directly, f32 accumulation): no f32 [M, N] round trip.
    gate, up = jnp.matmul(x2, w_gate, precision=precision), jnp.matmul(x2, w_up, precision=precision)
    h = (activate(gate.astype(jnp.float32), spec.activation) * up.astype(jnp.float32)).astype(x.dtype)
    y = h if w_down is None else jnp.matmul(h, w_down, precision=precision)
    return y.reshape(*x.shape[:-1], y.shape[-1])


GATED_MLP_DOT = Implementation(fn=gated_mlp_dot)
