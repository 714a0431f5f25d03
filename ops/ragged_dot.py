"""Ragged (grouped) matmul: `ragged_dot` and its transposed form `ragged_dot_transposed`."""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from forgeax.core import KernelConfig, Selection, define_op
from forgeax.kernels.common.ragged_dot import RaggedDotSpec
from forgeax.ops import checks

_BACKENDS = {
    "xla": "forgeax.kernels.xla.ragged_dot:RAGGED_DOT",
    "xla_ragged": "forgeax.kernels.xla.ragged_dot:XLA_RAGGED",
    "triton": "forgeax.kernels.triton.ragged_dot:RAGGED_DOT",
    "pallas_gpu": "forgeax.kernels.pallas.gpu.ragged_dot:RAGGED_DOT",
    "pallas_tpu": "forgeax.kernels.pallas.tpu.ragged_dot:RAGGED_DOT",
}
_TRANSPOSED_BACKENDS = {
    "xla": "forgeax.kernels.xla.ragged_dot:RAGGED_DOT_TRANSPOSED",
    "xla_ragged": "forgeax.kernels.xla.ragged_dot:XLA_RAGGED_TRANSPOSED",
    "triton": "forgeax.kernels.triton.ragged_dot:RAGGED_DOT_TRANSPOSED",
    "pallas_gpu": "forgeax.kernels.pallas.gpu.ragged_dot:RAGGED_DOT_TRANSPOSED",
    "pallas_tpu": "forgeax.kernels.pallas.tpu.ragged_dot:RAGGED_DOT_TRANSPOSED",
}


def _features(args, kwargs) -> dict:
    """What selection rules (rules/ragged_dot.json) read of a call."""
    lhs, rhs, _ = args
    del kwargs
    return {"m": int(lhs.shape[0]), "k": int(lhs.shape[1]), "n": int(rhs.shape[-1]), "groups": int(rhs.shape[0]),
            "dtype": lhs.dtype.name}


RAGGED_DOT = define_op("ragged_dot", _BACKENDS, selection=Selection.load("forgeax.ops", "rules/ragged_dot.json"),
                       features=_features)
RAGGED_DOT_TRANSPOSED = define_op("ragged_dot_transposed", _TRANSPOSED_BACKENDS,
                                  priority={"gpu": ["triton"], "tpu": ["xla_ragged", "pallas_tpu"], "cpu": ["xla_ragged"]})


def _check_group_sizes(group_sizes: Any, g: int | None) -> int:
    if not (hasattr(group_sizes, "shape") and hasattr(group_sizes, "dtype")):
        raise TypeError(f"group_sizes: expected an int32 array, got {type(group_sizes).__name__}")
    if jnp.dtype(group_sizes.dtype) != jnp.int32:
        raise TypeError(f"group_sizes: expected dtype int32, got {jnp.dtype(group_sizes.dtype).name}")
    if group_sizes.ndim != 1:
        raise ValueError(f"group_sizes: expected shape [G], got {tuple(group_sizes.shape)}")
    if g is not None and group_sizes.shape[0] != g:
        raise ValueError(f"group_sizes: expected length G = {g} (rhs.shape[0]), got {group_sizes.shape[0]}")
    if group_sizes.shape[0] == 0:
        raise ValueError("group_sizes: expected at least one group")
    return int(group_sizes.shape[0])


def _spec(first: Any, preferred_element_type: Any) -> RaggedDotSpec:
    if preferred_element_type is None:
        return RaggedDotSpec(out_dtype=jnp.dtype(first.dtype).name)
    try:
        dtype = jnp.dtype(preferred_element_type)
    except TypeError:
        raise TypeError(f"preferred_element_type: expected a dtype, got {preferred_element_type!r}") from None
    if dtype not in [jnp.dtype(d) for d in checks.FLOAT_DTYPES]:
        raise TypeError(f"preferred_element_type: expected float32, bfloat16 or float16, got {dtype.name}")
    return RaggedDotSpec(out_dtype=dtype.name)


