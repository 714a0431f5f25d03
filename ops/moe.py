"""Token-choice mixture-of-experts MLP on the ragged matmul: `moe_mlp`.

    p = softmax(router_logits)            [T, E], f32
    (w, e) = top_k(p, k); w /= sum(w)     (renormalize) per token
    y[t] = sum_j w[t, j] * keep[t, j] * expert_{e[t, j]}(x[t]),
    expert_e(x) = (act(x @ w_gate[e]) * (x @ w_up[e])) @ w_down[e]

The T*k (token, choice) assignments are sorted by expert (stable: token order within an expert),
x rows gathered in that order, the three products run as `ragged_dot` over the expert groups,
and the results are gathered back and combined with the routing weights in f32.

Capacity: with capacity_factor set, each expert takes at most C = ceil(capacity_factor * T * k / E)
assignments, the first ones in token order (token t before t + 1; a token's choices in top-k
order); the rest are dropped (contribute 0; the token keeps its other choices, weights are not
renormalised again). Dropped assignments are sorted past the groups, where ragged_dot does no work.

Auxiliary load-balancing loss (Switch Transformer / Mixtral): E * sum_e f_e * P_e, f_e the fraction
of the T*k assignments routed to expert e (before drops), P_e the mean router probability of e;
1 for a perfectly balanced router. Gradients reach the router through P_e.

Expert parallelism (expert_axis set): call inside `shard_map` with tokens (x, router_logits)
and experts (the weights) sharded over the same mesh axis. Assignments travel to the device that
holds their expert by one all-to-all (fixed [P, T_local * k] slots per device pair) and back by
another; routing, capacity and the aux loss use global counts, so results equal the
single-device call on the gathered arrays.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from forgeax.kernels.common.gated_mlp import ACTIVATIONS, activate
from forgeax.ops import checks
from forgeax.ops.ragged_dot import ragged_dot


def _check(x, router_logits, w_gate, w_up, w_down, top_k, activation, capacity_factor, experts):
    checks.floating_array("x", x, min_rank=1)
    checks.floating_array("router_logits", router_logits, min_rank=1)
    d = int(x.shape[-1])
    if tuple(router_logits.shape[:-1]) != tuple(x.shape[:-1]):
        raise ValueError(f"router_logits: expected leading axes {tuple(x.shape[:-1])} (x's) and a last axis E, "
                         f"got shape {tuple(router_logits.shape)}")
    for name, w in (("w_gate", w_gate), ("w_up", w_up), ("w_down", w_down)):
        checks.floating_array(name, w)
        if w.ndim != 3:
            raise ValueError(f"{name}: expected a rank-3 array [E, ., .], got shape {tuple(w.shape)}")
        if w.dtype != x.dtype:
            raise TypeError(f"{name}: expected x's dtype {x.dtype.name}, got {w.dtype.name}")
    e_local, f = int(w_gate.shape[0]), int(w_gate.shape[2])
    if tuple(w_gate.shape) != (e_local, d, f):
        raise ValueError(f"w_gate: expected shape [E, D={d}, F], got {tuple(w_gate.shape)}")
    if tuple(w_up.shape) != (e_local, d, f):
        raise ValueError(f"w_up: expected w_gate's shape {tuple(w_gate.shape)}, got {tuple(w_up.shape)}")
    if tuple(w_down.shape) != (e_local, f, d):
        raise ValueError(f"w_down: expected shape {(e_local, f, d)} ([E, F, D]), got {tuple(w_down.shape)}")
    if router_logits.shape[-1] != experts:
        raise ValueError(f"router_logits: expected a last axis of E = {experts} experts, got {router_logits.shape[-1]}")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= experts:
        raise ValueError(f"top_k: expected an int in [1, {experts}] (the number of experts), got {top_k!r}")
    if not isinstance(activation, str) or activation not in ACTIVATIONS:
        raise ValueError(f"activation: expected one of {ACTIVATIONS}, got {activation!r}")
    if capacity_factor is not None:
        checks.positive_float("capacity_factor", capacity_factor)


def _route(logits, top_k, renormalize):
    """(probabilities [T, E], weights [T, k], experts [T, k]) in f32 / int32."""
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    weights, experts = jax.lax.top_k(probs, top_k)
    if renormalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return probs, weights, experts.astype(jnp.int32)


def _positions(flat_experts, e, offsets=None):
    """Each assignment's place among its expert's assignments, in order ([A] int32), and the
    per-expert counts [E]; `offsets` [E] counts assignments before this shard's."""
    onehot = jax.nn.one_hot(flat_experts, e, dtype=jnp.int32)
    before = jnp.cumsum(onehot, axis=0) - onehot
    pos = jnp.take_along_axis(before, flat_experts[:, None], axis=1)[:, 0]
    if offsets is not None:
        pos = pos + offsets[flat_experts]
    return pos, jnp.sum(onehot, axis=0)


