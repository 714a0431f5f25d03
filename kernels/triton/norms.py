"""RMSNorm and LayerNorm as Triton kernels (forward and backward), over rows of x.

x is viewed as (R, D) (kernels/common/norms.py does the reshape, custom_vjp and
vmap). Per row, with statistics in f32:

    RMSNorm:   rstd = rsqrt(mean(x^2) + eps),          xhat = x * rstd
    LayerNorm: mu = mean(x), rstd = rsqrt(var(x) + eps), xhat = (x - mu) * rstd
    y = xhat * scale (+ offset)

Backward, g = dy * scale (module docstring of kernels/common/norms.py):

    dx = rstd * (g - [mean(g)] - xhat * mean(g * xhat))     ([..] LayerNorm only)
    dscale = sum_rows(dy * xhat), doffset = sum_rows(dy)

Kernels (one of each serves both norms, switched by constexprs):
  * `_forward_kernel`: program i normalises rows [i*BLOCK_ROWS, (i+1)*BLOCK_ROWS),
    a [BLOCK_ROWS, BLOCK_D] tile (BLOCK_D = next power of two >= D, tail masked).
    Writes y (x's dtype) and stats [R, 1] = rstd or [R, 2] = (rstd, mean), f32.
  * `_backward_kernel`: a persistent-style grid of a few programs per SM; each
    walks a contiguous chunk of rows, writes dx, and accumulates dscale/doffset
    in f32 registers, written once as partials [programs, 1 or 2, D] and summed
    by XLA afterwards. No atomics: the result is deterministic.
Sizes, strides and eps are constexprs: constexpr strides let Triton prove
16-byte alignment (vector loads), and the interpreter needs constexpr loop bounds.
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
from forgeax.kernels.common.norms import NormKernels, differentiable_norm
from forgeax.kernels.triton.elementwise import row_tile
from forgeax.kernels.triton.launch import triton_call

# Largest D one program handles as a single register tile. ptxas (sm_90a) shows
# no spills up to D=8192 at the default configs; at D=16384 the backward spills
# (~200 B bf16, ~1.3 KB f32): still correct, slower. Beyond that it gets worse.
MAX_D = 16384
_X_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)
_PARAM_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)  # others are cast to f32 first


# ----------------------------------------------------------------------------- kernels


@triton.jit
def _forward_kernel(
    X, W, B,  # inputs: x [R, D], scale [D], offset [D] (a dummy when HAS_OFFSET is False)
    Y, STATS,  # outputs: y [R, D] in x's dtype, stats [R, N_STATS] f32
    ROWS: tl.constexpr, D: tl.constexpr, EPS: tl.constexpr,
    BLOCK_ROWS: tl.constexpr, BLOCK_D: tl.constexpr,
    IS_RMS: tl.constexpr, HAS_OFFSET: tl.constexpr, N_STATS: tl.constexpr,
):
    rows, cols, row_ok, col_ok, mask, offsets = row_tile(ROWS, D, BLOCK_ROWS, BLOCK_D)

    x = tl.load(X + offsets, mask=mask, other=0.0).to(tl.float32)
    if IS_RMS:
        centred = x
    else:
        mean = tl.sum(x, axis=1) / D
        centred = tl.where(mask, x - mean[:, None], 0.0)  # masked tail must not add to var
    rstd = tl.rsqrt(tl.sum(centred * centred, axis=1) / D + EPS)
    w = tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32)
    y = centred * rstd[:, None] * w[None, :]
    if HAS_OFFSET:
        y += tl.load(B + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(Y + offsets, y.to(Y.dtype.element_ty), mask=mask)
    tl.store(STATS + rows * N_STATS, rstd, mask=row_ok)
    if not IS_RMS:
        tl.store(STATS + rows * N_STATS + 1, mean, mask=row_ok)


@triton.jit
def _load_tile(X, DY, STATS, rows, cols, row_ok, col_ok, D: tl.constexpr, N_STATS: tl.constexpr, IS_RMS: tl.constexpr):
    """x, dy (input dtype), rstd, mean (f32) of one tile; masked rows give rstd = 0, so xhat = 0."""
    mask = row_ok[:, None] & col_ok[None, :]
    offsets = rows[:, None] * D + cols[None, :]
    x = tl.load(X + offsets, mask=mask, other=0.0)
    dy = tl.load(DY + offsets, mask=mask, other=0.0)
    rstd = tl.load(STATS + rows * N_STATS, mask=row_ok, other=0.0)
    if IS_RMS:
        mean = rstd  # unused
    else:
        mean = tl.load(STATS + rows * N_STATS + 1, mask=row_ok, other=0.0)
    return x, dy, rstd, mean


@triton.jit
def _backward_kernel(
    X, W, STATS, DY,  # inputs: x [R, D], scale [D], stats [R, N_STATS], dy [R, D]
    DX, DPARAMS,  # outputs: dx [R, D] in x's dtype, partials [programs, N_PARAMS, D] f32
    ROWS: tl.constexpr, D: tl.constexpr,
    BLOCK_ROWS: tl.constexpr, BLOCK_D: tl.constexpr, ROWS_PER_PROGRAM: tl.constexpr,
    IS_RMS: tl.constexpr, HAS_OFFSET: tl.constexpr, N_STATS: tl.constexpr, N_PARAMS: tl.constexpr,
    PREFETCH: tl.constexpr,
):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_D)
    col_ok = cols < D
    w = tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32)
    # f32 partial sums over this program's rows. 1-D: with D >= 256 a thread
    # holds the same columns of every row of the tile, so the sum over the
    # tile's rows is in-thread, and the registers don't grow with BLOCK_ROWS.
    acc_scale = tl.zeros([BLOCK_D], dtype=tl.float32)
    acc_offset = tl.zeros([BLOCK_D], dtype=tl.float32)
    first = pid * ROWS_PER_PROGRAM
    end = tl.minimum(first + ROWS_PER_PROGRAM, ROWS)
    rows = first + tl.arange(0, BLOCK_ROWS)
    if ROWS * D >= 2**31:  # element offsets would overflow int32
        rows = rows.to(tl.int64)
    # PREFETCH: the next tile's loads are issued before this tile is reduced,
    # so HBM stays busy through the reductions and stores (the loop is a
    # chain of load -> reduce -> store otherwise, and Triton does not
    # software-pipeline loads that feed no dot).
    x_n, dy_n, rstd_n, mean_n = _load_tile(X, DY, STATS, rows, cols, rows < end, col_ok, D, N_STATS, IS_RMS)
    for _ in range(0, ROWS_PER_PROGRAM, BLOCK_ROWS):  # ROWS_PER_PROGRAM % BLOCK_ROWS == 0
        row_ok = rows < end
        if PREFETCH:
            x, dy, rstd, mean = x_n, dy_n, rstd_n, mean_n
            nxt = rows + BLOCK_ROWS
            x_n, dy_n, rstd_n, mean_n = _load_tile(X, DY, STATS, nxt, cols, nxt < end, col_ok, D, N_STATS, IS_RMS)
        else:
            x, dy, rstd, mean = _load_tile(X, DY, STATS, rows, cols, row_ok, col_ok, D, N_STATS, IS_RMS)
        mask = row_ok[:, None] & col_ok[None, :]
        x = x.to(tl.float32)
        dy = dy.to(tl.float32)
        if IS_RMS:
            xhat = x * rstd[:, None]
        else:
            xhat = tl.where(mask, (x - mean[:, None]) * rstd[:, None], 0.0)
        g = dy * w[None, :]
        c1 = tl.sum(xhat * g, axis=1) / D
        if IS_RMS:
            dx = (g - xhat * c1[:, None]) * rstd[:, None]
        else:
            c2 = tl.sum(g, axis=1) / D
            dx = (g - c2[:, None] - xhat * c1[:, None]) * rstd[:, None]
        tl.store(DX + rows[:, None] * D + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask)
        acc_scale += tl.sum(dy * xhat, axis=0)
        if HAS_OFFSET:
            acc_offset += tl.sum(dy, axis=0)
        rows += BLOCK_ROWS
    partial = DPARAMS + pid * (N_PARAMS * D) + cols
    tl.store(partial, acc_scale, mask=col_ok)
    if HAS_OFFSET:
        tl.store(partial + D, acc_offset, mask=col_ok)


# ----------------------------------------------------------------------------- configs


@dataclasses.dataclass(frozen=True, kw_only=True)
class TritonNormConfig(KernelConfig):
    """Launch tunables of the RMSNorm / LayerNorm kernels for one (rows, D, dtype); see
    `default_config`.

    fwd_block_rows/bwd_block_rows: rows per tile (powers of two).
    fwd_num_warps/bwd_num_warps: warps per program.
    bwd_programs_per_sm: backward grid size is about this many programs per SM
      (each program then loops over a contiguous chunk of rows).
    bwd_num_stages: Triton's software-pipelining depth of the backward's row loop.
    bwd_prefetch: the backward issues the next tile's loads before reducing
      the current one (explicit double buffering in registers).
    """

    fwd_block_rows: int
    fwd_num_warps: int
    bwd_block_rows: int
    bwd_num_warps: int
    bwd_programs_per_sm: int
    bwd_num_stages: int = 1
    bwd_prefetch: bool = False

    def validate(self) -> None:
        super().validate()
        cls = type(self).__name__
        for name in ("fwd_block_rows", "bwd_block_rows"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1 or value & (value - 1):
                raise ValueError(f"{cls}.{name}: expected a power of two, got {value!r}")
        for name in ("fwd_num_warps", "bwd_num_warps"):
            value = getattr(self, name)
            if isinstance(value, bool) or value not in (1, 2, 4, 8, 16, 32):
                raise ValueError(f"{cls}.{name}: expected 1, 2, 4, 8, 16 or 32, got {value!r}")
        for name in ("bwd_num_stages", "bwd_programs_per_sm"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{cls}.{name}: expected an int >= 1, got {value!r}")
        if not isinstance(self.bwd_prefetch, bool):
            raise ValueError(f"{cls}.bwd_prefetch: expected a bool, got {self.bwd_prefetch!r}")


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def default_config(rows: int, d: int, dtype) -> TritonNormConfig:
    """The launch heuristic (timed on an H200 at D = 4096; register counts from ptxas).

    Forward: tiles of ~4096 elements, ~16 per thread (D=4096 bf16: one 8 KB row
    per program, 8 warps, two 16-byte loads per thread per input); small D packs
    rows so a program still moves several KB. Backward: ~16 elements per thread
    per row plus the prefetched next tile, two programs resident per SM; the
    grid is about as many programs as fit on the GPU at once, each looping over
    a contiguous chunk of rows.
    """
    del dtype  # the element budget per thread is in f32 registers, whatever the input
    block_d = _pow2_at_least(d)
    row_cap = _pow2_at_least(max(rows, 1))
    if interpret_enabled():
        # The interpreter pays per op per program, so: few large tiles. Same code
        # paths (row masks, multi-iteration loops, partials from several programs).
        return TritonNormConfig(
            fwd_block_rows=min(max(32768 // block_d, 1), 64, row_cap),
            fwd_num_warps=4,
            bwd_block_rows=min(max(16384 // block_d, 1), 16, row_cap),
            bwd_num_warps=4,
            bwd_programs_per_sm=1,
            bwd_prefetch=block_d <= 4096,  # the GPU default's code path
        )
    fwd_rows = min(max(4096 // block_d, 1), 64, row_cap)
    bwd_rows = min(max(2048 // block_d, 1), 16, row_cap)
    # Measured on an H200 at 32768 x 4096 bf16 (benchmarks/results/norms_H200_2026-11-22_tune_triton_run2.json):
    # prefetching the next tile took the backward from 79% to ~90% of copy
    # bandwidth; with it, 8 warps (one 16-byte load per input per thread and
    # row) beat 16 for LayerNorm and tie for RMSNorm. Above D = 4096 the
    # second tile in registers would spill, so no prefetch there.
    return TritonNormConfig(
        fwd_block_rows=fwd_rows,
        fwd_num_warps=min(max(fwd_rows * block_d // 512, 1), 16),
        bwd_block_rows=bwd_rows,
        bwd_num_warps=min(max(bwd_rows * block_d // 512, 1), 16),
        bwd_programs_per_sm=1 if block_d >= 8192 else 2 if block_d >= 1024 else 4,
        bwd_prefetch=block_d <= 4096,
    )


def named_candidates(rows: int, d: int, dtype) -> dict[str, TritonNormConfig]:
    """The default and a few alternatives worth timing on a GPU, by name
    (benchmarks/tune_triton_norms.py)."""
    base = default_config(rows, d, dtype)
    r = dataclasses.replace
    return {
        "default": base,
        "fwd_2rows": r(base, fwd_block_rows=base.fwd_block_rows * 2, fwd_num_warps=min(base.fwd_num_warps * 2, 16)),
        "bwd_no_prefetch": r(base, bwd_prefetch=False),
        "bwd_2x_warps": r(base, bwd_num_warps=min(base.bwd_num_warps * 2, 16)),
        "bwd_4prog": r(base, bwd_programs_per_sm=4),
        "bwd_2rows": r(base, bwd_block_rows=base.bwd_block_rows * 2),
        "bwd_stages2": r(base, bwd_num_stages=2),
    }


def _rows_and_dim(x) -> tuple[int, int]:
    return int(np.prod(x.shape[:-1], dtype=np.int64)), int(x.shape[-1])


def heuristic_config(x, scale, offset=None, *, eps) -> TritonNormConfig:
    """`default_config` for the op's arguments (x [..., D] viewed as rows of D)."""
    del scale, offset, eps
    return default_config(*_rows_and_dim(x), x.dtype)


