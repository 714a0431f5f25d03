"""Gated MLP as Mosaic TPU Pallas kernels: a blocked dual matmul with the gating in its epilogue.

Shapes (kernels/common/gated_mlp.py folds the leading axes and holds the custom_vjp): x
`[M, K]`, w_gate / w_up `[K, N]` (a fused `[K, 2, N]` weight is split into the two first),
dh `[M, N]`. The grid is (M / block_m, N / block_n, K / block_k), K innermost ("arbitrary"):
each step adds x_blk @ w_gate_blk and x_blk @ w_up_blk into two f32 VMEM accumulators (the x
block is loaded once for both), and the last K step runs the epilogue:

  forward:  h = act(gate) * up                                     -> [M, N] in x's dtype
  backward: d_gate = dh * up * act'(gate), d_up = dh * act(gate)   -> two [M, N] (+ h if asked)

so the `[M, 2N]` pre-activations never reach HBM. The backward's plain products (dx, dW,
dw_down, dh) are XLA dots in the shared shell.

TPU block rules: the last two block dims must be multiples of (8, 128) (16 rows for 16-bit
types). Arrays whose sizes are not multiples of the blocks are zero-padded first (zeros in K
add nothing; padded rows and columns are sliced off): a copy, the price of simplicity here.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from forgeax.core.config import KernelConfig
from forgeax.core.registry import Implementation
from forgeax.core.runtime import interpret_enabled
from forgeax.kernels.common.gated_mlp import activate_and_derivative, differentiable_gated_mlp, split_weights, supports_float_rows
from forgeax.kernels.pallas.interpret import without_effects

_F32 = jnp.float32
_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
_VMEM_LIMIT = 32 << 20  # the scoped VMEM asked for (v5e's default is 16 MiB; current chips have >= 64 MiB)


@dataclasses.dataclass(frozen=True, kw_only=True)
class GatedMLPTpuConfig(KernelConfig):
    """block_m (a multiple of 16), block_n and block_k (multiples of 128): the grid's tiles.
    Defaults: 256 x 256 output tiles over K steps of 512, about 3 MiB of VMEM in bf16 with
    double-buffered inputs and two f32 accumulators."""

    block_m: int = 256
    block_n: int = 256
    block_k: int = 512

    def validate(self) -> None:
        super().validate()
        if self.block_m % 16:
            raise ValueError(f"GatedMLPTpuConfig.block_m: expected a multiple of 16, got {self.block_m}")
        for name in ("block_n", "block_k"):
            if getattr(self, name) % 128:
                raise ValueError(f"GatedMLPTpuConfig.{name}: expected a multiple of 128, got {getattr(self, name)}")


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def _fit(config: GatedMLPTpuConfig, m: int, n: int, k: int) -> GatedMLPTpuConfig:
    return config.replace(block_m=min(config.block_m, _round_up(m, 16)), block_n=min(config.block_n, _round_up(n, 128)),
                          block_k=min(config.block_k, _round_up(k, 128)))


def _dims(x, w_gate):
    return int(math.prod(x.shape[:-1])), int(w_gate.shape[-1]), int(x.shape[-1])


def heuristic_config(x, w_gate, w_up, w_down=None, *, spec) -> GatedMLPTpuConfig:
    del w_up, w_down, spec
    base = GatedMLPTpuConfig(block_m=128, block_n=128, block_k=128) if interpret_enabled() else GatedMLPTpuConfig()
    return _fit(base, *_dims(x, w_gate))


def candidate_configs(x, w_gate, w_up, w_down=None, *, spec) -> list[GatedMLPTpuConfig]:
    dims = _dims(x, w_gate)
    out = [heuristic_config(x, w_gate, w_up, w_down, spec=spec)]
    for bm, bn, bk in ((512, 256, 512), (256, 512, 512), (512, 512, 256), (128, 256, 1024), (256, 256, 1024)):
        cfg = _fit(GatedMLPTpuConfig(block_m=bm, block_n=bn, block_k=bk), *dims)
        if cfg not in out:
            out.append(cfg)
    return out


# ----------------------------------------------------------------------------- kernels


def _accumulate(x_ref, wg_ref, wu_ref, acc_g, acc_u, precision):
    @pl.when(pl.program_id(2) == 0)
    def _():
        acc_g[...] = jnp.zeros_like(acc_g)
        acc_u[...] = jnp.zeros_like(acc_u)

    x = x_ref[...]
    acc_g[...] += jnp.dot(x, wg_ref[...], preferred_element_type=_F32, precision=precision)
    acc_u[...] += jnp.dot(x, wu_ref[...], preferred_element_type=_F32, precision=precision)


def _forward_kernel(x_ref, wg_ref, wu_ref, h_ref, acc_g, acc_u, *, activation, precision):
    _accumulate(x_ref, wg_ref, wu_ref, acc_g, acc_u, precision)

    @pl.when(pl.program_id(2) == pl.num_programs(2) - 1)
    def _():
        a, _ = activate_and_derivative(acc_g[...], activation)
        h_ref[...] = (a * acc_u[...]).astype(h_ref.dtype)


def _backward_kernel(x_ref, wg_ref, wu_ref, dh_ref, dg_ref, du_ref, *rest, activation, precision, want_h):
    h_ref, acc_g, acc_u = rest if want_h else (None, *rest)
    _accumulate(x_ref, wg_ref, wu_ref, acc_g, acc_u, precision)

    @pl.when(pl.program_id(2) == pl.num_programs(2) - 1)
    def _():
        a, da = activate_and_derivative(acc_g[...], activation)
        dh = dh_ref[...].astype(_F32)
        up = acc_u[...]
        dg_ref[...] = (dh * up * da).astype(dg_ref.dtype)
        du_ref[...] = (dh * a).astype(du_ref.dtype)
        if want_h:
            h_ref[...] = (a * up).astype(h_ref.dtype)


# ----------------------------------------------------------------------------- launches


def _pad(a, rows: int, cols: int):
    return a if a.shape == (rows, cols) else jnp.pad(a, ((0, rows - a.shape[0]), (0, cols - a.shape[1])))


def _call(kernel, x, w_gate, w_up, extra, n_out, config, interpret):
    """Pads, launches `kernel` on (x, w_gate, w_up, *extra [M, N] arrays) and returns its n_out
    [M, N] outputs, unpadded."""
    w_gate, w_up = split_weights(w_gate, w_up)
    (m, k), n = x.shape, w_gate.shape[1]
    cfg = _fit(config, m, n, k)
    bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
    mp, np_, kp = _round_up(m, bm), _round_up(n, bn), _round_up(k, bk)
    args = (_pad(x, mp, kp), _pad(w_gate, kp, np_), _pad(w_up, kp, np_), *(_pad(e, mp, np_) for e in extra))
    x_spec = pl.BlockSpec((bm, bk), lambda i, j, kk: (i, kk))
    w_spec = pl.BlockSpec((bk, bn), lambda i, j, kk: (kk, j))
    mn_spec = pl.BlockSpec((bm, bn), lambda i, j, kk: (i, j))
    out_shape = tuple(jax.ShapeDtypeStruct((mp, np_), x.dtype) for _ in range(n_out))
    itemsize = jnp.dtype(x.dtype).itemsize
    call = pl.pallas_call(
        kernel,
        grid=(mp // bm, np_ // bn, kp // bk),
        in_specs=[x_spec, w_spec, w_spec] + [mn_spec] * len(extra),
        out_specs=tuple(mn_spec for _ in range(n_out)),
        out_shape=out_shape,
        scratch_shapes=[pltpu.VMEM((bm, bn), _F32), pltpu.VMEM((bm, bn), _F32)],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary"),
                                             vmem_limit_bytes=_VMEM_LIMIT),
        cost_estimate=pl.CostEstimate(flops=4 * mp * np_ * kp, transcendentals=mp * np_,
                                      bytes_accessed=itemsize * (mp * kp + 2 * kp * np_ + (n_out + len(extra)) * mp * np_)),
        interpret=pltpu.InterpretParams() if interpret else False,
    )
    if interpret:
        call = without_effects(call, out_shape)
    return tuple(o[:m, :n] for o in call(*args))


def _precision(dtype):
    return jax.lax.Precision.HIGHEST if jnp.dtype(dtype) == _F32 else jax.lax.Precision.DEFAULT


def forward(x, w_gate, w_up, *, activation, config):
    kernel = functools.partial(_forward_kernel, activation=activation, precision=_precision(x.dtype))
    return _call(kernel, x, w_gate, w_up, (), 1, config, interpret_enabled())[0]


def backward(x, w_gate, w_up, dh, *, activation, config, want_h):
    kernel = functools.partial(_backward_kernel, activation=activation, precision=_precision(x.dtype), want_h=want_h)
    outs = _call(kernel, x, w_gate, w_up, (dh.astype(x.dtype),), 3 if want_h else 2, config, interpret_enabled())
    return jnp.concatenate(outs[:2], axis=1), outs[2] if want_h else None


_DIFFERENTIABLE = differentiable_gated_mlp(forward, backward)


def gated_mlp(x, w_gate, w_up, w_down=None, *, spec, config: GatedMLPTpuConfig):
    return _DIFFERENTIABLE(x, w_gate, w_up, w_down, spec, config)


GATED_MLP = Implementation(
    fn=gated_mlp,
    platforms={"tpu"},
    interpretable=True,
    supports=supports_float_rows,
    config_type=GatedMLPTpuConfig,
    heuristic_config=heuristic_config,
    candidate_configs=candidate_configs,
)
