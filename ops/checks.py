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
