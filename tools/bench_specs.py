"""Benchmark specs: named shapes from real models, how to call each op, and its floor.

A spec says, for an op and a mode ("fwd" or "fwd+bwd"), how to build inputs,
how to run one backend, and how many bytes / FLOPs the call must move at
minimum. `tools/bench.py` times every backend and anchor side by side.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from forgeax import ops


@dataclasses.dataclass(frozen=True)
class Shape:
    name: str
    dims: tuple[int, ...]
    dtype: str
    small: bool = False  # cheap enough for the CPU default run


@dataclasses.dataclass(frozen=True)
class Spec:
    op: str
    shapes: tuple[Shape, ...]
    make_inputs: Callable[[Shape, jax.Array], tuple[Any, ...]]
    # (backend, mode) -> jitted function of the inputs
    build: Callable[[str, str], Callable[..., Any]]
    # (shape, mode) -> (bytes, flops) the call must move / compute at minimum
    floor: Callable[[Shape, str], tuple[float, float]]
    # Keyword options every call passes (also given to each backend's supports()).
    options: dict[str, Any] = dataclasses.field(default_factory=dict)


def _passes_floor(*, fwd: int, fwd_bwd: int) -> Callable[[Shape, str], tuple[float, float]]:
    """A memory-bound op's floor: `fwd` / `fwd_bwd` passes over an array of the shape (bytes, no FLOPs)."""

    def floor(shape: Shape, mode: str) -> tuple[float, float]:
        pass_bytes = math.prod(shape.dims) * jnp.dtype(shape.dtype).itemsize
        return (fwd if mode == "fwd" else fwd_bwd) * pass_bytes, 0.0

    return floor


NORM_EPS = 1e-6


def _norm_spec(op_name: str, public: Callable[..., Any], has_offset: bool) -> Spec:
    shapes = (
        Shape("llama3-8b 32k tokens", (32768, 4096), "bfloat16"),
        Shape("llama3-70b 8k tokens", (8192, 8192), "bfloat16"),
        Shape("gpt2 16k tokens", (16384, 768), "bfloat16"),
        Shape("small f32", (4096, 1024), "float32", small=True),
    )

    def make_inputs(shape: Shape, key: jax.Array) -> tuple[Any, ...]:
        kx, ks, ko, kd = jax.random.split(key, 4)
        x = jax.random.normal(kx, shape.dims, jnp.float32).astype(shape.dtype)
        dy = jax.random.normal(kd, shape.dims, jnp.float32).astype(shape.dtype)
        scale = 1.0 + 0.1 * jax.random.normal(ks, shape.dims[-1:], jnp.float32)
        offset = 0.1 * jax.random.normal(ko, shape.dims[-1:], jnp.float32)
        return (x, scale, offset, dy) if has_offset else (x, scale, dy)

    def build(backend: str, mode: str) -> Callable[..., Any]:
        fn = functools.partial(public, backend=backend, eps=NORM_EPS)
        if mode == "fwd":
            return jax.jit(lambda *a: fn(*a[:-1]))

        # A training step's view: the forward output is used, then the backward.
        def fwd_bwd(*a):
            y, pullback = jax.vjp(fn, *a[:-1])
            return (y,) + pullback(a[-1])

        return jax.jit(fwd_bwd)

    # fwd: read x, write y. fwd+bwd adds: read x and dy, write dx.
    return Spec(op_name, shapes, make_inputs, build, _passes_floor(fwd=2, fwd_bwd=5), options={"eps": NORM_EPS})


SPECS: dict[str, Spec] = {
    "rms_norm": _norm_spec("rms_norm", ops.rms_norm, has_offset=False),
    "layer_norm": _norm_spec("layer_norm", ops.layer_norm, has_offset=True),
}


def _cross_entropy_spec() -> Spec:
    shapes = (
        Shape("llama3 8k tokens x 128k vocab", (8192, 128256), "bfloat16"),
        Shape("small f32", (512, 32000), "float32", small=True),
    )

    def make_inputs(shape: Shape, key: jax.Array) -> tuple[Any, ...]:
        kx, kt = jax.random.split(key)
        logits = jax.random.normal(kx, shape.dims, jnp.float32).astype(shape.dtype)
        targets = jax.random.randint(kt, shape.dims[:-1], 0, shape.dims[-1], jnp.int32)
        return logits, targets, jnp.float32(1.0)  # last: the cotangent of the mean loss

    def build(backend: str, mode: str) -> Callable[..., Any]:
        fn = functools.partial(ops.cross_entropy, backend=backend)
        if mode == "fwd":
            return jax.jit(lambda logits, targets, ct: fn(logits, targets))

        def fwd_bwd(logits, targets, ct):
            loss, pullback = jax.vjp(lambda x: fn(x, targets), logits)
            return (loss,) + pullback(ct)

        return jax.jit(fwd_bwd)

    # fwd: read the logits once. fwd+bwd: read them twice (loss, then gradient), write the gradient once.
    return Spec("cross_entropy", shapes, make_inputs, build, _passes_floor(fwd=1, fwd_bwd=3))


SPECS["cross_entropy"] = _cross_entropy_spec()


def _linear_cross_entropy_spec() -> Spec:
    # dims: (tokens N, hidden H, vocabulary V).
    shapes = (
        Shape("llama3-8b 8k tokens x 128k vocab", (8192, 4096, 128256), "bfloat16"),
        Shape("small f32", (512, 256, 8000), "float32", small=True),
    )

    def make_inputs(shape: Shape, key: jax.Array) -> tuple[Any, ...]:
        n, h, v = shape.dims
        kx, kw, kt = jax.random.split(key, 3)
        x = jax.random.normal(kx, (n, h), jnp.float32).astype(shape.dtype)
        w = (jax.random.normal(kw, (h, v), jnp.float32) / h**0.5).astype(shape.dtype)
        targets = jax.random.randint(kt, (n,), 0, v, jnp.int32)
        return x, w, targets, jnp.float32(1.0)  # last: the cotangent of the mean loss

    def build(backend: str, mode: str) -> Callable[..., Any]:
        fn = functools.partial(ops.linear_cross_entropy, backend=backend)
        if mode == "fwd":
            return jax.jit(lambda x, w, targets, ct: fn(x, w, targets))

        def fwd_bwd(x, w, targets, ct):
            loss, pullback = jax.vjp(lambda a, b: fn(a, b, targets), x, w)
            return (loss,) + pullback(ct)

        return jax.jit(fwd_bwd)

    def floor(shape: Shape, mode: str) -> tuple[float, float]:
        n, h, v = shape.dims
        itemsize = jnp.dtype(shape.dtype).itemsize
        # Bytes: read x and W (fwd+bwd: also write dx and dW). FLOPs: the logits
        # matmul (fwd); + dx = g @ W^T and dW = x^T @ g (fwd+bwd).
        passes = 1 if mode == "fwd" else 2
        return passes * (n * h + h * v) * itemsize, (1 if mode == "fwd" else 3) * 2.0 * n * h * v

    return Spec("linear_cross_entropy", shapes, make_inputs, build, floor)


SPECS["linear_cross_entropy"] = _linear_cross_entropy_spec()
