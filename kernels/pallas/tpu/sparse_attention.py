"""Block-sparse attention (NSA's selected branch) as Mosaic TPU kernels, with interpreter support.

NOT RUN ON A TPU: numerics are proven in Pallas' TPU interpreter against the XLA reference and
the Mosaic lowering by cross-lowering on CPU. The contract is kernels/common/sparse_attention.py.

Layout: Mosaic blocks need their last two dims to be multiples of (8, 128) or whole, so the
wrapper transposes to heads-major q [B, N, Tp, H], k/v [B, K, Sp, H] with T, S padded to whole
blocks (padded keys are masked with an iota, s < S; padded query rows are sliced off and carry
lse = +inf in the backward, so p = 0 there). lse and D travel as [B, N, Tp, 1] columns. f16 is
computed as f32 (no f16 MXU path); f32 dots run at HIGHEST.

The selection tables (kernels/common/sparse_attention.py) are scalar-prefetched into SMEM, so the
BlockSpec index maps fetch only the selected K/V (or Q) blocks:
  * forward and dQ: grid (B, N, nq, W) over the slots of `forward_table`; slots past a row's
    count repeat its last block (no new DMA) and skip the compute; f32 VMEM accumulators (m, l,
    acc / dq) live across the slots and are stored at the last one.
  * dK/dV: grid (B, K, items, G): `_dkdv_items` lists, per (b, kv head), the (key block j,
    query block i) pairs ordered by j (nq * W + nk items at most: a key block no query reads
    gets one inactive item, which stores zeros); dk, dv accumulate over a key block's items and
    the G query heads of its group, and are stored at its last item. No atomics.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from forgeax.core.config import KernelConfig
from forgeax.core.registry import Implementation
from forgeax.core.runtime import interpret_enabled
from forgeax.kernels.common.sparse_attention import (
    SparseAttentionSpec, differentiable_sparse_attention, forward_table, num_blocks, transposed_table,
)
from forgeax.kernels.pallas.interpret import without_effects

__all__ = ["SPARSE_ATTENTION", "PallasTpuSparseAttentionConfig"]

_F32 = jnp.float32
_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


@dataclasses.dataclass(frozen=True, kw_only=True)
class PallasTpuSparseAttentionConfig(KernelConfig):
    """No tiling knobs: a program is one (query or key) block of block_size rows. The VMEM limit
    of the three kernels, in MiB."""

    vmem_limit_mib: int = 64


def heuristic_config(*args, **kwargs) -> PallasTpuSparseAttentionConfig:
    del args, kwargs
    return PallasTpuSparseAttentionConfig()


def _dot(a, b, contract):
    """a . b over the given axes ((a_axis,), (b_axis,)), f32 accumulation (HIGHEST for f32)."""
    precision = lax.Precision.HIGHEST if a.dtype == _F32 else None
    return lax.dot_general(a, b, (contract, ((), ())), preferred_element_type=_F32, precision=precision)


def _logits(q, k, i, j, *, spec, T, S):
    """(z [bs, bs] masked with -inf, tanh of the cap or None) of query block i and key block j."""
    bs = spec.block_size
    z = spec.scale * _dot(q, k, ((1,), (1,)))
    th = None
    if spec.logit_soft_cap is not None:
        th = jnp.tanh(z / spec.logit_soft_cap)
        z = spec.logit_soft_cap * th
    t = i * bs + lax.broadcasted_iota(jnp.int32, (bs, bs), 0)
    s = j * bs + lax.broadcasted_iota(jnp.int32, (bs, bs), 1)
    ok = s < S
    if spec.causal:
        ok = ok & (s <= t + (S - T))
    return jnp.where(ok, z, -jnp.inf), th


def _slot(cols_ref, counts_ref, b, h, i, w, *, K, nq, W):
    """The key block of slot w of query block i (the row's last one past its count)."""
    row = (b * K + h) * nq + i
    w = jnp.maximum(jnp.minimum(w, counts_ref[row] - 1), 0)
    return cols_ref[row * W + w]


def _fwd_kernel(cols_ref, counts_ref, q_ref, k_ref, v_ref, o_ref, lse_ref, m_ref, l_ref, acc_ref, *, spec, T, S, K, G,
                nq, W):
    b, n, i, w = (pl.program_id(a) for a in range(4))
    h = lax.div(n, G)

    @pl.when(w == 0)
    def _():
        m_ref[...] = jnp.full_like(m_ref, -jnp.inf)
        l_ref[...] = jnp.zeros_like(l_ref)
        acc_ref[...] = jnp.zeros_like(acc_ref)

    @pl.when(w < counts_ref[(b * K + h) * nq + i])
    def _():
        j = _slot(cols_ref, counts_ref, b, h, i, w, K=K, nq=nq, W=W)
        z, _ = _logits(q_ref[...], k_ref[...], i, j, spec=spec, T=T, S=S)
        m = m_ref[...]
        m_new = jnp.maximum(m, jnp.max(z, axis=1, keepdims=True))
        m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        p = jnp.exp(z - m_safe)
        alpha = jnp.exp(m - m_safe)
        l_ref[...] = l_ref[...] * alpha + jnp.sum(p, axis=1, keepdims=True)
        v = v_ref[...]
        acc_ref[...] = acc_ref[...] * alpha + _dot(p.astype(v.dtype), v, ((1,), (0,)))
        m_ref[...] = m_new

    @pl.when(w == W - 1)
    def _():
        l = l_ref[...]
        nonempty = l > 0
        o_ref[...] = (acc_ref[...] * jnp.where(nonempty, 1.0 / jnp.where(nonempty, l, 1.0), 0.0)).astype(o_ref.dtype)
        m = jnp.where(m_ref[...] == -jnp.inf, 0.0, m_ref[...])
        lse_ref[...] = jnp.where(nonempty, m + jnp.log(jnp.where(nonempty, l, 1.0)), -jnp.inf)


def _dq_kernel(cols_ref, counts_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, d_ref, dq_ref, acc_ref, *, spec, T, S, K,
               G, nq, W):
    b, n, i, w = (pl.program_id(a) for a in range(4))
    h = lax.div(n, G)

    @pl.when(w == 0)
    def _():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    @pl.when(w < counts_ref[(b * K + h) * nq + i])
    def _():
        j = _slot(cols_ref, counts_ref, b, h, i, w, K=K, nq=nq, W=W)
        k = k_ref[...]
        z, th = _logits(q_ref[...], k, i, j, spec=spec, T=T, S=S)
        p = jnp.exp(z - lse_ref[...])
        dz = p * (_dot(do_ref[...], v_ref[...], ((1,), (1,))) - d_ref[...])
        if th is not None:
            dz = dz * (1.0 - th * th)
        acc_ref[...] += _dot(dz.astype(k.dtype), k, ((1,), (0,)))

    @pl.when(w == W - 1)
    def _():
        dq_ref[...] = (spec.scale * acc_ref[...]).astype(dq_ref.dtype)


def _dkdv_kernel(key_ref, query_ref, active_ref, first_ref, last_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, d_ref,
                 dk_ref, dv_ref, dk_acc, dv_acc, *, spec, T, S, K, G, L):
    b, h, x, g = (pl.program_id(a) for a in range(4))
    item = (b * K + h) * L + x

    @pl.when((first_ref[item] == 1) & (g == 0))
    def _():
        dk_acc[...] = jnp.zeros_like(dk_acc)
        dv_acc[...] = jnp.zeros_like(dv_acc)

    @pl.when(active_ref[item] == 1)
    def _():
        q, do = q_ref[...], do_ref[...]
        z, th = _logits(q, k_ref[...], query_ref[item], key_ref[item], spec=spec, T=T, S=S)
        p = jnp.exp(z - lse_ref[...])  # [queries, keys]
        dv_acc[...] += _dot(p.astype(do.dtype), do, ((0,), (0,)))
        dz = p * (_dot(do, v_ref[...], ((1,), (1,))) - d_ref[...])
        if th is not None:
            dz = dz * (1.0 - th * th)
        dk_acc[...] += _dot(dz.astype(q.dtype), q, ((0,), (0,)))

    @pl.when((last_ref[item] == 1) & (g == G - 1))
    def _():
        dk_ref[...] = (spec.scale * dk_acc[...]).astype(dk_ref.dtype)
        dv_ref[...] = dv_acc[...].astype(dv_ref.dtype)


def _dkdv_items(block_indices, spec, T, S):
    """Per (b, kv head), L = nq * W + nk items (key block, query block, active, first, last) in
    key-block order: a key block's readers, ascending, or one inactive item when it has none."""
    B, K, nq, W = block_indices.shape
    nk = num_blocks(S, spec.block_size)
    rows, counts, _ = transposed_table(block_indices, spec, T, S)  # [B, K, nk, nq], [B, K, nk]
    items = jnp.maximum(counts, 1)
    ends = jnp.cumsum(items, axis=-1)
    L = nq * min(W, nk) + nk
    x = jnp.arange(L, dtype=jnp.int32)
    key = jnp.minimum(jax.vmap(jax.vmap(lambda e: jnp.searchsorted(e, x, side="right")))(ends), nk - 1).astype(jnp.int32)
    take = lambda a: jnp.take_along_axis(a, key, axis=-1)  # noqa: E731
    pos = x - (take(ends) - take(items))
    real = x < ends[..., -1:]
    query = jnp.take_along_axis(rows.reshape(B, K, nk * nq), key * nq + jnp.clip(pos, 0, nq - 1), axis=-1)
    flags = (real & (pos < take(counts)), real & (pos == 0), real & (pos == take(items) - 1))
    return (key, query.astype(jnp.int32)) + tuple(f.astype(jnp.int32) for f in flags)


def _heads_major(a, length, dtype):
    """[B, L, heads, D] -> [B, heads, length, D] in dtype, zero-padded along L."""
    a = jnp.swapaxes(a, 1, 2).astype(dtype)
    return jnp.pad(a, ((0, 0), (0, 0), (0, length - a.shape[2]), (0, 0)))


def _compute_dtype(dtype):
    return _F32 if jnp.dtype(dtype) == jnp.dtype(jnp.float16) else dtype


def _call(kernel, *, prefetch, grid, in_specs, out_specs, out_shape, scratch, semantics, config):
    interpret = interpret_enabled()
    call = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(num_scalar_prefetch=prefetch, grid=grid, in_specs=in_specs,
                                               out_specs=out_specs, scratch_shapes=scratch),
        out_shape=out_shape,
        compiler_params=pltpu.CompilerParams(dimension_semantics=semantics,
                                             vmem_limit_bytes=config.vmem_limit_mib << 20),
        interpret=pltpu.InterpretParams() if interpret else False,
    )
    return without_effects(call, out_shape) if interpret else call


