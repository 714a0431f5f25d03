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
from forgeax.core import UnsupportedError


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

    def build(backend: str | None, mode: str, options: dict[str, Any]) -> Callable[..., Any]:
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

    def build(backend: str | None, mode: str, options: dict[str, Any]) -> Callable[..., Any]:
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

    def training_step(loss: Callable[..., Any], mode: str) -> Callable[..., Any]:
        """loss(x, w, targets) -> the loss (fwd), or the loss and its gradients for x and W."""
        if mode == "fwd":
            return jax.jit(lambda x, w, targets, ct: loss(x, w, targets))

        def fwd_bwd(x, w, targets, ct):
            value, pullback = jax.vjp(lambda a, b: loss(a, b, targets), x, w)
            return (value,) + pullback(ct)

        return jax.jit(fwd_bwd)

    def build(backend: str | None, mode: str, options: dict[str, Any]) -> Callable[..., Any]:
        return training_step(functools.partial(ops.linear_cross_entropy, backend=backend), mode)

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
        return training_step(lambda x, w, targets: ops.cross_entropy(jnp.dot(x, w), targets, backend="xla"), mode)

    return Spec("linear_cross_entropy", shapes, make_inputs, build, floor,
                anchors={"xla_materialised": materialised_bf16}, main_anchor="xla_materialised")


SPECS["linear_cross_entropy"] = _linear_cross_entropy_spec()


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

    def training_step(fn: Callable[..., Any], mode: str) -> Callable[..., Any]:
        if mode == "fwd":
            return jax.jit(lambda x, wg, wu, wd, ct: fn(x, wg, wu, wd))

        def fwd_bwd(x, wg, wu, wd, ct):
            out, pullback = jax.vjp(fn, x, wg, wu, wd)
            return (out,) + pullback(ct)

        return jax.jit(fwd_bwd)

    def build(backend: str | None, mode: str, options: dict[str, Any]) -> Callable[..., Any]:
        return training_step(functools.partial(ops.gated_mlp, backend=backend, **options), mode)

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


SPECS["gated_mlp"] = _gated_mlp_spec()


