"""Masked mean over the sequence axis: `mean_pool` (sequence embeddings, packed sequences)."""

from __future__ import annotations

import operator

import jax.numpy as jnp
from jaxtyping import Array, Float, Integer

from forgeax.core import KernelConfig, Selection, define_op
from forgeax.ops import checks

__all__ = ["mean_pool"]


def _features(args, kwargs) -> dict:
    """What the selection rules (rules/mean_pool.json) read of a call."""
    x, _, segment_ids = args
    return {"batch": int(x.shape[0]), "tokens": int(x.shape[1]), "dim": int(x.shape[2]), "dtype": x.dtype.name,
            "segments": 0 if segment_ids is None else int(kwargs["num_segments"])}


MEAN_POOL = define_op(
    "mean_pool",
    {"xla": "forgeax.kernels.xla.mean_pool:MEAN_POOL", "triton": "forgeax.kernels.triton.mean_pool:MEAN_POOL"},
    selection=Selection.load("forgeax.ops", "rules/mean_pool.json"),
    features=_features,
)


def mean_pool(
    x: Float[Array, "B T D"],
    *,
    lengths: Integer[Array, " B"] | None = None,
    segment_ids: Integer[Array, "B T"] | None = None,
    num_segments: int | None = None,
    backend: str | None = None,
    config: KernelConfig | None = None,
) -> Float[Array, "B D"] | Float[Array, "B S D"]:
    """The mean of x's rows over the sequence axis 1, masked by lengths or split by segment ids.

    Args:
      x: `[B, T, D]`, f32/bf16/f16.
      lengths: None or `[B]` integers: row b averages its first lengths[b] steps (clipped to
        [0, T]); a length of 0 gives zeros (and a zero gradient).
      segment_ids: None or `[B, T]` integers (packed sequences): output row (b, s) averages
        the steps t with segment_ids[b, t] == s. Ids outside [0, num_segments) belong to no
        segment (use -1 for padding); a segment with no steps gives zeros.
      num_segments: S, the static number of segments per batch row; required with segment_ids.
      backend: None (best for this device), "xla", "triton", or a registered name.
      config: a kernel config of the chosen backend (None: tuned or heuristic).

    Without lengths and segment_ids, the plain mean over all T steps. Sums are in f32.

    Returns:
      `[B, D]` (no segment_ids) or `[B, num_segments, D]`, in x's dtype. Differentiable with
      respect to x.
    """
    checks.floating_array("x", x)
    if x.ndim != 3:
        raise ValueError(f"x: expected 3 axes [B, T, D], got shape {tuple(x.shape)}")
    b, t, _ = x.shape
    if segment_ids is not None and lengths is not None:
        raise ValueError("segment_ids: give segment_ids or lengths, not both")
    if segment_ids is None:
        if num_segments is not None:
            raise ValueError("num_segments: only meaningful with segment_ids")
        if lengths is None:
            lengths = jnp.full((b,), t, jnp.int32)
        checks.integer_array("lengths", lengths, (b,), "[B] of x")
        return MEAN_POOL(x, jnp.asarray(lengths).astype(jnp.int32), None, num_segments=None, backend=backend,
                         config=config)
    checks.integer_array("segment_ids", segment_ids, (b, t), "[B, T] of x")
    if num_segments is None:
        raise ValueError("num_segments: required with segment_ids (the static size of the output's segment axis)")
    try:
        num_segments = operator.index(num_segments)
    except TypeError:
        raise TypeError(f"num_segments: expected an int, got {num_segments!r}") from None
    if num_segments <= 0:
        raise ValueError(f"num_segments: expected an int >= 1, got {num_segments}")
    return MEAN_POOL(x, None, jnp.asarray(segment_ids).astype(jnp.int32), num_segments=num_segments, backend=backend,
                     config=config)
