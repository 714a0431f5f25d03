"""The matmul ops: gated_mlp, ragged_dot (and moe_mlp shapes), newton_schulz."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from forgeax import ops
from forgeax.core import UnsupportedError
from forgeax.kernels.common.gated_mlp import GatedMLPSpec

from .base import Shape, Spec, training_step, with_config


def _gated_mlp_spec() -> Spec:
    # dims: (M tokens, K model width, N hidden width, K_out: 0 = no down projection).
    shapes = (
        Shape("llama3-8b 16k tokens no down", (16384, 4096, 14336, 0), "bfloat16"),
        Shape("llama3-8b 16k tokens with down", (16384, 4096, 14336, 4096), "bfloat16"),
        Shape("small f32", (512, 256, 1024, 256), "float32", small=True),
    )

    def make_inputs(shape: Shape, key: jax.Array) -> tuple[Any, ...]:
        m, k, n, k_out = shape.dims
        kx, kg, ku, kd, kc = jax.random.split(key, 5)
        normal = lambda key, s, scale: (scale * jax.random.normal(key, s, jnp.float32)).astype(shape.dtype)  # noqa: E731
        w_down = normal(kd, (n, k_out), n ** -0.5) if k_out else None
        ct = normal(kc, (m, k_out or n), 1.0)
        return normal(kx, (m, k), 1.0), normal(kg, (k, n), k ** -0.5), normal(ku, (k, n), k ** -0.5), w_down, ct

    def build(backend: str | None, mode: str, options: dict[str, Any]) -> Callable[..., Any]:
        fields = dict(options)  # config fields ('pallas_gpu:block_n=64')
        activation = fields.pop("activation", "silu")

        def mlp(x, wg, wu, wd):
            spec = GatedMLPSpec(activation=activation)
            return ops.gated_mlp(x, wg, wu, wd, activation=activation, backend=backend,
                                 **with_config("gated_mlp", backend, fields, x, wg, wu, wd, spec=spec))

        return training_step(mlp, mode)

    def plain_jax(mode: str, options: dict[str, Any]) -> Callable[..., Any]:
        # What users write: bf16 products (f32 accumulation inside the GEMM), silu, the product.
        def mlp(x, wg, wu, wd):
            h = jax.nn.silu(x @ wg) * (x @ wu)
            return h if wd is None else h @ wd

        return training_step(mlp, mode)

    def floor(shape: Shape, mode: str) -> tuple[float, float]:
        m, k, n, k_out = shape.dims
        itemsize = jnp.dtype(shape.dtype).itemsize
        # FLOPs: the gate and up products (+ the down product); fwd+bwd 3x (dx and dW per product).
        flops = 2.0 * 2 * m * k * n + 2.0 * m * n * k_out
        # Bytes: read x and the weights, write the output (fwd+bwd: also read dy, write dx and dW).
        weights = 2 * k * n + n * k_out
        tensors = m * k + weights + m * (k_out or n)
        return (tensors if mode == "fwd" else 2 * tensors + m * k + weights) * itemsize, flops * (1 if mode == "fwd" else 3)

    return Spec("gated_mlp", shapes, make_inputs, build, floor, anchors={"jax_plain": plain_jax},
                main_anchor="jax_plain", precheck=False)


def _ragged_dot_spec() -> Spec:
    from forgeax.kernels.common.ragged_dot import RaggedDotSpec  # noqa: PLC0415 - the kernels' spec, for configs
    # dims: (M rows, K, N, G groups). Options: "groups" (how rows fall into groups: "balanced"
    # uniform random routing, "skewed" Zipf-like expert popularity), "moe" (dims are then
    # (T tokens, D, F, E, top_k): a whole moe_mlp layer, the three products on this backend).
    shapes = (
        Shape("G8 M16384 K4096 N4096 balanced", (16384, 4096, 4096, 8), "bfloat16", options=(("groups", "balanced"),)),
        Shape("G64 M16384 K4096 N4096 skewed", (16384, 4096, 4096, 64), "bfloat16", options=(("groups", "skewed"),)),
        Shape("G128 M16384 K4096 N4096 skewed", (16384, 4096, 4096, 128), "bfloat16", options=(("groups", "skewed"),)),
        Shape("deepseek-v3 routed T8192 top8 G256 K7168 N2048", (65536, 7168, 2048, 256), "bfloat16",
              options=(("groups", "balanced"),)),
        Shape("deepseek-v3 routed T4096 top8 G256 K7168 N2048", (32768, 7168, 2048, 256), "bfloat16",
              options=(("groups", "balanced"),)),
        Shape("moe_mlp mixtral-8x7b T8192 top2", (8192, 4096, 14336, 8, 2), "bfloat16", options=(("moe", True),)),
        # The routed experts of one DeepSeek-V3 layer (no shared expert): weights 22.5 GB, + their gradients.
        Shape("moe_mlp deepseek-v3 T4096 top8 E256 D7168 F2048", (4096, 7168, 2048, 256, 8), "bfloat16",
              options=(("moe", True), ("top_k", 8))),
        Shape("small f32 G8", (2048, 256, 512, 8), "float32", small=True, options=(("groups", "skewed"),)),
    )

    def make_inputs(shape: Shape, key: jax.Array) -> tuple[Any, ...]:
        options = dict(shape.options)
        normal = lambda k, s, scale=1.0: (scale * jax.random.normal(k, s, jnp.float32)).astype(shape.dtype)  # noqa: E731
        ks = jax.random.split(key, 6)
        if options.get("moe"):
            t, d, f, e, _ = shape.dims
            return (normal(ks[0], (t, d)), jax.random.normal(ks[1], (t, e), jnp.float32), normal(ks[2], (e, d, f), d ** -0.5),
                    normal(ks[3], (e, d, f), d ** -0.5), normal(ks[4], (e, f, d), f ** -0.5), normal(ks[5], (t, d)))
        m, k, n, g = shape.dims
        weights = jnp.ones(g) if options["groups"] == "balanced" else 1.0 / (1.0 + jnp.arange(g)) ** 1.2
        rows = jax.random.categorical(ks[0], jnp.log(weights), shape=(m,))
        sizes = jnp.bincount(rows, length=g).astype(jnp.int32)
        return normal(ks[1], (m, k)), normal(ks[2], (g, k, n), k ** -0.5), sizes, normal(ks[3], (m, n))

    def build(backend: str | None, mode: str, options: dict[str, Any]) -> Callable[..., Any]:
        options = dict(options)
        if options.pop("moe", False):
            return _moe_step(backend, mode, options)
        options.pop("groups", None)
        options.pop("top_k", None)
        if backend == "xla":
            raise UnsupportedError("the reference runs G dense products: not a benchmark backend")

        def call(lhs, rhs, sizes):  # options left: config fields ('pallas_gpu:block_m=64')
            spec = RaggedDotSpec(out_dtype=jnp.dtype(lhs.dtype).name)
            return ops.ragged_dot(lhs, rhs, sizes, backend=backend,
                                  **with_config("ragged_dot", backend, options, lhs, rhs, sizes, spec=spec))

        return _ragged_step(call, mode)

    def _ragged_step(fn: Callable[..., Any], mode: str) -> Callable[..., Any]:
        return training_step(fn, mode, wrt=2)  # lhs, rhs (group sizes held)

    def _moe_step(backend: str | None, mode: str, options: dict[str, Any]) -> Callable[..., Any]:
        if backend == "xla":
            raise UnsupportedError("the reference runs E dense products: not a benchmark backend")
        return training_step(functools.partial(ops.moe_mlp, top_k=options.get("top_k", 2), backend=backend), mode)

    def jax_lax_ragged_dot(mode: str, options: dict[str, Any]) -> Callable[..., Any]:
        # XLA's production path: jax.lax.ragged_dot (inside the same MoE layer for the moe shape).
        options = dict(options)
        if options.pop("moe", False):
            return _moe_step("xla_ragged", mode, options)
        return _ragged_step(jax.lax.ragged_dot, mode)

    def floor(shape: Shape, mode: str) -> tuple[float, float]:
        itemsize = jnp.dtype(shape.dtype).itemsize
        if dict(shape.options).get("moe"):
            t, d, f, e, top_k = shape.dims
            flops = 3 * 2.0 * t * top_k * d * f  # gate, up, down over T * top_k rows
            tensors = 2 * t * d + 3 * e * d * f
            return (tensors if mode == "fwd" else 2 * tensors) * itemsize, flops * (1 if mode == "fwd" else 3)
        m, k, n, g = shape.dims
        tensors = m * k + g * k * n + m * n
        return (tensors if mode == "fwd" else 2 * tensors) * itemsize, 2.0 * m * k * n * (1 if mode == "fwd" else 3)

    return Spec("ragged_dot", shapes, make_inputs, build, floor, anchors={"jax_lax_ragged_dot": jax_lax_ragged_dot},
                main_anchor="jax_lax_ragged_dot", precheck=False)


def _newton_schulz_spec() -> Spec:
    # dims: (M, N) of one matrix (Muon's update of a weight); 5 steps, Muon's coefficients.
    shapes = (
        Shape("muon 4096x4096", (4096, 4096), "bfloat16"),
        Shape("muon 4096x14336 (llama3-8b mlp)", (4096, 14336), "bfloat16"),
        Shape("small f32", (256, 512), "float32", small=True),
    )
    steps = 5

    def make_inputs(shape: Shape, key: jax.Array) -> tuple[Any, ...]:
        return (jax.random.normal(key, shape.dims, jnp.float32).astype(shape.dtype), None)

    def build(backend: str | None, mode: str, options: dict[str, Any]) -> Callable[..., Any]:
        if mode != "fwd":
            raise UnsupportedError("Muon never differentiates newton_schulz: forward only")
        # Extra settings ('triton:triton_update=True:gram_block=256') are fields of the backend's config.
        fields = dict(options)
        if not fields:
            return jax.jit(lambda g, ct: ops.newton_schulz(g, steps=steps, backend=backend))
        impl = ops.OPS["newton_schulz"].implementation(backend)

        def run(g, ct):
            from forgeax.kernels.common.newton_schulz import NewtonSchulzSpec  # noqa: PLC0415

            config = impl.heuristic_config(g, spec=NewtonSchulzSpec(steps=steps)).replace(**fields)
            return ops.newton_schulz(g, steps=steps, backend=backend, config=config)

        return jax.jit(run)

    def floor(shape: Shape, mode: str) -> tuple[float, float]:
        m, n = sorted(shape.dims[-2:])
        # Per step, with the symmetry of the two Gram products (the minimum work): X X^T M^2 N,
        # A A^T M^3, B X 2 M^2 N (without symmetry: 2 M^2 N + 2 M^3 + 2 M^2 N). Bytes: g in, X out.
        flops = steps * (m * m * n + m**3 + 2.0 * m * m * n)
        return 2 * m * n * jnp.dtype(shape.dtype).itemsize, flops

    return Spec("newton_schulz", shapes, make_inputs, build, floor, precheck=False)


SPECS = {"gated_mlp": _gated_mlp_spec(), "ragged_dot": _ragged_dot_spec(), "newton_schulz": _newton_schulz_spec()}
