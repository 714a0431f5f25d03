"""Newton-Schulz orthogonalisation with a symmetric Gram-product Triton kernel.

Each step of the iteration (kernels/common/newton_schulz.py) on x [batch, M, K] (M <= K) runs

    A = x x^T          `_gram_kernel`: only tiles (i, j) with i <= j, each also stored mirrored
    B = c A A^T + b A  `_gram_kernel` again (A A = A A^T: A is symmetric), b A fused in its epilogue
    x = B x + a x      `_update_kernel` (a tiled matmul with a x fused in), or XLA's dot

The two Gram products are symmetric, so computing only the upper triangle of tiles saves
(T - 1) / 2T of their FLOPs (T = cdiv(M, block) tiles per side): per step the FLOPs fall from
2 M^2 K + 2 M^3 + 2 M^2 K to about M^2 K + M^3 + 2 M^2 K. A diagonal tile is stored once; an
off-diagonal one twice (the tile and its transpose), so A and B are exactly symmetric off the
diagonal tiles. The tile list (i, j) is a small int32 table, one program per tile and matrix.
Products take bf16 operands with f32 accumulation; the epilogue is f32; outputs are bf16.
The gradient is the reference's autodiff (kernels/common/newton_schulz.py), not a kernel.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import triton
import triton.language as tl

from forgeax.core.config import KernelConfig
from forgeax.core.registry import Implementation
from forgeax.core.runtime import interpret_enabled
from forgeax.kernels.common import newton_schulz as common
from forgeax.kernels.triton.launch import triton_call

_BLOCKS = (16, 32, 64, 128, 256)


@dataclasses.dataclass(frozen=True, kw_only=True)
class NewtonSchulzTritonConfig(KernelConfig):
    """Tiles of the two kernels. `gram_block`: the square output tile of the Gram kernel;
    `block_k`: the reduction step of both; `update_block_m/n`: the update kernel's output tile;
    `group_m`: output row-tiles per L2 group of the update kernel; `triton_update`: run the
    update product in Triton (False: XLA's dot, i.e. cuBLAS)."""

    gram_block: int = 128
    block_k: int = 64
    update_block_m: int = 128
    update_block_n: int = 128
    group_m: int = 8
    num_warps: int = 8
    num_stages: int = 3
    triton_update: bool = False

    def validate(self) -> None:
        super().validate()
        for name in ("gram_block", "block_k", "update_block_m", "update_block_n"):
            if getattr(self, name) not in _BLOCKS:
                raise ValueError(f"{type(self).__name__}.{name}: expected one of {_BLOCKS}, got {getattr(self, name)}")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"{type(self).__name__}.num_warps: expected 1, 2, 4, 8 or 16, got {self.num_warps}")


def _fit(size: int, block: int) -> int:
    """The block, shrunk (to >= 16, a power of two) when the dimension is smaller."""
    return max(16, min(block, triton.next_power_of_2(size)))


def heuristic_config(g, *, spec) -> NewtonSchulzTritonConfig:
    del spec
    m = min(g.shape[-2:])
    return NewtonSchulzTritonConfig(gram_block=_fit(m, 128), block_k=_fit(m, 64), update_block_m=_fit(m, 128))


def candidate_configs(g, *, spec) -> list[NewtonSchulzTritonConfig]:
    del spec
    m = min(g.shape[-2:])
    out = []
    for block, block_k, warps, stages, triton_update in (
        (128, 64, 8, 3, False), (128, 64, 8, 4, False), (128, 32, 4, 4, False), (64, 64, 4, 4, False),
        (256, 64, 8, 3, False), (128, 64, 8, 3, True), (128, 64, 8, 4, True),
    ):
        config = NewtonSchulzTritonConfig(gram_block=_fit(m, block), block_k=block_k, num_warps=warps,
                                          num_stages=stages, triton_update=triton_update)
        if config not in out:
            out.append(config)
    return out


# ----------------------------------------------------------------------------- kernels


@triton.jit
def _dot(a, b, acc, INTERPRET: tl.constexpr):
    """acc + a @ b. In the interpreter the operands go to f32 first: Triton 3.6's interpreter
    multiplies the raw uint16 bit patterns of bf16 operands (exact: bf16 products fit f32)."""
    if INTERPRET:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a, b, acc)


