"""The backward kernels of the chunked gated linear attention (kernels/triton/gated_linear_attention.py),
and the jit helpers both files share.

With dH_c = d loss / d (the state at the end of chunk c), A the intra-chunk scores (stored by
the forward) and dA[t, s] = scale do_t . v_s (s <= t in a chunk), per chunk of a head:

    dH_{c-1}  = exp(B_c) dH_c + scale (q e^{b})^T do                 (states, chunks in reverse)
    dq_t = scale e^{b_t} (do_t h_c^T) + sum_{s <= t} dA[t, s] k_s e^{b_t - b_s}
    dk_s = e^{B - b_s} (v_s dH_c^T)   + sum_{t >= s} dA[t, s] q_t e^{b_t - b_s}
    dv_s = (k_s e^{B - b_s}) dH_c + scale sum_{t >= s} A[t, s] do_t

Three launches: the reverse state walk (one program per [K block, V block] of a head's state),
dq/dk per (chunk, K block) and dv per (chunk, V block), on whole-chunk tiles. The intra-chunk
sums are one tl.dot each with e^{b_t - b_s} = e^{b_t} e^{-b_s} where |b| <= gate_range(dtype)
over the tile; otherwise (strongly negative gates) they split the chunk into 16-row blocks:
an off-diagonal block pair is one tl.dot with the gates taken relative to a boundary row
between them (every exponent <= 0), the diagonal blocks are elementwise over K, one gathered
row offset at a time. The d initial states are the
state gradients where a sequence starts. dg = the reverse sum over the sequence of q dq - k dk:
the dq/dk kernel stores its within-chunk part, XLA adds the later chunks' sums.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import triton
import triton.language as tl

from forgeax.core.runtime import interpret_enabled
from forgeax.kernels.triton.attention_tiles import dot
from forgeax.kernels.triton.launch import triton_call


def dot_mode(dtype) -> int:
    """attention_tiles.dot's mode: 2 in the interpreter (it would multiply bf16 bit patterns),
    1 for f32 (3 TF32 products: about f32 accuracy on tensor cores), 0 native 16-bit."""
    if interpret_enabled():
        return 2
    return 1 if jnp.dtype(dtype) == jnp.float32 else 0


def gate_range(dtype) -> float:
    """The largest |b| for which the kernels take e^{b_t - b_s} as e^{b_t} e^{-b_s} (operands
    q e^{b}, k e^{-b} of a tl.dot in the inputs' dtype; masked entries must stay finite, since
    0 * inf is NaN). f16 (max 65504, about e^11): e^6 times |k| up to ~160. bf16 / f32 (max
    about e^88, normal min about e^-87): e^50 times |k| up to ~1e16, and the masked f32 scores
    (at most K |q| |k| e^50) stay finite. The relative error is the exact path's: each term is
    rounded once, and the sums scale every term of a row by the same factor. log-sigmoid gates
    of mean -0.36 sum to about -23 over a 64-row chunk: almost every tile takes one tl.dot."""
    return 6.0 if jnp.dtype(dtype) == jnp.float16 else 50.0


def pow2_at_least(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


@triton.jit
def state_tile(N: tl.constexpr, KD: tl.constexpr, VD: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):
    """The state kernels' program: axis 0 = (K block, V block), axis 1 = row x head. Returns
    (row, head, K indices, V indices, the [BK, BV] offsets in a [KD, VD] state, its mask)."""
    nvb: tl.constexpr = (VD + BV - 1) // BV
    r = (tl.program_id(1) // N).to(tl.int64)
    n = tl.program_id(1) % N
    rk = (tl.program_id(0) // nvb) * BK + tl.arange(0, BK)
    rv = (tl.program_id(0) % nvb) * BV + tl.arange(0, BV)
    tile = rk[:, None] * VD + rv[None, :]
    return r, n, rk, rv, tile, (rk < KD)[:, None] & (rv < VD)[None, :]


@triton.jit
def chunk_program(N: tl.constexpr, TP: tl.constexpr, C: tl.constexpr):
    """The chunk kernels' program: axis 1 = chunk, axis 2 = row x head. Returns (row, head,
    chunk, the chunk's first row offset in [*, D] arrays' rows (tokens x heads), its C row offsets)."""
    c = tl.program_id(1)
    r = (tl.program_id(2) // N).to(tl.int64)
    n = tl.program_id(2) % N
    base = (r * TP + c * C) * N + n
    return r, n, c, base, base + tl.arange(0, C) * N


@triton.jit
def load_rows(X, rows, cols, D: tl.constexpr):
    """x[rows, cols] of an [*, D] array in f32, zero outside D."""
    return tl.load(X + rows[:, None] * D + cols[None, :], mask=(cols < D)[None, :], other=0.0).to(tl.float32)


@triton.jit
def chunk_outer(X_, Y_, B_, r, n, c, rk, rv, N: tl.constexpr, TP: tl.constexpr, KD: tl.constexpr, VD: tl.constexpr,
                C: tl.constexpr, TO_END: tl.constexpr, PRECISION: tl.constexpr):
    """The state walks' step for chunk c: (e^{B} [BK], (x e^{B - b})^T y if TO_END else
    (x e^{b})^T y, [BK, BV] f32); x: [*, KD] rows, y: [*, VD] rows (B: b at the chunk's last row)."""
    base = (r * TP + c * C) * N + n
    rows = base + tl.arange(0, C) * N
    x = load_rows(X_, rows, rk, KD)
    b = load_rows(B_, rows, rk, KD)
    last = tl.load(B_ + (base + (C - 1) * N) * KD + rk, mask=rk < KD, other=0.0)
    y = tl.load(Y_ + rows[:, None] * VD + rv[None, :], mask=(rv < VD)[None, :], other=0.0)
    if TO_END:
        xe = x * tl.exp(last[None, :] - b)
    else:
        xe = x * tl.exp(b)
    return tl.exp(last), dot(tl.trans(xe.to(y.dtype)), y, PRECISION)


@triton.jit
def _states_backward(Q_, B_, DO, STARTS, ENDS, DFINAL, DH, DINIT,
                     N: tl.constexpr, TP: tl.constexpr, KD: tl.constexpr, VD: tl.constexpr, NC: tl.constexpr,
                     C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, SCALE: tl.constexpr, PRECISION: tl.constexpr):
    r, n, rk, rv, tile, m2 = state_tile(N, KD, VD, BK, BV)
    dstate = tl.zeros([BK, BV], dtype=tl.float32)
    for cc in range(NC):
        c = NC - 1 - cc
        # Branch-free resets (masked loads / stores) keep the loop pipelinable.
        end = tl.load(ENDS + r * (NC + 1) + c + 1)
        dfinal = tl.load(DFINAL + (tl.maximum(end, 0) * N + n) * KD * VD + tile, mask=m2 & (end >= 0), other=0.0)
        dstate = tl.where(end >= 0, dfinal, dstate)
        tl.store(DH + ((r * N + n) * NC + c) * KD * VD + tile, dstate.to(DH.dtype.element_ty), mask=m2)
        decay, update = chunk_outer(Q_, DO, B_, r, n, c, rk, rv, N, TP, KD, VD, C, False, PRECISION)
        dstate = dstate * decay[:, None] + SCALE * update
        start = tl.load(STARTS + r * NC + c)
        tl.store(DINIT + (tl.maximum(start, 0) * N + n) * KD * VD + tile, dstate, mask=m2 & (start >= 0))
        dstate = tl.where(start >= 0, 0.0, dstate)


@triton.jit
def _dqk_exact(Q_, K_, B_, q, k, b, da, dq, dk, base, rk, N: tl.constexpr, KD: tl.constexpr, C: tl.constexpr,
               PRECISION: tl.constexpr):
    """dq, dk plus the intra-chunk terms for any gates g <= 0, every exponent <= 0."""
    t = tl.arange(0, C)
    blk = t // 16
    mk = rk < KD
    dt = Q_.dtype.element_ty
    # Off-diagonal 16-row blocks, relative to the row between them.
    for i in tl.static_range(1, C // 16):
        ref = tl.load(B_ + (base + i * 16 * N) * KD + rk, mask=mk, other=0.0)  # b at block i's first row
        ki = k * tl.exp(tl.where((blk < i)[:, None], ref[None, :] - b, float("-inf")))
        dai = tl.where((blk == i)[:, None], da, 0.0)
        rows_i = tl.exp(tl.where((blk == i)[:, None], b - ref[None, :], float("-inf")))
        dq += rows_i * dot(dai.to(dt), ki.to(dt), PRECISION)
    for j in tl.static_range(0, C // 16 - 1):
        ref = tl.load(B_ + (base + (j * 16 + 15) * N) * KD + rk, mask=mk, other=0.0)  # b at block j's last row
        qj = q * tl.exp(tl.where((blk > j)[:, None], b - ref[None, :], float("-inf")))
        daj = tl.where((blk == j)[None, :], da, 0.0)
        rows_j = tl.exp(tl.where((blk == j)[:, None], ref[None, :] - b, float("-inf")))
        dk += rows_j * dot(tl.trans(daj).to(dt), qj.to(dt), PRECISION)
    # Diagonal blocks: for each offset s, row t meets row u = 16 blk(t) + s of its own block
    # (as the key of dq_t when u <= t, as the query of dk_t when u >= t).
    for s in range(16):
        u = blk * 16 + s
        gathered = base + u * N
        qu = load_rows(Q_, gathered, rk, KD)
        ku = load_rows(K_, gathered, rk, KD)
        bu = load_rows(B_, gathered, rk, KD)
        before = (u <= t)[:, None]
        after = (u >= t)[:, None]
        decay = tl.exp(tl.where(before, b - bu, bu - b))
        da_tu = tl.sum(tl.where(t[None, :] == u[:, None], da, 0.0), axis=1)  # dA[t, u]
        da_ut = tl.sum(tl.where(t[:, None] == u[None, :], da, 0.0), axis=0)  # dA[u, t]
        dq += tl.where(before, da_tu[:, None] * ku * decay, 0.0)
        dk += tl.where(after, da_ut[:, None] * qu * decay, 0.0)
    return dq, dk


@triton.jit
def _dqk_backward(Q_, K_, V_, B_, DO, H, DH, DQ, DK, DG,
                  N: tl.constexpr, TP: tl.constexpr, KD: tl.constexpr, VD: tl.constexpr, NC: tl.constexpr,
                  C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, SCALE: tl.constexpr, PRECISION: tl.constexpr,
                  GATE_RANGE: tl.constexpr):
    r, n, c, base, rows = chunk_program(N, TP, C)
    t = tl.arange(0, C)
    rk = tl.program_id(0) * BK + tl.arange(0, BK)
    mk = rk < KD
    q = load_rows(Q_, rows, rk, KD)
    k = load_rows(K_, rows, rk, KD)
    b = load_rows(B_, rows, rk, KD)
    last = tl.load(B_ + (base + (C - 1) * N) * KD + rk, mask=mk, other=0.0)
    dt = DO.dtype.element_ty
    state = ((r * N + n) * NC + c) * KD * VD
    da = tl.zeros([C, C], dtype=tl.float32)
    dq = tl.zeros([C, BK], dtype=tl.float32)
    dk = tl.zeros([C, BK], dtype=tl.float32)
    for v0 in range(0, VD, BV):
        rv = v0 + tl.arange(0, BV)
        mv = rv < VD
        do = tl.load(DO + rows[:, None] * VD + rv[None, :], mask=mv[None, :], other=0.0)
        v = tl.load(V_ + rows[:, None] * VD + rv[None, :], mask=mv[None, :], other=0.0)
        hs = state + rk[:, None] * VD + rv[None, :]
        m2 = mk[:, None] & mv[None, :]
        h = tl.load(H + hs, mask=m2, other=0.0).to(dt)
        dh = tl.load(DH + hs, mask=m2, other=0.0).to(dt)
        da += dot(do, tl.trans(v), PRECISION)
        dq += dot(do, tl.trans(h), PRECISION)
        dk += dot(v, tl.trans(dh), PRECISION)
    da = tl.where(t[:, None] >= t[None, :], SCALE * da, 0.0)
    eb = tl.exp(b)
    dq = SCALE * eb * dq
    dk = tl.exp(last[None, :] - b) * dk
    if tl.max(tl.abs(b)) <= GATE_RANGE:
        # Gates that stay in range: e^{b_t - b_s} = e^{b_t} e^{-b_s}, one product each.
        enb = tl.exp(-b)
        dq += eb * dot(da.to(dt), (k * enb).to(dt), PRECISION)
        dk += enb * dot(tl.trans(da).to(dt), (q * eb).to(dt), PRECISION)
    else:
        dq, dk = _dqk_exact(Q_, K_, B_, q, k, b, da, dq, dk, base, rk, N, KD, C, PRECISION)
    out = rows[:, None] * KD + rk[None, :]
    tl.store(DQ + out, dq.to(DQ.dtype.element_ty), mask=mk[None, :])
    tl.store(DK + out, dk.to(DK.dtype.element_ty), mask=mk[None, :])
    # d loss / d b_t = q_t dq_t - k_t dk_t, reverse-summed inside the chunk (XLA adds the later chunks').
    tl.store(DG + out, tl.cumsum(q * dq - k * dk, axis=0, reverse=True), mask=mk[None, :])


@triton.jit
def _dv_backward(K_, B_, DO, DH, A_, DV,
                 N: tl.constexpr, TP: tl.constexpr, KD: tl.constexpr, VD: tl.constexpr, NC: tl.constexpr,
                 C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, SCALE: tl.constexpr, PRECISION: tl.constexpr):
    r, n, c, base, rows = chunk_program(N, TP, C)
    t = tl.arange(0, C)
    rv = tl.program_id(0) * BV + tl.arange(0, BV)
    mv = rv < VD
    do = tl.load(DO + rows[:, None] * VD + rv[None, :], mask=mv[None, :], other=0.0)
    dt = do.dtype
    a = tl.load(A_ + rows[:, None] * C + t[None, :])
    dv = SCALE * dot(tl.trans(a), do, PRECISION)
    for k0 in range(0, KD, BK):
        rk = k0 + tl.arange(0, BK)
        mk = rk < KD
        k = load_rows(K_, rows, rk, KD)
        b = load_rows(B_, rows, rk, KD)
        last = tl.load(B_ + (base + (C - 1) * N) * KD + rk, mask=mk, other=0.0)
        dh = tl.load(DH + ((r * N + n) * NC + c) * KD * VD + rk[:, None] * VD + rv[None, :],
                     mask=mk[:, None] & mv[None, :], other=0.0)
        dv += dot((k * tl.exp(last[None, :] - b)).to(dt), dh.to(dt), PRECISION)
    tl.store(DV + rows[:, None] * VD + rv[None, :], dv.to(DV.dtype.element_ty), mask=mv[None, :])


def gradients(q, k, v, b, starts, ends, h, a, do, dfinal, *, seqs: int, scale: float, chunk: int, config):
    """(dq, dk, dv in the inputs' dtype, d initial states f32, the within-chunk reverse sums of
    q dq - k dk f32) on the chunk layout; h the forward's chunk states, a its intra-chunk
    scores [R, Tp, N, C]."""
    r, tp, n, kd = q.shape
    vd, nc = v.shape[3], tp // chunk
    dims = dict(N=n, TP=tp, KD=kd, VD=vd, NC=nc, C=chunk, SCALE=scale, PRECISION=dot_mode(q.dtype))
    bsk, bsv = (min(config.block_state, pow2_at_least(max(d, 16))) for d in (kd, vd))
    dh, dinit = triton_call(
        q, b, do, starts, ends, dfinal.astype(jnp.float32), kernel=_states_backward,
        out_shape=(jax.ShapeDtypeStruct(h.shape, h.dtype), jax.ShapeDtypeStruct((seqs, n, kd, vd), jnp.float32)),
        grid=(triton.cdiv(kd, bsk) * triton.cdiv(vd, bsv), r * n), num_warps=config.state_warps,
        num_stages=config.num_stages, BK=bsk, BV=bsv, **dims)
    # A sequence that is empty has no start in the tables: its slot is never written.
    written = jnp.zeros((seqs + 1,), bool).at[jnp.where(starts >= 0, starts, seqs)].set(True)[:seqs]
    dinit = jnp.where(written[:, None, None, None], dinit, 0.0)
    bk = min(config.block_k, pow2_at_least(max(kd, 16)))
    bv = min(config.block_v, pow2_at_least(max(vd, 16)))
    dq, dk, dg = triton_call(
        q, k, v, b, do, h, dh, kernel=_dqk_backward,
        out_shape=(jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct(q.shape, q.dtype),
                   jax.ShapeDtypeStruct(q.shape, jnp.float32)),
        grid=(triton.cdiv(kd, bk), nc, r * n), num_warps=config.num_warps, num_stages=config.num_stages,
        BK=bk, BV=bv, GATE_RANGE=gate_range(q.dtype), **dims)
    dv = triton_call(
        k, b, do, dh, a, kernel=_dv_backward, out_shape=jax.ShapeDtypeStruct(v.shape, v.dtype),
        grid=(triton.cdiv(vd, bv), nc, r * n), num_warps=config.num_warps, num_stages=config.num_stages,
        BK=bk, BV=bv, **dims)
    return dq, dk, dv, dinit, dg