def _attention_spec() -> Spec:
    # dims: (B, T, N, K, H); S = T. Options per shape: the report list.
    shapes = (
        Shape("causal B4 T4096 N32 H128", (4, 4096, 32, 32, 128), "bfloat16", options=(("causal", True),)),
        Shape("full B4 T4096 N32 H128", (4, 4096, 32, 32, 128), "bfloat16"),
        Shape("llama3-8b GQA B1 T8192 N32 KV8", (1, 8192, 32, 8, 128), "bfloat16", options=(("causal", True),)),
        Shape("causal H64 B4 T4096 N32", (4, 4096, 32, 32, 64), "bfloat16", options=(("causal", True),)),
        Shape("causal H256 B2 T4096 N16", (2, 4096, 16, 16, 256), "bfloat16", options=(("causal", True),)),
        # Gemma 2's attention (9B: 16 heads over 8 kv heads of 256, logit soft cap 50): cuDNN cannot.
        Shape("gemma2 soft cap 50 H256 B2 T4096 N16 KV8", (2, 4096, 16, 8, 256), "bfloat16",
              options=(("causal", True), ("logit_soft_cap", 50.0))),
        Shape("window 4096 causal B1 T16384 N32", (1, 16384, 32, 32, 128), "bfloat16",
              options=(("causal", True), ("window", (4096, 0)))),
        Shape("soft cap 50 causal B4 T4096 N32", (4, 4096, 32, 32, 128), "bfloat16",
              options=(("causal", True), ("logit_soft_cap", 50.0))),
        # 8 documents of 2048 tokens packed into one row (segment_ids); the anchors run the same
        # documents unpacked, as a batch of 8: the cost packing should come close to.
        Shape("packed 8x2048 causal B1 T16384 N32", (1, 16384, 32, 32, 128), "bfloat16",
              options=(("causal", True), ("documents", 2048))),
        Shape("packed 32x512 GQA H64 causal B1 T16384 N32 KV8", (1, 16384, 32, 8, 64), "bfloat16",
              options=(("causal", True), ("documents", 512))),
        # Unaligned length (not a multiple of 128) with a soft cap: cuDNN cannot; pallas_gpu runs it
        # in place over whole tiles (`Tails`).
        Shape("soft cap 50 causal B4 T4000 N32", (4, 4000, 32, 32, 128), "bfloat16",
              options=(("causal", True), ("logit_soft_cap", 50.0))),
        # Not causal, so pallas_gpu masks the keys past S (`Band.cols`); and the plain causal call
        # at that length, which cuDNN takes.
        Shape("soft cap 50 full B4 T4000 N32", (4, 4000, 32, 32, 128), "bfloat16",
              options=(("logit_soft_cap", 50.0),)),
        Shape("causal B4 T4000 N32 H128", (4, 4000, 32, 32, 128), "bfloat16", options=(("causal", True),)),
        # A length that is not a multiple of 8: pallas_gpu copies the arrays padded to 4008 (`Tails`).
        Shape("soft cap 50 causal B4 T4001 N32", (4, 4001, 32, 32, 128), "bfloat16",
              options=(("causal", True), ("logit_soft_cap", 50.0))),
        # MLA's q/k 192 with v 128 (DeepSeek-V2/V3 training; cuDNN through jax.nn needs equal head
        # dims; pallas_gpu computes v at 128), 192 itself, and Phi-3's 96: plain (cuDNN takes
        # it) and packed (cuDNN cannot; the anchors run it unpacked).
        Shape("MLA H192 v128 causal B4 T4096 N16", (4, 4096, 16, 16, 192), "bfloat16",
              options=(("causal", True), ("value_head_dim", 128))),
        Shape("causal H96 B4 T4096 N32", (4, 4096, 32, 32, 96), "bfloat16", options=(("causal", True),)),
        Shape("causal H192 B4 T4096 N16", (4, 4096, 16, 16, 192), "bfloat16", options=(("causal", True),)),
        Shape("packed 8x2048 H96 causal B1 T16384 N32", (1, 16384, 32, 32, 96), "bfloat16",
              options=(("causal", True), ("documents", 2048))),
        Shape("small causal f32", (1, 256, 4, 2, 64), "float32", small=True, options=(("causal", True),)),
    )

    def make_inputs(shape: Shape, key: jax.Array) -> tuple[Any, ...]:
        B, T, N, K, H = shape.dims
        Hv = dict(shape.options).get("value_head_dim", H)
        kq, kk, kv, kd = jax.random.split(key, 4)
        normal = lambda k, s: jax.random.normal(k, s, jnp.float32).astype(shape.dtype)
        return normal(kq, (B, T, N, H)), normal(kk, (B, T, K, H)), normal(kv, (B, T, K, Hv)), normal(kd, (B, T, N, Hv))

    def training_step(fn: Callable[..., Any], mode: str) -> Callable[..., Any]:
        if mode == "fwd":
            return jax.jit(lambda q, k, v, do: fn(q, k, v))

        def fwd_bwd(q, k, v, do):
            out, pullback = jax.vjp(fn, q, k, v)
            return (out,) + pullback(do)

        return jax.jit(fwd_bwd)

    def build(backend: str | None, mode: str, options: dict[str, Any]) -> Callable[..., Any]:
        options = dict(options)
        options.pop("value_head_dim", None)  # in the inputs' shapes
        doc = options.pop("documents", None)
        if doc is None:
            return training_step(functools.partial(ops.attention, backend=backend, **options), mode)

        def packed(q, k, v):
            ids = jnp.broadcast_to(jnp.arange(q.shape[1], dtype=jnp.int32) // doc, q.shape[:2])
            return ops.attention(q, k, v, segment_ids=(ids, ids), backend=backend, **options)

        return training_step(packed, mode)

    def jax_nn(implementation: str) -> Callable[[str, dict[str, Any]], Callable[..., Any]]:
        def anchor(mode: str, options: dict[str, Any]) -> Callable[..., Any]:
            if options.get("logit_soft_cap") is not None:
                raise UnsupportedError(f"jax.nn.dot_product_attention({implementation}) has no logit soft cap")
            if options.get("value_head_dim") is not None:
                raise UnsupportedError(f"jax.nn.dot_product_attention({implementation}) needs equal q, k, v head dims")
            window = options.get("window")
            fn = functools.partial(
                jax.nn.dot_product_attention, is_causal=bool(options.get("causal")), implementation=implementation,
                local_window_size=None if window is None else tuple(window),
            )
            doc = options.get("documents")
            if doc is not None:  # the packed documents as a batch: [B, T] -> [B * T / doc, doc]
                unpack = lambda x: x.reshape(-1, doc, *x.shape[2:])
                return training_step(lambda q, k, v: fn(unpack(q), unpack(k), unpack(v)).reshape(q.shape), mode)
            return training_step(fn, mode)

        return anchor

    def floor(shape: Shape, mode: str) -> tuple[float, float]:
        B, T, N, K, H = shape.dims
        options = dict(shape.options)
        Hv = options.get("value_head_dim", H)
        itemsize = jnp.dtype(shape.dtype).itemsize
        if options.get("documents"):  # causal inside each document
            doc = options["documents"]
            pairs = T // doc * doc * (doc + 1) / 2
        elif options.get("window"):
            pairs = sum(min(t + 1, options["window"][0] + 1) for t in range(T))
        elif options.get("causal"):
            pairs = T * (T + 1) / 2
        else:
            pairs = T * T
        fwd_flops = 2.0 * B * N * (H + Hv) * pairs  # QK^T and PV
        # Bytes: q, k, v, out (fwd); + do, dq, dk, dv and re-reading q, k, v, out (fwd+bwd).
        tensors = B * T * N * (H + Hv) + B * T * K * (H + Hv)
        return (tensors if mode == "fwd" else 3 * tensors) * itemsize, fwd_flops * (1 if mode == "fwd" else 3.5)

    return Spec("attention", shapes, make_inputs, build, floor,
                anchors={"cudnn": jax_nn("cudnn"), "jax_nn_xla": jax_nn("xla")}, main_anchor="cudnn", precheck=False)


SPECS["attention"] = _attention_spec()


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
        fn = functools.partial(ops.rope_qk, backend=backend, **options)
        if mode == "fwd":
            return jax.jit(lambda q, k, positions, ct: fn(q, k, positions))

        def fwd_bwd(q, k, positions, ct):
            out, pullback = jax.vjp(lambda q, k: fn(q, k, positions), q, k)
            return out, pullback(ct)

        return jax.jit(fwd_bwd)

    def floor(shape: Shape, mode: str) -> tuple[float, float]:
        B, T, N, K, H = shape.dims
        # fwd: read q, k and the positions, write q, k. fwd+bwd adds: read dq, dk, write their rotations.
        qk = B * T * (N + K) * H * jnp.dtype(shape.dtype).itemsize
        return (2 if mode == "fwd" else 4) * qk + B * T * 4, 0.0

    return Spec("rope_qk", shapes, make_inputs, build, floor, precheck=False)


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
    return Spec("add_rms_norm", shapes, make_inputs, build, _passes_floor(fwd=4, fwd_bwd=7), options={"eps": NORM_EPS},
                precheck=False)


SPECS["rope_qk"] = _rope_qk_spec()
SPECS["add_rms_norm"] = _add_rms_norm_spec()


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
                                  **_with_config("ragged_dot", backend, options, lhs, rhs, sizes, spec=spec))

        return _ragged_step(call, mode)

    def _ragged_step(fn: Callable[..., Any], mode: str) -> Callable[..., Any]:
        if mode == "fwd":
            return jax.jit(lambda lhs, rhs, sizes, ct: fn(lhs, rhs, sizes))

        def fwd_bwd(lhs, rhs, sizes, ct):
            out, pullback = jax.vjp(lambda a, b: fn(a, b, sizes), lhs, rhs)
            return (out,) + pullback(ct)

        return jax.jit(fwd_bwd)

    def _moe_step(backend: str | None, mode: str, options: dict[str, Any]) -> Callable[..., Any]:
        if backend == "xla":
            raise UnsupportedError("the reference runs E dense products: not a benchmark backend")
        fn = functools.partial(ops.moe_mlp, top_k=options.get("top_k", 2), backend=backend)
        if mode == "fwd":
            return jax.jit(lambda x, logits, wg, wu, wd, ct: fn(x, logits, wg, wu, wd))

        def fwd_bwd(x, logits, wg, wu, wd, ct):
            out, pullback = jax.vjp(fn, x, logits, wg, wu, wd)
            return (out,) + pullback(ct)

        return jax.jit(fwd_bwd)

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


