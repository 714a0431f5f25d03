"""Gated linear attention as Mosaic TPU kernels: one sequential walk over the chunks per head.

Math and layout: kernels/xla/gated_linear_attention.py and kernels/common/gated_linear_attention.py.
XLA moves the arrays to [R, N, Tp, *] (so a chunk block is (C, K): whole K, C rows) and
computes b, the running sum of g inside each chunk. Grid (R, N, chunks), the chunk axis
sequential; the state is carried in VMEM, transposed ([V, K]: the per-K decay then scales
lanes, and every product is an NN, NT or TN matmul).

  forward, chunk c: (restart from the initial state where a sequence starts) store h_c;
    o = scale [ (q e^b) h_c + intra ];  h <- e^{B} h + (k e^{B - b})^T v;  store the end state.
  backward, chunks in reverse: dH (the end-state gradient; a sequence's final-state cotangent
    where it ends) gives the inter-chunk parts of dq, dk, dv; the intra-chunk parts come from
    16-row blocks; dH <- e^{B} dH + scale (q e^b)^T do, stored as the start-state gradient.
Intra-chunk, 16-row blocks i, j: off-diagonal scores (q_i e^{b_i - r}) (k_j e^{r - b_j})^T with
r a row of b between them (exponents <= 0); a diagonal block one column (or row) at a time,
elementwise over K. Final states and d initial states are gathered by XLA from the per-chunk
end states / start-state gradients. dg: kernels/common/gated_linear_attention.py.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from forgeax.core.registry import Implementation
from forgeax.core.runtime import interpret_enabled
from forgeax.kernels.common.gated_linear_attention import (
    LAYOUT, PER_CHUNK, STATES, SUB_CHUNK, TABLE, GLASpec, chunk_cumsum, gate_gradient_from, kernel_supports,
    lightning_gates, on_layout, split_by_sequences)

_F32 = jnp.float32
MAX_HEAD_DIM = 256
_NT = (((1,), (1,)), ((), ()))  # a @ b^T
_TN = (((0,), (0,)), ((), ()))  # a^T @ b


def _nt(a, b):
    return jax.lax.dot_general(a, b, _NT, preferred_element_type=_F32)


def _tn(a, b):
    return jax.lax.dot_general(a, b, _TN, preferred_element_type=_F32)


def _dot(a, b):
    return jnp.dot(a, b, preferred_element_type=_F32)


def _column(m, s):
    """Column s of a (16, 16) value as (16, 1)."""
    lanes = jax.lax.broadcasted_iota(jnp.int32, m.shape, 1)
    return jnp.sum(jnp.where(lanes == s, m, 0.0), axis=1, keepdims=True)


def _rows(x, i):
    return x[i * SUB_CHUNK:(i + 1) * SUB_CHUNK]


def _diagonal_scores(q, k, b):
    """A[t, s] = sum_k q_t k_s e^{b_t - b_s}, s <= t, of one (16, K) block."""
    t = jax.lax.broadcasted_iota(jnp.int32, (SUB_CHUNK, 1), 0)
    lanes = jax.lax.broadcasted_iota(jnp.int32, (SUB_CHUNK, SUB_CHUNK), 1)
    scores = jnp.zeros((SUB_CHUNK, SUB_CHUNK), _F32)
    for s in range(SUB_CHUNK):
        decay = jnp.exp(jnp.where(t >= s, b - b[s:s + 1], -jnp.inf))
        col = jnp.sum(q * k[s:s + 1] * decay, axis=1, keepdims=True)
        scores = scores + jnp.where(lanes == s, col, 0.0)
    return scores


def _forward_kernel(starts, ends, q_ref, k_ref, v_ref, b_ref, init_ref, o_ref, h_ref, hend_ref, state_ref, *,
                    scale, chunks):
    del ends
    r, c = pl.program_id(0), pl.program_id(2)

    @pl.when(c == 0)
    def _():
        state_ref[...] = jnp.zeros_like(state_ref)

    @pl.when(starts[r * chunks + c] >= 0)
    def _():
        state_ref[...] = init_ref[...]

    state = state_ref[...]
    h_ref[...] = state
    q, k, v, b = (x[...].astype(_F32) for x in (q_ref, k_ref, v_ref, b_ref))
    dt = v_ref.dtype
    o_ref[...] = (scale * _nt((q * jnp.exp(b)).astype(dt), state.astype(dt))).astype(o_ref.dtype)
    for i in range(q.shape[0] // SUB_CHUNK):
        qi, bi = _rows(q, i), _rows(b, i)
        ref = bi[0:1]
        qe = (qi * jnp.exp(bi - ref)).astype(dt)
        acc = _dot(_diagonal_scores(qi, _rows(k, i), bi).astype(dt), _rows(v, i).astype(dt))
        for j in range(i):
            ke = (_rows(k, j) * jnp.exp(ref - _rows(b, j))).astype(dt)
            acc = acc + _dot(_nt(qe, ke).astype(dt), _rows(v, j).astype(dt))
        rows = pl.ds(i * SUB_CHUNK, SUB_CHUNK)
        o_ref[rows, :] = (o_ref[rows, :].astype(_F32) + scale * acc).astype(o_ref.dtype)
    last = b[-1:]
    state = state * jnp.exp(last) + _tn(v.astype(dt), (k * jnp.exp(last - b)).astype(dt))
    state_ref[...] = state
    hend_ref[...] = state


def _backward_kernel(starts, ends, q_ref, k_ref, v_ref, b_ref, do_ref, h_ref, dfinal_ref,
                     dq_ref, dk_ref, dv_ref, dstart_ref, dstate_ref, *, scale, chunks):
    r, step = pl.program_id(0), pl.program_id(2)
    c = chunks - 1 - step

    @pl.when(step == 0)
    def _():
        dstate_ref[...] = jnp.zeros_like(dstate_ref)

    @pl.when(ends[r * (chunks + 1) + c + 1] >= 0)
    def _():
        dstate_ref[...] = dfinal_ref[...]

    dh = dstate_ref[...]  # [V, K]: d loss / d (the state at the chunk's end), transposed
    q, k, v, b, do = (x[...].astype(_F32) for x in (q_ref, k_ref, v_ref, b_ref, do_ref))
    dt = v_ref.dtype
    last = b[-1:]
    h = h_ref[...].astype(dt)
    dq_ref[...] = scale * jnp.exp(b) * _dot(do.astype(dt), h)
    dk_ref[...] = jnp.exp(last - b) * _dot(v.astype(dt), dh.astype(dt))
    dv_ref[...] = _nt((k * jnp.exp(last - b)).astype(dt), dh.astype(dt))
    blocks = q.shape[0] // SUB_CHUNK
    t = jax.lax.broadcasted_iota(jnp.int32, (SUB_CHUNK, 1), 0)
    for i in range(blocks):
        qi, ki, vi, bi, doi = (_rows(x, i) for x in (q, k, v, b, do))
        first, final = bi[0:1], bi[-1:]
        dq = jnp.zeros_like(qi)
        for j in range(i):
            da = _nt(doi.astype(dt), _rows(v, j).astype(dt))
            dq = dq + _dot(da.astype(dt), (_rows(k, j) * jnp.exp(first - _rows(b, j))).astype(dt))
        dq = dq * jnp.exp(bi - first)
        dk = jnp.zeros_like(ki)
        dv = jnp.zeros_like(vi)
        ke = (ki * jnp.exp(final - bi)).astype(dt)
        for j in range(i + 1, blocks):
            qe = (_rows(q, j) * jnp.exp(_rows(b, j) - final)).astype(dt)
            dk = dk + _tn(_nt(_rows(do, j).astype(dt), vi.astype(dt)).astype(dt), qe)
            dv = dv + _tn(_nt(qe, ke).astype(dt), _rows(do, j).astype(dt))
        dk = dk * jnp.exp(final - bi)
        causal = jax.lax.broadcasted_iota(jnp.int32, (SUB_CHUNK, SUB_CHUNK), 0) >= jax.lax.broadcasted_iota(
            jnp.int32, (SUB_CHUNK, SUB_CHUNK), 1)
        da = jnp.where(causal, _nt(doi, vi), 0.0)  # [t, s]
        da_t = jnp.where(causal.T, _nt(vi, doi), 0.0)  # [s, t]
        for s in range(SUB_CHUNK):
            dq = dq + _column(da, s) * ki[s:s + 1] * jnp.exp(jnp.where(t >= s, bi - bi[s:s + 1], -jnp.inf))
            dk = dk + _column(da_t, s) * qi[s:s + 1] * jnp.exp(jnp.where(t <= s, bi[s:s + 1] - bi, -jnp.inf))
        dv = dv + _tn(_diagonal_scores(qi, ki, bi).astype(dt), doi.astype(dt))
        rows = pl.ds(i * SUB_CHUNK, SUB_CHUNK)
        dq_ref[rows, :] = dq_ref[rows, :] + scale * dq
        dk_ref[rows, :] = dk_ref[rows, :] + scale * dk
        dv_ref[rows, :] = dv_ref[rows, :] + scale * dv
    dh = dh * jnp.exp(last) + scale * _tn(do.astype(dt), (q * jnp.exp(b)).astype(dt))
    dstart_ref[...] = dh

    @pl.when(starts[r * chunks + c] >= 0)
    def _():
        dstate_ref[...] = jnp.zeros_like(dstate_ref)

    @pl.when(starts[r * chunks + c] < 0)
    def _():
        dstate_ref[...] = dh


def _call(kernel, scalars, arrays, specs, out_shape, out_specs, scratch, grid):
    return pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(num_scalar_prefetch=len(scalars), grid=grid, in_specs=specs,
                                               out_specs=out_specs, scratch_shapes=scratch),
        out_shape=out_shape,
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary")),
        interpret=pltpu.InterpretParams() if interpret_enabled() else False,
    )(*scalars, *arrays)


def _forward(q, k, v, b, init, starts, ends, *, scale, chunk):
    """On [R, N, Tp, *]: (o, h [R, N, NC, V, K] start states, end states likewise); init [S, N, V, K]."""
    r, n, tp, kd = q.shape
    vd, nc = v.shape[3], tp // chunk
    rows = lambda d: pl.BlockSpec((None, None, chunk, d), lambda ri, ni, c, st, en: (ri, ni, c, 0))  # noqa: E731
    state = pl.BlockSpec((None, None, None, vd, kd), lambda ri, ni, c, st, en: (ri, ni, c, 0, 0))
    init_spec = pl.BlockSpec((None, None, vd, kd), lambda ri, ni, c, st, en: (jnp.maximum(st[ri * nc + c], 0), ni, 0, 0))
    states = jax.ShapeDtypeStruct((r, n, nc, vd, kd), _F32)
    return _call(functools.partial(_forward_kernel, scale=scale, chunks=nc), (starts.reshape(-1), ends.reshape(-1)),
                 (q, k, v, b, init), [rows(kd), rows(kd), rows(vd), rows(kd), init_spec],
                 (jax.ShapeDtypeStruct(v.shape, q.dtype), states, states), (rows(vd), state, state),
                 [pltpu.VMEM((vd, kd), _F32)], (r, n, nc))


def _backward(q, k, v, b, do, h, dfinal, starts, ends, *, scale, chunk):
    r, n, tp, kd = q.shape
    vd, nc = v.shape[3], tp // chunk
    rows = lambda d: pl.BlockSpec((None, None, chunk, d), lambda ri, ni, s, st, en: (ri, ni, nc - 1 - s, 0))  # noqa: E731
    state = pl.BlockSpec((None, None, None, vd, kd), lambda ri, ni, s, st, en: (ri, ni, nc - 1 - s, 0, 0))
    dfinal_spec = pl.BlockSpec((None, None, vd, kd), lambda ri, ni, s, st, en: (
        jnp.maximum(en[ri * (nc + 1) + nc - s], 0), ni, 0, 0))
    f32 = lambda x: jax.ShapeDtypeStruct(x.shape, _F32)  # noqa: E731
    return _call(functools.partial(_backward_kernel, scale=scale, chunks=nc), (starts.reshape(-1), ends.reshape(-1)),
                 (q, k, v, b, do, h, dfinal), [rows(kd), rows(kd), rows(vd), rows(kd), rows(vd), state, dfinal_spec],
                 (f32(q), f32(k), f32(v), f32(h)), (rows(kd), rows(kd), rows(vd), state),
                 [pltpu.VMEM((vd, kd), _F32)], (r, n, nc))


def _heads_first(x):
    return jnp.swapaxes(x, 1, 2)


def _per_sequence(per_chunk, table, seqs):
    """[R, N, NC, V, K] per chunk -> [S, N, K, V] at the chunk each sequence's table entry names."""
    values = jnp.swapaxes(jnp.moveaxis(per_chunk, 2, 1), -1, -2)  # [R, NC, N, K, V]
    return jnp.zeros((seqs + 1,) + values.shape[2:], _F32).at[jnp.where(table >= 0, table, seqs)].set(values)[:seqs]


