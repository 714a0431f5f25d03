"""A Llama-style decoder in plain JAX whose hot ops are forgeax ops.

Parameters are a pytree of float32 arrays (cast to the compute dtype in the forward):

    embed [V, D]; "layers", each stacked over the L layers: attn_norm [L, D], wq [L, D, N*H],
    wk [L, D, K*H], wv [L, D, K*H], wo [L, N*H, D], mlp_norm [L, D], w_gate [L, D, F], w_up [L, D, F],
    w_down [L, F, D]; final_norm [D]; unembed [D, V] unless tied.

The layers run as one `jax.lax.scan`: fully unrolled by default (`cfg.unroll_layers`: XLA gets
straight-line code, the faster step), or rolled, so each op is lowered and (under a mesh)
partitioned once, not once per layer, and compile time does not grow with depth.

Block (pre-norm, the residual add fused into the next norm by ops.add_rms_norm):

    n, h = add_rms_norm(delta, h)          # h += delta; n = rms_norm(h) * scale
    delta = wo(attention(rope_qk(wq n, wk n), wv n, causal))        GQA: N query heads, K kv heads
    n, h = add_rms_norm(delta, h)
    delta = gated_mlp(n, w_gate, w_up, w_down)                      SwiGLU
    loss  = linear_cross_entropy(final_norm(h), unembed, targets)   no [tokens, V] logits

`backends` maps each OPS key (config.py) to the `backend=` its op gets (None: forgeax's own
selection; "plain": the op as plain JAX code, plain.py, the baseline without forgeax).
`param_specs` gives the Megatron-style PartitionSpecs over mesh axes ("data", "model").
"""

from __future__ import annotations

import math
from typing import Mapping

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from forgeax import ops

from . import plain
from .config import ModelConfig

Backends = Mapping[str, str | None]


def init_params(cfg: ModelConfig, key: jax.Array) -> dict:
    d, f, h = cfg.d_model, cfg.d_ff, cfg.head_dim
    keys = iter(jax.random.split(key, 2 + 7 * cfg.n_layers))

    def dense(shape, fan_in, scale=1.0):
        return jax.random.normal(next(keys), shape, jnp.float32) * (scale / math.sqrt(fan_in))

    out_scale = 1.0 / math.sqrt(2 * cfg.n_layers)  # residual branches start small (GPT-2 style)
    per_layer = [{
        "attn_norm": jnp.ones((d,), jnp.float32),
        "wq": dense((d, cfg.n_heads * h), d),
        "wk": dense((d, cfg.n_kv_heads * h), d),
        "wv": dense((d, cfg.n_kv_heads * h), d),
        "wo": dense((cfg.n_heads * h, d), cfg.n_heads * h, out_scale),
        "mlp_norm": jnp.ones((d,), jnp.float32),
        "w_gate": dense((d, f), d),
        "w_up": dense((d, f), d),
        "w_down": dense((f, d), f, out_scale),
    } for _ in range(cfg.n_layers)]
    layers = {name: jnp.stack([layer[name] for layer in per_layer]) for name in per_layer[0]}
    params = {"embed": dense((cfg.vocab, d), d),
              "layers": layers, "final_norm": jnp.ones((d,), jnp.float32)}
    if not cfg.tie_embeddings:
        params["unembed"] = dense((d, cfg.vocab), d)
    return params


def param_specs(params: dict) -> dict:
    """Megatron-style tensor parallelism: q/k/v and gate/up split by columns (heads, hidden units),
    wo and w_down by rows, so each layer needs one all-reduce per sublayer; the rest replicated.
    The layer axis (leading, stacked) is never split."""
    column, row = P(None, None, "model"), P(None, "model", None)
    by_name = {"wq": column, "wk": column, "wv": column, "wo": row, "w_gate": column, "w_up": column, "w_down": row}
    specs = {name: P() for name in params if name != "layers"}
    specs["layers"] = {name: by_name.get(name, P()) for name in params["layers"]}
    return specs


def _norm(x, scale, cfg: ModelConfig, backends: Backends):
    if backends["norm"] == "plain":
        return plain.rms_norm(x, scale, cfg.norm_eps)
    return ops.rms_norm(x, scale.astype(x.dtype), eps=cfg.norm_eps, backend=backends["norm"])


def _add_norm(delta, h, scale, cfg: ModelConfig, backends: Backends):
    if backends["residual_norm"] == "plain":
        return plain.add_rms_norm(delta, h, scale, cfg.norm_eps)
    return ops.add_rms_norm(delta, h, scale.astype(h.dtype), eps=cfg.norm_eps, backend=backends["residual_norm"])


def _attention(n, layer, positions, cfg: ModelConfig, backends: Backends):
    B, T, _ = n.shape
    dt = n.dtype
    q = (n @ layer["wq"].astype(dt)).reshape(B, T, cfg.n_heads, cfg.head_dim)
    k = (n @ layer["wk"].astype(dt)).reshape(B, T, cfg.n_kv_heads, cfg.head_dim)
    v = (n @ layer["wv"].astype(dt)).reshape(B, T, cfg.n_kv_heads, cfg.head_dim)
    if backends["rope"] == "plain":
        q, k = plain.rope_qk(q, k, positions, cfg.rope_theta)
    else:
        q, k = ops.rope_qk(q, k, positions, theta=cfg.rope_theta, backend=backends["rope"])
    if backends["attention"] == "plain":
        o = plain.attention(q, k, v)
    else:
        o = ops.attention(q, k, v, causal=True, backend=backends["attention"])
    return o.reshape(B, T, cfg.n_heads * cfg.head_dim) @ layer["wo"].astype(dt)


