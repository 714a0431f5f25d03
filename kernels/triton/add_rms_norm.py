"""Fused residual add + RMSNorm as Triton kernels (forward and backward), over rows.

x, residual viewed as (R, D) (kernels/common/add_rms_norm.py does the reshape, custom_vjp
and vmap). Per row, statistics in f32:

    s = x + residual (rounded to x's dtype),  rstd = rsqrt(mean(s^2) + eps)
    normed = s * rstd * scale
    backward, shat = s * rstd, g = dnormed * scale:
      ds = rstd * (g - shat * mean(g * shat)) + dsum,   dscale = sum_rows(dnormed * shat)

  * `_forward_kernel`: program i owns rows [i*BLOCK_ROWS, (i+1)*BLOCK_ROWS) as one
    [BLOCK_ROWS, BLOCK_D] tile (BLOCK_D = next power of two >= D, tail masked): reads x and
    residual once, writes s, normed and rstd [R] f32. Four passes over (R, D): the floor.
  * `_backward_kernel`: a few programs per SM, each walking a contiguous chunk of rows:
    reads s, dnormed, dsum, writes ds (the gradient of x and of residual: one array), and
    accumulates dscale in f32 registers, written once per program as partials [programs, D]
    and summed by XLA (no atomics: deterministic). With `bwd_prefetch` the next tile's loads
    are issued before the current tile is reduced, so HBM stays busy through the reductions.
Sizes and eps are constexprs (alignment proofs for vector loads; the interpreter needs
constexpr loop bounds).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import triton
import triton.language as tl

from forgeax.core.config import KernelConfig
from forgeax.core.registry import Implementation
from forgeax.core.runtime import gpu_sm_count, interpret_enabled
from forgeax.kernels.common.add_rms_norm import AddRmsNormKernels, differentiable_add_rms_norm
from forgeax.kernels.triton.elementwise import row_tile
from forgeax.kernels.triton.launch import triton_call

# Largest D one program holds as a register tile (as for the Triton norms: above it the
# backward spills).
MAX_D = 16384
_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


# ----------------------------------------------------------------------------- kernels


@triton.jit
def _forward_kernel(
    X, RES, W,  # inputs: x [R, D], residual [R, D], scale [D] f32
    Y, S, RSTD,  # outputs: normed [R, D], s [R, D] (x's dtype), rstd [R] f32
    ROWS: tl.constexpr, D: tl.constexpr, EPS: tl.constexpr,
    BLOCK_ROWS: tl.constexpr, BLOCK_D: tl.constexpr,
):
    rows, cols, row_ok, col_ok, mask, offsets = row_tile(ROWS, D, BLOCK_ROWS, BLOCK_D)
    x = tl.load(X + offsets, mask=mask, other=0.0)
    r = tl.load(RES + offsets, mask=mask, other=0.0)
    s = (x.to(tl.float32) + r.to(tl.float32)).to(S.dtype.element_ty)  # the add a plain x + residual rounds
    tl.store(S + offsets, s, mask=mask)
    s = s.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(s * s, axis=1) / D + EPS)
    w = tl.load(W + cols, mask=col_ok, other=0.0)
    tl.store(Y + offsets, (s * rstd[:, None] * w[None, :]).to(Y.dtype.element_ty), mask=mask)
    tl.store(RSTD + rows, rstd, mask=row_ok)


@triton.jit
def _load_tile(S, DN, DSUM, RSTD, rows, cols, row_ok, col_ok, D: tl.constexpr):
    """s, dnormed, dsum (input dtype) and rstd of a tile; masked rows give rstd = 0."""
    mask = row_ok[:, None] & col_ok[None, :]
    offsets = rows[:, None] * D + cols[None, :]
    s = tl.load(S + offsets, mask=mask, other=0.0)
    dn = tl.load(DN + offsets, mask=mask, other=0.0)
    dsum = tl.load(DSUM + offsets, mask=mask, other=0.0)
    rstd = tl.load(RSTD + rows, mask=row_ok, other=0.0)
    return s, dn, dsum, rstd


@triton.jit
def _backward_kernel(
    S, W, RSTD, DN, DSUM,  # inputs: s [R, D], scale [D] f32, rstd [R], dnormed [R, D], dsum [R, D]
    DS, DSCALE,  # outputs: ds [R, D] in s's dtype, partials [programs, D] f32
    ROWS: tl.constexpr, D: tl.constexpr,
    BLOCK_ROWS: tl.constexpr, BLOCK_D: tl.constexpr, ROWS_PER_PROGRAM: tl.constexpr, PREFETCH: tl.constexpr,
):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_D)
    col_ok = cols < D
    w = tl.load(W + cols, mask=col_ok, other=0.0)
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)  # 1-D: the sum over a tile's rows stays in-thread
    first = pid * ROWS_PER_PROGRAM
    end = tl.minimum(first + ROWS_PER_PROGRAM, ROWS)
    rows = first + tl.arange(0, BLOCK_ROWS)
    if ROWS * D >= 2**31:
        rows = rows.to(tl.int64)
    s_n, dn_n, dsum_n, rstd_n = _load_tile(S, DN, DSUM, RSTD, rows, cols, rows < end, col_ok, D)
    for _ in range(0, ROWS_PER_PROGRAM, BLOCK_ROWS):  # ROWS_PER_PROGRAM % BLOCK_ROWS == 0
        row_ok = rows < end
        if PREFETCH:
            s, dn, dsum, rstd = s_n, dn_n, dsum_n, rstd_n
            nxt = rows + BLOCK_ROWS
            s_n, dn_n, dsum_n, rstd_n = _load_tile(S, DN, DSUM, RSTD, nxt, cols, nxt < end, col_ok, D)
        else:
            s, dn, dsum, rstd = _load_tile(S, DN, DSUM, RSTD, rows, cols, row_ok, col_ok, D)
        mask = row_ok[:, None] & col_ok[None, :]
        shat = s.to(tl.float32) * rstd[:, None]
        dn = dn.to(tl.float32)
        g = dn * w[None, :]
        c = tl.sum(shat * g, axis=1) / D
        ds = (g - shat * c[:, None]) * rstd[:, None] + dsum.to(tl.float32)
        tl.store(DS + rows[:, None] * D + cols[None, :], ds.to(DS.dtype.element_ty), mask=mask)
        acc += tl.sum(dn * shat, axis=0)
        rows += BLOCK_ROWS
    tl.store(DSCALE + pid * D + cols, acc, mask=col_ok)


# ----------------------------------------------------------------------------- config


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


@dataclasses.dataclass(frozen=True, kw_only=True)
class AddRmsNormConfig(KernelConfig):
    """fwd/bwd_block_rows: rows per tile (powers of two); fwd/bwd_num_warps: warps per program;
    bwd_programs_per_sm: the backward grid is about this many programs per SM, each looping over
    a contiguous chunk of rows; bwd_prefetch: issue the next tile's loads before reducing this one."""

    fwd_block_rows: int
    fwd_num_warps: int
    bwd_block_rows: int
    bwd_num_warps: int
    bwd_programs_per_sm: int
    bwd_prefetch: bool = True

    def validate(self) -> None:
        super().validate()
        for name in ("fwd_block_rows", "bwd_block_rows"):
            value = getattr(self, name)
            if value & (value - 1):
                raise ValueError(f"AddRmsNormConfig.{name}: expected a power of two, got {value}")
        for name in ("fwd_num_warps", "bwd_num_warps"):
            if getattr(self, name) not in (1, 2, 4, 8, 16, 32):
                raise ValueError(f"AddRmsNormConfig.{name}: expected 1, 2, 4, 8, 16 or 32, got {getattr(self, name)}")


