"""Paged and contiguous decode attention as a Mosaic TPU kernel (forward only).

Semantics: kernels/common/paged.py and kernels/xla/paged_attention.py (one query per request at
its last key; window, soft cap; GQA).

Grid (B, max_pages), the page axis sequential ("arbitrary"). lengths and page_table are scalar-
prefetched (PrefetchScalarGridSpec), so the K/V index maps fetch page page_table[b, j] directly:
k_pages [P, page, KV, H] is viewed (a free reshape) as [P, page * KV, H] and one grid step holds
one whole page, all kv heads, as a [page * KV, H] block (its last two dims are the array's: legal
under the (8, 128) tiling rule whatever page and KV are). Steps outside the request's allowed
pages [lo // page, cdiv(L, page)) keep the previous block index (no new DMA) and skip compute.

Per step, for all N query heads at once ([N, H] q block):
    z = scale q k^T  [N, page * KV]   (column c is slot c // KV of kv head c % KV)
    z = -inf unless kv head c % KV == n // G, position j * page + c // KV in [lo, L)
and an online softmax over the steps in VMEM scratch (m, l, acc in f32). Scoring every kv
head's keys against every query head costs KV times the (idle) MXU work of a per-head dot, and
no strided sublane slicing. The last step writes out = acc / l (0 when L = 0) and lse.

decode_attention views the contiguous cache [B, S, KV, H] as B * S / page pages with the
identity page table (`contiguous_as_pages`: a free reshape when a page size in 128..8 divides S,
else S is padded, a copy); num_splits has no effect here.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from forgeax.core.registry import Implementation
from forgeax.core.runtime import interpret_enabled
from forgeax.kernels.common.batching import fold_vmap_into_rows
from forgeax.kernels.common.paged import PagedSpec, cdiv, contiguous_as_pages, split_decode_launch

_div, _rem = jax.lax.div, jax.lax.rem  # of non-negative ints: no floor-division sign fix-ups to lower


def _page_range(L, spec: PagedSpec, page: int):
    """(first, last) page index a request of length L >= 0 reads (last = -1 when L = 0)."""
    lo = jnp.maximum(L - 1 - spec.window_left, 0) if spec.window_left is not None else jnp.zeros_like(L)
    return lo, _div(lo, page), _div(L + page - 1, page) - 1

_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))


def _kernel(lens_ref, table_ref, q_ref, k_ref, v_ref, o_ref, lse_ref, m_ref, l_ref, acc_ref,
            *, spec: PagedSpec, page: int, kv: int, group: int, max_pages: int):
    del table_ref
    b, j = pl.program_id(0), pl.program_id(1)
    L = jnp.clip(lens_ref[b], 0, max_pages * page)
    lo, first, last = _page_range(L, spec, page)

    @pl.when(j == 0)
    def _():
        m_ref[...] = jnp.full_like(m_ref, -jnp.inf)
        l_ref[...] = jnp.zeros_like(l_ref)
        acc_ref[...] = jnp.zeros_like(acc_ref)

    @pl.when((j >= first) & (j <= last))
    def _():
        q = q_ref[...]
        k = k_ref[...]
        precision = jax.lax.Precision.HIGHEST if q.dtype == jnp.float32 else None
        z = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32,
                                precision=precision) * spec.scale
        if spec.logit_soft_cap is not None:
            z = spec.logit_soft_cap * jnp.tanh(z / spec.logit_soft_cap)
        col = jax.lax.broadcasted_iota(jnp.int32, z.shape, 1)
        row = jax.lax.broadcasted_iota(jnp.int32, z.shape, 0)
        s = j * page + _div(col, kv)
        ok = (_rem(col, kv) == _div(row, group)) & (s < L) & (s >= lo)
        z = jnp.where(ok, z, -jnp.inf)
        m_prev = m_ref[...]
        m_new = jnp.maximum(m_prev, jnp.max(z, axis=1, keepdims=True))
        m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        p = jnp.exp(z - m_safe)
        alpha = jnp.exp(m_prev - m_safe)
        l_ref[...] = alpha * l_ref[...] + jnp.sum(p, axis=1, keepdims=True)
        v = v_ref[...]
        acc_ref[...] = alpha * acc_ref[...] + jnp.dot(p.astype(v.dtype), v, preferred_element_type=jnp.float32,
                                                      precision=precision)
        m_ref[...] = m_new

    @pl.when(j == max_pages - 1)
    def _():
        l = l_ref[...]
        nonempty = l > 0
        o_ref[...] = (acc_ref[...] * jnp.where(nonempty, 1.0 / jnp.where(nonempty, l, 1.0), 0.0)).astype(o_ref.dtype)
        m = m_ref[...]
        lse_ref[...] = jnp.where(nonempty, jnp.where(nonempty, m, 0.0) + jnp.log(jnp.where(nonempty, l, 1.0)), -jnp.inf)


def _paged(q, k_pages, v_pages, lengths, page_table, spec: PagedSpec):
    B, N, H = q.shape
    P, page, KV, _ = k_pages.shape
    HV = v_pages.shape[3]
    max_pages = page_table.shape[1]
    kp = k_pages.reshape(P, page * KV, H)
    vp = v_pages.reshape(P, page * KV, HV)

    def page_index(b, j, lens, table):
        _, first, last = _page_range(jnp.clip(lens[b], 0, max_pages * page), spec, page)
        jj = jnp.clip(j, first, jnp.maximum(last, 0))
        return jnp.clip(table[b, jj], 0, P - 1), 0, 0

    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=2,
        grid=(B, max_pages),
        in_specs=[pl.BlockSpec((None, N, H), lambda b, j, *_: (b, 0, 0)),
                  pl.BlockSpec((None, page * KV, H), page_index),
                  pl.BlockSpec((None, page * KV, HV), page_index)],
        out_specs=[pl.BlockSpec((None, N, HV), lambda b, j, *_: (b, 0, 0)),
                   pl.BlockSpec((None, N, 1), lambda b, j, *_: (b, 0, 0))],
        scratch_shapes=[pltpu.VMEM((N, 1), jnp.float32), pltpu.VMEM((N, 1), jnp.float32),
                        pltpu.VMEM((N, HV), jnp.float32)],
    )
    kernel = functools.partial(_kernel, spec=spec, page=page, kv=KV, group=N // KV, max_pages=max_pages)
    out, lse = pl.pallas_call(
        kernel, grid_spec=grid_spec,
        out_shape=(jax.ShapeDtypeStruct((B, N, HV), q.dtype), jax.ShapeDtypeStruct((B, N, 1), jnp.float32)),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
        interpret=pltpu.InterpretParams() if interpret_enabled() else False,
    )(lengths.astype(jnp.int32), page_table.astype(jnp.int32), q, kp, vp)
    return out, (lse[..., 0] if spec.return_lse else None)


def paged_attention(q, k_pages, v_pages, lengths, page_table, *, spec: PagedSpec):
    # vmap folds into the requests (q, lengths, page_table) over a shared page pool (Pallas has no
    # batching rule for scalar-prefetched operands); a vmapped pool loops (lax.map). Sharded
    # requests / heads launch per device (split_decode_launch).
    run = split_decode_launch(lambda q, kp, vp, lens, table: _paged(q, kp, vp, lens, table, spec))
    return fold_vmap_into_rows(run, row_args=(0, 3, 4))(q, k_pages, v_pages, lengths, page_table)


def contiguous_page_size(S: int) -> int:
    """The page decode_attention views a contiguous cache in: the largest of 128..8 dividing S, else
    min(128, S rounded up to a multiple of 8) (then the cache is padded)."""
    for page in (128, 64, 32, 16, 8):
        if S % page == 0:
            return page
    return min(128, cdiv(S, 8) * 8)


def _decode(q, k, v, lengths, spec: PagedSpec):
    page = contiguous_page_size(k.shape[1])
    k_pages, table = contiguous_as_pages(k, page)
    v_pages, _ = contiguous_as_pages(v, page)
    lengths = jnp.clip(lengths.astype(jnp.int32), 0, k.shape[1])
    return _paged(q, k_pages, v_pages, lengths, table, spec)


def decode_attention(q, k, v, lengths, *, spec: PagedSpec):
    split = split_decode_launch(lambda q, k, v, lens, _: _decode(q, k, v, lens, spec))
    run = lambda q, k, v, lens: split(q, k, v, lens, None)  # noqa: E731
    return fold_vmap_into_rows(run, row_args=(0, 1, 2, 3))(q, k, v, lengths)


def _supports(q, *args, **kwargs) -> str | None:
    del args, kwargs
    if jnp.dtype(q.dtype) not in _DTYPES:
        return f"dtype {jnp.dtype(q.dtype).name} is not float32/bfloat16"
    return None


PAGED_ATTENTION = Implementation(fn=paged_attention, platforms={"tpu"}, interpretable=True, supports=_supports)
DECODE_ATTENTION = Implementation(fn=decode_attention, platforms={"tpu"}, interpretable=True, supports=_supports)