def _mlp(n, layer, backends: Backends):
    dt = n.dtype
    B, T, D = n.shape
    weights = (layer["w_gate"].astype(dt), layer["w_up"].astype(dt), layer["w_down"].astype(dt))
    if backends["mlp"] == "plain":
        y = plain.gated_mlp(n.reshape(B * T, D), *weights)
    else:
        y = ops.gated_mlp(n.reshape(B * T, D), *weights, activation="silu", backend=backends["mlp"])
    return y.reshape(B, T, -1)


def hidden(params: dict, tokens: jax.Array, cfg: ModelConfig, backends: Backends) -> jax.Array:
    """The final normed hidden states `[B, T, D]` in the compute dtype."""
    dt = jnp.dtype(cfg.dtype)
    return decoder_layers(params["layers"], params["final_norm"], params["embed"].astype(dt)[tokens], cfg, backends)


def decoder_layers(layers: dict, final_norm: jax.Array, h: jax.Array, cfg: ModelConfig, backends: Backends) -> jax.Array:
    """The decoder layers (`layers`: each parameter stacked over the layers) and the final norm
    over embedded inputs `h [B, T, D]` (compute dtype).

    One scan step is a layer from its normed input on: it carries (h, n), n = the layer's
    attention input, and ends with the residual add fused into the *next* norm (the next layer's
    attn_norm, or final_norm after the last layer), the same ops in the same order as the
    layers written out one by one."""
    positions = jnp.arange(h.shape[1], dtype=jnp.int32)
    next_norms = jnp.concatenate([layers["attn_norm"][1:], final_norm[None]])

    def layer_step(carry, xs):
        h, n = carry
        layer, next_norm = xs
        delta = _attention(n, layer, positions, cfg, backends)
        n, h = _add_norm(delta, h, layer["mlp_norm"], cfg, backends)
        delta = _mlp(n, layer, backends)
        n, h = _add_norm(delta, h, next_norm, cfg, backends)
        return (h, n), None

    step = jax.checkpoint(layer_step) if cfg.remat else layer_step
    n = _norm(h, layers["attn_norm"][0], cfg, backends)
    (_, n), _ = jax.lax.scan(step, (h, n), (layers, next_norms), unroll=cfg.unroll_layers)
    return n


def unembedding(params: dict, cfg: ModelConfig) -> jax.Array:
    """`[D, V]` in the compute dtype (the embedding's transpose when tied)."""
    w = params["embed"].T if cfg.tie_embeddings else params["unembed"]
    return w.astype(jnp.dtype(cfg.dtype))


def loss_fn(params: dict, tokens: jax.Array, targets: jax.Array, cfg: ModelConfig, backends: Backends) -> jax.Array:
    """Mean next-token cross-entropy (nats), fused with the output projection."""
    n = hidden(params, tokens, cfg, backends)
    B, T, D = n.shape
    args = (n.reshape(B * T, D), unembedding(params, cfg), targets.reshape(B * T))
    if backends["loss"] == "plain":
        return plain.linear_cross_entropy(*args)
    return ops.linear_cross_entropy(*args, backend=backends["loss"])


def logits_fn(params: dict, tokens: jax.Array, cfg: ModelConfig, backends: Backends) -> jax.Array:
    """`[B, T, V]` float32 logits (for sampling)."""
    n = hidden(params, tokens, cfg, backends)
    return (n @ unembedding(params, cfg)).astype(jnp.float32)


def sample(params: dict, prompts: list[list[int]], cfg: ModelConfig, backends: Backends, *, new_tokens: int = 80,
           temperature: float = 0.0, key: jax.Array | None = None) -> list[list[int]]:
    """Continues each prompt (token ids) by `new_tokens` tokens: greedy (temperature 0) or sampled.

    Each new token reruns the causal forward over a fixed `[len(prompts), seq_len]` window (no KV
    cache: the window's later positions cannot affect earlier ones), inside one jitted loop."""
    T = cfg.seq_len
    lengths = [min(len(p), T - 1) for p in prompts]
    buf = jnp.zeros((len(prompts), T), jnp.int32)
    for i, p in enumerate(prompts):
        if lengths[i]:
            buf = buf.at[i, :lengths[i]].set(jnp.asarray(p[len(p) - lengths[i]:], jnp.int32))
    key = jax.random.PRNGKey(0) if key is None else key
    steps = min(new_tokens, T - max(lengths))

    @jax.jit
    def run(params, buf, pos, key):
        def body(i, carry):
            buf, pos, key = carry
            logits = logits_fn(params, buf, cfg, backends)
            last = jnp.take_along_axis(logits, (pos - 1)[:, None, None], axis=1)[:, 0]
            key, sub = jax.random.split(key)
            if temperature > 0:
                nxt = jax.random.categorical(sub, last / temperature)
            else:
                nxt = jnp.argmax(last, axis=-1)
            buf = buf.at[jnp.arange(buf.shape[0]), pos].set(nxt.astype(jnp.int32))
            return buf, pos + 1, key
        return jax.lax.fori_loop(0, steps, body, (buf, pos, key))[0]

    out = jax.device_get(run(params, buf, jnp.asarray(lengths, jnp.int32), key))
    return [out[i, lengths[i]:lengths[i] + steps].tolist() for i in range(len(prompts))]