@triton.jit
def _gram_kernel(
    X, C, TILE_I, TILE_J,  # x [batch, M, K], c [batch, M, M] (a dummy unless HAS_C), tile table [tiles]
    OUT,  # [batch, M, M] bf16
    M: tl.constexpr, K: tl.constexpr, ALPHA: tl.constexpr, BETA: tl.constexpr, HAS_C: tl.constexpr,
    BLOCK: tl.constexpr, BLOCK_K: tl.constexpr, INTERPRET: tl.constexpr,
):
    t = tl.program_id(0)
    batch = tl.program_id(1).to(tl.int64)
    i = tl.load(TILE_I + t)
    j = tl.load(TILE_J + t)
    rows = i * BLOCK + tl.arange(0, BLOCK)
    cols = j * BLOCK + tl.arange(0, BLOCK)
    ks = tl.arange(0, BLOCK_K)
    x = X + batch * (M * K)
    acc = tl.zeros((BLOCK, BLOCK), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + ks
        left = tl.load(x + rows[:, None] * K + kk[None, :], mask=(rows[:, None] < M) & (kk[None, :] < K), other=0.0)
        right = tl.load(x + cols[:, None] * K + kk[None, :], mask=(cols[:, None] < M) & (kk[None, :] < K), other=0.0)
        acc = _dot(left, tl.trans(right), acc, INTERPRET)
    mask = (rows[:, None] < M) & (cols[None, :] < M)
    acc = acc * ALPHA
    out = OUT + batch * (M * M)
    if HAS_C:
        c = tl.load(C + batch * (M * M) + rows[:, None] * M + cols[None, :], mask=mask, other=0.0)
        acc += BETA * c.to(tl.float32)
    tile = acc.to(OUT.dtype.element_ty)
    tl.store(out + rows[:, None] * M + cols[None, :], tile, mask=mask)
    if i != j:  # the mirrored tile (j, i); c is symmetric, so its epilogue is the transpose too
        tl.store(out + cols[:, None] * M + rows[None, :], tl.trans(tile), mask=(cols[:, None] < M) & (rows[None, :] < M))


@triton.jit
def _update_kernel(
    B, X,  # b [batch, M, M], x [batch, M, N]
    OUT,  # [batch, M, N] bf16: b @ x + A * x
    M: tl.constexpr, N: tl.constexpr, A: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    pid = tl.program_id(0)
    batch = tl.program_id(1).to(tl.int64)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    # Grouped order: GROUP_M row-tiles walk the column tiles together, so x's columns stay in L2.
    per_group = GROUP_M * tiles_n
    first_m = (pid // per_group) * GROUP_M
    group_rows = tl.minimum(tiles_m - first_m, GROUP_M)
    tile_m = first_m + (pid % per_group) % group_rows
    tile_n = (pid % per_group) // group_rows
    rows = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    b = B + batch * (M * M)
    x = X + batch * (M * N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, M, BLOCK_K):
        kk = k0 + ks
        left = tl.load(b + rows[:, None] * M + kk[None, :], mask=(rows[:, None] < M) & (kk[None, :] < M), other=0.0)
        right = tl.load(x + kk[:, None] * N + cols[None, :], mask=(kk[:, None] < M) & (cols[None, :] < N), other=0.0)
        acc = _dot(left, right, acc, INTERPRET)
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    offsets = rows[:, None] * N + cols[None, :]
    acc += A * tl.load(x + offsets, mask=mask, other=0.0).to(tl.float32)
    tl.store(OUT + batch * (M * N) + offsets, acc.to(OUT.dtype.element_ty), mask=mask)


# ----------------------------------------------------------------------------- launchers


def gram(x, c, alpha: float, beta: float, config: NewtonSchulzTritonConfig):
    """alpha x x^T (+ beta c) for x [batch, M, K] bf16: upper-triangle tiles, mirrored."""
    batch, m, k = x.shape
    block = config.gram_block
    tile_i, tile_j = (jnp.asarray(t) for t in common.upper_tiles(triton.cdiv(m, block)))
    return triton_call(
        x, x if c is None else c, tile_i, tile_j,
        kernel=_gram_kernel,
        out_shape=jax.ShapeDtypeStruct((batch, m, m), common.ITERATION_DTYPE),
        grid=(len(tile_i), batch),
        num_warps=config.num_warps, num_stages=config.num_stages,
        M=m, K=k, ALPHA=float(alpha), BETA=float(beta), HAS_C=c is not None,
        BLOCK=block, BLOCK_K=config.block_k, INTERPRET=interpret_enabled(),
    )


def update(b, x, a: float, config: NewtonSchulzTritonConfig):
    """b x + a x for b [batch, M, M], x [batch, M, N] bf16: Triton's tiled matmul or XLA's dot."""
    if not config.triton_update:
        return common.xla_update(b, x, a)
    batch, m, n = x.shape
    tiles = triton.cdiv(m, config.update_block_m) * triton.cdiv(n, config.update_block_n)
    return triton_call(
        b, x,
        kernel=_update_kernel,
        out_shape=jax.ShapeDtypeStruct((batch, m, n), common.ITERATION_DTYPE),
        grid=(tiles, batch),
        num_warps=config.num_warps, num_stages=config.num_stages,
        M=m, N=n, A=float(a),
        BLOCK_M=config.update_block_m, BLOCK_N=config.update_block_n, BLOCK_K=config.block_k, GROUP_M=config.group_m,
        INTERPRET=interpret_enabled(),
    )


NEWTON_SCHULZ = Implementation(
    fn=common.newton_schulz_with(common.Kernels(gram=gram, update=update)),
    platforms={"gpu"},
    interpretable=True,
    config_type=NewtonSchulzTritonConfig,
    heuristic_config=heuristic_config,
    candidate_configs=candidate_configs,
)
