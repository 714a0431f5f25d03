"""Serving attention: paged / decode attention, mla_decode, ragged paged attention."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from forgeax import ops
from forgeax.core import UnsupportedError

from .base import Shape, Spec


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


SPECS = {
    "paged_attention": _decode_spec("paged_attention"),
    "decode_attention": _decode_spec("decode_attention"),
    "mla_decode": _mla_decode_spec(),
    "ragged_paged_attention": _ragged_paged_attention_spec(),
}