def candidate_configs(x, scale, offset=None, *, eps) -> tuple[TritonNormConfig, ...]:
    """The search space of a call: `named_candidates`, the default first."""
    del scale, offset, eps
    return tuple(dict.fromkeys(named_candidates(*_rows_and_dim(x), x.dtype).values()))


def _num_sms() -> int:
    """Streaming multiprocessors of the first GPU; 132 (H100/H200) when there is none.

    In interpret mode, a pretend 4-SM GPU keeps the backward grid small.
    """
    return 4 if interpret_enabled() else gpu_sm_count()


# ----------------------------------------------------------------------------- row kernels


def _param(p):
    return p if p.dtype in _PARAM_DTYPES else p.astype(jnp.float32)


def _forward(x, scale, offset, *, eps, is_rms, config):
    rows, d = x.shape
    n_stats = 1 if is_rms else 2
    if rows == 0:
        return jnp.zeros_like(x), jnp.zeros((0, n_stats), jnp.float32)
    cfg = config or default_config(rows, d, x.dtype)
    block_rows = min(cfg.fwd_block_rows, _pow2_at_least(rows))
    scale = _param(scale)
    has_offset = offset is not None
    y, stats = triton_call(
        x, scale, _param(offset) if has_offset else scale,
        kernel=_forward_kernel,
        out_shape=(jax.ShapeDtypeStruct((rows, d), x.dtype), jax.ShapeDtypeStruct((rows, n_stats), jnp.float32)),
        grid=(triton.cdiv(rows, block_rows),),
        num_warps=cfg.fwd_num_warps,
        num_stages=1,
        ROWS=rows, D=d, EPS=float(np.float32(eps)),
        BLOCK_ROWS=block_rows, BLOCK_D=_pow2_at_least(d),
        IS_RMS=is_rms, HAS_OFFSET=has_offset, N_STATS=n_stats,
    )
    return y, stats