SPECS["ragged_dot"] = _ragged_dot_spec()


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


SPECS["newton_schulz"] = _newton_schulz_spec()


def _decode_spec(op_name: str) -> Spec:
    # dims: (B, context, N, KV, H, page); every request at the full context. Forward only.
    paged = op_name == "paged_attention"
    shapes = (
        Shape("decode B64 ctx8192 N32 KV8 H128 page16", (64, 8192, 32, 8, 128, 16), "bfloat16"),
        Shape("decode B8 ctx32768 N32 KV8 H128 page16", (8, 32768, 32, 8, 128, 16), "bfloat16"),
        Shape("decode B128 ctx2048 N32 KV8 H128 page16", (128, 2048, 32, 8, 128, 16), "bfloat16"),
        Shape("small f32", (2, 256, 8, 2, 64, 16), "float32", small=True),
    )

    def make_inputs(shape: Shape, key: jax.Array) -> tuple[Any, ...]:
        B, S, N, KV, H, page = shape.dims
        kq, kk, kv, kp = jax.random.split(key, 4)
        normal = lambda k, s: jax.random.normal(k, s, jnp.float32).astype(shape.dtype)  # noqa: E731
        q = normal(kq, (B, N, H))
        lengths = jnp.full((B,), S, jnp.int32)
        if not paged:
            return q, normal(kk, (B, S, KV, H)), normal(kv, (B, S, KV, H)), lengths, None
        pages = B * S // page
        k_pages, v_pages = normal(kk, (pages, page, KV, H)), normal(kv, (pages, page, KV, H))
        table = jax.random.permutation(kp, pages).astype(jnp.int32).reshape(B, S // page)  # shuffled pages
        return q, k_pages, v_pages, lengths, table, None

    def build(backend: str | None, mode: str, options: dict[str, Any]) -> Callable[..., Any]:
        if mode != "fwd":
            raise UnsupportedError(f"{op_name} is forward only (decoding is inference)")
        public = ops.paged_attention if paged else ops.decode_attention
        # Extra settings ('triton:block_k=32:num_splits=4') are fields of the backend's config.
        fields = dict(options)
        if not fields:
            return jax.jit(lambda *a: public(*a[:-1], backend=backend))
        impl = ops.OPS[op_name].implementation(backend)

        def run(*a):
            from forgeax.kernels.common.paged import PagedSpec  # noqa: PLC0415

            spec = PagedSpec(scale=a[0].shape[-1] ** -0.5)
            config = impl.heuristic_config(*a[:-1], spec=spec).replace(**fields)
            return public(*a[:-1], backend=backend, config=config)

        return jax.jit(run)

    def floor(shape: Shape, mode: str) -> tuple[float, float]:
        B, S, N, KV, H, _ = shape.dims
        # K and V read once (the floor), q read and out written; QK^T and PV flops.
        nbytes = (2 * B * S * KV * H + 2 * B * N * H) * jnp.dtype(shape.dtype).itemsize
        return nbytes, 4.0 * B * N * S * H

    def jax_pallas_gpu(mode: str, options: dict[str, Any]) -> Callable[..., Any]:
        # jax.experimental.pallas.ops.gpu.paged_attention (Pallas on Triton): pages [KV, P, page, H]
        # (heads first; the layout change is made once, outside the timed call) and no 1/sqrt(H)
        # scale (irrelevant to its time).
        if mode != "fwd" or not paged:
            raise UnsupportedError("the Pallas GPU paged_attention anchor is a paged forward")
        try:
            from jax.experimental.pallas.ops.gpu import paged_attention as jax_paged  # noqa: PLC0415
        except ImportError as e:
            raise UnsupportedError(f"jax.experimental.pallas.ops.gpu.paged_attention: {e}") from None
        heads_first = jax.jit(lambda p: jnp.moveaxis(p, 2, 0))
        cache: dict[int, Any] = {}

        def run(q, k_pages, v_pages, lengths, table, ct):
            # The transposed pages are made once per input array (outside the timed calls).
            key = id(k_pages)
            if key not in cache:
                cache[key] = (heads_first(k_pages), heads_first(v_pages))
            kh, vh = cache[key]
            return timed(q, kh, vh, table, lengths)

        timed = jax.jit(lambda q, k, v, t, l: jax_paged.paged_attention(q, k, v, t, l))
        return run

    anchors = {"jax_pallas_gpu_paged": jax_pallas_gpu} if paged else {}
    return Spec(op_name, shapes, make_inputs, build, floor, anchors=anchors, precheck=False)


SPECS["paged_attention"] = _decode_spec("paged_attention")
SPECS["decode_attention"] = _decode_spec("decode_attention")


def _mla_decode_spec() -> Spec:
    # dims: (B, context, N, L, R, page): DeepSeek-V3's absorbed MLA decode (128 heads, latent 512 +
    # rope 64), every request at the full context; page 0 = contiguous cache. Forward only.
    shapes = (
        Shape("DeepSeek-V3 B64 ctx8192 N128 L512+64", (64, 8192, 128, 512, 64, 0), "bfloat16"),
        Shape("DeepSeek-V3 B64 ctx8192 N128 L512+64 page64", (64, 8192, 128, 512, 64, 64), "bfloat16"),
        Shape("DeepSeek-V3 B4 ctx32768 N128 L512+64", (4, 32768, 128, 512, 64, 0), "bfloat16"),
        Shape("DeepSeek-V2-Lite B32 ctx4096 N16 L512+64 page16", (32, 4096, 16, 512, 64, 16), "bfloat16"),
        Shape("small f32", (2, 256, 16, 64, 16, 16), "float32", small=True),
    )

    def make_inputs(shape: Shape, key: jax.Array) -> tuple[Any, ...]:
        B, S, N, L, R, page = shape.dims
        kq, kr, kc, kk, kp = jax.random.split(key, 5)
        normal = lambda k, s: jax.random.normal(k, s, jnp.float32).astype(shape.dtype)  # noqa: E731
        lengths = jnp.full((B,), S, jnp.int32)
        cache, table = (B, S), None
        if page:
            pages = B * S // page
            cache = (pages, page)
            table = jax.random.permutation(kp, pages).astype(jnp.int32).reshape(B, S // page)  # shuffled pages
        return (normal(kq, (B, N, L)), normal(kr, (B, N, R)), normal(kc, cache + (L,)), normal(kk, cache + (R,)),
                lengths, table, None)

    def build(backend: str | None, mode: str, options: dict[str, Any]) -> Callable[..., Any]:
        if mode != "fwd":
            raise UnsupportedError("mla_decode is forward only (decoding is inference)")
        # Extra settings ('triton:block_h=64:num_splits=2') are fields of the backend's config.
        fields = dict(options)

        def run(ql, qr, kv, kr, lengths, table, ct):
            config = None
            if fields:
                from forgeax.kernels.common.paged import PagedSpec  # noqa: PLC0415

                impl = ops.OPS["mla_decode"].implementation(backend)
                config = impl.heuristic_config(ql, qr, kv, kr, lengths, table, spec=PagedSpec()).replace(**fields)
            return ops.mla_decode(ql, qr, kv, kr, lengths, page_table=table, backend=backend, config=config)

        return jax.jit(run)

    def floor(shape: Shape, mode: str) -> tuple[float, float]:
        B, S, N, L, R, _ = shape.dims
        # The latent cache and rope keys read once (the floor: B*S*(L+R) elements), q read, out written;
        # flops of q.kv + q_rope.k_rope and P kv.
        nbytes = (B * S * (L + R) + B * N * (2 * L + R)) * jnp.dtype(shape.dtype).itemsize
        return nbytes, 2.0 * B * N * S * (2 * L + R)

    return Spec("mla_decode", shapes, make_inputs, build, floor, precheck=False)


SPECS["mla_decode"] = _mla_decode_spec()


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

    def step(fn: Callable[..., Any], mode: str, argnums: int = 4) -> Callable[..., Any]:
        if mode == "fwd":
            return jax.jit(lambda *a: fn(*a[:argnums]))

        def fwd_bwd(*a):
            out, pullback = jax.vjp(fn, *a[:argnums])
            return (out,) + pullback(a[-1])

        return jax.jit(fwd_bwd)

    def build(backend: str | None, mode: str, options: dict[str, Any]) -> Callable[..., Any]:
        if backend == "xla":
            raise UnsupportedError("the reference is a scan over T whose backward keeps every [K, V] state: not a benchmark backend")
        return step(functools.partial(ops.gated_linear_attention, chunk_size=64, backend=backend, **options), mode)

    def xla_chunked(mode: str, options: dict[str, Any]) -> Callable[..., Any]:
        return step(functools.partial(ops.gated_linear_attention, chunk_size=64, backend="xla_chunked", **options), mode)

    def attention_causal(mode: str, options: dict[str, Any]) -> Callable[..., Any]:
        if mode == "fwd":
            return jax.jit(lambda q, k, v, g, do: ops.attention(q, k, v, causal=True))
        return step(lambda q, k, v: ops.attention(q, k, v, causal=True), mode, argnums=3)

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


SPECS["gated_linear_attention"] = _gated_linear_attention_spec()


def _ragged_paged_attention_spec() -> Spec:
    # dims: (prefills, prefill length, decodes, decode context, N, KV, H, page). Each prefill is a
    # fresh sequence (q_len = kv_len); each decode has one query over `context` keys; pages shuffled.
    shapes = (
        Shape("mixed 4x2048 prefill + 60 decodes ctx8192 N32 KV8 H128 page16", (4, 2048, 60, 8192, 32, 8, 128, 16),
              "bfloat16"),
        Shape("decode-heavy 2x512 prefill + 120 decodes ctx4096 N32 KV8 H128 page16", (2, 512, 120, 4096, 32, 8, 128, 16),
              "bfloat16"),
        Shape("small f32", (1, 64, 3, 256, 8, 2, 64, 16), "float32", small=True),
    )

    def make_inputs(shape: Shape, key: jax.Array) -> tuple[Any, ...]:
        P, Lp, D, ctx, N, KV, H, page = shape.dims
        kq, kk, kv, kp = jax.random.split(key, 4)
        normal = lambda k, s: jax.random.normal(k, s, jnp.float32).astype(shape.dtype)  # noqa: E731
        q_lens = jnp.array([Lp] * P + [1] * D, jnp.int32)
        kv_lens = jnp.array([Lp] * P + [ctx] * D, jnp.int32)
        cu = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(q_lens)]).astype(jnp.int32)
        need = [Lp // page] * P + [ctx // page] * D
        max_pages, pages = max(need), sum(need)
        ids = jax.random.permutation(kp, pages).astype(jnp.int32)
        starts = [sum(need[:i]) for i in range(P + D)]
        table = jnp.stack([jnp.pad(ids[s:s + n], (0, max_pages - n)) for s, n in zip(starts, need)])
        k_pages, v_pages = normal(kk, (pages, page, KV, H)), normal(kv, (pages, page, KV, H))
        q = normal(kq, (P * Lp + D, N, H))
        # The "separately" anchor's inputs: the prefills' keys contiguous (as a prefill step has them)
        # and the decodes' own lengths and page table (built here, outside the timed calls).
        contiguous = lambda pages_: pages_[table[:P, :Lp // page]].reshape(P, Lp, KV, H)  # noqa: E731
        extras = (contiguous(k_pages), contiguous(v_pages), kv_lens[P:], table[P:])
        return q, k_pages, v_pages, cu, kv_lens, table, extras

    def build(backend: str | None, mode: str, options: dict[str, Any]) -> Callable[..., Any]:
        if mode != "fwd":
            raise UnsupportedError("ragged_paged_attention is forward only (serving)")
        # Extra settings ('triton:block_q=32:num_warps=8') are fields of the backend's config.
        fields = dict(options)
        if not fields:
            return jax.jit(lambda *a: ops.ragged_paged_attention(*a[:-1], backend=backend))
        impl = ops.OPS["ragged_paged_attention"].implementation(backend)

        def run(*a):
            from forgeax.kernels.common.attention import AttentionSpec  # noqa: PLC0415

            spec = AttentionSpec(causal=True, scale=a[0].shape[-1] ** -0.5, window_right=0)
            config = impl.heuristic_config(*a[:-1], spec=spec).replace(**fields)
            return ops.ragged_paged_attention(*a[:-1], backend=backend, config=config)

        return jax.jit(run)

    def separately(mode: str, options: dict[str, Any]) -> Callable[..., Any]:
        # What a server runs without the fused op: ops.attention over the prefills (contiguous
        # keys, causal) and ops.paged_attention over the decodes, each with its default backend.
        if mode != "fwd":
            raise UnsupportedError("forward only")

        def run(q, k_pages, v_pages, cu, kv_lens, table, extras):
            k_pre, v_pre, decode_lens, decode_table = extras
            P, Lp = k_pre.shape[:2]
            prefill = ops.attention(q[:P * Lp].reshape((P, Lp) + q.shape[1:]), k_pre, v_pre, causal=True)
            decode = ops.paged_attention(q[P * Lp:], k_pages, v_pages, decode_lens, decode_table)
            return prefill, decode

        return jax.jit(run)

    def floor(shape: Shape, mode: str) -> tuple[float, float]:
        P, Lp, D, ctx, N, KV, H, _ = shape.dims
        # Bytes: each sequence's K and V read once, q read and out written. FLOPs: QK^T and PV,
        # causal for the prefills.
        tokens = P * Lp + D
        nbytes = (2 * (P * Lp + D * ctx) * KV * H + 2 * tokens * N * H) * jnp.dtype(shape.dtype).itemsize
        pairs = P * Lp * (Lp + 1) / 2 + D * ctx
        return nbytes, 4.0 * N * H * pairs

    return Spec("ragged_paged_attention", shapes, make_inputs, build, floor, anchors={"separately": separately},
                main_anchor="separately", precheck=False)


SPECS["ragged_paged_attention"] = _ragged_paged_attention_spec()


def _sparse_attention_spec() -> Spec:
    # dims: (B, T, N, K, H, block_size); S = T, causal, NSA's selected branch: query block i reads
    # ceil((i + 1) * density) of its i + 1 causal-valid key blocks, the diagonal and random earlier
    # ones (the same for the N // K heads of a kv head). Anchor: ops.attention dense causal at the
    # same shape; issue 37's target is sparse fwd+bwd <= 1.3 x anchor x density, i.e.
    # speedup_vs_anchor >= 1 / (1.3 * density): 6.15 at 1/8 (the ceil makes the selected share
    # 0.127 at T 32768, 0.132 at T 8192: sum(chosen) / (nq (nq + 1) / 2) of `selection`).
    shapes = (
        # The reference's [B, N, T, S] f32 scores take 137 GB at T 32768: not timed there.
        Shape("nsa 1/8 llama3-8b GQA B1 T32768 N32 KV8 H128 bs64", (1, 32768, 32, 8, 128, 64), "bfloat16",
              options=(("density", 0.125), ("block_size", 64), ("reference_fits", False))),
        Shape("nsa 1/8 GQA B1 T8192 N32 KV8 H128 bs64", (1, 8192, 32, 8, 128, 64), "bfloat16",
              options=(("density", 0.125), ("block_size", 64))),
        Shape("small f32", (1, 256, 4, 2, 64, 16), "float32", small=True, options=(("density", 0.25), ("block_size", 16))),
    )

    def selection(shape: Shape):
        import numpy as np  # noqa: PLC0415

        B, T, N, K, H, bs = shape.dims
        density = dict(shape.options)["density"]
        nq = -(-T // bs)
        chosen = [math.ceil((i + 1) * density) for i in range(nq)]
        idx = np.full((B, K, nq, max(chosen)), -1, np.int32)
        rng = np.random.default_rng(0)
        for i, c in enumerate(chosen):
            idx[:, :, i, 0] = i
            if c > 1:
                idx[:, :, i, 1:c] = np.argsort(rng.random((B, K, i)), axis=-1)[..., :c - 1]
        return idx, chosen

    def make_inputs(shape: Shape, key: jax.Array) -> tuple[Any, ...]:
        B, T, N, K, H, bs = shape.dims
        kq, kk, kv, kd = jax.random.split(key, 4)
        normal = lambda k, s: jax.random.normal(k, s, jnp.float32).astype(shape.dtype)  # noqa: E731
        idx = jnp.asarray(selection(shape)[0])
        return normal(kq, (B, T, N, H)), normal(kk, (B, T, K, H)), normal(kv, (B, T, K, H)), idx, normal(kd, (B, T, N, H))

    def step(fn: Callable[..., Any], mode: str) -> Callable[..., Any]:
        if mode == "fwd":
            return jax.jit(lambda q, k, v, idx, do: fn(q, k, v, idx))

        def fwd_bwd(q, k, v, idx, do):
            out, pullback = jax.vjp(lambda q, k, v: fn(q, k, v, idx), q, k, v)
            return (out,) + pullback(do)

        return jax.jit(fwd_bwd)

    def build(backend: str | None, mode: str, options: dict[str, Any]) -> Callable[..., Any]:
        options = dict(options)
        options.pop("density")
        block_size = options.pop("block_size")
        if backend == "xla" and not options.pop("reference_fits", True):
            raise UnsupportedError("the reference materialises [B, N, T, S] f32 scores: too large here")
        options.pop("reference_fits", None)

        def call(q, k, v, idx):  # what is left of options: config fields ('triton:bwd_heads=1')
            from forgeax.kernels.common.sparse_attention import SparseAttentionSpec  # noqa: PLC0415

            spec = SparseAttentionSpec(block_size=block_size, causal=True, scale=1 / math.sqrt(q.shape[3]))
            config = _with_config("sparse_attention", backend, options, q, k, v, idx, spec=spec)
            return ops.sparse_attention(q, k, v, block_indices=idx, block_size=block_size, causal=True,
                                        backend=backend, **config)

        return step(call, mode)

    def dense_causal(mode: str, options: dict[str, Any]) -> Callable[..., Any]:
        return step(lambda q, k, v, idx: ops.attention(q, k, v, causal=True), mode)

    def floor(shape: Shape, mode: str) -> tuple[float, float]:
        B, T, N, K, H, bs = shape.dims
        _, chosen = selection(shape)
        pairs = sum((c - 1) * bs * bs + bs * (bs + 1) / 2 for c in chosen)  # per head; the diagonal block half
        flops = 4.0 * B * N * H * pairs
        tensors = 2 * B * T * N * H + 2 * B * T * K * H
        return (tensors if mode == "fwd" else 3 * tensors) * jnp.dtype(shape.dtype).itemsize, flops * (1 if mode == "fwd" else 3.5)

    return Spec("sparse_attention", shapes, make_inputs, build, floor, anchors={"dense_causal": dense_causal},
                main_anchor="dense_causal", precheck=False)


SPECS["sparse_attention"] = _sparse_attention_spec()


def _with_config(op_name: str, backend: str | None, fields: dict[str, Any], *args: Any, **kwargs: Any) -> dict[str, Any]:
    """{"config": the backend's heuristic config with `fields` replaced} ('triton:block_t=32'), or {}."""
    if not fields:
        return {}
    impl = ops.OPS[op_name].implementation(backend)
    return {"config": impl.heuristic_config(*args, **kwargs).replace(**fields)}


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
        if mode == "fwd":
            return jax.jit(lambda x, a, h0, ct: fn(x, a))

        def fwd_bwd(x, a, h0, ct):
            h, pullback = jax.vjp(fn, x, a)
            return (h,) + pullback(ct)

        return jax.jit(fwd_bwd)

    def build(backend: str | None, mode: str, options: dict[str, Any]) -> Callable[..., Any]:
        options = dict(options)
        reverse = options.pop("reverse", False)

        def fn(x, a):
            config = _with_config("linear_recurrence", backend, options, x, a, None, reverse=reverse)
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
    return Spec("linear_recurrence", shapes, make_inputs, build, _passes_floor(fwd=3, fwd_bwd=8),
                anchors={"xla_associative_scan": xla_associative_scan}, main_anchor="xla_associative_scan", precheck=False)


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
            config = _with_config("mean_pool", backend, options, x, lengths, ids, num_segments=segments)
            return ops.mean_pool(x, lengths=lengths, segment_ids=ids, num_segments=segments, backend=backend, **config)

        if mode == "fwd":
            return jax.jit(lambda x, lengths, ids, ct: fn(x, lengths, ids))

        def fwd_bwd(x, lengths, ids, ct):
            out, pullback = jax.vjp(lambda x: fn(x, lengths, ids), x)
            return (out,) + pullback(ct)

        return jax.jit(fwd_bwd)

    # fwd: read x (the output is T times smaller). fwd+bwd adds: write dx.
    return Spec("mean_pool", shapes, make_inputs, build, _passes_floor(fwd=1, fwd_bwd=2), precheck=False)


SPECS["linear_recurrence"] = _linear_recurrence_spec()
SPECS["mean_pool"] = _mean_pool_spec()
