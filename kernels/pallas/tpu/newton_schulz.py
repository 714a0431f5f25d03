"""Newton-Schulz orthogonalisation on TPUs: a Mosaic TPU upper-triangle Gram kernel, XLA's dot for the rest.

NOT RUN ON A TPU: no TPU was available while writing this. It is proven in Pallas' TPU
interpreter (tests/newton_schulz_test.py under FORGEAX_INTERPRET=1, against the XLA reference)
and by lowering for TPU (tests/lowering_newton_schulz_test.py); nothing here is measured.

Per step (kernels/common/newton_schulz.py has the math) on x [batch, M, K], M <= K:

    A = x x^T, B = c A A^T + b A   `_gram_kernel`, only the tiles (i, j) with i <= j
    x = B x + a x                  XLA's dot (the MXU at full rate; no symmetry to exploit)

The Gram kernel's grid is (batch, upper tiles, K / block_k); the tile list (i, j) arrives as
two scalar-prefetched int32 tables that its index maps read, so each grid step loads the row
blocks i and j of x, accumulates x_i x_j^T in an f32 VMEM scratch and writes the tile (with
the fused epilogue alpha acc + beta c_ij) at the last k step. The lower tiles are never
written: one XLA select mirrors the upper ones (an M^2 pass, small beside the M^2 K product).
Operands are zero-padded to whole blocks first (a padded row or column adds zeros).
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
from forgeax.kernels.common import newton_schulz as common
from forgeax.kernels.pallas.interpret import without_effects

_LANES = 128
_VMEM_LIMIT = 64 * 1024 * 1024


@dataclasses.dataclass(frozen=True, kw_only=True)
class NewtonSchulzTpuConfig(KernelConfig):
    """`block`: the square output tile of the Gram kernel; `block_k`: its reduction step.
    Both multiples of 128 (the lane width)."""

    block: int = 256
    block_k: int = 512

    def validate(self) -> None:
        super().validate()
        for name in ("block", "block_k"):
            if getattr(self, name) % _LANES:
                raise ValueError(f"{type(self).__name__}.{name}: expected a multiple of {_LANES}, got {getattr(self, name)}")


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def heuristic_config(g, *, spec) -> NewtonSchulzTpuConfig:
    del spec
    m, k = sorted(g.shape[-2:])
    return NewtonSchulzTpuConfig(block=min(256, _round_up(m, _LANES)), block_k=min(512, _round_up(k, _LANES)))


def candidate_configs(g, *, spec) -> list[NewtonSchulzTpuConfig]:
    del spec
    m, k = sorted(g.shape[-2:])
    out = []
    for block, block_k in ((128, 512), (256, 512), (256, 1024), (512, 512)):
        config = NewtonSchulzTpuConfig(block=min(block, _round_up(m, _LANES)), block_k=min(block_k, _round_up(k, _LANES)))
        if config not in out:
            out.append(config)
    return out


def _gram_kernel(tile_i, tile_j, left_ref, right_ref, *rest, alpha: float, beta: float, has_c: bool):
    c_ref, out_ref, acc_ref = rest if has_c else (None, *rest)
    del tile_i, tile_j
    k = pl.program_id(2)

    @pl.when(k == 0)
    def _():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    acc_ref[...] += jax.lax.dot_general(left_ref[...], right_ref[...], (((1,), (1,)), ((), ())),
                                        preferred_element_type=jnp.float32)

    @pl.when(k == pl.num_programs(2) - 1)
    def _():
        out = alpha * acc_ref[...]
        if has_c:
            out = out + beta * c_ref[...].astype(jnp.float32)
        out_ref[...] = out.astype(out_ref.dtype)


@functools.lru_cache(maxsize=None)
def _gram_call(batch: int, m: int, k: int, block: int, block_k: int, alpha: float, beta: float, has_c: bool,
               interpret: bool):
    """(tile_i, tile_j, x [batch, m, k], [c [batch, m, m]]) -> upper tiles of alpha x x^T + beta c."""
    tiles = len(common.upper_tiles(m // block)[0])
    row_block = lambda which: pl.BlockSpec((None, block, block_k), lambda b, t, kk, ti, tj: (b, (ti, tj)[which][t], kk))  # noqa: E731
    tile_spec = pl.BlockSpec((None, block, block), lambda b, t, kk, ti, tj: (b, ti[t], tj[t]))
    out_shape = jax.ShapeDtypeStruct((batch, m, m), common.ITERATION_DTYPE)
    call = pl.pallas_call(
        functools.partial(_gram_kernel, alpha=alpha, beta=beta, has_c=has_c),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(batch, tiles, k // block_k),
            in_specs=[row_block(0), row_block(1)] + ([tile_spec] if has_c else []),
            out_specs=tile_spec,
            scratch_shapes=[pltpu.VMEM((block, block), jnp.float32)],
        ),
        out_shape=out_shape,
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary"),
                                             vmem_limit_bytes=_VMEM_LIMIT),
        cost_estimate=pl.CostEstimate(flops=2 * batch * tiles * block * block * k, transcendentals=0,
                                      bytes_accessed=2 * batch * (2 * tiles * block * k + (2 if has_c else 1) * tiles * block * block)),
        interpret=pltpu.InterpretParams() if interpret else False,
    )
    return without_effects(call, out_shape) if interpret else call


def gram(x, c, alpha: float, beta: float, config: NewtonSchulzTpuConfig):
    """alpha x x^T (+ beta c) for x [batch, M, K] bf16: the kernel's upper tiles, mirrored by XLA."""
    batch, m, k = x.shape
    block = min(config.block, _round_up(m, _LANES))
    block_k = min(config.block_k, _round_up(k, _LANES))
    mp, kp = _round_up(m, block), _round_up(k, block_k)
    xp = jnp.pad(x, ((0, 0), (0, mp - m), (0, kp - k)))
    args = [xp, xp]
    if c is not None:
        args.append(jnp.pad(c, ((0, 0), (0, mp - m), (0, mp - m))))
    tile_i, tile_j = (jnp.asarray(t) for t in common.upper_tiles(mp // block))
    call = _gram_call(batch, mp, kp, block, block_k, float(alpha), float(beta), c is not None, interpret_enabled())
    upper = call(tile_i, tile_j, *args)[:, :m, :m]
    blocks = jnp.arange(m) // block
    return jnp.where(blocks[:, None] <= blocks[None, :], upper, jnp.swapaxes(upper, -1, -2))


def update(b, x, a: float, config: NewtonSchulzTpuConfig):
    del config
    return common.xla_update(b, x, a)


NEWTON_SCHULZ = Implementation(
    fn=common.newton_schulz_with(common.Kernels(gram=gram, update=update)),
    platforms={"tpu"},
    interpretable=True,
    config_type=NewtonSchulzTpuConfig,
    heuristic_config=heuristic_config,
    candidate_configs=candidate_configs,
)
