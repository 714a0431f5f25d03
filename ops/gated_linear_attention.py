"""Gated linear attention and lightning attention: `gated_linear_attention`,
`gated_linear_attention_step` (decoding) and `lightning_attention`."""

from __future__ import annotations

import operator

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Integer

from forgeax.core import KernelConfig, Selection, define_op
from forgeax.kernels.common.gated_linear_attention import SUB_CHUNK, GLASpec
from forgeax.ops import checks

__all__ = ["gated_linear_attention", "gated_linear_attention_step", "lightning_attention"]


def _features(args, kwargs) -> dict:
    """What the selection rules (rules/gated_linear_attention.json) read of a call."""
    q, v = args[0], args[2]
    return {"key_dim": int(q.shape[3]), "value_dim": int(v.shape[3]), "tokens": int(q.shape[0] * q.shape[1]),
            "varlen": args[5] is not None, "dtype": q.dtype.name, "chunk_size": kwargs["spec"].chunk_size}


def _backends(attr: str) -> dict[str, str]:
    return {
        "xla": f"forgeax.kernels.xla.gated_linear_attention:{attr}",
        "xla_chunked": f"forgeax.kernels.xla.gated_linear_attention:{attr}_CHUNKED",
        "triton": f"forgeax.kernels.triton.gated_linear_attention:{attr}",
        "pallas_tpu": f"forgeax.kernels.pallas.tpu.gated_linear_attention:{attr}",
    }


GATED_LINEAR_ATTENTION = define_op(
    "gated_linear_attention", _backends("GATED_LINEAR_ATTENTION"),
    selection=Selection.load("forgeax.ops", "rules/gated_linear_attention.json"), features=_features)
LIGHTNING_ATTENTION = define_op(
    "lightning_attention", _backends("LIGHTNING_ATTENTION"),
    selection=Selection.load("forgeax.ops", "rules/lightning_attention.json"), features=_features)


def _check_qkv(q, k, v) -> None:
    for name, x in (("q", q), ("k", k), ("v", v)):
        checks.floating_array(name, x)
        if x.ndim != 4:
            raise ValueError(f"{name}: expected 4 axes [B, T, N, {'V' if name == 'v' else 'K'}], got shape {tuple(x.shape)}")
    for name, x in (("k", k), ("v", v)):
        if x.dtype != q.dtype:
            raise TypeError(f"{name}: expected q's dtype {jnp.dtype(q.dtype).name}, got {jnp.dtype(x.dtype).name}")
    if tuple(k.shape) != tuple(q.shape):
        raise ValueError(f"k: expected q's shape {tuple(q.shape)}, got {tuple(k.shape)}")
    if tuple(v.shape[:3]) != tuple(q.shape[:3]):
        raise ValueError(f"v: expected shape {(*q.shape[:3], 'V')} (q's B, T, N), got {tuple(v.shape)}")


def _spec(q, scale, chunk_size) -> GLASpec:
    if scale is None:
        scale = q.shape[3] ** -0.5
    checks.positive_float("scale", scale)
    try:
        chunk_size = operator.index(chunk_size)
    except TypeError:
        raise TypeError(f"chunk_size: expected an int, got {chunk_size!r}") from None
    if chunk_size < SUB_CHUNK or chunk_size & (chunk_size - 1) or chunk_size > 256:
        raise ValueError(f"chunk_size: expected a power of two in [{SUB_CHUNK}, 256], got {chunk_size}")
    return GLASpec(scale=float(scale), chunk_size=chunk_size)


def _seqs(q, cu_seqlens) -> int:
    """The number of sequences (B, or len(cu_seqlens) - 1); checks cu_seqlens' type and shape."""
    if cu_seqlens is None:
        return q.shape[0]
    checks.integer_array("cu_seqlens", cu_seqlens)
    if cu_seqlens.ndim != 1 or cu_seqlens.shape[0] < 2:
        raise ValueError(f"cu_seqlens: expected shape [num_seqs + 1] with num_seqs >= 1, got {tuple(cu_seqlens.shape)}")
    if q.shape[0] != 1:
        raise ValueError(f"cu_seqlens: packed sequences need B == 1 (q's batch is {q.shape[0]})")
    if not isinstance(cu_seqlens, jax.core.Tracer):
        import numpy as np  # noqa: PLC0415

        cu = np.asarray(cu_seqlens)
        if cu[0] != 0 or cu[-1] != q.shape[1] or (np.diff(cu) < 0).any():
            raise ValueError(f"cu_seqlens: expected non-decreasing offsets from 0 to T = {q.shape[1]}, got {cu.tolist()}")
    return cu_seqlens.shape[0] - 1