def _backward(x, scale, stats, dy, *, eps, has_offset, config):
    del eps  # folded into the saved rstd
    rows, d = x.shape
    n_params = 2 if has_offset else 1
    if rows == 0:
        zeros = jnp.zeros((d,), jnp.float32)
        return jnp.zeros_like(x), zeros, zeros if has_offset else None
    cfg = config or default_config(rows, d, x.dtype)
    block_rows = min(cfg.bwd_block_rows, _pow2_at_least(rows))
    # Contiguous chunks of rows, a multiple of the tile, about programs_per_sm per SM.
    target = _num_sms() * cfg.bwd_programs_per_sm
    rows_per_program = triton.cdiv(triton.cdiv(rows, target), block_rows) * block_rows
    programs = triton.cdiv(rows, rows_per_program)
    n_stats = stats.shape[1]
    dx, partials = triton_call(
        x, _param(scale), stats, dy.astype(x.dtype),
        kernel=_backward_kernel,
        out_shape=(jax.ShapeDtypeStruct((rows, d), x.dtype), jax.ShapeDtypeStruct((programs, n_params, d), jnp.float32)),
        grid=(programs,),
        num_warps=cfg.bwd_num_warps,
        num_stages=cfg.bwd_num_stages,
        ROWS=rows, D=d,
        BLOCK_ROWS=block_rows, BLOCK_D=_pow2_at_least(d), ROWS_PER_PROGRAM=rows_per_program,
        IS_RMS=n_stats == 1, HAS_OFFSET=has_offset, N_STATS=n_stats, N_PARAMS=n_params,
        PREFETCH=cfg.bwd_prefetch,
    )
    sums = jnp.sum(partials, axis=0)
    return dx, sums[0], sums[1] if has_offset else None


