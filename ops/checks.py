"""Argument checks shared by the public ops: each error names the argument."""

from __future__ import annotations

import math
from typing import Any

import jax.numpy as jnp

FLOAT_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


def floating_array(name: str, value: Any, *, min_rank: int = 0) -> None:
    """`value` is an array of a supported float dtype with at least `min_rank` axes."""
    if not (hasattr(value, "shape") and hasattr(value, "dtype")):
        raise TypeError(f"{name}: expected a JAX or NumPy array, got {type(value).__name__}")
    if jnp.dtype(value.dtype) not in [jnp.dtype(d) for d in FLOAT_DTYPES]:
        raise TypeError(f"{name}: expected dtype float32, bfloat16 or float16, got {jnp.dtype(value.dtype).name}")
    if value.ndim < min_rank:
        raise ValueError(f"{name}: expected at least {min_rank} axes, got shape {tuple(value.shape)}")


def positive_float(name: str, value: Any) -> None:
    """`value` is a finite Python/NumPy number > 0 (not a traced array)."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise TypeError(f"{name}: expected a positive number, got {value!r}") from None
    if not (number > 0 and math.isfinite(number)):
        raise ValueError(f"{name}: expected a finite number > 0, got {value!r}")


def integer_array(name: str, value: Any, shape: tuple[int, ...] | None = None, expected: str = "") -> None:
    """`value` is an array of an integer dtype, of exactly `shape` when given (`expected` says what it is)."""
    if not (hasattr(value, "shape") and hasattr(value, "dtype")):
        raise TypeError(f"{name}: expected an integer JAX or NumPy array, got {type(value).__name__}")
    if not jnp.issubdtype(value.dtype, jnp.integer):
        raise TypeError(f"{name}: expected an integer dtype, got {jnp.dtype(value.dtype).name}")
    if shape is not None and tuple(value.shape) != tuple(shape):
        what = f" ({expected})" if expected else ""
        raise ValueError(f"{name}: expected shape {tuple(shape)}{what}, got {tuple(value.shape)}")


def scale_and_soft_cap(scale: Any, logit_soft_cap: Any, head_dim: int) -> tuple[float, float | None]:
    """The attention score scale (None: 1 / sqrt(head_dim)) and soft cap (None: off), both checked > 0."""
    if scale is None:
        scale = 1.0 / math.sqrt(head_dim)
    else:
        positive_float("scale", scale)
    if logit_soft_cap is not None:
        positive_float("logit_soft_cap", logit_soft_cap)
        logit_soft_cap = float(logit_soft_cap)
    return float(scale), logit_soft_cap


def kv_heads_divide(name: str, num_heads: int, kv_heads: int, label: str = "K") -> None:
    """GQA/MQA: the query heads are a whole multiple of the kv heads of argument `name`."""
    if kv_heads == 0 or num_heads % kv_heads != 0:
        raise ValueError(f"{name}: query heads N={num_heads} must be a multiple of kv heads {label}={kv_heads}")


def window(window: Any, causal: bool) -> tuple[int | None, int | None]:
    """The attention `window=(left, right)` (ints >= 0 or None; None: unbounded) as (left, right);
    right is 0 with causal (a query sees no later key). ops.attention's rule, shared by the
    paged and ragged paged ops."""
    if window is None:
        return None, None
    if not (isinstance(window, (tuple, list)) and len(window) == 2):
        raise TypeError(f"window: expected (left, right) with ints >= 0 or None, got {window!r}")
    out = []
    for side, w in zip(("left", "right"), window):
        if w is None:
            out.append(None)
            continue
        if isinstance(w, bool) or not isinstance(w, (int, jnp.integer)):
            raise TypeError(f"window: {side} size must be an int >= 0 or None, got {w!r}")
        if w < 0:
            raise ValueError(f"window: {side} size must be >= 0, got {int(w)}")
        out.append(int(w))
    return out[0], (0 if causal else out[1])
