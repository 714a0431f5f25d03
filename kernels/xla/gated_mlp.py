"""Gated MLP reference: plain jax.numpy, f32 accumulation.

    gate = x @ w_gate,  up = x @ w_up  (f32),  h = act(gate) * up,
    y = h                      (no down projection), or
    y = round(h) @ w_down      (h rounded to x's dtype first, as the kernels keep it)

x `[..., K]`, w_gate/w_up `[K, N]` (or w_gate a fused `[K, 2, N]` with w_up None: `[:, 0]` gate,
`[:, 1]` up), w_down `[N, K_out]`; output in x's dtype. Activations: silu, gelu (erf), gelu_tanh,
relu. Its gradient is JAX autodiff: the oracle for every backward kernel.

`GATED_MLP_DOT` ("xla_dot") is what plain JAX code runs: XLA's dots in the input dtype (f32
accumulation; f32 inputs at full precision), gate and up kept in it for the backward, which is
the kernels' shared one (kernels/common/gated_mlp.py: one rounding of dpre, 16-bit matmuls). It
is what the kernels must beat on a GPU.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from forgeax.core.registry import Implementation
from forgeax.kernels.common.gated_mlp import GatedMLPSpec, activate, differentiable_gated_mlp, matmul, split_weights


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



@dataclasses.dataclass(frozen=True)
class _SavePreactivations:
    """XLA's forward has [gate | up] at hand: the shared backward takes them instead of recomputing."""

    save_preactivations: bool = True


def _forward_saving(x, w_gate, w_up, *, activation, config):
    del config
    gate, up = matmul(x, w_gate), matmul(x, w_up)
    h = (activate(gate.astype(jnp.float32), activation) * up.astype(jnp.float32)).astype(x.dtype)
    return h, jnp.concatenate([gate, up], axis=1)


def _forward(x, w_gate, w_up, *, activation, config):
    return _forward_saving(x, w_gate, w_up, activation=activation, config=config)[0]  # XLA drops the unused concat


def _recompute(x, w_gate, w_up, dh, *, activation, config, want_h):
    raise AssertionError("xla_dot always saves its preactivations")  # never called: see _SavePreactivations


_DOT = differentiable_gated_mlp(_forward, _recompute, _forward_saving)


def gated_mlp_dot(
    x: Float[Array, "*B K"],
    w_gate: Float[Array, "K N"] | Float[Array, "K 2 N"],
    w_up: Float[Array, "K N"] | None,
    w_down: Float[Array, "N K_out"] | None,
    *,
    spec: GatedMLPSpec,
) -> Float[Array, "*B D"]:
    if w_up is None:
        w_gate, w_up = split_weights(w_gate, w_up)
    return _DOT(x, w_gate, w_up, w_down, spec, _SavePreactivations())


GATED_MLP_DOT = Implementation(fn=gated_mlp_dot)