def _expert_mlp(xs, group_sizes, w_gate, w_up, w_down, activation, backend):
    """The gated MLP of each group's rows (rows past the groups give 0)."""
    gate = ragged_dot(xs, w_gate, group_sizes, preferred_element_type=jnp.float32, backend=backend)
    up = ragged_dot(xs, w_up, group_sizes, preferred_element_type=jnp.float32, backend=backend)
    h = (activate(gate, activation) * up).astype(xs.dtype)
    return ragged_dot(h, w_down, group_sizes, backend=backend)


def _sorted_compute(x, source, keys, groups, w_gate, w_up, w_down, activation, backend):
    """expert_{keys[i]}(x[source[i]]) for every row i (keys == groups: dropped, 0), via a sort by
    key; x rows are gathered once, in sorted order."""
    order = jnp.argsort(keys, stable=True)
    group_sizes = jnp.bincount(keys, length=groups + 1)[:groups].astype(jnp.int32)
    y = _expert_mlp(x[source[order]], group_sizes, w_gate, w_up, w_down, activation, backend)
    return jnp.zeros_like(y).at[order].set(y, unique_indices=True)


def _aux_loss(probs_sum, counts, tokens, top_k, e):
    f = counts.astype(jnp.float32) / (tokens * top_k)
    p = probs_sum / tokens
    return e * jnp.sum(f * p)


def moe_mlp(
    x: Float[Array, "*B D"],
    router_logits: Float[Array, "*B E"],
    w_gate: Float[Array, "E D F"],
    w_up: Float[Array, "E D F"],
    w_down: Float[Array, "E F D"],
    *,
    top_k: int = 2,
    activation: str = "silu",
    renormalize: bool = True,
    capacity_factor: float | None = None,
    return_aux_loss: bool = False,
    expert_axis: str | None = None,
    backend: str | None = None,
) -> Float[Array, "*B D"] | tuple[Float[Array, "*B D"], Float[Array, ""]]:
    """A token-choice mixture-of-experts gated MLP (Mixtral / DeepSeek style), differentiable.

    Args:
      x: `[..., D]` tokens, f32/bf16/f16.
      router_logits: `[..., E]` router scores of each token (any float dtype; softmax in f32).
      w_gate, w_up: `[E, D, F]` per-expert gate and up projections, x's dtype.
      w_down: `[E, F, D]` per-expert down projections.
      top_k: experts per token, 1..E.
      activation: "silu" (SwiGLU), "gelu", "gelu_tanh" or "relu".
      renormalize: divide each token's top-k probabilities by their sum (Mixtral); else the
        softmax probabilities themselves weigh the experts.
      capacity_factor: None (no drops) or > 0: each expert takes at most
        ceil(capacity_factor * T * top_k / E) assignments, first come in token order.
      return_aux_loss: also return the load-balancing loss E * sum_e f_e * P_e (f32 scalar).
      expert_axis: a mesh axis name to run expert-parallel inside `shard_map` (x and
        router_logits sharded over tokens, the weights over experts along that axis).
      backend: the `ragged_dot` backend of the three grouped products (None: best).

    Returns:
      `[..., D]` in x's dtype, or (that, aux_loss) with return_aux_loss.
    """
    if expert_axis is None:
        experts = int(w_gate.shape[0]) if hasattr(w_gate, "shape") and w_gate.ndim == 3 else -1
    else:
        experts = int(w_gate.shape[0]) * _axis_size(expert_axis)
    _check(x, router_logits, w_gate, w_up, w_down, top_k, activation, capacity_factor, experts)
    lead, d = x.shape[:-1], int(x.shape[-1])
    x2 = x.reshape(-1, d)
    logits = router_logits.reshape(-1, experts)
    if expert_axis is None:
        y, aux = _single_device(x2, logits, w_gate, w_up, w_down, top_k, activation, renormalize, capacity_factor, backend)
    else:
        y, aux = _expert_parallel(x2, logits, w_gate, w_up, w_down, top_k, activation, renormalize, capacity_factor,
                                  expert_axis, backend)
    y = y.reshape(*lead, d)
    return (y, aux) if return_aux_loss else y