def _shapes(q, k, v, spec):
    B, T, N, H = q.shape
    S, K, Hv = k.shape[1], k.shape[2], v.shape[3]
    bs = spec.block_size
    nq, nk = num_blocks(T, bs), num_blocks(S, bs)
    return B, T, N, H, S, K, Hv, bs, nq, nk


def _row_specs(bs, G, K, nq, W):
    """Forward / dQ BlockSpecs: q-side rows (b, n, i), then k, v at the slot's key block."""
    row = lambda width: pl.BlockSpec((None, None, bs, width), lambda b, n, i, w, c, cnt: (b, n, i, 0))  # noqa: E731
    key = lambda width: pl.BlockSpec(  # noqa: E731
        (None, None, bs, width),
        lambda b, n, i, w, c, cnt: (b, lax.div(n, G), _slot(c, cnt, b, lax.div(n, G), i, w, K=K, nq=nq, W=W), 0))
    return row, key


def forward(q, k, v, block_indices, *, spec: SparseAttentionSpec, config: PallasTpuSparseAttentionConfig):
    B, T, N, H, S, K, Hv, bs, nq, nk = _shapes(q, k, v, spec)
    G = N // K
    cdt = _compute_dtype(q.dtype)
    cols, counts, _ = forward_table(block_indices, spec, T, S)
    W = cols.shape[-1]
    row, key = _row_specs(bs, G, K, nq, W)
    kernel = functools.partial(_fwd_kernel, spec=spec, T=T, S=S, K=K, G=G, nq=nq, W=W)
    out, lse = _call(
        kernel, prefetch=2, grid=(B, N, nq, W), in_specs=[row(H), key(H), key(Hv)], out_specs=[row(Hv), row(1)],
        out_shape=[jax.ShapeDtypeStruct((B, N, nq * bs, Hv), cdt), jax.ShapeDtypeStruct((B, N, nq * bs, 1), _F32)],
        scratch=[pltpu.VMEM((bs, 1), _F32), pltpu.VMEM((bs, 1), _F32), pltpu.VMEM((bs, Hv), _F32)],
        semantics=("parallel", "parallel", "parallel", "arbitrary"), config=config,
    )(cols.reshape(-1), counts.reshape(-1), _heads_major(q, nq * bs, cdt), _heads_major(k, nk * bs, cdt),
      _heads_major(v, nk * bs, cdt))
    return jnp.swapaxes(out[:, :, :T], 1, 2).astype(q.dtype), lse[:, :, :T, 0]


