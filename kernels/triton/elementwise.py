"""@triton.jit element-wise (and small tile) helpers shared by the Triton kernels."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def tanh(y):
    """tanh from exp (the interpreter has no libdevice); exp(-2|y|) <= 1 cannot overflow."""
    e = tl.exp(-2.0 * tl.abs(y))
    th = (1.0 - e) / (1.0 + e)
    return tl.where(y < 0, -th, th)


@triton.jit
def dot(a, b, acc, DOT: tl.constexpr):
    """acc + a @ b. DOT: 0 native (16-bit inputs); 1 f32 inputs as 3 TF32 products; 2 the
    interpreter (operands upcast first: Triton 3.6's interpreter multiplies bf16 bit patterns)."""
    if DOT == 1:
        return tl.dot(a, b, acc, input_precision="tf32x3")
    elif DOT == 2:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)

