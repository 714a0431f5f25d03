"""Gated linear attention as chunked Triton kernels (forward and backward), on the chunk layout.

Math and layout: kernels/xla/gated_linear_attention.py and kernels/common/gated_linear_attention.py.
Arrays [R, Tp, N, *] (Tp a multiple of the chunk C); b = the f32 running sum of g inside each
chunk (XLA computes it), B its last row; h_c = the [K, V] state at the start of chunk c.

Forward, two launches:
  * states: one program per (K block, V block, row x head) walks the chunks in order with the
    state in f32 registers, storing h_c (in the inputs' dtype: the tensor-core operand) and the
    final state of each sequence that ends, loading initial states where a sequence starts;
    h_{c+1} = exp(B_c) h_c + (k * exp(B_c - b))^T v   (tl.dot);
  * output: one program per (V block, chunk, row x head), whole-chunk tiles:
    o = scale [ (q e^{b}) h_c + A v ], A[t, s] = sum_k q_t k_s e^{b_t - b_s} (s <= t), built in
    registers per K block. Where |b| <= GATE_RANGE over the tile (e^{+-b} and the masked
    entries stay finite in the dot's input dtype) A = (q e^{b}) (k e^{-b})^T, one tl.dot.
    Otherwise (strongly negative gates) from 16-row blocks: an off-diagonal block row i as one
    tl.dot of (q e^{b - r_i}) and (k e^{r_i - b}) with r_i = b at block i's first row (every
    exponent <= 0, stable for any g <= 0), the diagonal blocks elementwise over K. The program
    of the first V block stores A for the backward.
Backward, three launches (kernels/triton/gated_linear_attention_backward.py): dH (the state
gradients, chunks in reverse, d initial states where a sequence starts), dq/dk per (chunk,
K block), dv per (chunk, V block). dg is q dq - k dk reverse-summed within each sequence
(inside a chunk by the dq/dk kernel, across chunks by XLA), plus the final-state term at each
sequence's end.
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
    LAYOUT, PER_CHUNK, STATES, TABLE, GLASpec, chunk_cumsum, gate_gradient_from_within, kernel_supports,
    lightning_gates, on_layout, split_by_sequences)
from forgeax.kernels.triton import gated_linear_attention_backward as backward
from forgeax.kernels.triton.attention_tiles import dot
from forgeax.kernels.triton.gated_linear_attention_backward import (
    chunk_outer, chunk_program, load_rows, pow2_at_least, state_tile)
from forgeax.kernels.triton.launch import triton_call

MAX_HEAD_DIM = 256  # K and V: the dq/dk kernel holds [C, K block] tiles and loops over V blocks


@triton.jit
def _states_forward(K_, V_, B_, INIT, STARTS, ENDS, H, FINAL,
                    N: tl.constexpr, TP: tl.constexpr, KD: tl.constexpr, VD: tl.constexpr, NC: tl.constexpr,
                    C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, PRECISION: tl.constexpr):
    r, n, rk, rv, tile, m2 = state_tile(N, KD, VD, BK, BV)
    state = tl.zeros([BK, BV], dtype=tl.float32)
    for c in range(NC):
        # Branch-free resets (masked loads / stores) keep the loop pipelinable.
        end = tl.load(ENDS + r * (NC + 1) + c)
        tl.store(FINAL + (tl.maximum(end, 0) * N + n) * KD * VD + tile, state, mask=m2 & (end >= 0))
        start = tl.load(STARTS + r * NC + c)
        init = tl.load(INIT + (tl.maximum(start, 0) * N + n) * KD * VD + tile, mask=m2 & (start >= 0), other=0.0)
        state = tl.where(start >= 0, init, state)
        tl.store(H + ((r * N + n) * NC + c) * KD * VD + tile, state.to(H.dtype.element_ty), mask=m2)
        decay, update = chunk_outer(K_, V_, B_, r, n, c, rk, rv, N, TP, KD, VD, C, True, PRECISION)
        state = state * decay[:, None] + update
    end = tl.load(ENDS + r * (NC + 1) + NC)
    tl.store(FINAL + (tl.maximum(end, 0) * N + n) * KD * VD + tile, state, mask=m2 & (end >= 0))


@triton.jit
def _output_forward(Q_, K_, V_, B_, H, O, A_,
                    N: tl.constexpr, TP: tl.constexpr, KD: tl.constexpr, VD: tl.constexpr, NC: tl.constexpr,
                    C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, SCALE: tl.constexpr,
                    PRECISION: tl.constexpr, GATE_RANGE: tl.constexpr, STORE_A: tl.constexpr):
    r, n, c, base, rows = chunk_program(N, TP, C)
    t = tl.arange(0, C)
    blk = t // 16
    rv = tl.program_id(0) * BV + tl.arange(0, BV)
    mv = rv < VD
    v = tl.load(V_ + rows[:, None] * VD + rv[None, :], mask=mv[None, :], other=0.0)
    dt = v.dtype
    state = ((r * N + n) * NC + c) * KD * VD
    acc = tl.zeros([C, BV], dtype=tl.float32)
    scores = tl.zeros([C, C], dtype=tl.float32)
    for k0 in range(0, KD, BK):
        rk = k0 + tl.arange(0, BK)
        mk = rk < KD
        q = load_rows(Q_, rows, rk, KD)
        k = load_rows(K_, rows, rk, KD)
        b = load_rows(B_, rows, rk, KD)
        h = tl.load(H + state + rk[:, None] * VD + rv[None, :], mask=mk[:, None] & mv[None, :], other=0.0)
        qe = q * tl.exp(b)
        acc += dot(qe.to(dt), h.to(dt), PRECISION)
        if tl.max(tl.abs(b)) <= GATE_RANGE:
            # Gates that stay in range: A = (q e^b)(k e^-b)^T, one product (masked below).
            scores += dot(qe.to(dt), tl.trans((k * tl.exp(-b)).to(dt)), PRECISION)
        else:
            for i in tl.static_range(1, C // 16):
                ref = tl.load(B_ + (base + i * 16 * N) * KD + rk, mask=mk, other=0.0)  # b at block i's first row
                qi = q * tl.exp(tl.where((blk == i)[:, None], b - ref[None, :], float("-inf")))
                ki = k * tl.exp(tl.where((blk < i)[:, None], ref[None, :] - b, float("-inf")))
                scores += dot(qi.to(dt), tl.trans(ki.to(dt)), PRECISION)
            # Diagonal blocks: row t meets row u = 16 blk(t) + s of its own block, u <= t.
            for s in range(16):
                u = blk * 16 + s
                gathered = base + u * N
                ku = load_rows(K_, gathered, rk, KD)
                bu = load_rows(B_, gathered, rk, KD)
                before = u <= t
                col = tl.sum(q * ku * tl.exp(tl.where(before[:, None], b - bu, float("-inf"))), axis=1)
                scores += tl.where(t[None, :] == u[:, None], col[:, None], 0.0)
    scores = tl.where(t[:, None] >= t[None, :], scores, 0.0)
    if STORE_A:
        if tl.program_id(0) == 0:
            tl.store(A_ + rows[:, None] * C + t[None, :], scores.to(A_.dtype.element_ty))
    acc += dot(scores.to(dt), v, PRECISION)
    tl.store(O + rows[:, None] * VD + rv[None, :], (SCALE * acc).to(O.dtype.element_ty), mask=mv[None, :])


# ----------------------------------------------------------------------------- config


@dataclasses.dataclass(frozen=True, kw_only=True)
class GLATritonConfig(KernelConfig):
    """block_state: the K and V block of the two state kernels (one program per [block, block]
    piece of a head's state), run with state_warps warps; block_k: the K block (a loop in the
    output and dv kernels, a grid axis of dq/dk); block_v: the V block (a grid axis of the
    output and dv kernels, a loop in dq/dk); num_warps: warps of the chunk kernels; num_stages:
    software pipelining depth of every kernel's loop."""

    block_state: int = 64
    block_k: int = 32
    block_v: int = 128
    num_warps: int = 8
    state_warps: int = 4
    num_stages: int = 2

    def validate(self) -> None:
        super().validate()
        for name in ("block_state", "block_v", "block_k"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"GLATritonConfig.{name}: expected a power of two >= 16, got {value}")
        for name in ("num_warps", "state_warps"):
            if getattr(self, name) not in (1, 2, 4, 8, 16):
                raise ValueError(f"GLATritonConfig.{name}: expected 1, 2, 4, 8 or 16, got {getattr(self, name)}")
        if not 1 <= self.num_stages <= 5:
            raise ValueError(f"GLATritonConfig.num_stages: expected 1 to 5, got {self.num_stages}")


