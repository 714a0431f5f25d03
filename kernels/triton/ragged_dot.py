"""Ragged (grouped) matmul as Triton grouped GEMMs, NVIDIA GPUs.

lhs `[M, K]` (rows sorted by group), rhs `[G, K, N]`, group_sizes `[G]` int32.

  * `_grouped_kernel`: out[r] = lhs[r] @ rhs[g(r)]. A persistent grid (a few programs per SM)
    walks a tile table built on device from group_sizes (kernels/common/ragged_dot.py:
    cumsum of per-group row tiles; empty groups have no tiles, a group's last tile is masked
    at its end; the rows past the sum are one more pseudo-group whose tiles store zeros
    without touching rhs). Output tiles are numbered (row tile, column tile) in bands of
    GROUP_M row tiles, so programs running together share rhs columns and lhs rows in L2.
    The same kernel, with rhs's strides swapped, computes the backward's d lhs = dout @ rhs^T.
  * `_transposed_kernel`: tr[g] = lhs_g^T @ dout_g (`[G, K, N]`, d rhs of the backward): one
    program per (group, K tile, N tile), reducing over the group's rows in BLOCK_K-row steps;
    an empty group's tiles store zeros after no loads.

bf16/f16 operands multiply natively with f32 accumulation; f32 operands as 3 TF32 products.
Columns past N are clamped on load (`% N`) and masked on store; K tails are masked to zero.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import triton
import triton.language as tl

from forgeax.core.config import KernelConfig
from forgeax.core.registry import Implementation
from forgeax.core.runtime import gpu_sm_count, interpret_enabled
from forgeax.kernels.common.ragged_dot import RaggedDotSpec, differentiable_ragged_dot, group_bounds, max_row_tiles, row_tiles
from forgeax.kernels.triton.elementwise import dot
from forgeax.kernels.triton.launch import check_matmul_tiles, fit_matmul_tiles, triton_call

_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


@triton.jit
def _grouped_kernel(
    A, B, TILE_GROUP, TILE_ROW0, TILE_ROW1, NUM_TILES,  # a [M, K]; b [G, ., .]; the tile table
    OUT,  # out [M, N]
    M: tl.constexpr, N: tl.constexpr, K: tl.constexpr, G: tl.constexpr,
    SB_K: tl.constexpr, SB_N: tl.constexpr, PROGRAMS: tl.constexpr, DOT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    row_tiles = tl.load(NUM_TILES)
    n_tiles: tl.constexpr = (N + BLOCK_N - 1) // BLOCK_N
    per_band: tl.constexpr = GROUP_M * n_tiles
    rk = tl.arange(0, BLOCK_K)
    for t in range(tl.program_id(0), row_tiles * n_tiles, PROGRAMS):
        first = (t // per_band) * GROUP_M
        band = tl.minimum(row_tiles - first, GROUP_M)
        rt = first + (t % per_band) % band
        nt = (t % per_band) // band
        g = tl.load(TILE_GROUP + rt)
        row0 = tl.load(TILE_ROW0 + rt)
        row1 = tl.load(TILE_ROW1 + rt)
        om = (row0 + tl.arange(0, BLOCK_M)).to(tl.int64)
        on = nt * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok = om < row1
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if g < G:
            rm = tl.where(row_ok, om, row0)  # rows past the tile's end re-read its first row
            rn = on % N
            a_ptrs = A + rm[:, None] * K + rk[None, :]
            b_ptrs = B + g.to(tl.int64) * (K * N) + rk[:, None] * SB_K + rn[None, :] * SB_N
            for k in range(0, K, BLOCK_K):
                if K % BLOCK_K == 0:
                    a = tl.load(a_ptrs)
                    b = tl.load(b_ptrs)
                else:
                    k_ok = rk < K - k
                    a = tl.load(a_ptrs, mask=k_ok[None, :], other=0.0)
                    b = tl.load(b_ptrs, mask=k_ok[:, None], other=0.0)
                acc = dot(a, b, acc, DOT)
                a_ptrs += BLOCK_K
                b_ptrs += BLOCK_K * SB_K
        mask = row_ok[:, None] & (on < N)[None, :]
        tl.store(OUT + om[:, None] * N + on[None, :], acc.to(OUT.dtype.element_ty), mask=mask)


@triton.jit
def _transposed_kernel(
    A, D, STARTS, ENDS,  # a [M, K]; d [M, N]; each group's row range
    OUT,  # out [G, K, N]
    K: tl.constexpr, N: tl.constexpr, DOT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    k_tiles: tl.constexpr = (K + BLOCK_M - 1) // BLOCK_M
    n_tiles: tl.constexpr = (N + BLOCK_N - 1) // BLOCK_N
    pid = tl.program_id(0)
    g = pid // (k_tiles * n_tiles)
    kt = (pid % (k_tiles * n_tiles)) // n_tiles
    nt = pid % n_tiles
    start = tl.load(STARTS + g)
    end = tl.load(ENDS + g)
    ok = kt * BLOCK_M + tl.arange(0, BLOCK_M)  # output rows: K
    on = nt * BLOCK_N + tl.arange(0, BLOCK_N)
    rk, rn = ok % K, on % N
    rr = tl.arange(0, BLOCK_K)  # reduction: the group's rows
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for r in range(start, end, BLOCK_K):
        rows = (r + rr).to(tl.int64)
        row_ok = rows < end
        a = tl.load(A + rows[:, None] * K + rk[None, :], mask=row_ok[:, None], other=0.0)  # [BK, BM]
        d = tl.load(D + rows[:, None] * N + rn[None, :], mask=row_ok[:, None], other=0.0)  # [BK, BN]
        acc = dot(tl.trans(a), d, acc, DOT)
    mask = (ok < K)[:, None] & (on < N)[None, :]
    out = OUT + g.to(tl.int64) * (K * N) + ok[:, None] * N + on[None, :]
    tl.store(out, acc.to(OUT.dtype.element_ty), mask=mask)


@dataclasses.dataclass(frozen=True, kw_only=True)
class RaggedDotConfig(KernelConfig):
    """Tiles and launch parameters of both grouped GEMMs.

    Grouped kernel: block_m x block_n output tiles, K steps of block_k, GROUP_M row tiles per
    L2 band, programs_per_sm persistent programs per SM. Transposed kernel: block_m x block_n
    tiles of the [K, N] output, block_k rows per reduction step. Powers of two >= 16.
    """

    block_m: int = 128
    block_n: int = 128
    block_k: int = 64
    group_m: int = 8
    programs_per_sm: int = 1
    num_warps: int = 8
    num_stages: int = 3

    def validate(self) -> None:
        super().validate()
        check_matmul_tiles(self)


def heuristic_config(lhs, rhs, group_sizes, *, spec) -> RaggedDotConfig:
    """128 x 128 x 64 tiles, 8 warps, 3 stages: a Hopper bf16 Triton GEMM at its best (96 KiB of
    shared memory for 3 stages). The interpreter pays per program and per op: 16/32-wide tiles."""
    del group_sizes, spec
    m, k = lhs.shape
    n = rhs.shape[2]
    if interpret_enabled():
        return RaggedDotConfig(block_m=16, block_n=32, block_k=16, group_m=2, programs_per_sm=1, num_warps=4, num_stages=1)
    if jnp.dtype(lhs.dtype) == jnp.float32:
        return fit_matmul_tiles(RaggedDotConfig(block_m=64, block_n=64, block_k=32, num_warps=4, num_stages=3), m, n, k)
    return fit_matmul_tiles(RaggedDotConfig(), m, n, k)


def candidate_configs(lhs, rhs, group_sizes, *, spec) -> list[RaggedDotConfig]:
    m, k = lhs.shape
    n = rhs.shape[2]
    out = [heuristic_config(lhs, rhs, group_sizes, spec=spec)]
    for bm, bn, bk, warps, stages in ((128, 256, 64, 8, 3), (128, 128, 64, 8, 4), (128, 128, 64, 4, 4), (64, 128, 64, 4, 4),
                                      (128, 64, 64, 4, 4), (256, 128, 64, 8, 3), (64, 256, 64, 8, 3)):
        for group, per_sm in ((8, 1), (8, 2), (16, 1)):
            cfg = fit_matmul_tiles(RaggedDotConfig(block_m=bm, block_n=bn, block_k=bk, group_m=group, programs_per_sm=per_sm,
                                                   num_warps=warps, num_stages=stages), m, n, k)
            if cfg not in out:
                out.append(cfg)
    return out


def _dot_mode(dtype) -> int:
    return 2 if interpret_enabled() else (1 if jnp.dtype(dtype) == jnp.float32 else 0)


def forward(lhs, rhs, group_sizes, *, out_dtype, config: RaggedDotConfig, transpose_rhs: bool):
    """lhs @ rhs[g] per group; with transpose_rhs, rhs `[G, N, K]` is read as `[G, K, N]`."""
    m, k = lhs.shape
    g = rhs.shape[0]
    n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
    cfg = fit_matmul_tiles(config, m, n, k) if not interpret_enabled() else config
    tiles = row_tiles(group_sizes, m, cfg.block_m)
    total = max_row_tiles(m, g, cfg.block_m) * triton.cdiv(n, cfg.block_n)
    programs = max(1, min(total, gpu_sm_count() * cfg.programs_per_sm))
    if interpret_enabled():
        programs = min(total, 4)
    return triton_call(lhs, rhs.astype(lhs.dtype), *tiles, kernel=_grouped_kernel,
                       out_shape=jax.ShapeDtypeStruct((m, n), out_dtype), grid=(programs,),
                       num_warps=cfg.num_warps, num_stages=cfg.num_stages,
                       M=m, N=n, K=k, G=g, SB_K=1 if transpose_rhs else n, SB_N=k if transpose_rhs else 1,
                       PROGRAMS=programs, DOT=_dot_mode(lhs.dtype),
                       BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m)


def transposed(lhs, dout, group_sizes, *, out_dtype, config: RaggedDotConfig):
    """lhs_g^T @ dout_g per group: `[G, K, N]`."""
    m, k = lhs.shape
    n = dout.shape[1]
    g = group_sizes.shape[0]
    cfg = fit_matmul_tiles(config, k, n, m) if not interpret_enabled() else config
    starts, ends = group_bounds(group_sizes, m)
    grid = (g * triton.cdiv(k, cfg.block_m) * triton.cdiv(n, cfg.block_n),)
    return triton_call(lhs, dout.astype(lhs.dtype), starts, ends, kernel=_transposed_kernel,
                       out_shape=jax.ShapeDtypeStruct((g, k, n), out_dtype), grid=grid,
                       num_warps=cfg.num_warps, num_stages=cfg.num_stages, K=k, N=n, DOT=_dot_mode(lhs.dtype),
                       BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k)


_RAGGED_DOT, _RAGGED_DOT_T = differentiable_ragged_dot(forward, transposed)


def ragged_dot(lhs, rhs, group_sizes, *, spec: RaggedDotSpec, config: RaggedDotConfig):
    return _RAGGED_DOT(lhs, rhs, group_sizes, jnp.dtype(spec.out_dtype), config)


def ragged_dot_transposed(lhs, dout, group_sizes, *, spec: RaggedDotSpec, config: RaggedDotConfig):
    return _RAGGED_DOT_T(lhs, dout, group_sizes, jnp.dtype(spec.out_dtype), config)


def supports(lhs, rhs, group_sizes, *, spec) -> str | None:
    del rhs, group_sizes, spec
    if jnp.dtype(lhs.dtype) not in _DTYPES:
        return f"lhs dtype {jnp.dtype(lhs.dtype).name} is not one of float32/bfloat16/float16"
    if 0 in lhs.shape:
        return "empty lhs"
    return None


def _transposed_heuristic(lhs, dout, group_sizes, *, spec) -> RaggedDotConfig:
    del dout, group_sizes, spec
    if interpret_enabled():
        return RaggedDotConfig(block_m=16, block_n=32, block_k=16, group_m=2, num_warps=4, num_stages=1)
    if jnp.dtype(lhs.dtype) == jnp.float32:
        return RaggedDotConfig(block_m=64, block_n=64, block_k=32, num_warps=4, num_stages=3)
    return RaggedDotConfig()


RAGGED_DOT = Implementation(fn=ragged_dot, platforms={"gpu"}, interpretable=True, supports=supports,
                            config_type=RaggedDotConfig, heuristic_config=heuristic_config,
                            candidate_configs=candidate_configs)
RAGGED_DOT_TRANSPOSED = Implementation(fn=ragged_dot_transposed, platforms={"gpu"}, interpretable=True, supports=supports,
                                       config_type=RaggedDotConfig, heuristic_config=_transposed_heuristic)
