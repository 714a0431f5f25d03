"""Ragged (grouped) matmul as Mosaic TPU kernels (megablox-style), with interpreter support.

lhs `[M, K]` rows sorted by group, rhs `[G, K, N]`, group_sizes `[G]` int32.

Work items: each group visits the aligned block_m row blocks its rows overlap (a block shared by
two groups is visited once per group, rows outside the visiting group masked to zero). The item
table (group, row block, first/last visit of the output block) is built on device from
group_sizes and scalar-prefetched, so the BlockSpec index maps pick each item's lhs/rhs/out
blocks. The rows past sum(group_sizes) are one more pseudo-group that contributes zeros.

  * `_forward_kernel`: grid (N blocks, items, K blocks); an f32 VMEM accumulator lives across the
    consecutive items of one output row block and is stored at its last visit.
  * `_transposed_kernel`: tr[g] = lhs_g^T @ dout_g; grid (K blocks, N blocks, items), items of
    one group consecutive; an empty group gets one inactive item, which stores zeros.

d lhs = ragged_dot(dout, rhs^T) (the forward kernel on rhs swapped to `[G, N, K]`), d rhs is the
transposed kernel. Products accumulate in f32.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from forgeax.core.config import KernelConfig
from forgeax.core.registry import Implementation
from forgeax.core.runtime import interpret_enabled
from forgeax.kernels.common.ragged_dot import RaggedDotSpec, differentiable_ragged_dot, group_bounds

_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))


@dataclasses.dataclass(frozen=True, kw_only=True)
class RaggedDotTpuConfig(KernelConfig):
    """block_m: rows per item (a multiple of 16); block_k, block_n: K / N blocks (multiples of
    128; a dimension they do not divide is taken whole)."""

    block_m: int = 128
    block_k: int = 512
    block_n: int = 512

    def validate(self) -> None:
        super().validate()
        if self.block_m % 16:
            raise ValueError(f"RaggedDotTpuConfig.block_m: expected a multiple of 16, got {self.block_m}")
        for name in ("block_k", "block_n"):
            if getattr(self, name) % 128:
                raise ValueError(f"RaggedDotTpuConfig.{name}: expected a multiple of 128, got {getattr(self, name)}")


def heuristic_config(*args, **kwargs) -> RaggedDotTpuConfig:
    del args, kwargs
    return RaggedDotTpuConfig(block_m=16) if interpret_enabled() else RaggedDotTpuConfig()


def _block(dim: int, block: int) -> int:
    return block if dim % block == 0 else dim


def _flags(key):
    """(first, last) visit of each run of equal `key` values, int32."""
    prev = jnp.concatenate([key[:1] - 1, key[:-1]])
    nxt = jnp.concatenate([key[1:], key[-1:] + 1])
    return (key != prev).astype(jnp.int32), (key != nxt).astype(jnp.int32)


def _items(starts, ends, m: int, bm: int, *, keep_empty: bool):
    """(group, row block, active, count) of the work items, padded to a static length."""
    g = starts.shape[0]
    blocks = -(-m // bm)
    first = starts // bm
    last = jnp.maximum(ends - 1, 0) // bm
    count = jnp.where(ends > starts, last - first + 1, 0)
    if keep_empty:
        count = jnp.maximum(count, 1)
    cum_end = jnp.cumsum(count)
    length = blocks + g
    t = jnp.arange(length, dtype=jnp.int32)
    group = jnp.minimum(jnp.searchsorted(cum_end, t, side="right"), g - 1).astype(jnp.int32)
    active = (t < cum_end[-1]) & (ends[group] > starts[group])
    block = jnp.minimum(first[group] + t - (cum_end[group] - count[group]), jnp.minimum(last[group], blocks - 1))
    return group, block.astype(jnp.int32), active.astype(jnp.int32)


def _forward_kernel(group_ref, block_ref, first_ref, last_ref, starts_ref, ends_ref, lhs_ref, rhs_ref, out_ref, acc_ref,
                    *, groups: int, bm: int, k_steps: int):
    w, k = pl.program_id(1), pl.program_id(2)
    g = group_ref[w]

    @pl.when((k == 0) & (first_ref[w] == 1))
    def _():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    rows = block_ref[w] * bm + jax.lax.broadcasted_iota(jnp.int32, (bm, 1), 0)
    inside = (rows >= starts_ref[g]) & (rows < ends_ref[g]) & (g < groups)
    a = jnp.where(inside, lhs_ref[...], jnp.zeros_like(lhs_ref[...]))
    acc_ref[...] += jnp.dot(a, rhs_ref[...], preferred_element_type=jnp.float32)

    @pl.when((k == k_steps - 1) & (last_ref[w] == 1))
    def _():
        out_ref[...] = acc_ref[...].astype(out_ref.dtype)


def forward(lhs, rhs, group_sizes, *, out_dtype, config: RaggedDotTpuConfig, transpose_rhs: bool):
    if transpose_rhs:
        rhs = jnp.swapaxes(rhs, 1, 2)
    rhs = rhs.astype(lhs.dtype)
    m, k = lhs.shape
    g, _, n = rhs.shape
    bm, bk, bn = config.block_m, _block(k, config.block_k), _block(n, config.block_n)
    starts, ends = group_bounds(group_sizes, m)
    starts = jnp.concatenate([starts, ends[-1:]])  # the tail rows as group G (zeros)
    ends = jnp.concatenate([ends, jnp.full((1,), m, jnp.int32)])
    group, block, _ = _items(starts, ends, m, bm, keep_empty=False)
    first, last = _flags(block)
    k_steps = k // bk
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=6,
        grid=(n // bn, group.shape[0], k_steps),
        in_specs=[pl.BlockSpec((bm, bk), lambda j, w, kk, gr, bl, *_: (bl[w], kk)),
                  pl.BlockSpec((None, bk, bn), lambda j, w, kk, gr, bl, *_: (jnp.minimum(gr[w], g - 1), kk, j))],
        out_specs=pl.BlockSpec((bm, bn), lambda j, w, kk, gr, bl, *_: (bl[w], j)),
        scratch_shapes=[pltpu.VMEM((bm, bn), jnp.float32)],
    )
    kernel = functools.partial(_forward_kernel, groups=g, bm=bm, k_steps=k_steps)
    return pl.pallas_call(
        kernel, grid_spec=grid_spec, out_shape=jax.ShapeDtypeStruct((m, n), out_dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary", "arbitrary")),
        interpret=pltpu.InterpretParams() if interpret_enabled() else False,
    )(group, block, first, last, starts, ends, lhs, rhs)


def _transposed_kernel(group_ref, block_ref, active_ref, first_ref, last_ref, starts_ref, ends_ref, lhs_ref, dout_ref,
                       out_ref, acc_ref, *, bm: int):
    w = pl.program_id(2)
    g = group_ref[w]

    @pl.when(first_ref[w] == 1)
    def _():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    rows = block_ref[w] * bm + jax.lax.broadcasted_iota(jnp.int32, (bm, 1), 0)
    inside = (rows >= starts_ref[g]) & (rows < ends_ref[g]) & (active_ref[w] == 1)
    a = jnp.where(inside, lhs_ref[...], jnp.zeros_like(lhs_ref[...]))
    d = jnp.where(inside, dout_ref[...], jnp.zeros_like(dout_ref[...]))
    acc_ref[...] += jax.lax.dot_general(a, d, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32)

    @pl.when(last_ref[w] == 1)
    def _():
        out_ref[...] = acc_ref[...].astype(out_ref.dtype)


def transposed(lhs, dout, group_sizes, *, out_dtype, config: RaggedDotTpuConfig):
    dout = dout.astype(lhs.dtype)
    m, k = lhs.shape
    n = dout.shape[1]
    g = group_sizes.shape[0]
    bm, bk, bn = config.block_m, _block(k, config.block_k), _block(n, config.block_n)
    starts, ends = group_bounds(group_sizes, m)
    group, block, active = _items(starts, ends, m, bm, keep_empty=True)
    first, last = _flags(group)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=7,
        grid=(k // bk, n // bn, group.shape[0]),
        in_specs=[pl.BlockSpec((bm, bk), lambda i, j, w, gr, bl, *_: (bl[w], i)),
                  pl.BlockSpec((bm, bn), lambda i, j, w, gr, bl, *_: (bl[w], j))],
        out_specs=pl.BlockSpec((None, bk, bn), lambda i, j, w, gr, bl, *_: (gr[w], i, j)),
        scratch_shapes=[pltpu.VMEM((bk, bn), jnp.float32)],
    )
    return pl.pallas_call(
        functools.partial(_transposed_kernel, bm=bm), grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct((g, k, n), out_dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary")),
        interpret=pltpu.InterpretParams() if interpret_enabled() else False,
    )(group, block, active, first, last, starts, ends, lhs, dout)


_RAGGED_DOT, _RAGGED_DOT_T = differentiable_ragged_dot(forward, transposed)


def ragged_dot(lhs, rhs, group_sizes, *, spec: RaggedDotSpec, config: RaggedDotTpuConfig):
    return _RAGGED_DOT(lhs, rhs, group_sizes, jnp.dtype(spec.out_dtype), config)


def ragged_dot_transposed(lhs, dout, group_sizes, *, spec: RaggedDotSpec, config: RaggedDotTpuConfig):
    return _RAGGED_DOT_T(lhs, dout, group_sizes, jnp.dtype(spec.out_dtype), config)


def supports(lhs, rhs, group_sizes, *, spec) -> str | None:
    del rhs, group_sizes, spec
    if jnp.dtype(lhs.dtype) not in _DTYPES:
        return f"lhs dtype {jnp.dtype(lhs.dtype).name} is not float32/bfloat16"
    if 0 in lhs.shape:
        return "empty lhs"
    return None


RAGGED_DOT = Implementation(fn=ragged_dot, platforms={"tpu"}, interpretable=True, supports=supports,
                            config_type=RaggedDotTpuConfig, heuristic_config=heuristic_config)
RAGGED_DOT_TRANSPOSED = Implementation(fn=ragged_dot_transposed, platforms={"tpu"}, interpretable=True, supports=supports,
                                       config_type=RaggedDotTpuConfig, heuristic_config=heuristic_config)
