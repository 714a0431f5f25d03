"""Newton-Schulz orthogonalisation (Muon's quintic iteration): `newton_schulz`."""

from __future__ import annotations

import math
import numbers

from jaxtyping import Array, Float

from forgeax.core import KernelConfig, Selection, define_op
from forgeax.kernels.common.newton_schulz import COEFFICIENTS, NewtonSchulzSpec
from forgeax.ops import checks

_BACKENDS = {
    "xla": "forgeax.kernels.xla.newton_schulz:NEWTON_SCHULZ",
    "triton": "forgeax.kernels.triton.newton_schulz:NEWTON_SCHULZ",
    "pallas_tpu": "forgeax.kernels.pallas.tpu.newton_schulz:NEWTON_SCHULZ",
    "pallas_gpu": "forgeax.kernels.pallas.gpu.newton_schulz:NEWTON_SCHULZ",
}


def _features(args, kwargs) -> dict:
    """What selection rules (rules/newton_schulz.json) read of a call: the small and large side."""
    del kwargs
    m, n = (int(d) for d in args[0].shape[-2:])
    return {"small": min(m, n), "large": max(m, n), "dtype": args[0].dtype.name}


NEWTON_SCHULZ = define_op("newton_schulz", _BACKENDS, selection=Selection.load("forgeax.ops", "rules/newton_schulz.json"),
                          features=_features)


def _spec(steps, coefficients, eps) -> NewtonSchulzSpec:
    if isinstance(steps, bool) or not isinstance(steps, numbers.Integral):
        raise TypeError(f"steps: expected an int >= 1, got {steps!r}")
    if steps < 1:
        raise ValueError(f"steps: expected an int >= 1, got {steps}")
    try:
        coefficients = tuple(float(c) for c in coefficients)
    except (TypeError, ValueError):
        raise TypeError(f"coefficients: expected three numbers (a, b, c), got {coefficients!r}") from None
    if len(coefficients) != 3 or not all(math.isfinite(c) for c in coefficients):
        raise ValueError(f"coefficients: expected three finite numbers (a, b, c), got {coefficients!r}")
    checks.positive_float("eps", eps)
    return NewtonSchulzSpec(steps=int(steps), coefficients=coefficients, eps=float(eps))


def newton_schulz(
    g: Float[Array, "*B M N"],
    *,
    steps: int = 5,
    coefficients: tuple[float, float, float] = COEFFICIENTS,
    eps: float = 1e-7,
    backend: str | None = None,
    config: KernelConfig | None = None,
) -> Float[Array, "*B M N"]:
    """Approximately orthogonalises each matrix of g: Muon's quintic Newton-Schulz iteration.

        X = G / (||G||_F + eps);  steps times:  A = X X^T,  B = b A + c A A,  X = a X + B X

    on the small side (G is transposed first when M > N). With the default coefficients and 5
    steps the singular values of the result lie in a band around 1 (about [0.68, 1.13] for a
    well-conditioned input), not exactly at 1: that is Muon's design, trading exactness for
    speed. The iterations run in bf16 (bf16 operands, f32 accumulation), as Muon's reference
    does; the normalisation is in f32.

    Args:
      g: `[..., M, N]` f32/bf16/f16, M, N >= 1; leading axes are independent matrices.
      steps: iterations, >= 1.
      coefficients: (a, b, c) of the quintic p(s) = a s + b s^3 + c s^5.
      eps: added to the Frobenius norm before dividing; > 0.
      backend: None (best for this device), "xla", "triton", "pallas_gpu", "pallas_tpu", or a user-registered name.
      config: a kernel config of the chosen backend (its `config_type`), or None.

    Returns:
      `[..., M, N]` in g's dtype. Differentiable: the gradient of every backend is the autodiff
      of the XLA reference iteration (recomputed in the backward).
    """
    checks.floating_array("g", g, min_rank=2)
    if 0 in g.shape[-2:]:
        raise ValueError(f"g: expected non-empty matrices, got shape {tuple(g.shape)}")
    spec = _spec(steps, coefficients, eps)
    return NEWTON_SCHULZ(g, spec=spec, backend=backend, config=config)
