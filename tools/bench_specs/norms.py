"""Row-wise memory-bound ops: rms_norm, layer_norm, add_rms_norm, rope_qk, mean_pool."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from forgeax import ops

from .base import NORM_EPS, Shape, Spec, passes_floor, training_step, with_config


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

    def build(backend: str | None, mode: str, options: dict[str, Any]) -> Callable[..., Any]:
        return training_step(functools.partial(public, backend=backend, eps=NORM_EPS), mode)

    # fwd: read x, write y. fwd+bwd adds: read x and dy, write dx.
    return Spec(op_name, shapes, make_inputs, build, passes_floor(fwd=2, fwd_bwd=5), options={"eps": NORM_EPS})


def _add_rms_norm_spec() -> Spec:
    shapes = (
        Shape("llama3-8b 32k tokens", (32768, 4096), "bfloat16"),
        Shape("llama3-70b 8k tokens", (8192, 8192), "bfloat16"),
        Shape("small f32", (4096, 1024), "float32", small=True),
    )

    def make_inputs(shape: Shape, key: jax.Array) -> tuple[Any, ...]:
        kx, kr, ks, kn, kd = jax.random.split(key, 5)
        normal = lambda k: jax.random.normal(k, shape.dims, jnp.float32).astype(shape.dtype)  # noqa: E731
        scale = 1.0 + 0.1 * jax.random.normal(ks, shape.dims[-1:], jnp.float32)
        return normal(kx), normal(kr), scale, (normal(kn), normal(kd))

    def build(backend: str | None, mode: str, options: dict[str, Any]) -> Callable[..., Any]:
        fn = functools.partial(ops.add_rms_norm, backend=backend, **options)
        if mode == "fwd":
            return jax.jit(lambda x, r, s, ct: fn(x, r, s))

        def fwd_bwd(x, r, s, ct):  # both outputs used, as in a pre-norm block
            out, pullback = jax.vjp(fn, x, r, s)
            dx, _, dscale = pullback(ct)
            # d residual is the same array as dx: returning it too would time a copy XLA adds
            # only to give the program two distinct output buffers.
            return out, dx, dscale

        return jax.jit(fwd_bwd)

    # fwd: read x and residual, write normed and the sum. fwd+bwd adds: read both cotangents and
    # write d(sum) once (the gradient of x and of residual is one array).
    return Spec("add_rms_norm", shapes, make_inputs, build, passes_floor(fwd=4, fwd_bwd=7), options={"eps": NORM_EPS},
                precheck=False)


def _rope_qk_spec() -> Spec:
    # dims: (B, T, N, K, H): q [B, T, N, H], k [B, T, K, H] (K < N: GQA), positions [B, T].
    shapes = (
        Shape("llama2-7b MHA B8 T4096 N32 H128", (8, 4096, 32, 32, 128), "bfloat16"),
        Shape("llama3-8b GQA B8 T4096 N32 KV8 H128", (8, 4096, 32, 8, 128), "bfloat16"),
        Shape("small f32", (1, 256, 4, 2, 64), "float32", small=True),
    )

    def make_inputs(shape: Shape, key: jax.Array) -> tuple[Any, ...]:
        B, T, N, K, H = shape.dims
        kq, kk, kdq, kdk = jax.random.split(key, 4)
        normal = lambda k, s: jax.random.normal(k, s, jnp.float32).astype(shape.dtype)  # noqa: E731
        positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
        return normal(kq, (B, T, N, H)), normal(kk, (B, T, K, H)), positions, (normal(kdq, (B, T, N, H)), normal(kdk, (B, T, K, H)))

    def build(backend: str | None, mode: str, options: dict[str, Any]) -> Callable[..., Any]:
        return training_step(functools.partial(ops.rope_qk, backend=backend, **options), mode, wrt=2)  # q, k

    def floor(shape: Shape, mode: str) -> tuple[float, float]:
        B, T, N, K, H = shape.dims
        # fwd: read q, k and the positions, write q, k. fwd+bwd adds: read dq, dk, write their rotations.
        qk = B * T * (N + K) * H * jnp.dtype(shape.dtype).itemsize
        return (2 if mode == "fwd" else 4) * qk + B * T * 4, 0.0

    return Spec("rope_qk", shapes, make_inputs, build, floor, precheck=False)


def _mean_pool_spec() -> Spec:
    # dims: (B, T, D); option "segments": S packed sequences per row (ids in runs, 1/16 padding),
    # else per-row lengths in (T/2, T].
    shapes = (
        Shape("llama3-8b B8 T4096 D4096 lengths", (8, 4096, 4096), "bfloat16"),
        Shape("llama3-8b B8 T4096 D4096 16 packed", (8, 4096, 4096), "bfloat16", options=(("segments", 16),)),
        Shape("small f32", (4, 512, 256), "float32", small=True),
        Shape("small f32 packed", (4, 512, 256), "float32", small=True, options=(("segments", 8),)),
    )

    def make_inputs(shape: Shape, key: jax.Array) -> tuple[Any, ...]:
        b, t, d = shape.dims
        kx, kl, kc = jax.random.split(key, 3)
        x = jax.random.normal(kx, shape.dims, jnp.float32).astype(shape.dtype)
        segments = dict(shape.options).get("segments")
        if segments:
            ids = jnp.minimum(jnp.arange(t) * segments // (t - t // 16), segments)  # runs, then padding
            ids = jnp.broadcast_to(jnp.where(ids >= segments, -1, ids).astype(jnp.int32), (b, t))
            lengths, out = None, (b, segments, d)
        else:
            ids, lengths, out = None, jax.random.randint(kl, (b,), t // 2 + 1, t + 1, jnp.int32), (b, d)
        return x, lengths, ids, jax.random.normal(kc, out, jnp.float32).astype(shape.dtype)

    def build(backend: str | None, mode: str, options: dict[str, Any]) -> Callable[..., Any]:
        options = dict(options)
        segments = options.pop("segments", None)

        def fn(x, lengths, ids):
            config = with_config("mean_pool", backend, options, x, lengths, ids, num_segments=segments)
            return ops.mean_pool(x, lengths=lengths, segment_ids=ids, num_segments=segments, backend=backend, **config)

        return training_step(fn, mode, wrt=1)  # x

    # fwd: read x (the output is T times smaller). fwd+bwd adds: write dx.
    return Spec("mean_pool", shapes, make_inputs, build, passes_floor(fwd=1, fwd_bwd=2), precheck=False)


SPECS = {
    "rms_norm": _norm_spec("rms_norm", ops.rms_norm, has_offset=False),
    "layer_norm": _norm_spec("layer_norm", ops.layer_norm, has_offset=True),
    "add_rms_norm": _add_rms_norm_spec(),
    "rope_qk": _rope_qk_spec(),
    "mean_pool": _mean_pool_spec(),
}
