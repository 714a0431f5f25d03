"""Linear + cross-entropy on GPUs: XLA matmuls (cuBLAS) around the Triton cross-entropy row kernels.

The chunk loop is kernels/common/linear_cross_entropy.py (its docstring has
the algorithm): per chunk of C tokens, logits = x_c @ W (+ b) as an XLA dot
(cuBLAS, f32 accumulation) stored in the matmul dtype (bf16 for bf16 x and W,
as the unfused `x @ W` would), then one Triton launch on that chunk,
`_loss_grad_kernel` of kernels/triton/cross_entropy.py: per row the online
log-sum-exp and the loss in f32, then the gradient d loss / d logits written
over the logits in place, ready for the next two matmuls (dx_c = g @ W^T,
dW += x_c^T @ g). For reduction="none" the backward reruns the loop with
`_grad_kernel`, given lse and the per-row cotangent.

Config: the row kernel's launch (`LinearCrossEntropyTritonConfig`). The default chunk
(2048 tokens of bf16 logits at V=128256) and the in-place gradient are measured against
XLA with materialised logits in benchmarks/results/linear_cross_entropy_H200_2026-11-22_bench.json.
Vocabulary-parallel (axis_name, W sharded over V inside shard_map): per chunk the row kernels'
`_stats_kernel` (the slice's partials, combined by kernels/common/losses.py: one pmax + one
psum per chunk) then `_grad_kernel` with the global lse (no fused loss-and-gradient kernel).
"""

from __future__ import annotations

import dataclasses
import functools

import jax.numpy as jnp

from forgeax.core.config import KernelConfig
from forgeax.core.registry import Implementation
from forgeax.kernels.common import linear_cross_entropy as chunked
from forgeax.kernels.common.losses import LossSpec, vocab_parallel_grad, vocab_parallel_loss, vocab_range
from forgeax.kernels.triton import cross_entropy as triton_ce


@dataclasses.dataclass(frozen=True, kw_only=True)
class LinearCrossEntropyTritonConfig(KernelConfig):
    """Launch of the cross-entropy row kernel on each chunk (as in CrossEntropyTritonConfig:
    block_v, a power of two, vocabulary elements per loop step; num_warps, an upper bound)."""

    block_v: int = 8192
    num_warps: int = 8

    def validate(self) -> None:
        super().validate()
        triton_ce.check_row_launch(self)


def heuristic_config(x, weight, targets, bias=None, *, spec: LossSpec, chunk_size=None) -> LinearCrossEntropyTritonConfig:
    del x, weight, targets, bias, spec, chunk_size
    return LinearCrossEntropyTritonConfig(block_v=triton_ce.heuristic_block_v())


def candidate_configs(x, weight, targets, bias=None, *, spec: LossSpec, chunk_size=None) -> list[LinearCrossEntropyTritonConfig]:
    del x, weight, targets, bias, spec, chunk_size
    return [LinearCrossEntropyTritonConfig(block_v=b, num_warps=w) for b in (2048, 4096, 8192, 16384) for w in (2, 4, 8, 16)]


def _loss(logits, t, spec, config):
    if spec.axis_name is not None:  # this device's vocabulary slice: partials + collectives
        return vocab_parallel_loss(functools.partial(triton_ce.stats_rows, spec=spec, config=config), logits, t, spec)
    return triton_ce.loss_rows(logits, t, spec, config)


def _loss_and_grad(logits, t, spec, config, dtype):
    if spec.axis_name is not None:  # the gradient needs the global lse: two kernels
        loss, lse = _loss(logits, t, spec, config)
        return loss, lse, _grad(logits, t, lse, jnp.ones_like(lse), spec, config, dtype)
    return triton_ce.loss_and_grad_rows(logits, t, spec, config, grad_dtype=dtype, in_place=True)


def _grad(logits, t, lse, scale, spec, config, dtype):
    if spec.axis_name is not None:
        vocab = vocab_range(spec, logits.shape[-1])[1]
        grad = functools.partial(triton_ce.grad_rows, spec=spec, config=config, grad_dtype=dtype, in_place=True, vocab=vocab)
        return vocab_parallel_grad(grad, logits, t, lse, scale, spec)
    return triton_ce.grad_rows(logits, t, lse, scale, spec, config, grad_dtype=dtype, in_place=True)


CHUNK_KERNELS = chunked.ChunkKernels(loss=_loss, loss_and_grad=_loss_and_grad, grad=_grad, f32_logits=False)


LINEAR_CROSS_ENTROPY = Implementation(
    fn=chunked.linear_cross_entropy_with(CHUNK_KERNELS, heuristic_config),
    platforms={"gpu"},
    interpretable=True,
    supports=chunked.supports_single_device,
    config_type=LinearCrossEntropyTritonConfig,
    heuristic_config=heuristic_config,
    candidate_configs=candidate_configs,
)
