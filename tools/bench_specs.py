"""Benchmark specs: named shapes from real models, how to call each op, and its floor.

A spec says, for an op and a mode ("fwd" or "fwd+bwd"), how to build inputs,
how to run one backend, and how many bytes / FLOPs the call must move at
minimum. `tools/bench.py` times every backend and anchor side by side.
"""

from __future__ import annotations

import dataclasses
import functools
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
    # Anchors: name -> (mode -> jitted function of the inputs); XLA is the "xla" backend.
    anchors: dict[str, Callable[[str], Callable[..., Any]]] = dataclasses.field(default_factory=dict)


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
        fn = functools.partial(public, backend=backend)
        if mode == "fwd":
            return jax.jit(lambda *a: fn(*a[:-1]))

        # A training step's view: the forward output is used, then the backward.
        def fwd_bwd(*a):
            y, pullback = jax.vjp(fn, *a[:-1])
            return (y,) + pullback(a[-1])

        return jax.jit(fwd_bwd)

    def floor(shape: Shape, mode: str) -> tuple[float, float]:
        n = 1
        for d in shape.dims:
            n *= d
        pass_bytes = n * jnp.dtype(shape.dtype).itemsize
        # fwd: read x, write y. fwd+bwd adds: read x and dy, write dx.
        return (2 if mode == "fwd" else 5) * pass_bytes, 0.0

    return Spec(op_name, shapes, make_inputs, build, floor)


SPECS: dict[str, Spec] = {
    "rms_norm": _norm_spec("rms_norm", ops.rms_norm, has_offset=False),
    "layer_norm": _norm_spec("layer_norm", ops.layer_norm, has_offset=True),
}
