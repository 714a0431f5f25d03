"""The backward kernels of the chunked gated linear attention (kernels/triton/gated_linear_attention.py).

With dH_c = d loss / d (the state at the end of chunk c), A the intra-chunk scores and
dA[t, s] = do_t . v_s (s <= t in a chunk), per chunk of a head:

    dH_{c-1}  = exp(B_c) dH_c + scale (q e^{b})^T do                 (states, chunks in reverse)
    dq_t = scale [ e^{b_t} (do_t h_c^T) + sum_{s <= t} dA[t, s] k_s e^{b_t - b_s} ]
    dk_s = e^{B - b_s} (v_s dH_c^T) + scale sum_{t >= s} dA[t, s] q_t e^{b_t - b_s}
    dv_s = (k_s e^{B - b_s}) dH_c + scale sum_{t >= s} A[t, s] do_t

Off-diagonal 16-row blocks use tl.dot with a reference row (every exponent <= 0), the
diagonal blocks elementwise over K, as in the forward. The d initial states are the state
gradients where a sequence starts; dq and dk come back in f32 (dg is computed from them).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import triton
import triton.language as tl

from forgeax.core.runtime import interpret_enabled
from forgeax.kernels.common.gated_linear_attention import SUB_CHUNK
from forgeax.kernels.triton.attention_tiles import dot
from forgeax.kernels.triton.launch import triton_call


def dot_mode(dtype) -> int:
    """attention_tiles.dot's mode: 2 in the interpreter (it would multiply bf16 bit patterns),
    1 for f32 (3 TF32 products: about f32 accuracy on tensor cores), 0 native 16-bit."""
    if interpret_enabled():
        return 2
    return 1 if jnp.dtype(dtype) == jnp.float32 else 0


@triton.jit
def diagonal_scores(Q_, K_, B_, rows, KD: tl.constexpr, BK: tl.constexpr, BKD: tl.constexpr):
    """A[t, s] = sum_k q_t k_s exp(b_t - b_s) for s <= t of one 16-row block (rows: [16] row
    offsets of [*, KD] arrays), elementwise over K in pieces of BKD."""
    t = tl.arange(0, 16)
    causal = (t[:, None] >= t[None, :])[:, :, None]
    scores = tl.zeros([16, 16], dtype=tl.float32)
    for kc in tl.static_range(0, BK, BKD):
        rk = kc + tl.arange(0, BKD)
        m = (rk < KD)[None, :]
        offsets = rows[:, None] * KD + rk[None, :]
        q = tl.load(Q_ + offsets, mask=m, other=0.0).to(tl.float32)
        k = tl.load(K_ + offsets, mask=m, other=0.0).to(tl.float32)
        b = tl.load(B_ + offsets, mask=m, other=0.0)
        decay = tl.exp(tl.where(causal, b[:, None, :] - b[None, :, :], float("-inf")))
        scores += tl.sum(q[:, None, :] * k[None, :, :] * decay, axis=2)
    return scores


@triton.jit
def _states_backward(Q_, B_, DO, STARTS, ENDS, DFINAL, DH, DINIT,
                     N: tl.constexpr, TP: tl.constexpr, KD: tl.constexpr, VD: tl.constexpr, NC: tl.constexpr,
                     C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, SCALE: tl.constexpr, PRECISION: tl.constexpr):
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
    dstate = tl.zeros([BK, BV], dtype=tl.float32)
    for cc in range(NC):
        c = NC - 1 - cc
        end = tl.load(ENDS + r * (NC + 1) + c + 1)
        if end >= 0:
            dstate = tl.load(DFINAL + (end * N + n) * KD * VD + tile, mask=m2, other=0.0)
        tl.store(DH + ((r * N + n) * NC + c) * KD * VD + tile, dstate, mask=m2)
        rows = (r * TP + c * C + rc) * N + n
        q = tl.load(Q_ + rows[:, None] * KD + rk[None, :], mask=mk[None, :], other=0.0)
        b = tl.load(B_ + rows[:, None] * KD + rk[None, :], mask=mk[None, :], other=0.0)
        last = tl.load(B_ + ((r * TP + c * C + C - 1) * N + n) * KD + rk, mask=mk, other=0.0)
        do = tl.load(DO + rows[:, None] * VD + rv[None, :], mask=mv[None, :], other=0.0)
        qe = (q.to(tl.float32) * tl.exp(b)).to(do.dtype)
        dstate = dstate * tl.exp(last)[:, None] + SCALE * dot(tl.trans(qe), do, PRECISION)
        start = tl.load(STARTS + r * NC + c)
        if start >= 0:
            tl.store(DINIT + (start * N + n) * KD * VD + tile, dstate, mask=m2)
            dstate = tl.zeros([BK, BV], dtype=tl.float32)


@triton.jit
def _dqk_backward(Q_, K_, V_, B_, DO, H, DH, DQ, DK,
                  N: tl.constexpr, TP: tl.constexpr, KD: tl.constexpr, VD: tl.constexpr, NC: tl.constexpr,
                  C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, SCALE: tl.constexpr, PRECISION: tl.constexpr):
    i = tl.program_id(0)
    r = (tl.program_id(1) // N).to(tl.int64)
    n = tl.program_id(1) % N
    c = i * 16 // C
    j0 = c * (C // 16)
    j1 = j0 + C // 16
    rk = tl.program_id(2) * BK + tl.arange(0, BK)
    rv = tl.arange(0, BV)
    mk = rk < KD
    mv = rv < VD
    t = tl.arange(0, 16)
    rows = (r * TP + i * 16 + t) * N + n
    q = tl.load(Q_ + rows[:, None] * KD + rk[None, :], mask=mk[None, :], other=0.0)
    k = tl.load(K_ + rows[:, None] * KD + rk[None, :], mask=mk[None, :], other=0.0)
    b = tl.load(B_ + rows[:, None] * KD + rk[None, :], mask=mk[None, :], other=0.0)
    first = tl.load(B_ + ((r * TP + i * 16) * N + n) * KD + rk, mask=mk, other=0.0)
    last_row = tl.load(B_ + ((r * TP + i * 16 + 15) * N + n) * KD + rk, mask=mk, other=0.0)
    chunk_last = tl.load(B_ + ((r * TP + c * C + C - 1) * N + n) * KD + rk, mask=mk, other=0.0)
    do = tl.load(DO + rows[:, None] * VD + rv[None, :], mask=mv[None, :], other=0.0)
    v = tl.load(V_ + rows[:, None] * VD + rv[None, :], mask=mv[None, :], other=0.0)
    dt = do.dtype
    state = ((r * N + n) * NC + c) * KD * VD + rk[:, None] * VD + rv[None, :]
    m2 = mk[:, None] & mv[None, :]
    h = tl.load(H + state, mask=m2, other=0.0)
    dh = tl.load(DH + state, mask=m2, other=0.0)
    dq = tl.exp(b) * dot(do, tl.trans(h.to(dt)), PRECISION)
    dk_state = tl.exp(chunk_last[None, :] - b) * dot(v, tl.trans(dh.to(dt)), PRECISION)
    acc = tl.zeros([16, BK], dtype=tl.float32)
    for j in range(j0, i):
        rows_j = (r * TP + j * 16 + t) * N + n
        vj = tl.load(V_ + rows_j[:, None] * VD + rv[None, :], mask=mv[None, :], other=0.0)
        kj = tl.load(K_ + rows_j[:, None] * KD + rk[None, :], mask=mk[None, :], other=0.0)
        bj = tl.load(B_ + rows_j[:, None] * KD + rk[None, :], mask=mk[None, :], other=0.0)
        da = dot(do, tl.trans(vj), PRECISION)
        ke = (kj.to(tl.float32) * tl.exp(first[None, :] - bj)).to(dt)
        acc += dot(da.to(dt), ke, PRECISION)
    dq += tl.exp(b - first[None, :]) * acc
    acc = tl.zeros([16, BK], dtype=tl.float32)
    for j in range(i + 1, j1):
        rows_j = (r * TP + j * 16 + t) * N + n
        doj = tl.load(DO + rows_j[:, None] * VD + rv[None, :], mask=mv[None, :], other=0.0)
        qj = tl.load(Q_ + rows_j[:, None] * KD + rk[None, :], mask=mk[None, :], other=0.0)
        bj = tl.load(B_ + rows_j[:, None] * KD + rk[None, :], mask=mk[None, :], other=0.0)
        da = dot(doj, tl.trans(v), PRECISION)  # [rows of j, rows of i]
        qe = (qj.to(tl.float32) * tl.exp(bj - last_row[None, :])).to(dt)
        acc += dot(tl.trans(da).to(dt), qe, PRECISION)
    dk_intra = tl.exp(last_row[None, :] - b) * acc
    causal = t[:, None] >= t[None, :]
    da = tl.where(causal, dot(do, tl.trans(v), PRECISION), 0.0)
    decay = tl.exp(tl.where(causal[:, :, None], b[:, None, :] - b[None, :, :], float("-inf")))  # [t, s, BK]
    dq += tl.sum(da[:, :, None] * k.to(tl.float32)[None, :, :] * decay, axis=1)
    dk_intra += tl.sum(da[:, :, None] * q.to(tl.float32)[:, None, :] * decay, axis=0)
    out = rows[:, None] * KD + rk[None, :]
    tl.store(DQ + out, SCALE * dq, mask=mk[None, :])
    tl.store(DK + out, dk_state + SCALE * dk_intra, mask=mk[None, :])


@triton.jit
def _dv_backward(Q_, K_, B_, DO, DH, DV,
                 N: tl.constexpr, TP: tl.constexpr, KD: tl.constexpr, VD: tl.constexpr, NC: tl.constexpr,
                 C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BKD: tl.constexpr, SCALE: tl.constexpr,
                 PRECISION: tl.constexpr):
    i = tl.program_id(0)
    r = (tl.program_id(1) // N).to(tl.int64)
    n = tl.program_id(1) % N
    c = i * 16 // C
    j1 = (c + 1) * (C // 16)
    rk = tl.arange(0, BK)
    rv = tl.program_id(2) * BV + tl.arange(0, BV)
    mk = rk < KD
    mv = rv < VD
    t = tl.arange(0, 16)
    rows = (r * TP + i * 16 + t) * N + n
    k = tl.load(K_ + rows[:, None] * KD + rk[None, :], mask=mk[None, :], other=0.0)
    b = tl.load(B_ + rows[:, None] * KD + rk[None, :], mask=mk[None, :], other=0.0)
    last_row = tl.load(B_ + ((r * TP + i * 16 + 15) * N + n) * KD + rk, mask=mk, other=0.0)
    chunk_last = tl.load(B_ + ((r * TP + c * C + C - 1) * N + n) * KD + rk, mask=mk, other=0.0)
    do = tl.load(DO + rows[:, None] * VD + rv[None, :], mask=mv[None, :], other=0.0)
    dt = do.dtype
    dh = tl.load(DH + ((r * N + n) * NC + c) * KD * VD + rk[:, None] * VD + rv[None, :],
                 mask=mk[:, None] & mv[None, :], other=0.0)
    dv = dot((k.to(tl.float32) * tl.exp(chunk_last[None, :] - b)).to(dt), dh.to(dt), PRECISION)
    ke = (k.to(tl.float32) * tl.exp(last_row[None, :] - b)).to(dt)
    acc = tl.zeros([16, BV], dtype=tl.float32)
    for j in range(i + 1, j1):
        rows_j = (r * TP + j * 16 + t) * N + n
        qj = tl.load(Q_ + rows_j[:, None] * KD + rk[None, :], mask=mk[None, :], other=0.0)
        bj = tl.load(B_ + rows_j[:, None] * KD + rk[None, :], mask=mk[None, :], other=0.0)
        doj = tl.load(DO + rows_j[:, None] * VD + rv[None, :], mask=mv[None, :], other=0.0)
        qe = (qj.to(tl.float32) * tl.exp(bj - last_row[None, :])).to(dt)
        scores = dot(qe, tl.trans(ke), PRECISION)  # [rows of j, rows of i]
        acc += dot(tl.trans(scores).to(dt), doj, PRECISION)
    scores = diagonal_scores(Q_, K_, B_, rows, KD, BK, BKD)
    acc += dot(tl.trans(scores).to(dt), do, PRECISION)
    tl.store(DV + rows[:, None] * VD + rv[None, :], dv + SCALE * acc, mask=mv[None, :])


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def gradients(q, k, v, b, starts, ends, h, do, dfinal, *, seqs: int, scale: float, chunk: int, config):
    """(dq f32, dk f32, dv f32, d initial states f32) on the chunk layout."""
    r, tp, n, kd = q.shape
    vd, nc = v.shape[3], tp // chunk
    dims = dict(N=n, TP=tp, KD=kd, VD=vd, NC=nc, C=chunk, SCALE=scale, PRECISION=dot_mode(q.dtype))
    bs = min(config.block_state, _pow2_at_least(max(kd, 16)), _pow2_at_least(max(vd, 16)))
    dh, dinit = triton_call(
        q, b, do, starts, ends, dfinal.astype(jnp.float32), kernel=_states_backward,
        out_shape=(jax.ShapeDtypeStruct(h.shape, jnp.float32), jax.ShapeDtypeStruct((seqs, n, kd, vd), jnp.float32)),
        grid=(triton.cdiv(kd, bs) * triton.cdiv(vd, bs), r * n), num_warps=config.num_warps, num_stages=2,
        BK=bs, BV=bs, **dims)
    # A sequence that is empty has no start in the tables: its slot is never written.
    written = jnp.zeros((seqs + 1,), bool).at[jnp.where(starts >= 0, starts, seqs)].set(True)[:seqs]
    dinit = jnp.where(written[:, None, None, None], dinit, 0.0)
    bk = min(config.block_k, _pow2_at_least(max(kd, 16)))
    bv_full = _pow2_at_least(max(vd, 16))
    dq, dk = triton_call(
        q, k, v, b, do, h, dh, kernel=_dqk_backward,
        out_shape=(jax.ShapeDtypeStruct(q.shape, jnp.float32), jax.ShapeDtypeStruct(q.shape, jnp.float32)),
        grid=(tp // SUB_CHUNK, r * n, triton.cdiv(kd, bk)), num_warps=config.num_warps, num_stages=2,
        BK=bk, BV=bv_full, **dims)
    bk_full = _pow2_at_least(max(kd, 16))
    bv = min(config.block_v, bv_full)
    dv = triton_call(
        q, k, b, do, dh, kernel=_dv_backward, out_shape=jax.ShapeDtypeStruct(v.shape, jnp.float32),
        grid=(tp // SUB_CHUNK, r * n, triton.cdiv(vd, bv)), num_warps=config.num_warps, num_stages=2,
        BK=bk_full, BV=bv, BKD=min(bk_full, 32), **dims)
    return dq, dk, dv, dinit