# ----------------------------------------------------------------------------- public entry points


@functools.cache
def _differentiable(kind: str, config: TritonNormConfig | None):
    """kind: "rms", "layer" (no offset) or "layer_offset"; config None = `default_config` per shape."""
    forward = functools.partial(_forward, is_rms=kind == "rms", config=config)
    backward = functools.partial(_backward, has_offset=kind == "layer_offset", config=config)
    return differentiable_norm(NormKernels(forward=forward, backward=backward))


def rms_norm(x, scale, *, eps, config: TritonNormConfig | None = None):
    """RMSNorm over the last axis; `config` None: `default_config` for the rows each kernel sees."""
    return _differentiable("rms", config)(x, scale, None, eps=eps)


def layer_norm(x, scale, offset, *, eps, config: TritonNormConfig | None = None):
    """LayerNorm over the last axis (offset may be None); `config` as for `rms_norm`."""
    return _differentiable("layer" if offset is None else "layer_offset", config)(x, scale, offset, eps=eps)


def _supports(x, scale, offset=None, *, eps):
    del scale, offset, eps
    d = x.shape[-1] if x.ndim else 0
    if x.dtype not in _X_DTYPES:
        return f"x dtype {jnp.dtype(x.dtype).name} is not one of float32/bfloat16/float16"
    if d == 0:
        return "D=0 (empty last axis)"
    if d > MAX_D:
        return f"D={d} exceeds the {MAX_D} one-block limit of the Triton norm kernels"
    return None


def _supports_rms(x, scale, *, eps):
    return _supports(x, scale, eps=eps)


RMS_NORM = Implementation(fn=rms_norm, platforms={"gpu"}, interpretable=True, supports=_supports_rms,
                          config_type=TritonNormConfig, heuristic_config=heuristic_config,
                          candidate_configs=candidate_configs)
LAYER_NORM = Implementation(fn=layer_norm, platforms={"gpu"}, interpretable=True, supports=_supports,
                            config_type=TritonNormConfig, heuristic_config=heuristic_config,
                            candidate_configs=candidate_configs)
