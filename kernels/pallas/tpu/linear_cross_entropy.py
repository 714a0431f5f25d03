"""Linear + cross-entropy on TPUs: XLA matmuls (the MXU) around the Mosaic TPU cross-entropy row kernels.

NOT RUN ON A TPU: no TPU was available while writing this. It is proven in
Pallas' TPU interpreter (tests/linear_cross_entropy_test.py under
FORGEAX_INTERPRET=1, against the XLA reference) and by lowering for TPU only
(tests/lowering_pallas_tpu_linear_cross_entropy_test.py); nothing here is
measured, and the default chunk is reasoned about, not tuned.

The chunk loop is kernels/common/linear_cross_entropy.py (its docstring has
the algorithm): per chunk of C tokens, logits = x_c @ W (+ b) as an XLA dot
with f32 accumulation, kept in f32 (as "xla_chunked" does, so the loss is the
one of `ops.cross_entropy` on f32 logits), then the kernels of
kernels/pallas/tpu/cross_entropy.py on that [C, V] chunk:
  * `_fwd_kernel` (loss_rows): per row the online log-sum-exp and the loss,
    (loss, lse) in f32;
  * `_bwd_kernel` (grad_rows): g = scale * d loss / d logits recomputed from
    lse, written in the matmul dtype (bf16 for bf16 x and W), ready for
    dx_c = g @ W^T and dW += x_c^T @ g.
"mean"/"sum" run both kernels per chunk (scale 1), inside the forward;
"none" runs the first in the forward and the second in the backward's rerun,
scaled by the per-token cotangent. So the chunk's logits are read twice and
the gradient written once, the HBM floor for two kernels; there is no fused
loss-and-gradient kernel (one read fewer), as there is in Triton.

Config: the row kernels' tile (`CrossEntropyPallasTpuConfig`, as for cross_entropy).
Default chunk: 1024 tokens at V=128256 (512 MiB of f32 logits + 256 MiB of
bf16 gradient), from the shared default_chunk_size.
Vocabulary-parallel (axis_name, W sharded over V inside shard_map): `_fwd_kernel(partials=True)`
per chunk, combined by kernels/common/losses.py (one pmax + one psum), then `_bwd_kernel` with
the global lse.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp

from forgeax.core.registry import Implementation
from forgeax.kernels.common import linear_cross_entropy as chunked
from forgeax.kernels.common.losses import LossSpec, vocab_parallel_grad, vocab_parallel_loss, vocab_range
from forgeax.kernels.pallas.tpu import cross_entropy as tpu_ce
from forgeax.kernels.pallas.tpu.cross_entropy import CrossEntropyPallasTpuConfig


def heuristic_config(x, weight, targets, bias=None, *, spec: LossSpec, chunk_size=None) -> CrossEntropyPallasTpuConfig:
    """The row kernels' tile on each chunk: the cross-entropy backend's default."""
    del x, weight, targets, bias, spec, chunk_size
    return CrossEntropyPallasTpuConfig(block_v=tpu_ce.heuristic_block_v())


def candidate_configs(x, weight, targets, bias=None, *, spec: LossSpec, chunk_size=None) -> list[CrossEntropyPallasTpuConfig]:
    del x, weight, bias, chunk_size
    return tpu_ce.candidate_configs(None, targets, spec=spec)


def _loss(logits, t, spec, config):
    if spec.axis_name is not None:  # this device's vocabulary slice: partials + collectives
        return vocab_parallel_loss(functools.partial(tpu_ce.stats_rows, spec=spec, config=config), logits, t, spec)
    return tpu_ce.loss_rows(logits, t, spec, config)


def _grad(logits, t, lse, scale, spec, config, dtype):
    if spec.axis_name is not None:
        vocab = vocab_range(spec, logits.shape[-1])[1]
        grad = functools.partial(tpu_ce.grad_rows, spec=spec, config=config, grad_dtype=dtype, vocab=vocab)
        return vocab_parallel_grad(grad, logits, t, lse, scale, spec)
    return tpu_ce.grad_rows(logits, t, lse, scale, spec, config, grad_dtype=dtype)


def _loss_and_grad(logits, t, spec, config, dtype):
    loss, lse = _loss(logits, t, spec, config)
    # Cotangent 1 per row; the kernel zeroes ignored rows itself.
    return loss, lse, _grad(logits, t, lse, jnp.ones_like(lse), spec, config, dtype)


CHUNK_KERNELS = chunked.ChunkKernels(loss=_loss, loss_and_grad=_loss_and_grad, grad=_grad, f32_logits=True)


LINEAR_CROSS_ENTROPY = Implementation(
    fn=chunked.linear_cross_entropy_with(CHUNK_KERNELS, heuristic_config),
    platforms={"tpu"},
    interpretable=True,
    supports=chunked.supports_single_device,
    config_type=CrossEntropyPallasTpuConfig,
    heuristic_config=heuristic_config,
    candidate_configs=candidate_configs,
)
