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


@triton.jit
def row_tile(ROWS: tl.constexpr, D: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_D: tl.constexpr):
    """This program's BLOCK_ROWS x BLOCK_D tile of a row-major [ROWS, D] array (D <= BLOCK_D):
    rows, cols, row_ok, col_ok, the 2-D mask and element offsets (int64 where int32 would overflow)."""
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    if ROWS * D >= 2**31:  # element offsets would overflow int32
        rows = rows.to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    row_ok = rows < ROWS
    col_ok = cols < D
    mask = row_ok[:, None] & col_ok[None, :]
    offsets = rows[:, None] * D + cols[None, :]
    return rows, cols, row_ok, col_ok, mask, offsets