@functools.cache
def _differentiable(scale: float, chunk: int):
    # Each launch, with the XLA steps that index states by the tables, runs on a sharded call's
    # local rows and heads (split_by_sequences).
    def forward(q, k, v, b, init, starts, ends):
        o, h, hend = _forward(*(_heads_first(x) for x in (q, k, v, b)), jnp.swapaxes(init, -1, -2), starts, ends,
                              scale=scale, chunk=chunk)
        return _heads_first(o), _per_sequence(hend, ends[:, 1:], init.shape[0]), h

    local_forward = split_by_sequences(forward, (LAYOUT,) * 4 + (STATES, TABLE, TABLE), (LAYOUT, STATES, PER_CHUNK))

    def backward(q, k, v, b, do, h, final, dfinal, starts, ends):
        dq, dk, dv, dstart = _backward(*(_heads_first(x) for x in (q, k, v, b, do)), h,
                                       jnp.swapaxes(dfinal, -1, -2), starts, ends, scale=scale, chunk=chunk)
        dq, dk, dv = (_heads_first(x) for x in (dq, dk, dv))
        dinit = _per_sequence(dstart, starts, final.shape[0])
        return dq, dk, dv, dinit, gate_gradient_from(q, k, dq, dk, final, dfinal, starts, ends, chunk)

    local_backward = split_by_sequences(backward, (LAYOUT,) * 5 + (PER_CHUNK, STATES, STATES, TABLE, TABLE),
                                        (LAYOUT,) * 3 + (STATES, LAYOUT))

    @jax.custom_vjp
    def run(q, k, v, g, init, starts, ends):
        return local_forward(q, k, v, chunk_cumsum(g, chunk), init, starts, ends)[:2]

    def run_fwd(q, k, v, g, init, starts, ends):
        b = chunk_cumsum(g, chunk)
        o, final, h = local_forward(q, k, v, b, init, starts, ends)
        return (o, final), (q, k, v, g, b, h, init, final, starts, ends)

    def run_bwd(residuals, cotangents):
        q, k, v, g, b, h, init, final, starts, ends = residuals
        do, dfinal = cotangents
        dq, dk, dv, dinit, dg = local_backward(q, k, v, b, do.astype(q.dtype), h, final, dfinal, starts, ends)
        return (dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), dg.astype(g.dtype), dinit.astype(init.dtype),
                None, None)

    run.defvjp(run_fwd, run_bwd)
    return run


def gated_linear_attention(q, k, v, g, initial_state, cu_seqlens, *, spec: GLASpec):
    return on_layout(_differentiable(spec.scale, spec.chunk_size), q, k, v, g, initial_state, cu_seqlens, spec.chunk_size)


def lightning_attention(q, k, v, decay, initial_state, cu_seqlens, *, spec: GLASpec):
    return gated_linear_attention(q, k, v, lightning_gates(q, decay), initial_state, cu_seqlens, spec=spec)


def _supports(q, k, v, *args, spec: GLASpec) -> str | None:
    del k, args, spec
    return kernel_supports(q, v, MAX_HEAD_DIM)


GATED_LINEAR_ATTENTION = Implementation(fn=gated_linear_attention, platforms={"tpu"}, interpretable=True,
                                        supports=_supports)
LIGHTNING_ATTENTION = Implementation(fn=lightning_attention, platforms={"tpu"}, interpretable=True, supports=_supports)