def _check_state(name: str, state, shape) -> None:
    if state is None:
        return
    checks.floating_array(name, state)
    if tuple(state.shape) != tuple(shape):
        raise ValueError(f"{name}: expected shape {tuple(shape)} [num_seqs, N, K, V], got {tuple(state.shape)}")


def _empty(q, v, initial_state, seqs):
    o = jnp.zeros(v.shape, q.dtype)
    state = jnp.zeros((seqs, q.shape[2], q.shape[3], v.shape[3]), jnp.float32) if initial_state is None else initial_state.astype(jnp.float32)
    return o, state


def _run(op, q, k, v, gate, *, scale, initial_state, return_final_state, chunk_size, cu_seqlens, backend, config):
    """The checks and the call `gated_linear_attention` and `lightning_attention` share, after their
    own gate check (`gate` is g or decay)."""
    spec = _spec(q, scale, chunk_size)
    seqs = _seqs(q, cu_seqlens)
    _check_state("initial_state", initial_state, (seqs, q.shape[2], q.shape[3], v.shape[3]))
    if not isinstance(return_final_state, bool):
        raise TypeError(f"return_final_state: expected a bool, got {return_final_state!r}")
    if q.shape[1] == 0 or q.shape[2] == 0:
        o, final = _empty(q, v, initial_state, seqs)
    else:
        o, final = op(q, k, v, gate, initial_state, cu_seqlens, spec=spec, backend=backend, config=config)
    return (o, final) if return_final_state else o


def gated_linear_attention(
    q: Float[Array, "B T N K"],
    k: Float[Array, "B T N K"],
    v: Float[Array, "B T N V"],
    g: Float[Array, "B T N K"],
    *,
    scale: float | None = None,
    initial_state: Float[Array, "S N K V"] | None = None,
    return_final_state: bool = False,
    chunk_size: int = 64,
    cu_seqlens: Integer[Array, " S1"] | None = None,
    backend: str | None = None,
    config: KernelConfig | None = None,
) -> Float[Array, "B T N V"] | tuple[Float[Array, "B T N V"], Float[Array, "S N K V"]]:
    """Gated linear attention (GLA, Yang et al. 2023), the chunk-parallel training form.

    Per head, with a [K, V] state and log-decay gates g <= 0 per key dimension (f32 math):

        S_t = diag(exp(g_t)) S_{t-1} + k_t^T v_t,      o_t = scale * q_t S_t

    The chunked backends split T into chunks of `chunk_size` tokens: attention inside a chunk,
    the state carried between chunks, every exponential of a gate difference taken <= 0 (stable
    for any g <= 0, e.g. -50). Decoding one token at a time: `gated_linear_attention_step`.

    Args:
      q, k: `[B, T, N, K]`; v: `[B, T, N, V]`, one dtype (f32/bf16/f16).
      g: `[B, T, N, K]` log gates (<= 0, not checked: positive values grow the state), any float dtype.
      scale: the output scale (default K ** -0.5).
      initial_state: `[num_seqs, N, K, V]` (num_seqs = B, or len(cu_seqlens) - 1), differentiable.
      return_final_state: also return the final states `[num_seqs, N, K, V]` f32 (differentiable).
      chunk_size: tokens per chunk of the chunked forms, a power of two in [16, 256].
      cu_seqlens: `[num_seqs + 1]` int offsets of sequences packed along T (B must be 1); the
        state restarts at each (from its initial state), as if each ran alone.
      backend: None (rules/gated_linear_attention.json, then the platform priority), "xla" (the
        recurrence, a scan over T: the reference), "xla_chunked", "triton", "pallas_tpu".
      config: a kernel config of the chosen backend.

    Returns:
      o `[B, T, N, V]` in q's dtype, and the final states when `return_final_state`.
    """
    _check_qkv(q, k, v)
    checks.floating_array("g", g)
    if tuple(g.shape) != tuple(q.shape):
        raise ValueError(f"g: expected q's shape {tuple(q.shape)}, got {tuple(g.shape)}")
    return _run(GATED_LINEAR_ATTENTION, q, k, v, g, scale=scale, initial_state=initial_state,
                return_final_state=return_final_state, chunk_size=chunk_size, cu_seqlens=cu_seqlens,
                backend=backend, config=config)


