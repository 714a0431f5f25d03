"""softcap as a Triton kernel: forward and backward, each one elementwise launch.

x is viewed as a flat vector of N elements; program i owns elements [i*BLOCK, (i+1)*BLOCK).
  forward:  y  = cap * tanh(x / cap)
  backward: dx = dy * (1 - tanh(x / cap)^2)   (recomputed from x: the only residual is x)
Math in f32, stored in x's dtype. The kernels are batch-aware: under jax.vmap,
`forgeax.triton_call` launches them once with the batch as grid axis 1 and passes each
pointer's per-example stride as `<pointer>_batch_stride` (0 when not vmapped).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import triton
import triton.language as tl

import forgeax
from forgeax import Implementation, KernelConfig

_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


@triton.jit
def _tanh(y):
    # tanh from exp (the interpreter has no libdevice); exp(-2|y|) <= 1 cannot overflow.
    e = tl.exp(-2.0 * tl.abs(y))
    th = (1.0 - e) / (1.0 + e)
    return tl.where(y < 0, -th, th)


@triton.jit
def _forward_kernel(x_ptr, y_ptr, N: tl.constexpr, CAP: tl.constexpr, BLOCK: tl.constexpr,
                    x_ptr_batch_stride: tl.constexpr = 0, y_ptr_batch_stride: tl.constexpr = 0):
    batch = tl.program_id(1)  # 0 unless vmapped
    x_ptr += batch * x_ptr_batch_stride
    y_ptr += batch * y_ptr_batch_stride
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < N
    x = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + offsets, (CAP * _tanh(x / CAP)).to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _backward_kernel(x_ptr, dy_ptr, dx_ptr, N: tl.constexpr, CAP: tl.constexpr, BLOCK: tl.constexpr,
                     x_ptr_batch_stride: tl.constexpr = 0, dy_ptr_batch_stride: tl.constexpr = 0,
                     dx_ptr_batch_stride: tl.constexpr = 0):
    batch = tl.program_id(1)
    x_ptr += batch * x_ptr_batch_stride
    dy_ptr += batch * dy_ptr_batch_stride
    dx_ptr += batch * dx_ptr_batch_stride
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < N
    x = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(dy_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    t = _tanh(x / CAP)
    tl.store(dx_ptr + offsets, (dy * (1.0 - t * t)).to(dx_ptr.dtype.element_ty), mask=mask)


@dataclasses.dataclass(frozen=True, kw_only=True)
class SoftcapConfig(KernelConfig):
    """block: elements per program (a power of two); num_warps: warps per program."""

    block: int = 1024
    num_warps: int = 4

    def validate(self) -> None:
        super().validate()
        if self.block & (self.block - 1):
            raise ValueError(f"SoftcapConfig.block: expected a power of two, got {self.block}")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"SoftcapConfig.num_warps: expected 1, 2, 4, 8 or 16, got {self.num_warps}")


def heuristic_config(x, *, cap) -> SoftcapConfig:
    del cap
    return SoftcapConfig(block=min(1024, max(16, 1 << max(0, x.size - 1).bit_length())))


def candidate_configs(x, *, cap) -> list[SoftcapConfig]:
    """The search space `forgeax.autotune` walks."""
    del x, cap
    return [SoftcapConfig(block=b, num_warps=w) for b in (512, 1024, 2048, 4096) for w in (4, 8)]


def _launch(kernel, inputs, *, cap: float, config: SoftcapConfig):
    n = inputs[0].size
    flat = [a.reshape(n) for a in inputs]
    out = forgeax.triton_call(
        *flat, kernel=kernel, out_shape=jax.ShapeDtypeStruct((n,), inputs[0].dtype),
        grid=(triton.cdiv(n, config.block),), num_warps=config.num_warps, num_stages=1,
        N=n, CAP=float(np.float32(cap)), BLOCK=config.block)
    return out.reshape(inputs[0].shape)


@functools.cache
def _differentiable(cap: float, config: SoftcapConfig):
    """The custom_vjp pattern: a forward launch, residuals, a backward launch."""

    @jax.custom_vjp
    def run(x):
        return _launch(_forward_kernel, (x,), cap=cap, config=config)

    def run_fwd(x):
        return run(x), x  # the residual: x (the backward recomputes tanh)

    def run_bwd(x, dy):
        return (_launch(_backward_kernel, (x, dy.astype(x.dtype)), cap=cap, config=config),)

    run.defvjp(run_fwd, run_bwd)
    return run


def softcap(x, *, cap: float, config: SoftcapConfig):
    if x.size == 0:
        return x
    return _differentiable(cap, config)(x)


def supports(x, *, cap) -> str | None:
    del cap
    if jnp.dtype(x.dtype) not in _DTYPES:
        return f"dtype {jnp.dtype(x.dtype).name} is not one of float32/bfloat16/float16"
    if x.size >= 2**31:
        return f"{x.size} elements: int32 offsets would overflow"
    return None


SOFTCAP = Implementation(fn=softcap, platforms={"gpu"}, interpretable=True, supports=supports,
                         config_type=SoftcapConfig, heuristic_config=heuristic_config,
                         candidate_configs=candidate_configs)
