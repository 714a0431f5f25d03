"""Normalisation over the last axis: `rms_norm` and `layer_norm`."""

from __future__ import annotations

from jaxtyping import Array, Float

from forgeax.core import KernelConfig, Selection, define_op
from forgeax.ops import checks

_BACKENDS = "forgeax.kernels.{}.norms:{}"


def _features(args, kwargs) -> dict:
    """What the selection rules (rules/rms_norm.json, rules/layer_norm.json) read of a call."""
    del kwargs
    x = args[0]
    return {"dim": int(x.shape[-1]), "rows": int(x.size // max(x.shape[-1], 1)), "dtype": x.dtype.name}


def _backends(attr: str) -> dict[str, str]:
    modules = {"xla": "xla", "triton": "triton", "pallas_gpu": "pallas.gpu", "pallas_tpu": "pallas.tpu"}
    return {name: _BACKENDS.format(module, attr) for name, module in modules.items()}


RMS_NORM = define_op("rms_norm", _backends("RMS_NORM"), selection=Selection.load("forgeax.ops", "rules/rms_norm.json"),
                     features=_features)
LAYER_NORM = define_op("layer_norm", _backends("LAYER_NORM"), selection=Selection.load("forgeax.ops", "rules/layer_norm.json"),
                       features=_features)


def _check(x, params: dict, eps: float) -> None:
    checks.floating_array("x", x, min_rank=1)
    for name, p in params.items():
        if p is None:
            continue
        checks.floating_array(name, p, min_rank=1)
        if p.shape != (x.shape[-1],):
            raise ValueError(f"{name}: expected shape ({x.shape[-1]},) (the last axis of x {tuple(x.shape)}), got {tuple(p.shape)}")
    checks.positive_float("eps", eps)


def rms_norm(
    x: Float[Array, "*B D"],
    scale: Float[Array, " D"],
    *,
    eps: float = 1e-6,
    backend: str | None = None,
    config: KernelConfig | None = None,
) -> Float[Array, "*B D"]:
    """Root-mean-square normalisation over the last axis.

        y = x / sqrt(mean(x^2, axis=-1) + eps) * scale

    Args:
      x: `[..., D]`, f32/bf16/f16; any number of leading axes.
      scale: `[D]` learnable gain (any float dtype; used in f32).
      eps: added to the mean square before the square root; > 0.
      backend: None (best for this device), "xla", "triton", "pallas",
        "pallas_gpu", "pallas_tpu", or a user-registered name.
      config: the chosen kernel's config (e.g. `forgeax.kernels.triton.norms.TritonNormConfig`);
        with backend=None only backends taking that config type are considered.

    Returns:
      `[..., D]` in x's dtype. Statistics are computed in f32. Differentiable
      with respect to x and scale.
    """
    _check(x, {"scale": scale}, eps)
    return RMS_NORM(x, scale, eps=float(eps), backend=backend, config=config)


def layer_norm(
    x: Float[Array, "*B D"],
    scale: Float[Array, " D"],
    offset: Float[Array, " D"] | None = None,
    *,
    eps: float = 1e-6,
    backend: str | None = None,
    config: KernelConfig | None = None,
) -> Float[Array, "*B D"]:
    """Layer normalisation over the last axis.

        y = (x - mean(x)) / sqrt(var(x) + eps) * scale + offset

    with the biased variance (mean of squared deviations), as in
    `flax.linen.LayerNorm` and `torch.nn.LayerNorm`.

    Args:
      x: `[..., D]`, f32/bf16/f16.
      scale: `[D]` gain. offset: `[D]` bias, or None for no bias.
      eps: > 0. backend, config: as for `rms_norm`.

    Returns:
      `[..., D]` in x's dtype; statistics in f32. Differentiable with respect
      to x, scale and offset.
    """
    _check(x, {"scale": scale, "offset": offset}, eps)
    return LAYER_NORM(x, scale, offset, eps=float(eps), backend=backend, config=config)

