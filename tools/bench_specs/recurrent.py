"""Linear attention and recurrences: gated_linear_attention, linear_recurrence."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from forgeax import ops
from forgeax.core import UnsupportedError

from .base import Shape, Spec, passes_floor, training_step, with_config


def _gated_linear_attention_spec() -> Spec:
    # dims: (B, T, N, K, V); chunk 64. The anchors: the XLA chunked form (the target is a
    # ratio to it, at T8192) and ops.attention causal on q, k, v of the same shape (the crossover
    # series over T).
    shapes = tuple(Shape(f"GLA B4 T{t} N16 K128 V128", (4, t, 16, 128, 128), "bfloat16") for t in (1024, 2048, 4096, 8192, 16384)) + (
        Shape("small f32", (1, 256, 2, 64, 64), "float32", small=True),)

    def make_inputs(shape: Shape, key: jax.Array) -> tuple[Any, ...]:
        b, t, n, kd, vd = shape.dims
        ks = jax.random.split(key, 5)
        normal = lambda k, s: jax.random.normal(k, s, jnp.float32).astype(shape.dtype)  # noqa: E731
        g = jax.nn.log_sigmoid(2.0 + 2.0 * jax.random.normal(ks[3], (b, t, n, kd))).astype(shape.dtype)
        return normal(ks[0], (b, t, n, kd)), normal(ks[1], (b, t, n, kd)), normal(ks[2], (b, t, n, vd)), g, normal(ks[4], (b, t, n, vd))

    def build(backend: str | None, mode: str, options: dict[str, Any]) -> Callable[..., Any]:
        if backend == "xla":
            raise UnsupportedError("the reference is a scan over T whose backward keeps every [K, V] state: not a benchmark backend")
        return training_step(functools.partial(ops.gated_linear_attention, chunk_size=64, backend=backend, **options), mode)

    def xla_chunked(mode: str, options: dict[str, Any]) -> Callable[..., Any]:
        return training_step(functools.partial(ops.gated_linear_attention, chunk_size=64, backend="xla_chunked", **options), mode)

    def attention_causal(mode: str, options: dict[str, Any]) -> Callable[..., Any]:
        if mode == "fwd":
            return jax.jit(lambda q, k, v, g, do: ops.attention(q, k, v, causal=True))
        return training_step(lambda q, k, v, g: ops.attention(q, k, v, causal=True), mode, wrt=3)

    def floor(shape: Shape, mode: str) -> tuple[float, float]:
        # The chunked form's FLOPs per token and head (chunk C): intra-chunk scores and output
        # (causal halves of 2 C K and 2 C V), the inter-chunk output and the state update
        # (2 K V each). The backward is taken as twice the forward. Bytes: q, k, g, v in, o out
        # (fwd+bwd adds do in and dq, dk, dg, dv out).
        b, t, n, kd, vd = shape.dims
        chunk = 64
        per_token = chunk * kd + chunk * vd + 4.0 * kd * vd
        tensors = b * t * n * (3 * kd + 2 * vd)
        scale = 1 if mode == "fwd" else 2
        return scale * tensors * jnp.dtype(shape.dtype).itemsize, (1 if mode == "fwd" else 3) * b * t * n * per_token

    return Spec("gated_linear_attention", shapes, make_inputs, build, floor,
                anchors={"xla_chunked": xla_chunked, "attention_causal": attention_causal},
                main_anchor="xla_chunked", precheck=False)


def _linear_recurrence_spec() -> Spec:
    # dims: (B, T, D): x, a [B, T, D] (a in (0.9, 1): long memory), no initial state.
    shapes = (
        Shape("mamba-like B8 T16384 D4096", (8, 16384, 4096), "bfloat16"),
        Shape("small f32", (2, 1024, 256), "float32", small=True),
    )

    def make_inputs(shape: Shape, key: jax.Array) -> tuple[Any, ...]:
        kx, ka, kc = jax.random.split(key, 3)
        x = jax.random.normal(kx, shape.dims, jnp.float32).astype(shape.dtype)
        a = jax.random.uniform(ka, shape.dims, jnp.float32, 0.9, 1.0).astype(shape.dtype)
        return x, a, None, jax.random.normal(kc, shape.dims, jnp.float32).astype(shape.dtype)

    def step(fn: Callable[..., Any], mode: str) -> Callable[..., Any]:
        return training_step(lambda x, a, h0: fn(x, a), mode, wrt=2)  # x, a (no initial state)

    def build(backend: str | None, mode: str, options: dict[str, Any]) -> Callable[..., Any]:
        options = dict(options)
        reverse = options.pop("reverse", False)

        def fn(x, a):
            config = with_config("linear_recurrence", backend, options, x, a, None, reverse=reverse)
            return ops.linear_recurrence(x, a, reverse=reverse, backend=backend, **config)

        return step(fn, mode)

    def xla_associative_scan(mode: str, options: dict[str, Any]) -> Callable[..., Any]:
        # What users write: jax.lax.associative_scan over (a, x) in f32, autodiff for the backward.
        def fn(x, a):
            def combine(left, right):
                return left[0] * right[0], right[0] * left[1] + right[1]

            h = jax.lax.associative_scan(combine, (a.astype(jnp.float32), x.astype(jnp.float32)), axis=1)[1]
            return h.astype(x.dtype)

        return step(fn, mode)

    # fwd: read x and a, write h. fwd+bwd adds: read g, a and h, write dx and da.
    return Spec("linear_recurrence", shapes, make_inputs, build, passes_floor(fwd=3, fwd_bwd=8),
                anchors={"xla_associative_scan": xla_associative_scan}, main_anchor="xla_associative_scan", precheck=False)


SPECS = {"gated_linear_attention": _gated_linear_attention_spec(), "linear_recurrence": _linear_recurrence_spec()}