def backward(q, k, v, block_indices, out, lse, dout, dlse, *, spec: SparseAttentionSpec,
             config: PallasTpuSparseAttentionConfig):
    B, T, N, H, S, K, Hv, bs, nq, nk = _shapes(q, k, v, spec)
    G = N // K
    cdt = _compute_dtype(q.dtype)
    Tp = nq * bs
    delta = jnp.einsum("btnh,btnh->bnt", dout.astype(_F32), out.astype(_F32)) - dlse
    column = lambda a, fill: jnp.pad(a, ((0, 0), (0, 0), (0, Tp - T)), constant_values=fill)[..., None]  # noqa: E731
    lse_col = column(jnp.where(lse == -jnp.inf, jnp.inf, lse), jnp.inf)  # p = exp(z - inf) = 0 on empty rows
    d_col = column(delta, 0.0)
    qh, doh = _heads_major(q, Tp, cdt), _heads_major(dout, Tp, cdt)
    kh, vh = _heads_major(k, nk * bs, cdt), _heads_major(v, nk * bs, cdt)

    cols, counts, _ = forward_table(block_indices, spec, T, S)
    W = cols.shape[-1]
    row, key = _row_specs(bs, G, K, nq, W)
    dq = _call(
        functools.partial(_dq_kernel, spec=spec, T=T, S=S, K=K, G=G, nq=nq, W=W), prefetch=2,
        grid=(B, N, nq, W), in_specs=[row(H), key(H), key(Hv), row(Hv), row(1), row(1)], out_specs=row(H),
        out_shape=jax.ShapeDtypeStruct((B, N, Tp, H), cdt), scratch=[pltpu.VMEM((bs, H), _F32)],
        semantics=("parallel", "parallel", "parallel", "arbitrary"), config=config,
    )(cols.reshape(-1), counts.reshape(-1), qh, kh, vh, doh, lse_col, d_col)

    tables = _dkdv_items(block_indices, spec, T, S)
    L = tables[0].shape[-1]
    at = lambda b, h, x, key_ref, query_ref: (b * K + h) * L + x  # noqa: E731
    qside = lambda width: pl.BlockSpec(  # noqa: E731
        (None, None, bs, width), lambda b, h, x, g, kr, qr, *_: (b, h * G + g, qr[at(b, h, x, kr, qr)], 0))
    kside = lambda width: pl.BlockSpec(  # noqa: E731
        (None, None, bs, width), lambda b, h, x, g, kr, qr, *_: (b, h, kr[at(b, h, x, kr, qr)], 0))
    dk, dv = _call(
        functools.partial(_dkdv_kernel, spec=spec, T=T, S=S, K=K, G=G, L=L), prefetch=5,
        grid=(B, K, L, G), in_specs=[qside(H), kside(H), kside(Hv), qside(Hv), qside(1), qside(1)],
        out_specs=[kside(H), kside(Hv)],
        out_shape=[jax.ShapeDtypeStruct((B, K, nk * bs, H), cdt), jax.ShapeDtypeStruct((B, K, nk * bs, Hv), cdt)],
        scratch=[pltpu.VMEM((bs, H), _F32), pltpu.VMEM((bs, Hv), _F32)],
        semantics=("parallel", "parallel", "arbitrary", "arbitrary"), config=config,
    )(*(t.reshape(-1) for t in tables), qh, kh, vh, doh, lse_col, d_col)
    back = lambda a, n: jnp.swapaxes(a[:, :, :n], 1, 2)  # noqa: E731
    return back(dq, T), back(dk, S), back(dv, S)


