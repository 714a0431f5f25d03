"""Rotary position embedding as a Mosaic TPU Pallas kernel (q and k in one call).

q: [B, T, N, H], k: [B, T, K, H] are viewed as [TOKENS, heads, H]; each grid step owns a
(block_tokens, heads, H) slab of each (the last two block dims are whole, so any N, H is a
legal block). The rotation is written lane-wise, without gathers, as

    out = x * cos(p * f) + partner(x) * s * sin(p * f)

with per-lane vectors (host-computed from the options, kernels/common/rope.py): f the
inverse frequency of the lane's pair (0 past rotary_dim), s = -1 on a pair's first element,
+1 on its second, 0 past rotary_dim (so the tail passes through: cos 0 = 1). partner(x) is
the lane's pair element, two lane rotations (`pltpu.roll`) selected by s:
  half-split: first lanes take x[i + R/2] (roll by H - R/2), second lanes x[i - R/2] (roll by R/2);
  interleaved: even lanes take x[i + 1] (roll by H - 1), odd lanes x[i - 1] (roll by 1).
The backward is the same kernel with sin negated (the inverse rotation).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from forgeax.core.config import KernelConfig
from forgeax.core.registry import Implementation
from forgeax.core.runtime import interpret_enabled
from forgeax.kernels.common.batching import fold_vmap_into_rows
from forgeax.kernels.common.partitioning import split_launch
from forgeax.kernels.common.rope import RopeSpec, inverse_frequencies, pair_indices

_F32 = jnp.float32
_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
# One f32 (tokens, heads, H) temporary may take this much VMEM (a few are live at once,
# plus the double-buffered q, k and outputs): well under v5e's 16 MiB scoped default.
_F32_TILE_BYTES = 1 << 20


@dataclasses.dataclass(frozen=True, kw_only=True)
class RopeTpuConfig(KernelConfig):
    """block_tokens: tokens per grid step, a multiple of 8 (the positions block's sublanes)
    unless it covers every token."""

    block_tokens: int

    def validate(self) -> None:
        super().validate()
        if self.block_tokens % 8:
            raise ValueError(f"RopeTpuConfig.block_tokens: expected a multiple of 8, got {self.block_tokens}")


def heuristic_config(q, *args, spec: RopeSpec, **kwargs) -> RopeTpuConfig:
    del spec, kwargs
    k = args[0] if args and getattr(args[0], "ndim", 0) == 4 else None
    heads = q.shape[2] + (0 if k is None else k.shape[2])
    want = max(8, _F32_TILE_BYTES // (4 * max(heads * q.shape[3], 1)) // 8 * 8)
    return RopeTpuConfig(block_tokens=want)


def candidate_configs(q, *args, spec: RopeSpec, **kwargs) -> list[RopeTpuConfig]:
    base = heuristic_config(q, *args, spec=spec, **kwargs)
    return [base, RopeTpuConfig(block_tokens=max(8, base.block_tokens // 2 // 8 * 8)), RopeTpuConfig(block_tokens=base.block_tokens * 2)]


def _lanes(spec: RopeSpec, h: int) -> np.ndarray:
    """(2, H) f32: row 0 the lane's inverse frequency, row 1 its sign s (module docstring)."""
    lanes = np.zeros((2, h), np.float32)
    first, second = pair_indices(spec)
    inv = inverse_frequencies(spec)
    lanes[0, first], lanes[0, second] = inv, inv
    lanes[1, first], lanes[1, second] = -1.0, 1.0
    return lanes


def _kernel(pos_ref, lanes_ref, *refs, n_arrays, shifts, inverse):
    x_refs, o_refs = refs[:n_arrays], refs[n_arrays:]
    freq, sign = lanes_ref[0:1, :], lanes_ref[1:2, :]
    angle = pos_ref[...].astype(_F32) * freq  # (tokens, H)
    cos = jnp.cos(angle)[:, None, :]
    sin = (jnp.sin(angle) * (-sign if inverse else sign))[:, None, :]
    first = (sign < 0)[:, None, :]
    for x_ref, o_ref in zip(x_refs, o_refs):
        x = x_ref[...].astype(_F32)
        partner = jnp.where(first, pltpu.roll(x, shifts[0], 2), pltpu.roll(x, shifts[1], 2))
        o_ref[...] = (x * cos + partner * sin).astype(o_ref.dtype)


def _rotate(arrays, positions, *, spec: RopeSpec, config: RopeTpuConfig, inverse: bool):
    b, t, _, h = arrays[0].shape
    tokens = b * t
    if tokens == 0 or h == 0:
        return arrays
    block = tokens if tokens <= config.block_tokens else config.block_tokens
    shifts = (h - 1, 1) if spec.interleaved else (h - spec.half, spec.half)
    flat = [a.reshape(tokens, a.shape[2], h) for a in arrays]
    slab = lambda a: pl.BlockSpec((block, a.shape[1], h), lambda i: (i, 0, 0))  # noqa: E731
    out = pl.pallas_call(
        functools.partial(_kernel, n_arrays=len(flat), shifts=shifts, inverse=inverse),
        grid=(pl.cdiv(tokens, block),),
        in_specs=[pl.BlockSpec((block, 1), lambda i: (i, 0)), pl.BlockSpec((2, h), lambda i: (0, 0))] + [slab(a) for a in flat],
        out_specs=[slab(a) for a in flat],
        out_shape=[jax.ShapeDtypeStruct(a.shape, a.dtype) for a in flat],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",)),
        cost_estimate=pl.CostEstimate(flops=4 * sum(a.size for a in flat), transcendentals=2 * tokens * h,
                                      bytes_accessed=2 * sum(a.size * a.dtype.itemsize for a in flat)),
        interpret=pltpu.InterpretParams() if interpret_enabled() else False,
    )(positions.reshape(tokens, 1).astype(jnp.int32), jnp.asarray(_lanes(spec, h)), *flat)
    return tuple(o.reshape(a.shape) for o, a in zip(out, arrays))


@functools.cache
def _differentiable(spec: RopeSpec, config: RopeTpuConfig, n_arrays: int):
    def rotate(arrays, positions, inverse):
        # vmap folds into the batch axis: one kernel over more tokens.
        def local(*xs):
            return tuple(_rotate(tuple(xs[:-1]), xs[-1], spec=spec, config=config, inverse=inverse))

        # The SPMD partitioner splits the launch over the batch, token and head axes (any mesh
        # axes; every array's heads the same number of ways).
        heads = ("b", "t", "h", None)

        def launch(arrays, positions):
            split = split_launch(local, (heads,) * len(arrays) + (("b", "t"),), ((heads, ()),) * len(arrays))
            return split(*arrays, positions)
        return fold_vmap_into_rows(launch, row_args=(0, 1))(arrays, positions)

    @jax.custom_vjp
    def run(arrays, positions):
        return rotate(arrays, positions, False)

    def run_fwd(arrays, positions):
        return run(arrays, positions), positions

    def run_bwd(positions, cotangents):
        grads = rotate(tuple(cotangents), positions, True)
        return tuple(grads), None  # integer positions: no gradient

    run.defvjp(run_fwd, run_bwd)
    return run


def rope(x, positions, *, spec: RopeSpec, config: RopeTpuConfig):
    return _differentiable(spec, config, 1)((x,), positions)[0]


def rope_qk(q, k, positions, *, spec: RopeSpec, config: RopeTpuConfig):
    if k.shape[2] == 0:
        return _differentiable(spec, config, 1)((q,), positions)[0], k
    return _differentiable(spec, config, 2)((q, k), positions)


def _supports(*arrays) -> str | None:
    for x in arrays:
        if jnp.dtype(x.dtype) not in _DTYPES:
            return f"dtype {jnp.dtype(x.dtype).name} is not one of float32/bfloat16/float16"
    return None


def _supports_rope(x, positions, *, spec):
    del positions, spec
    return _supports(x)


def _supports_rope_qk(q, k, positions, *, spec):
    del positions, spec
    return _supports(q, k)


ROPE = Implementation(fn=rope, platforms={"tpu"}, interpretable=True, supports=_supports_rope, config_type=RopeTpuConfig,
                      heuristic_config=heuristic_config, candidate_configs=candidate_configs)
ROPE_QK = Implementation(fn=rope_qk, platforms={"tpu"}, interpretable=True, supports=_supports_rope_qk,
                         config_type=RopeTpuConfig, heuristic_config=heuristic_config, candidate_configs=candidate_configs)