def heuristic_config(x, residual, scale, *, eps) -> AddRmsNormConfig:
    """Tiles of ~4096 elements forward (D = 4096 bf16: a row per program, 8 warps, 16-byte
    loads) and ~2048 backward (three row inputs, the next tile prefetched in registers up to
    D = 4096, two programs per SM). The interpreter pays per program: there, large tiles."""
    del residual, scale, eps
    d = x.shape[-1]
    rows = int(np.prod(x.shape[:-1]))
    block_d = _pow2_at_least(d)
    row_cap = _pow2_at_least(max(rows, 1))
    if interpret_enabled():
        return AddRmsNormConfig(fwd_block_rows=min(max(32768 // block_d, 1), 64, row_cap), fwd_num_warps=4,
                                bwd_block_rows=min(max(16384 // block_d, 1), 16, row_cap), bwd_num_warps=4,
                                bwd_programs_per_sm=1, bwd_prefetch=block_d <= 4096)
    fwd_rows = min(max(4096 // block_d, 1), 64, row_cap)
    bwd_rows = min(max(2048 // block_d, 1), 16, row_cap)
    return AddRmsNormConfig(
        fwd_block_rows=fwd_rows, fwd_num_warps=min(max(fwd_rows * block_d // 512, 1), 16),
        bwd_block_rows=bwd_rows, bwd_num_warps=min(max(bwd_rows * block_d // 512, 1), 16),
        bwd_programs_per_sm=1 if block_d >= 8192 else 2 if block_d >= 1024 else 4,
        bwd_prefetch=block_d <= 4096,
    )


def candidate_configs(x, residual, scale, *, eps) -> list[AddRmsNormConfig]:
    base = heuristic_config(x, residual, scale, eps=eps)
    r = base.replace
    return [base, r(fwd_num_warps=min(base.fwd_num_warps * 2, 16)), r(fwd_num_warps=max(base.fwd_num_warps // 2, 1)),
            r(fwd_block_rows=base.fwd_block_rows * 2, fwd_num_warps=min(base.fwd_num_warps * 2, 16)),
            r(bwd_prefetch=not base.bwd_prefetch), r(bwd_num_warps=min(base.bwd_num_warps * 2, 16)),
            r(bwd_programs_per_sm=base.bwd_programs_per_sm * 2), r(bwd_block_rows=base.bwd_block_rows * 2)]


def _num_sms() -> int:
    return 4 if interpret_enabled() else gpu_sm_count()  # a pretend 4-SM GPU keeps interpreted grids small


# ----------------------------------------------------------------------------- row kernels


def _forward(x, residual, scale, *, eps, config):
    rows, d = x.shape
    if rows == 0:
        return jnp.zeros_like(x), jnp.zeros_like(x), jnp.zeros((0,), jnp.float32)
    block_rows = min(config.fwd_block_rows, _pow2_at_least(rows))
    return triton_call(
        x, residual.astype(x.dtype), scale.astype(jnp.float32),
        kernel=_forward_kernel,
        out_shape=(jax.ShapeDtypeStruct((rows, d), x.dtype), jax.ShapeDtypeStruct((rows, d), x.dtype),
                   jax.ShapeDtypeStruct((rows,), jnp.float32)),
        grid=(triton.cdiv(rows, block_rows),),
        num_warps=config.fwd_num_warps,
        num_stages=1,
        ROWS=rows, D=d, EPS=float(np.float32(eps)), BLOCK_ROWS=block_rows, BLOCK_D=_pow2_at_least(d),
    )


def _backward(s, scale, rstd, dn, dsum, *, eps, config):
    del eps  # folded into rstd
    rows, d = s.shape
    if rows == 0:
        return jnp.zeros_like(s), jnp.zeros((d,), jnp.float32)
    block_rows = min(config.bwd_block_rows, _pow2_at_least(rows))
    target = _num_sms() * config.bwd_programs_per_sm
    rows_per_program = triton.cdiv(triton.cdiv(rows, target), block_rows) * block_rows
    programs = triton.cdiv(rows, rows_per_program)
    ds, partials = triton_call(
        s, scale.astype(jnp.float32), rstd, dn, dsum,
        kernel=_backward_kernel,
        out_shape=(jax.ShapeDtypeStruct((rows, d), s.dtype), jax.ShapeDtypeStruct((programs, d), jnp.float32)),
        grid=(programs,),
        num_warps=config.bwd_num_warps,
        num_stages=1,
        ROWS=rows, D=d, BLOCK_ROWS=block_rows, BLOCK_D=_pow2_at_least(d), ROWS_PER_PROGRAM=rows_per_program,
        PREFETCH=config.bwd_prefetch,
    )
    return ds, jnp.sum(partials, axis=0)


@functools.cache
def _differentiable(config: AddRmsNormConfig):
    return differentiable_add_rms_norm(AddRmsNormKernels(
        forward=functools.partial(_forward, config=config), backward=functools.partial(_backward, config=config)))


def add_rms_norm(x, residual, scale, *, eps, config: AddRmsNormConfig):
    return _differentiable(config)(x, residual, scale, eps=eps)


def _supports(x, residual, scale, *, eps):
    del residual, scale, eps
    if jnp.dtype(x.dtype) not in _DTYPES:
        return f"x dtype {jnp.dtype(x.dtype).name} is not one of float32/bfloat16/float16"
    d = x.shape[-1]
    if d == 0:
        return "D=0 (empty last axis)"
    if d > MAX_D:
        return f"D={d} exceeds the {MAX_D} one-block limit of the Triton add_rms_norm kernels"
    return None


ADD_RMS_NORM = Implementation(fn=add_rms_norm, platforms={"gpu"}, interpretable=True, supports=_supports,
                              config_type=AddRmsNormConfig, heuristic_config=heuristic_config,
                              candidate_configs=candidate_configs)
