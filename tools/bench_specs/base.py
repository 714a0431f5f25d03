"""The pieces every spec is made of: a named `Shape`, a `Spec`, and shared helpers."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from forgeax import ops

NORM_EPS = 1e-6


@dataclasses.dataclass(frozen=True)
class Shape:
    name: str
    dims: tuple[int, ...]
    dtype: str
    small: bool = False  # cheap enough for the CPU default run
    # Keyword options of this shape's calls (e.g. causal, window), merged over Spec.options.
    options: tuple[tuple[str, Any], ...] = ()


@dataclasses.dataclass(frozen=True)
class Spec:
    op: str
    shapes: tuple[Shape, ...]
    make_inputs: Callable[[Shape, jax.Array], tuple[Any, ...]]
    # (backend, mode, options) -> jitted function of the inputs
    build: Callable[[str, str, dict[str, Any]], Callable[..., Any]]
    # (shape, mode) -> (bytes, flops) the call must move / compute at minimum
    floor: Callable[[Shape, str], tuple[float, float]]
    # Keyword options every call passes (also given to each backend's supports()).
    options: dict[str, Any] = dataclasses.field(default_factory=dict)
    # Implementations users reach for today, timed in the same rounds: name -> (mode, options) -> fn.
    anchors: dict[str, Callable[[str, dict[str, Any]], Callable[..., Any]]] = dataclasses.field(default_factory=dict)
    main_anchor: str | None = None  # the anchor the targets are ratios against
    # Whether the public arguments are the backends' arguments (then supports() is asked first;
    # otherwise an UnsupportedError from the call says it).
    precheck: bool = True


def passes_floor(*, fwd: int, fwd_bwd: int) -> Callable[[Shape, str], tuple[float, float]]:
    """A memory-bound op's floor: `fwd` / `fwd_bwd` passes over an array of the shape (bytes, no FLOPs)."""

    def floor(shape: Shape, mode: str) -> tuple[float, float]:
        pass_bytes = math.prod(shape.dims) * jnp.dtype(shape.dtype).itemsize
        return (fwd if mode == "fwd" else fwd_bwd) * pass_bytes, 0.0

    return floor


def training_step(fn: Callable[..., Any], mode: str, wrt: int | None = None) -> Callable[..., Any]:
    """The jitted function of a spec's inputs `(*args, cotangent)`: `fn(*args)` ("fwd"), or its
    output and the gradients of the first `wrt` args (default: all) for that cotangent
    ("fwd+bwd"), the rest (targets, group sizes, indices) held fixed: a training step's view, the
    forward output used, then the backward."""
    if mode == "fwd":
        return jax.jit(lambda *a: fn(*a[:-1]))

    def fwd_bwd(*a):
        args, cotangent = a[:-1], a[-1]
        n = len(args) if wrt is None else wrt
        out, pullback = jax.vjp(lambda *d: fn(*d, *args[n:]), *args[:n])
        return (out,) + pullback(cotangent)

    return jax.jit(fwd_bwd)


def with_config(op_name: str, backend: str | None, fields: dict[str, Any], *args: Any, **kwargs: Any) -> dict[str, Any]:
    """{"config": the backend's heuristic config with `fields` replaced} ('triton:block_t=32'), or {}."""
    if not fields:
        return {}
    impl = ops.OPS[op_name].implementation(backend)
    return {"config": impl.heuristic_config(*args, **kwargs).replace(**fields)}