@functools.cache
def _differentiable(config: PallasTpuSparseAttentionConfig):
    return differentiable_sparse_attention(functools.partial(forward, config=config),
                                           functools.partial(backward, config=config))


def sparse_attention(q, k, v, block_indices, *, spec: SparseAttentionSpec, config: PallasTpuSparseAttentionConfig):
    """The backend's `fn` (signature: kernels/common/sparse_attention.py)."""
    return _differentiable(config)(q, k, v, block_indices, spec=spec)


def supports(q, k, v, block_indices, *, spec: SparseAttentionSpec) -> str | None:
    del block_indices
    for name, a in (("q", q), ("k", k), ("v", v)):
        if jnp.dtype(a.dtype) not in _DTYPES:
            return f"{name} dtype {jnp.dtype(a.dtype).name} is not one of float32/bfloat16/float16"
    if spec.block_size % 16:
        return f"block_size {spec.block_size}: Mosaic blocks take multiples of 16 rows"
    if 0 in q.shape or 0 in k.shape:
        return "empty q/k/v"
    return None


SPARSE_ATTENTION = Implementation(
    fn=sparse_attention, platforms=("tpu",), interpretable=True, supports=supports,
    config_type=PallasTpuSparseAttentionConfig, heuristic_config=heuristic_config,
)