def ragged_dot(
    lhs: Float[Array, "M K"],
    rhs: Float[Array, "G K N"],
    group_sizes: Int[Array, "G"],
    *,
    preferred_element_type: Any = None,
    backend: str | None = None,
    config: KernelConfig | None = None,
) -> Float[Array, "M N"]:
    """The grouped matmul of mixture-of-experts layers, with `jax.lax.ragged_dot`'s semantics.

        out[r] = lhs[r] @ rhs[g]   for the rows r of group g;   out[r] = 0 for r >= sum(group_sizes)

    Group g holds the consecutive rows [offset_g, offset_g + group_sizes[g]) of lhs, offset_g
    the sum of the sizes before it; sizes may be 0. A sum above M is clipped at M.

    Args:
      lhs: `[M, K]` f32/bf16/f16, rows sorted by group.
      rhs: `[G, K, N]`, lhs's dtype.
      group_sizes: `[G]` int32.
      preferred_element_type: the result's dtype (default lhs's). Products accumulate in f32.
      backend: None (best for this device), "xla" (the reference: masked dense products per
        group), "xla_ragged" (`jax.lax.ragged_dot`), "triton", "pallas_gpu" (Mosaic GPU, Hopper,
        bf16/f16 with K and N multiples of 64), "pallas_tpu", or a user-registered name.
      config: a kernel config of the chosen backend, or None.

    Returns:
      `[M, N]`. Differentiable with respect to lhs and rhs (d rhs is `ragged_dot_transposed`).
    """
    checks.floating_array("lhs", lhs)
    checks.floating_array("rhs", rhs)
    if lhs.ndim != 2:
        raise ValueError(f"lhs: expected shape [M, K], got {tuple(lhs.shape)}")
    if rhs.ndim != 3:
        raise ValueError(f"rhs: expected shape [G, K, N], got {tuple(rhs.shape)}")
    if rhs.shape[1] != lhs.shape[1]:
        raise ValueError(f"rhs: expected K = {lhs.shape[1]} (lhs.shape[1]) in shape [G, K, N], got {tuple(rhs.shape)}")
    if rhs.dtype != lhs.dtype:
        raise TypeError(f"rhs: expected lhs's dtype {lhs.dtype.name}, got {rhs.dtype.name}")
    _check_group_sizes(group_sizes, int(rhs.shape[0]))
    spec = _spec(lhs, preferred_element_type)
    return RAGGED_DOT(lhs, rhs, group_sizes, spec=spec, backend=backend, config=config)


def ragged_dot_transposed(
    lhs: Float[Array, "M K"],
    dout: Float[Array, "M N"],
    group_sizes: Int[Array, "G"],
    *,
    preferred_element_type: Any = None,
    backend: str | None = None,
    config: KernelConfig | None = None,
) -> Float[Array, "G K N"]:
    """Per-group products over rows: out[g] = lhs[rows of g]^T @ dout[rows of g].

    The gradient of `ragged_dot` with respect to rhs (d rhs = ragged_dot_transposed(lhs, d out)),
    itself a grouped product; rows past sum(group_sizes) contribute nothing and an empty group
    gives zeros.

    Args:
      lhs: `[M, K]` f32/bf16/f16, rows sorted by group.
      dout: `[M, N]` (cast to lhs's dtype for the product).
      group_sizes: `[G]` int32.
      preferred_element_type: the result's dtype (default lhs's). Products accumulate in f32.
      backend, config: as for `ragged_dot`.

    Returns:
      `[G, K, N]`, differentiable with respect to lhs and dout.
    """
    checks.floating_array("lhs", lhs)
    checks.floating_array("dout", dout)
    if lhs.ndim != 2:
        raise ValueError(f"lhs: expected shape [M, K], got {tuple(lhs.shape)}")
    if dout.ndim != 2 or dout.shape[0] != lhs.shape[0]:
        raise ValueError(f"dout: expected shape [M, N] with M = {lhs.shape[0]} (lhs.shape[0]), got {tuple(dout.shape)}")
    _check_group_sizes(group_sizes, None)
    spec = _spec(lhs, preferred_element_type)
    return RAGGED_DOT_TRANSPOSED(lhs, dout, group_sizes, spec=spec, backend=backend, config=config)
