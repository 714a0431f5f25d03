"""Rotary position embedding: `rope` and `rope_qk` (q and k in one kernel)."""

from __future__ import annotations

import operator

import jax.numpy as jnp
from jaxtyping import Array, Float, Integer

from forgeax.core import KernelConfig, Selection, define_op
from forgeax.kernels.common.rope import Llama3Scaling, RopeSpec
from forgeax.ops import checks

__all__ = ["Llama3Scaling", "rope", "rope_qk"]


def _features(args, kwargs) -> dict:
    """What the selection rules (rules/rope.json, rules/rope_qk.json) read of a call."""
    x, spec = args[0], kwargs["spec"]
    return {"head_dim": int(x.shape[-1]), "heads": int(x.shape[2]), "tokens": int(x.shape[0] * x.shape[1]),
            "rotary_dim": spec.rotary_dim, "interleaved": spec.interleaved, "dtype": x.dtype.name}


def _backends(attr: str) -> dict[str, str]:
    modules = {"xla": "xla", "triton": "triton", "pallas_tpu": "pallas.tpu"}
    return {name: f"forgeax.kernels.{module}.rope:{attr}" for name, module in modules.items()}


ROPE = define_op("rope", _backends("ROPE"), selection=Selection.load("forgeax.ops", "rules/rope.json"), features=_features)
ROPE_QK = define_op("rope_qk", _backends("ROPE_QK"), selection=Selection.load("forgeax.ops", "rules/rope_qk.json"),
                    features=_features)


def _check_x(name: str, x) -> None:
    checks.floating_array(name, x)
    if x.ndim != 4:
        raise ValueError(f"{name}: expected 4 axes [B, T, N, H], got shape {tuple(x.shape)}")


def _positions(positions, batch: int, tokens: int):
    """positions as [B, T] int32 (a [T] vector is shared by every batch row)."""
    if not (hasattr(positions, "shape") and hasattr(positions, "dtype")):
        raise TypeError(f"positions: expected an integer JAX or NumPy array, got {type(positions).__name__}")
    if not jnp.issubdtype(positions.dtype, jnp.integer):
        raise TypeError(f"positions: expected an integer dtype, got {jnp.dtype(positions.dtype).name}")
    if tuple(positions.shape) not in ((tokens,), (batch, tokens)):
        raise ValueError(f"positions: expected shape ({batch}, {tokens}) or ({tokens},), got {tuple(positions.shape)}")
    return jnp.broadcast_to(jnp.asarray(positions).astype(jnp.int32), (batch, tokens))


def _spec(head_dim: int, theta, rotary_dim, interleaved, scaling) -> RopeSpec:
    checks.positive_float("theta", theta)
    if rotary_dim is None:
        rotary_dim = head_dim
    try:
        rotary_dim = operator.index(rotary_dim)
    except TypeError:
        raise TypeError(f"rotary_dim: expected an int or None, got {rotary_dim!r}") from None
    if rotary_dim <= 0 or rotary_dim % 2 or rotary_dim > head_dim:
        raise ValueError(f"rotary_dim: expected an even int in [2, {head_dim}] (the head dim), got {rotary_dim}")
    if not isinstance(interleaved, bool):
        raise TypeError(f"interleaved: expected a bool, got {interleaved!r}")
    if scaling is not None and not isinstance(scaling, Llama3Scaling):
        raise TypeError(f"scaling: expected None or a Llama3Scaling, got {type(scaling).__name__}")
    return RopeSpec(rotary_dim=rotary_dim, theta=float(theta), interleaved=interleaved, scaling=scaling)


def rope(
    x: Float[Array, "B T N H"],
    positions: Integer[Array, "B T"] | Integer[Array, " T"],
    *,
    theta: float = 10000.0,
    rotary_dim: int | None = None,
    interleaved: bool = False,
    scaling: Llama3Scaling | None = None,
    backend: str | None = None,
    config: KernelConfig | None = None,
) -> Float[Array, "B T N H"]:
    """Rotary position embedding of `x` at integer `positions`.

    Each head vector's pairs (a_i, b_i), i < rotary_dim / 2, rotate by p * theta^(-2i/rotary_dim):
    a' = a cos - b sin, b' = b cos + a sin (cos/sin in f32 from the positions).

    Args:
      x: `[B, T, N, H]` queries or keys, f32/bf16/f16.
      positions: `[B, T]` or `[T]` integer positions (no gradient).
      theta: the frequency base, > 0.
      rotary_dim: how many leading elements of each head rotate (even, <= H; None: all H);
        the rest pass through untouched.
      interleaved: False: GPT-NeoX layout, a_i = x[i], b_i = x[i + R/2]; True: GPT-J layout,
        a_i = x[2i], b_i = x[2i + 1].
      scaling: None, or `Llama3Scaling(...)` for Llama-3.1's frequency scaling.
      backend: None (best for this device), "xla", "triton", "pallas_tpu", or a registered name.
      config: a kernel config of the chosen backend (None: tuned or heuristic).

    Returns:
      `[B, T, N, H]` in x's dtype. Differentiable with respect to x (the inverse rotation).
    """
    _check_x("x", x)
    spec = _spec(x.shape[-1], theta, rotary_dim, interleaved, scaling)
    return ROPE(x, _positions(positions, x.shape[0], x.shape[1]), spec=spec, backend=backend, config=config)


def rope_qk(
    q: Float[Array, "B T N H"],
    k: Float[Array, "B T K H"],
    positions: Integer[Array, "B T"] | Integer[Array, " T"],
    *,
    theta: float = 10000.0,
    rotary_dim: int | None = None,
    interleaved: bool = False,
    scaling: Llama3Scaling | None = None,
    backend: str | None = None,
    config: KernelConfig | None = None,
) -> tuple[Float[Array, "B T N H"], Float[Array, "B T K H"]]:
    """`rope` of queries and keys at the same positions, in one kernel (k may have fewer heads: GQA).

    q: `[B, T, N, H]`, k: `[B, T, K, H]` of q's dtype; the options as for `rope`.
    Returns (rotated q, rotated k); differentiable with respect to q and k.
    """
    _check_x("q", q)
    _check_x("k", k)
    if k.dtype != q.dtype:
        raise TypeError(f"k: expected q's dtype {jnp.dtype(q.dtype).name}, got {jnp.dtype(k.dtype).name}")
    if (k.shape[0], k.shape[1], k.shape[3]) != (q.shape[0], q.shape[1], q.shape[3]):
        raise ValueError(f"k: expected shape ({q.shape[0]}, {q.shape[1]}, K, {q.shape[3]}) (q's B, T and H), "
                         f"got {tuple(k.shape)}")
    spec = _spec(q.shape[-1], theta, rotary_dim, interleaved, scaling)
    return ROPE_QK(q, k, _positions(positions, q.shape[0], q.shape[1]), spec=spec, backend=backend, config=config)
