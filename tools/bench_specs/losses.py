"""The losses: cross_entropy and linear_cross_entropy."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from forgeax import ops

from .base import Shape, Spec, passes_floor, training_step


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

    def build(backend: str | None, mode: str, options: dict[str, Any]) -> Callable[..., Any]:
        return training_step(functools.partial(ops.cross_entropy, backend=backend), mode, wrt=1)  # logits

    # fwd: read the logits once. fwd+bwd: read them twice (loss, then gradient), write the gradient once.
    return Spec("cross_entropy", shapes, make_inputs, build, passes_floor(fwd=1, fwd_bwd=3))


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

    def step(loss: Callable[..., Any], mode: str) -> Callable[..., Any]:
        """loss(x, w, targets) -> the loss (fwd), or the loss and its gradients for x and W."""
        return training_step(loss, mode, wrt=2)

    def build(backend: str | None, mode: str, options: dict[str, Any]) -> Callable[..., Any]:
        return step(functools.partial(ops.linear_cross_entropy, backend=backend), mode)

    def floor(shape: Shape, mode: str) -> tuple[float, float]:
        n, h, v = shape.dims
        itemsize = jnp.dtype(shape.dtype).itemsize
        # Bytes: read x and W (fwd+bwd: also write dx and dW). FLOPs: the logits
        # matmul (fwd); + dx = g @ W^T and dW = x^T @ g (fwd+bwd).
        passes = 1 if mode == "fwd" else 2
        return passes * (n * h + h * v) * itemsize, (1 if mode == "fwd" else 3) * 2.0 * n * h * v

    def materialised_bf16(mode: str, options: dict[str, Any]) -> Callable[..., Any]:
        # What users write in plain JAX: logits = x @ W in the weight's dtype (f32 accumulation,
        # rounded once), then the XLA cross-entropy over them (f32 inside its fusions).
        return step(lambda x, w, targets: ops.cross_entropy(jnp.dot(x, w), targets, backend="xla"), mode)

    return Spec("linear_cross_entropy", shapes, make_inputs, build, floor,
                anchors={"xla_materialised": materialised_bf16}, main_anchor="xla_materialised")


SPECS = {"cross_entropy": _cross_entropy_spec(), "linear_cross_entropy": _linear_cross_entropy_spec()}