def heuristic_config(q, k, v, *args, spec: GLASpec | None = None, **kwargs) -> GLATritonConfig:
    """H100, K = V = 128, chunk 64: 64x64 state pieces (4 programs per head keep the SMs busy
    during the sequential walk), a whole 128-wide V block (A built once per chunk), K in 32-wide
    steps, 8 warps for the [64, 128] f32 accumulators (ptxas for sm_90: no spills; a 64-wide
    K block spills in dq/dk)."""
    del k, args, kwargs
    kd, vd = pow2_at_least(max(q.shape[3], 16)), pow2_at_least(max(v.shape[3], 16))
    chunk = spec.chunk_size if spec is not None else 64
    block_v = min(128, vd)
    return GLATritonConfig(block_state=min(64, max(kd, vd)), block_k=min(32, kd), block_v=block_v,
                           num_warps=8 if chunk * block_v >= 64 * 128 else 4)


def candidate_configs(q, k, v, *args, **kwargs) -> list[GLATritonConfig]:
    base = heuristic_config(q, k, v, *args, **kwargs)
    kd, vd = pow2_at_least(max(q.shape[3], 16)), pow2_at_least(max(v.shape[3], 16))
    changes = [{}, {"num_warps": 4}, {"num_stages": 1}, {"num_stages": 3}, {"block_k": min(kd, base.block_k * 2)},
               {"block_k": max(16, base.block_k // 2)}, {"block_v": max(16, base.block_v // 2)},
               {"block_state": min(128, max(kd, vd)), "state_warps": 8}, {"block_state": 32}, {"state_warps": 8}]
    configs: list[GLATritonConfig] = []
    for change in changes:
        config = base.replace(**change)
        if config not in configs:
            configs.append(config)
    return configs


# ----------------------------------------------------------------------------- launch


def _forward(q, k, v, b, init, starts, ends, *, scale: float, chunk: int, config: GLATritonConfig, store_a: bool):
    """(o, h [R, N, NC, K, V] in q's dtype, final states f32, A [R, Tp, N, C] or a placeholder)."""
    r, tp, n, kd = q.shape
    vd, nc, seqs = v.shape[3], tp // chunk, init.shape[0]
    dims = dict(N=n, TP=tp, KD=kd, VD=vd, NC=nc, C=chunk, PRECISION=backward.dot_mode(q.dtype))
    bsk, bsv = (min(config.block_state, pow2_at_least(max(d, 16))) for d in (kd, vd))
    h, final = triton_call(
        k, v, b, init, starts, ends, kernel=_states_forward,
        out_shape=(jax.ShapeDtypeStruct((r, n, nc, kd, vd), q.dtype), jax.ShapeDtypeStruct((seqs, n, kd, vd), jnp.float32)),
        grid=(triton.cdiv(kd, bsk) * triton.cdiv(vd, bsv), r * n), num_warps=config.state_warps,
        num_stages=config.num_stages, BK=bsk, BV=bsv, **dims)
    bk = min(config.block_k, pow2_at_least(max(kd, 16)))
    bv = min(config.block_v, pow2_at_least(max(vd, 16)))
    a_shape = (r, tp, n, chunk) if store_a else (1,)
    o, a = triton_call(
        q, k, v, b, h, kernel=_output_forward,
        out_shape=(jax.ShapeDtypeStruct(v.shape, q.dtype), jax.ShapeDtypeStruct(a_shape, q.dtype)),
        grid=(triton.cdiv(vd, bv), nc, r * n), num_warps=config.num_warps, num_stages=config.num_stages,
        BK=bk, BV=bv, SCALE=scale, GATE_RANGE=backward.gate_range(q.dtype), STORE_A=store_a, **dims)
    return o, h, final, a


@functools.cache
def _differentiable(scale: float, chunk: int, config: GLATritonConfig):
    """(q, k, v, g, init) on the chunk layout -> (o, final states), with the backward kernels."""

    # Each launch (with the XLA steps that index states by the tables) runs on a sharded call's
    # local rows and heads (split_by_sequences).
    def forward(q, k, v, b, init, starts, ends, store_a):
        o, h, final, a = _forward(q, k, v, b, init, starts, ends, scale=scale, chunk=chunk, config=config,
                                  store_a=store_a)
        return (o, final, h, a) if store_a else (o, final)

    inputs = (LAYOUT,) * 4 + (STATES, TABLE, TABLE)
    forward_only = split_by_sequences(functools.partial(forward, store_a=False), inputs, (LAYOUT, STATES))
    forward_saving = split_by_sequences(functools.partial(forward, store_a=True), inputs,
                                        (LAYOUT, STATES, PER_CHUNK, LAYOUT))

    def gradients(q, k, v, b, starts, ends, h, a, do, dfinal, final):
        dq, dk, dv, dinit, within = backward.gradients(q, k, v, b, starts, ends, h, a, do, dfinal,
                                                       seqs=dfinal.shape[0], scale=scale, chunk=chunk, config=config)
        return dq, dk, dv, dinit, gate_gradient_from_within(within, final, dfinal, starts, ends, chunk)

    local_gradients = split_by_sequences(gradients, (LAYOUT,) * 4 + (TABLE, TABLE, PER_CHUNK, LAYOUT, LAYOUT, STATES, STATES),
                                         (LAYOUT,) * 3 + (STATES, LAYOUT))

    @jax.custom_vjp
    def run(q, k, v, g, init, starts, ends):
        return forward_only(q, k, v, chunk_cumsum(g, chunk), init, starts, ends)

    def run_fwd(q, k, v, g, init, starts, ends):
        b = chunk_cumsum(g, chunk)
        o, final, h, a = forward_saving(q, k, v, b, init, starts, ends)
        return (o, final), (q, k, v, g, b, init, starts, ends, h, a, final)

    def run_bwd(residuals, cotangents):
        q, k, v, g, b, init, starts, ends, h, a, final = residuals
        do, dfinal = cotangents
        dq, dk, dv, dinit, dg = local_gradients(q, k, v, b, starts, ends, h, a, do.astype(q.dtype), dfinal, final)
        return dq, dk, dv, dg.astype(g.dtype), dinit.astype(init.dtype), None, None

    run.defvjp(run_fwd, run_bwd)
    return run


def gated_linear_attention(q, k, v, g, initial_state, cu_seqlens, *, spec: GLASpec, config: GLATritonConfig):
    return on_layout(_differentiable(spec.scale, spec.chunk_size, config), q, k, v, g, initial_state, cu_seqlens,
                     spec.chunk_size)


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
