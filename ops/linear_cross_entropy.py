"""Fused linear layer + softmax cross-entropy: `linear_cross_entropy`."""

from __future__ import annotations

from collections.abc import Hashable

from jaxtyping import Array, Float, Integer

from forgeax.core import KernelConfig, Selection, define_op
from forgeax.ops import checks
from forgeax.ops.cross_entropy import check_targets, loss_spec


LINEAR_CROSS_ENTROPY = define_op(
    "linear_cross_entropy",
    {
        "xla": "forgeax.kernels.xla.linear_cross_entropy:LINEAR_CROSS_ENTROPY",
        "xla_chunked": "forgeax.kernels.xla.linear_cross_entropy:LINEAR_CROSS_ENTROPY_CHUNKED",
        "triton": "forgeax.kernels.triton.linear_cross_entropy:LINEAR_CROSS_ENTROPY",
        "pallas_gpu": "forgeax.kernels.pallas.gpu.linear_cross_entropy:LINEAR_CROSS_ENTROPY",
        "pallas_tpu": "forgeax.kernels.pallas.tpu.linear_cross_entropy:LINEAR_CROSS_ENTROPY",
    },
    selection=Selection.load("forgeax.ops", "rules/linear_cross_entropy.json"),
)


def _check(x, weight, targets, bias, chunk_size) -> None:
    checks.floating_array("x", x, min_rank=1)
    checks.floating_array("weight", weight)
    if weight.ndim != 2:
        raise ValueError(f"weight: expected shape [H, V] (2 axes), got {tuple(weight.shape)}")
    if weight.shape[0] != x.shape[-1]:
        raise ValueError(f"weight: expected {x.shape[-1]} rows (x's last axis H), got shape {tuple(weight.shape)}")
    if weight.shape[1] == 0:
        raise ValueError(f"weight: expected a non-empty vocabulary axis, got shape {tuple(weight.shape)}")
    if bias is not None:
        checks.floating_array("bias", bias)
        if tuple(bias.shape) != (weight.shape[1],):
            raise ValueError(f"bias: expected None or shape {(weight.shape[1],)} (weight's vocabulary axis), got {tuple(bias.shape)}")
    check_targets(targets, tuple(x.shape[:-1]), "x's")
    if chunk_size is not None:
        if isinstance(chunk_size, bool) or not isinstance(chunk_size, int):
            raise TypeError(f"chunk_size: expected None or a Python int, got {chunk_size!r}")
        if chunk_size <= 0:
            raise ValueError(f"chunk_size: expected None or an int > 0, got {chunk_size!r}")


def linear_cross_entropy(
    x: Float[Array, "*B H"],
    weight: Float[Array, "H V"],
    targets: Integer[Array, "*B"],
    *,
    bias: Float[Array, "V"] | None = None,
    label_smoothing: float = 0.0,
    ignore_index: int = -100,
    reduction: str = "mean",
    z_loss: float = 0.0,
    logit_soft_cap: float | None = None,
    axis_name: Hashable | None = None,
    chunk_size: int | None = None,
    backend: str | None = None,
    config: KernelConfig | None = None,
) -> Float[Array, "..."]:
    """Softmax cross-entropy of the logits `x @ weight + bias`, without materialising them.

    Exactly `ops.cross_entropy(x @ weight + bias, targets, ...)` with the
    logits computed with f32 accumulation (`preferred_element_type=float32`;
    the "triton" backend then stores them in the matmul dtype, bf16 for bf16
    inputs, as `x @ weight` would, before the f32 loss);
    see `ops.cross_entropy` for the loss, the options and their semantics
    (ignored and out-of-range targets, reductions, all-ignored mean = 0).
    The chunked backends ("xla_chunked", "triton") never hold more than
    `chunk_size` rows of logits: per chunk they compute the logits, the loss
    and its gradient with respect to the logits, and immediately fold that into
    dx and dW, so a forward+backward costs the three matmuls of the unfused
    version with O(chunk_size * V) extra memory.

    `axis_name`: vocabulary-parallel inside `shard_map`. `weight` (and `bias`)
    hold this device's contiguous slice of the vocabulary ([H, V / n], in mesh
    order along `axis_name`); x and targets (global class ids) are the same on
    every device. Each device computes its logits slice; the cross-entropy
    statistics are combined with collectives, so the loss and the gradients
    equal the unsharded ones (dx is summed over the devices).

    Args:
      x: `[..., H]` f32/bf16/f16.
      weight: `[H, V]` f32/bf16/f16 (the matmuls run in the promoted dtype of x
        and weight, accumulating in f32).
      targets: `[...]` (x's shape without its last axis), integer class ids.
      bias: None or `[V]`.
      label_smoothing, ignore_index, reduction, z_loss, logit_soft_cap: as in
        `ops.cross_entropy`.
      axis_name: None, or the `shard_map` mesh axis the vocabulary is split over.
      chunk_size: tokens per chunk for the chunked backends (need not divide
        the number of tokens). None: a chunk's logits stay under ~512 MiB
        (at V=128256: 1024 tokens of f32 logits in xla_chunked, 2048 of bf16
        logits in triton), but it has at least 512 tokens (matmul
        efficiency), and the chunks are evened out to pad the fewest tokens.
        The reference ignores it.
      backend: None (best for this device), "xla" (materialises the logits),
        "xla_chunked", "triton", "pallas_gpu", "pallas_tpu" ("pallas"), or a
        user-registered name.
      config: None (a tuned or heuristic config for the call), or a kernel config
        of the chosen backend: `LinearCrossEntropyTritonConfig` (the row kernel's
        block_v, num_warps), `LinearCrossEntropyPallasGpuConfig` (warpgroups,
        block_n, stages) or `CrossEntropyPallasTpuConfig` (block_rows, block_v),
        each in its backend's kernels/<backend>/ file. With backend=None only
        backends taking that config type are considered; "xla" and
        "xla_chunked" take none. `forgeax.explain` shows the config a call runs with.

    Returns:
      f32: a scalar for "mean"/"sum"; for "none" an array of targets' shape.
      Differentiable with respect to x, weight and bias (gradients in their
      dtypes); targets get no gradient.
    """
    _check(x, weight, targets, bias, chunk_size)
    spec = loss_spec(label_smoothing, ignore_index, reduction, z_loss, logit_soft_cap, axis_name)
    return LINEAR_CROSS_ENTROPY(x, weight, targets, bias, spec=spec, chunk_size=chunk_size, backend=backend, config=config)
