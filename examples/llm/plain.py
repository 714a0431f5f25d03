"""The same model's ops written as a JAX user writes them without forgeax: the fair baseline.

`--ops plain` (or `--attention plain`, ...) runs these instead of forgeax ops. They are plain
`jax.numpy` in the compute dtype, with the usual f32 statistics (norm variance, softmax of the
loss), and attention through `jax.nn.dot_product_attention` (cuDNN's fused kernel on a GPU).
forgeax's `xla` backends are not this baseline: they are the f32 references its tests compare
against (HIGHEST-precision matmuls, a materialised f32 loss), slower than what users write.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def rms_norm(x, scale, eps: float):
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (y * scale.astype(jnp.float32)).astype(x.dtype)


def add_rms_norm(delta, h, scale, eps: float):
    h = h + delta
    return rms_norm(h, scale, eps), h


def rope_qk(q, k, positions, theta: float):
    """GPT-NeoX (half-split) rotation of q and k at integer `positions` [T]."""
    half = q.shape[-1] // 2
    inv_freq = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angles = positions.astype(jnp.float32)[:, None] * inv_freq  # [T, half]
    cos, sin = jnp.cos(angles)[None, :, None, :], jnp.sin(angles)[None, :, None, :]

    def rotate(x):
        x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
        return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)

    return rotate(q), rotate(k)


def attention(q, k, v):
    """Causal GQA attention; cuDNN's fused kernel on a GPU, XLA's composition elsewhere."""
    implementation = "cudnn" if jax.default_backend() == "gpu" else None
    return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=implementation)


def gated_mlp(x, w_gate, w_up, w_down):
    return (jax.nn.silu(x @ w_gate) * (x @ w_up)) @ w_down


def linear_cross_entropy(x, w, targets):
    """Mean next-token cross-entropy: f32 logits [tokens, V] materialised, as in most training code."""
    logits = jnp.dot(x, w, preferred_element_type=jnp.float32)
    nll = jax.nn.logsumexp(logits, axis=-1) - jnp.take_along_axis(logits, targets[:, None], axis=-1)[:, 0]
    return jnp.mean(nll)
