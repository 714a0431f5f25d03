"""Gated linear attention as chunked Triton kernels (forward and backward), on the chunk layout.

Math and layout: kernels/xla/gated_linear_attention.py and kernels/common/gated_linear_attention.py.
Arrays [R, Tp, N, *] (Tp a multiple of the chunk C); b = the f32 running sum of g inside each
chunk (XLA computes it); h_c = the [K, V] state at the start of chunk c.

Forward, two launches:
  * states: one program per (K block, V block, row x head) walks the chunks in order, storing
    h_c (f32) and the final state of each sequence that ends, loading initial states where a
    sequence starts; h_{c+1} = exp(B_c) h_c + (k * exp(B_c - b))^T v   (tl.dot);
  * output: one program per (16-row block i, row x head, V block), independent of the others:
    o_i = scale [ (q_i e^{b_i}) h_c + sum_{j < i in chunk} A_ij v_j + A_ii v_i ], an off-diagonal
    A_ij = (q_i e^{b_i - r}) (k_j e^{r - b_j})^T with r = b at block i's first row (tl.dot, every
    exponent <= 0), the diagonal A_ii elementwise over K in [16, 16, 32] pieces.
Backward, three launches (kernels/triton/gated_linear_attention_backward.py): dH (the state
gradients, chunks in reverse, d initial states where a sequence starts), dq/dk per (16-row
block, K block), dv per (16-row block, V block). dg is q dq - k dk reverse-summed within each
sequence (XLA), plus the final-state term at each sequence's end.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import triton
import triton.language as tl

from forgeax.core.config import KernelConfig
from forgeax.core.registry import Implementation
from forgeax.kernels.common.gated_linear_attention import (
    SUB_CHUNK, GLASpec, chunk_cumsum, from_layout, gate_gradient_from, kernel_supports, lightning_gates, make_layout,
    to_layout)
from forgeax.kernels.triton import gated_linear_attention_backward as backward
from forgeax.kernels.triton.attention_tiles import dot
from forgeax.kernels.triton.gated_linear_attention_backward import diagonal_scores
from forgeax.kernels.triton.launch import triton_call

MAX_HEAD_DIM = 256  # K and V: whole-K / whole-V tiles of 16 rows stay in registers up to here


@triton.jit
def _states_forward(K_, V_, B_, INIT, STARTS, ENDS, H, FINAL,
                    N: tl.constexpr, TP: tl.constexpr, KD: tl.constexpr, VD: tl.constexpr, NC: tl.constexpr,
                    C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, PRECISION: tl.constexpr):
    nvb: tl.constexpr = (VD + BV - 1) // BV
    kb = tl.program_id(0) // nvb
    vb = tl.program_id(0) % nvb
    r = (tl.program_id(1) // N).to(tl.int64)
    n = tl.program_id(1) % N
    rk = kb * BK + tl.arange(0, BK)
    rv = vb * BV + tl.arange(0, BV)
    mk = rk < KD
    mv = rv < VD
    tile = rk[:, None] * VD + rv[None, :]
    m2 = mk[:, None] & mv[None, :]
    rc = tl.arange(0, C)
    state = tl.zeros([BK, BV], dtype=tl.float32)
    for c in range(NC):
        end = tl.load(ENDS + r * (NC + 1) + c)
        if end >= 0:
            tl.store(FINAL + (end * N + n) * KD * VD + tile, state, mask=m2)
        start = tl.load(STARTS + r * NC + c)
        if start >= 0:
            state = tl.load(INIT + (start * N + n) * KD * VD + tile, mask=m2, other=0.0)
        tl.store(H + ((r * N + n) * NC + c) * KD * VD + tile, state, mask=m2)
        rows = (r * TP + c * C + rc) * N + n
        k = tl.load(K_ + rows[:, None] * KD + rk[None, :], mask=mk[None, :], other=0.0)
        b = tl.load(B_ + rows[:, None] * KD + rk[None, :], mask=mk[None, :], other=0.0)
        last = tl.load(B_ + ((r * TP + c * C + C - 1) * N + n) * KD + rk, mask=mk, other=0.0)
        v = tl.load(V_ + rows[:, None] * VD + rv[None, :], mask=mv[None, :], other=0.0)
        ke = (k.to(tl.float32) * tl.exp(last[None, :] - b)).to(v.dtype)
        state = state * tl.exp(last)[:, None] + dot(tl.trans(ke), v, PRECISION)
    end = tl.load(ENDS + r * (NC + 1) + NC)
    if end >= 0:
        tl.store(FINAL + (end * N + n) * KD * VD + tile, state, mask=m2)


@triton.jit
def _output_forward(Q_, K_, V_, B_, H, O,
                    N: tl.constexpr, TP: tl.constexpr, KD: tl.constexpr, VD: tl.constexpr, NC: tl.constexpr,
                    C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BKD: tl.constexpr, SCALE: tl.constexpr,
                    PRECISION: tl.constexpr):
    i = tl.program_id(0)
    r = (tl.program_id(1) // N).to(tl.int64)
    n = tl.program_id(1) % N
    c = i * 16 // C
    j0 = c * (C // 16)
    rk = tl.arange(0, BK)
    rv = tl.program_id(2) * BV + tl.arange(0, BV)
    mk = rk < KD
    mv = rv < VD
    rows = (r * TP + i * 16 + tl.arange(0, 16)) * N + n
    q = tl.load(Q_ + rows[:, None] * KD + rk[None, :], mask=mk[None, :], other=0.0)
    b = tl.load(B_ + rows[:, None] * KD + rk[None, :], mask=mk[None, :], other=0.0)
    ref = tl.load(B_ + ((r * TP + i * 16) * N + n) * KD + rk, mask=mk, other=0.0)
    dt = q.dtype
    h = tl.load(H + ((r * N + n) * NC + c) * KD * VD + rk[:, None] * VD + rv[None, :], mask=mk[:, None] & mv[None, :], other=0.0)
    acc = dot((q.to(tl.float32) * tl.exp(b)).to(dt), h.to(dt), PRECISION)
    qe = (q.to(tl.float32) * tl.exp(b - ref[None, :])).to(dt)
    for j in range(j0, i):
        rows_j = (r * TP + j * 16 + tl.arange(0, 16)) * N + n
        k = tl.load(K_ + rows_j[:, None] * KD + rk[None, :], mask=mk[None, :], other=0.0)
        bj = tl.load(B_ + rows_j[:, None] * KD + rk[None, :], mask=mk[None, :], other=0.0)
        ke = (k.to(tl.float32) * tl.exp(ref[None, :] - bj)).to(dt)
        scores = dot(qe, tl.trans(ke), PRECISION)
        v = tl.load(V_ + rows_j[:, None] * VD + rv[None, :], mask=mv[None, :], other=0.0)
        acc += dot(scores.to(dt), v, PRECISION)
    scores = diagonal_scores(Q_, K_, B_, rows, KD, BK, BKD)
    v = tl.load(V_ + rows[:, None] * VD + rv[None, :], mask=mv[None, :], other=0.0)
    acc += dot(scores.to(dt), v, PRECISION)
    tl.store(O + rows[:, None] * VD + rv[None, :], (SCALE * acc).to(O.dtype.element_ty), mask=mv[None, :])


# ----------------------------------------------------------------------------- config


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


@dataclasses.dataclass(frozen=True, kw_only=True)
class GLATritonConfig(KernelConfig):
    """block_state: the K and V block of the state kernels (one program per [block, block]
    piece of a head's state); block_v: the V block of the output and dv kernels; block_k: the K
    block of the dq/dk kernel; num_warps: warps per program."""

    block_state: int = 64
    block_v: int = 64
    block_k: int = 32
    num_warps: int = 4

    def validate(self) -> None:
        super().validate()
        for name in ("block_state", "block_v", "block_k"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"GLATritonConfig.{name}: expected a power of two >= 16, got {value}")
        if self.num_warps not in (1, 2, 4, 8):
            raise ValueError(f"GLATritonConfig.num_warps: expected 1, 2, 4 or 8, got {self.num_warps}")


def heuristic_config(q, k, v, *args, **kwargs) -> GLATritonConfig:
    del k, args, kwargs
    kd, vd = _pow2_at_least(max(q.shape[3], 16)), _pow2_at_least(max(v.shape[3], 16))
    return GLATritonConfig(block_state=min(64, kd, vd), block_v=min(64, vd), block_k=min(32, kd))


def candidate_configs(q, k, v, *args, **kwargs) -> list[GLATritonConfig]:
    base = heuristic_config(q, k, v, *args, **kwargs)
    return [base, base.replace(num_warps=8), base.replace(block_state=max(16, base.block_state // 2)),
            base.replace(block_v=max(16, base.block_v // 2), block_k=min(64, base.block_k * 2))]


# ----------------------------------------------------------------------------- launch


def _forward(q, k, v, b, init, starts, ends, *, scale: float, chunk: int, config: GLATritonConfig):
    r, tp, n, kd = q.shape
    vd, nc, seqs = v.shape[3], tp // chunk, init.shape[0]
    bs = min(config.block_state, _pow2_at_least(max(kd, 16)), _pow2_at_least(max(vd, 16)))
    dims = dict(N=n, TP=tp, KD=kd, VD=vd, NC=nc, C=chunk, PRECISION=backward.dot_mode(q.dtype))
    h, final = triton_call(
        k, v, b, init, starts, ends, kernel=_states_forward,
        out_shape=(jax.ShapeDtypeStruct((r, n, nc, kd, vd), jnp.float32), jax.ShapeDtypeStruct((seqs, n, kd, vd), jnp.float32)),
        grid=(triton.cdiv(kd, bs) * triton.cdiv(vd, bs), r * n), num_warps=config.num_warps, num_stages=2,
        BK=bs, BV=bs, **dims)
    bk = _pow2_at_least(max(kd, 16))
    bv = min(config.block_v, _pow2_at_least(max(vd, 16)))
    o = triton_call(
        q, k, v, b, h, kernel=_output_forward, out_shape=jax.ShapeDtypeStruct(v.shape, q.dtype),
        grid=(tp // SUB_CHUNK, r * n, triton.cdiv(vd, bv)), num_warps=config.num_warps, num_stages=2,
        BK=bk, BV=bv, BKD=min(bk, 32), SCALE=scale, **dims)
    return o, h, final


@functools.cache
def _differentiable(scale: float, chunk: int, config: GLATritonConfig):
    """(q, k, v, g, init) on the chunk layout -> (o, final states), with the backward kernels."""

    @jax.custom_vjp
    def run(q, k, v, g, init, starts, ends):
        o, _, final = _forward(q, k, v, chunk_cumsum(g, chunk), init, starts, ends, scale=scale, chunk=chunk, config=config)
        return o, final

    def run_fwd(q, k, v, g, init, starts, ends):
        b = chunk_cumsum(g, chunk)
        o, h, final = _forward(q, k, v, b, init, starts, ends, scale=scale, chunk=chunk, config=config)
        return (o, final), (q, k, v, g, b, init, starts, ends, h, final)

    def run_bwd(residuals, cotangents):
        q, k, v, g, b, init, starts, ends, h, final = residuals
        do, dfinal = cotangents
        dq, dk, dv, dinit = backward.gradients(q, k, v, b, starts, ends, h, do.astype(q.dtype), dfinal,
                                               seqs=init.shape[0], scale=scale, chunk=chunk, config=config)
        dg = gate_gradient_from(q, k, dq, dk, final, dfinal, starts, ends, chunk)
        return (dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), dg.astype(g.dtype), dinit.astype(init.dtype),
                None, None)

    run.defvjp(run_fwd, run_bwd)
    return run


def gated_linear_attention(q, k, v, g, initial_state, cu_seqlens, *, spec: GLASpec, config: GLATritonConfig):
    b, t, n, kd = q.shape
    vd = v.shape[3]
    layout = make_layout(b, t, spec.chunk_size, cu_seqlens)
    seqs = b if cu_seqlens is None else cu_seqlens.shape[0] - 1
    init = jnp.zeros((seqs, n, kd, vd), jnp.float32) if initial_state is None else initial_state.astype(jnp.float32)
    run = _differentiable(spec.scale, spec.chunk_size, config)
    o, final = run(*(to_layout(x, layout) for x in (q, k, v, g)), init, layout.starts, layout.ends)
    # An empty sequence's state passes through (its final-state slot is never written).
    final = jnp.where((layout.lengths > 0)[:, None, None, None], final, init)
    return from_layout(o, layout, t), final


def lightning_attention(q, k, v, decay, initial_state, cu_seqlens, *, spec: GLASpec, config: GLATritonConfig):
    return gated_linear_attention(q, k, v, lightning_gates(q, decay), initial_state, cu_seqlens, spec=spec, config=config)


def _supports(q, k, v, *args, spec: GLASpec) -> str | None:
    del k, args, spec
    return kernel_supports(q, v, MAX_HEAD_DIM)


GATED_LINEAR_ATTENTION = Implementation(
    fn=gated_linear_attention, platforms={"gpu"}, interpretable=True, supports=_supports, config_type=GLATritonConfig,
    heuristic_config=heuristic_config, candidate_configs=candidate_configs)
LIGHTNING_ATTENTION = Implementation(
    fn=lightning_attention, platforms={"gpu"}, interpretable=True, supports=_supports, config_type=GLATritonConfig,
    heuristic_config=heuristic_config, candidate_configs=candidate_configs)