def _capacity(capacity_factor, tokens, top_k, e):
    return None if capacity_factor is None else int(math.ceil(capacity_factor * tokens * top_k / e))


def _combine(y_assign, weights, keep, t, top_k, dtype):
    w = jnp.where(keep, weights.reshape(-1), 0.0)
    return jnp.sum((y_assign.astype(jnp.float32) * w[:, None]).reshape(t, top_k, -1), axis=1).astype(dtype)


def _single_device(x, logits, w_gate, w_up, w_down, top_k, activation, renormalize, capacity_factor, backend):
    t, e = logits.shape
    probs, weights, experts = _route(logits, top_k, renormalize)
    flat = experts.reshape(-1)  # assignment a = token * k + choice
    pos, counts = _positions(flat, e)
    capacity = _capacity(capacity_factor, t, top_k, e)
    keep = jnp.ones_like(flat, dtype=bool) if capacity is None else pos < capacity
    keys = jnp.where(keep, flat, e)
    source = jnp.arange(t * top_k, dtype=jnp.int32) // top_k  # assignment a is token a // k
    y = _sorted_compute(x, source, keys, e, w_gate, w_up, w_down, activation, backend)
    out = _combine(y, weights, keep, t, top_k, x.dtype)
    return out, _aux_loss(jnp.sum(probs, axis=0), counts, t, top_k, e)


def _axis_size(axis: str) -> int:
    return int(jax.lax.psum(1, axis))


def _expert_parallel(x, logits, w_gate, w_up, w_down, top_k, activation, renormalize, capacity_factor, axis, backend):
    """Inside shard_map: this device's tokens [T_l, D], all E logits; its E_l experts' weights."""
    p = _axis_size(axis)
    me = jax.lax.axis_index(axis)
    t_local, e = logits.shape
    e_local = e // p
    a = t_local * top_k
    probs, weights, experts = _route(logits, top_k, renormalize)
    flat = experts.reshape(-1)
    # Global token order: shards hold consecutive tokens, so assignments on earlier devices come first.
    local_counts = jnp.sum(jax.nn.one_hot(flat, e, dtype=jnp.int32), axis=0)
    all_counts = jax.lax.all_gather(local_counts, axis)  # [P, E]
    offsets = jnp.sum(jnp.where(jnp.arange(p)[:, None] < me, all_counts, 0), axis=0)
    pos, _ = _positions(flat, e, offsets)
    capacity = _capacity(capacity_factor, t_local * p, top_k, e)
    keep = jnp.ones_like(flat, dtype=bool) if capacity is None else pos < capacity
    # Dispatch: sort by destination device (dropped: P, last); slot i of destination q.
    dest = jnp.where(keep, flat // e_local, p)
    order = jnp.argsort(dest, stable=True)
    per_dest = jnp.bincount(dest, length=p + 1)[:p]
    start = jnp.cumsum(per_dest) - per_dest
    slots = jnp.arange(a)
    src = start[:, None] + slots[None, :]  # [P, A] rows of the sorted assignments
    valid = slots[None, :] < per_dest[:, None]
    src = jnp.where(valid, src, 0)
    sorted_rows = order[src]  # assignment index
    send_x = jnp.where(valid[..., None], x[sorted_rows // top_k], 0).astype(x.dtype)
    send_e = jnp.where(valid, flat[sorted_rows] - jnp.arange(p)[:, None] * e_local, e_local)
    recv_x = jax.lax.all_to_all(send_x, axis, 0, 0, tiled=False)
    recv_e = jax.lax.all_to_all(send_e, axis, 0, 0, tiled=False)
    y = _sorted_compute(recv_x.reshape(p * a, -1), jnp.arange(p * a), recv_e.reshape(-1), e_local, w_gate, w_up, w_down,
                        activation, backend)
    back = jax.lax.all_to_all(y.reshape(p, a, -1), axis, 0, 0, tiled=False)  # [P, A, D]: my assignments' results
    # Unpermute: assignment sorted_rows[q, i] came back at back[q, i].
    y_assign = jnp.zeros((a, x.shape[1]), back.dtype).at[jnp.where(valid, sorted_rows, a)].set(back, mode="drop")
    out = _combine(y_assign, weights, keep, t_local, top_k, x.dtype)
    aux = _aux_loss(jax.lax.psum(jnp.sum(probs, axis=0), axis), jax.lax.psum(local_counts, axis), t_local * p, top_k, e)
    return out, aux
