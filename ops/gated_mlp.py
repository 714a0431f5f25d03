"""The gated MLP of Llama-style blocks: `gated_mlp`."""

from __future__ import annotations

from jaxtyping import Array, Float

from forgeax.core import KernelConfig, Selection, define_op
from forgeax.kernels.common.gated_mlp import ACTIVATIONS, GatedMLPSpec
from forgeax.ops import checks

_BACKENDS = {
    "xla": "forgeax.kernels.xla.gated_mlp:GATED_MLP",
    "xla_dot": "forgeax.kernels.xla.gated_mlp:GATED_MLP_DOT",
    "triton": "forgeax.kernels.triton.gated_mlp:GATED_MLP",
    "pallas_gpu": "forgeax.kernels.pallas.gpu.gated_mlp:GATED_MLP",
    "pallas_tpu": "forgeax.kernels.pallas.tpu.gated_mlp:GATED_MLP",
}


def _features(args, kwargs) -> dict:
    """What selection rules (rules/gated_mlp.json) read of a call."""
    x, w_gate, w_up, w_down = args
    del kwargs, w_up
    k = int(x.shape[-1])
    return {"rows": int(x.size // max(k, 1)), "k": k, "n": int(w_gate.shape[-1]),
            "down": w_down is not None, "dtype": x.dtype.name}


GATED_MLP = define_op("gated_mlp", _BACKENDS, selection=Selection.load("forgeax.ops", "rules/gated_mlp.json"),
                      features=_features)


def _check(x, w_gate, w_up, w_down) -> None:
    checks.floating_array("x", x, min_rank=1)
    k = int(x.shape[-1])
    if k == 0:
        raise ValueError(f"x: expected a non-empty last axis (K), got shape {tuple(x.shape)}")
    checks.floating_array("w_gate", w_gate, min_rank=2)
    if w_up is None:
        if w_gate.ndim != 3 or w_gate.shape[:2] != (k, 2):
            raise ValueError(f"w_gate: with w_up=None expected a fused weight of shape ({k}, 2, N), got {tuple(w_gate.shape)}")
    else:
        if w_gate.ndim != 2 or w_gate.shape[0] != k:
            raise ValueError(f"w_gate: expected shape ({k}, N) (K = the last axis of x {tuple(x.shape)}), got {tuple(w_gate.shape)}")
        checks.floating_array("w_up", w_up, min_rank=2)
        if tuple(w_up.shape) != tuple(w_gate.shape):
            raise ValueError(f"w_up: expected the shape of w_gate {tuple(w_gate.shape)}, got {tuple(w_up.shape)}")
    n = int(w_gate.shape[-1])
    if n == 0:
        raise ValueError(f"w_gate: expected N >= 1, got shape {tuple(w_gate.shape)}")
    if w_down is not None:
        checks.floating_array("w_down", w_down, min_rank=2)
        if w_down.ndim != 2 or w_down.shape[0] != n or w_down.shape[1] == 0:
            raise ValueError(f"w_down: expected shape ({n}, K_out) (N = the last axis of w_gate), got {tuple(w_down.shape)}")
    for name, w in (("w_gate", w_gate), ("w_up", w_up), ("w_down", w_down)):
        if w is not None and w.dtype != x.dtype:
            raise TypeError(f"{name}: expected x's dtype {x.dtype.name}, got {w.dtype.name} (cast the weights first)")


def gated_mlp(
    x: Float[Array, "*B K"],
    w_gate: Float[Array, "K N"] | Float[Array, "K 2 N"],
    w_up: Float[Array, "K N"] | None,
    w_down: Float[Array, "N K_out"] | None = None,
    *,
    activation: str = "silu",
    backend: str | None = None,
    config: KernelConfig | None = None,
) -> Float[Array, "*B D"]:
    """The gated MLP (SwiGLU / GeGLU): gate and up projections, gated, optionally projected down.

        h = act(x @ w_gate) * (x @ w_up);   y = h @ w_down  (or y = h when w_down is None)

    Kernels compute both projections of an output tile in one pass over x, with the activation
    and product in the epilogue, so the `[M, 2N]` pre-activations are never written; the
    backward recomputes them from x (nothing of width 2N is kept for it).

    Args:
      x: `[..., K]` f32/bf16/f16; leading axes are tokens.
      w_gate: `[K, N]` gate projection. Or the fused form: a `[K, 2, N]` array with
        `w_gate[:, 0]` the gate and `w_gate[:, 1]` the up projection, passed with `w_up=None`
        (as one `[K, 2N]` matrix: columns `[0, N)` gate, `[N, 2N)` up).
      w_up: `[K, N]` up projection, or None with a fused w_gate.
      w_down: `[N, K_out]` down projection, or None to return h.
      activation: "silu" (SwiGLU), "gelu" (exact, erf), "gelu_tanh" (tanh approximation) or "relu".
      backend: None (best for this device), "xla" (the f32 reference), "xla_dot" (XLA's own
        16-bit dots, as plain JAX writes it), "triton", "pallas", "pallas_gpu" (Hopper;
        bf16/f16 with K and N multiples of 64), "pallas_tpu", or a user-registered name.
      config: a kernel config of the chosen backend (its `config_type`), or None.

    All arrays share x's dtype. Products accumulate in f32; h is rounded to x's dtype before
    the down projection.

    Returns:
      `[..., N]` (no down projection) or `[..., K_out]`, in x's dtype. Differentiable with
      respect to x and every weight.
    """
    if not isinstance(activation, str) or activation not in ACTIVATIONS:
        raise ValueError(f"activation: expected one of {ACTIVATIONS}, got {activation!r}")
    _check(x, w_gate, w_up, w_down)
    return GATED_MLP(x, w_gate, w_up, w_down, spec=GatedMLPSpec(activation=activation), backend=backend, config=config)
