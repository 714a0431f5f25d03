"""First-order linear recurrence over time: `linear_recurrence` (Mamba / RG-LRU style scans)."""

from __future__ import annotations

import jax.numpy as jnp
from jaxtyping import Array, Float

from forgeax.core import KernelConfig, Selection, define_op
from forgeax.ops import checks

__all__ = ["linear_recurrence"]


def _features(args, kwargs) -> dict:
    """What the selection rules (rules/linear_recurrence.json) read of a call."""
    x = args[0]
    return {"batch": int(x.shape[0]), "tokens": int(x.shape[1]), "dim": int(x.shape[2]), "dtype": x.dtype.name,
            "reverse": bool(kwargs["reverse"]), "initial_state": args[2] is not None}


_MODULES = {"xla": "xla:LINEAR_RECURRENCE", "xla_scan": "xla:LINEAR_RECURRENCE_SCAN",
            "triton": "triton:LINEAR_RECURRENCE", "pallas_tpu": "pallas.tpu:LINEAR_RECURRENCE"}
LINEAR_RECURRENCE = define_op(
    "linear_recurrence",
    {name: "forgeax.kernels.{}.linear_recurrence:{}".format(*ref.split(":")) for name, ref in _MODULES.items()},
    selection=Selection.load("forgeax.ops", "rules/linear_recurrence.json"),
    features=_features,
)


def linear_recurrence(
    x: Float[Array, "B T D"],
    a: Float[Array, "B T D"],
    *,
    initial_state: Float[Array, "B D"] | None = None,
    reverse: bool = False,
    return_final_state: bool = False,
    backend: str | None = None,
    config: KernelConfig | None = None,
) -> Float[Array, "B T D"] | tuple[Float[Array, "B T D"], Float[Array, "B D"]]:
    """The first-order linear recurrence h_t = a_t * h_{t-1} + x_t over axis 1.

    With `reverse=True` time runs from T-1 down to 0: h_t = a_t * h_{t+1} + x_t. The state
    before the first step is `initial_state` (zeros when None). The state is carried in f32
    whatever the input dtypes; h is rounded to x's dtype once per step on output.

    Args:
      x: `[B, T, D]` inputs, f32/bf16/f16.
      a: `[B, T, D]` decays (any float dtype; usually in [0, 1], any finite value works).
      initial_state: None or `[B, D]` (any float dtype), the state before the first step.
      reverse: run time backwards (from t = T-1 to 0).
      return_final_state: also return the state after the last step (`h[:, -1]`, or `h[:, 0]`
        when reverse), to chain calls over consecutive chunks of a sequence.
      backend: None (best for this device), "xla" (a sequential `lax.scan`, the reference),
        "xla_scan" (XLA's associative scan), "triton", "pallas_tpu", or a registered name.
      config: a kernel config of the chosen backend (None: tuned or heuristic).

    Returns:
      h `[B, T, D]` in x's dtype, or (h, final state `[B, D]` in x's dtype). Differentiable with
      respect to x, a and initial_state (the backward is the same recurrence run the other way).
    """
    checks.floating_array("x", x)
    checks.floating_array("a", a)
    if x.ndim != 3:
        raise ValueError(f"x: expected 3 axes [B, T, D], got shape {tuple(x.shape)}")
    if tuple(a.shape) != tuple(x.shape):
        raise ValueError(f"a: expected x's shape {tuple(x.shape)}, got {tuple(a.shape)}")
    if initial_state is not None:
        checks.floating_array("initial_state", initial_state)
        if tuple(initial_state.shape) != (x.shape[0], x.shape[2]):
            raise ValueError(f"initial_state: expected shape ({x.shape[0]}, {x.shape[2]}) ([B, D] of x), "
                             f"got {tuple(initial_state.shape)}")
    for name, value in (("reverse", reverse), ("return_final_state", return_final_state)):
        if not isinstance(value, bool):
            raise TypeError(f"{name}: expected a bool, got {value!r}")
    if x.shape[1] == 0:
        h = jnp.zeros_like(x)
        final = jnp.zeros((x.shape[0], x.shape[2]), x.dtype) if initial_state is None else initial_state.astype(x.dtype)
        return (h, final) if return_final_state else h
    h = LINEAR_RECURRENCE(x, a, initial_state, reverse=reverse, backend=backend, config=config)
    if not return_final_state:
        return h
    return h, h[:, 0 if reverse else x.shape[1] - 1]