def lightning_attention(
    q: Float[Array, "B T N K"],
    k: Float[Array, "B T N K"],
    v: Float[Array, "B T N V"],
    *,
    decay: Float[Array, " N"],
    scale: float | None = None,
    initial_state: Float[Array, "S N K V"] | None = None,
    return_final_state: bool = False,
    chunk_size: int = 64,
    cu_seqlens: Integer[Array, " S1"] | None = None,
    backend: str | None = None,
    config: KernelConfig | None = None,
) -> Float[Array, "B T N V"] | tuple[Float[Array, "B T N V"], Float[Array, "S N K V"]]:
    """Linear attention with a per-head exponential decay (Lightning Attention-2):

        S_t = exp(-decay[n]) S_{t-1} + k_t^T v_t,      o_t = scale * q_t S_t

    That is `gated_linear_attention` with g = -decay[n] on every key dimension, and every backend
    runs the GLA kernels on that broadcast gate. decay: `[N]` rates >= 0 (differentiable); the
    other arguments as for `gated_linear_attention`.
    """
    _check_qkv(q, k, v)
    checks.floating_array("decay", decay)
    if tuple(decay.shape) != (q.shape[2],):
        raise ValueError(f"decay: expected shape ({q.shape[2]},) (one rate per head), got {tuple(decay.shape)}")
    return _run(LIGHTNING_ATTENTION, q, k, v, decay, scale=scale, initial_state=initial_state,
                return_final_state=return_final_state, chunk_size=chunk_size, cu_seqlens=cu_seqlens,
                backend=backend, config=config)


def gated_linear_attention_step(
    q: Float[Array, "B N K"],
    k: Float[Array, "B N K"],
    v: Float[Array, "B N V"],
    g: Float[Array, "B N K"],
    state: Float[Array, "B N K V"],
    *,
    scale: float | None = None,
) -> tuple[Float[Array, "B N V"], Float[Array, "B N K V"]]:
    """One recurrent (decoding) step of gated linear attention: S = diag(exp(g)) state + k^T v,
    o = scale * q S. Returns (o in q's dtype, the new state f32). A few FLOPs per byte of state:
    plain XLA, differentiable. Lightning attention: g = -decay[:, None] broadcast to [B, N, K]."""
    for name, x in (("q", q), ("k", k), ("v", v), ("g", g), ("state", state)):
        checks.floating_array(name, x)
    b, n, kd = q.shape if q.ndim == 3 else (None, None, None)
    if q.ndim != 3:
        raise ValueError(f"q: expected 3 axes [B, N, K] (one token), got shape {tuple(q.shape)}")
    for name, x in (("k", k), ("g", g)):
        if tuple(x.shape) != (b, n, kd):
            raise ValueError(f"{name}: expected q's shape {(b, n, kd)}, got {tuple(x.shape)}")
    if v.ndim != 3 or tuple(v.shape[:2]) != (b, n):
        raise ValueError(f"v: expected shape ({b}, {n}, V), got {tuple(v.shape)}")
    if tuple(state.shape) != (b, n, kd, v.shape[2]):
        raise ValueError(f"state: expected shape {(b, n, kd, v.shape[2])}, got {tuple(state.shape)}")
    if scale is None:
        scale = kd ** -0.5
    checks.positive_float("scale", scale)
    from forgeax.kernels.xla.gated_linear_attention import gated_linear_attention_step as step  # noqa: PLC0415

    return step(q, k, v, g, state, scale=float(scale))
