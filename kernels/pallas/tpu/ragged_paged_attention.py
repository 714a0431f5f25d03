"""Ragged paged attention as a Mosaic TPU kernel (forward only), with interpreter support.

Semantics: kernels/common/ragged_paged_attention.py. q is laid out per kv head as
[KV, T * G, H] (row t * G + g: token t, query head kv_head * G + g), so one BlockSpec block of
BQ tokens is a [BQ * G, H] tile per kv head; the output comes back the same way.

Work items (megablox-style, built on device and scalar-prefetched): the row ranges (rows before
cu_q_lens[0], each sequence, rows past cu_q_lens[-1]) each visit the aligned BQ-token blocks they
overlap; a block shared by two sequences is visited once per sequence. Grid (items, key steps),
both "arbitrary": a key step brings PPS pages (PPS BlockSpec'd inputs whose index maps read the
sequence's page table, clamped into the item's live page range so skipped steps fetch nothing
new). Per item an online softmax (m, l, acc in f32 VMEM, all KV heads of the block) over the
steps whose keys it may see; at its last step the rows of its sequence are written into an f32
output tile that lives across the consecutive visits of one block and is stored at the last.
    z = scale <q, k> (cap * tanh(z / cap)), -inf where not allowed; m' = max(m, rowmax z);
    l = e^(m - m') l + rowsum e^(z - m'); acc = e^(m - m') acc + p v; out = acc / l (0 if l == 0)
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
from forgeax.kernels.common.attention import AttentionSpec, allowed_positions
from forgeax.kernels.common.ragged_dot import group_bounds
from forgeax.kernels.common.ragged_paged_attention import clamped_tables, row_groups, split_heads_launch

_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))
_F32 = jnp.float32


@dataclasses.dataclass(frozen=True, kw_only=True)
class RaggedPagedAttentionTpuConfig(KernelConfig):
    """block_q: query tokens per block (block_q * G must be a multiple of 8, the TPU sublanes);
    keys_per_step: keys per grid step, rounded down to whole pages (at least one)."""

    block_q: int = 16
    keys_per_step: int = 128


def heuristic_config(q, k_pages, *args, **kwargs) -> RaggedPagedAttentionTpuConfig:
    """About 128 query rows (block_q * G) per block, rounded up to whole sublanes."""
    del args, kwargs
    G = q.shape[1] // k_pages.shape[2]
    block_q = max(1, 128 // G)
    while (block_q * G) % 8:
        block_q += 1
    return RaggedPagedAttentionTpuConfig(block_q=block_q)


def _flags(key):
    """(first, last) visit of each run of equal `key` values, int32."""
    prev = jnp.concatenate([key[:1] - 1, key[:-1]])
    nxt = jnp.concatenate([key[1:], key[-1:] + 1])
    return (key != prev).astype(jnp.int32), (key != nxt).astype(jnp.int32)


def _items(cu_q_lens, kv_lens, T: int, bq: int, page: int, spec: AttentionSpec):
    """Per work item (group visiting one aligned token block), int32 [W]: sequence (-1: no
    sequence), block, first/last visit of the block, the group's rows [glo, ghi), the key
    position shift (row r sits at key r + shift), kv_len, and the live page range [plo, phi]."""
    S = kv_lens.shape[0]
    starts, ends = group_bounds(row_groups(cu_q_lens), T)
    starts = jnp.concatenate([starts, ends[-1:]])  # the rows past cu_q_lens[-1] as one more group
    ends = jnp.concatenate([ends, jnp.full((1,), T, jnp.int32)])
    g = starts.shape[0]
    blocks = -(-T // bq)
    first_b, last_b = starts // bq, jnp.maximum(ends - 1, 0) // bq
    count = jnp.where(ends > starts, last_b - first_b + 1, 0)
    cum_end = jnp.cumsum(count)
    t = jnp.arange(blocks + g, dtype=jnp.int32)
    group = jnp.minimum(jnp.searchsorted(cum_end, t, side="right"), g - 1).astype(jnp.int32)
    active = t < cum_end[-1]
    block = jnp.minimum(first_b[group] + t - (cum_end[group] - count[group]), jnp.minimum(last_b[group], blocks - 1))
    seq = jnp.where(active & (group >= 1) & (group <= S), group - 1, -1)
    sc = jnp.clip(seq, 0, S - 1)
    cu = cu_q_lens.astype(jnp.int32)
    L = jnp.where(seq >= 0, kv_lens[sc], 0)
    shift = L - (cu[sc + 1] - cu[sc]) - cu[sc]
    glo = jnp.where(active, starts[group], 0)
    ghi = jnp.where(active, ends[group], 0)
    r0, r1 = jnp.maximum(glo, block * bq), jnp.minimum(ghi, block * bq + bq)
    hi = jnp.where(r1 > r0, L, 0)
    lo = jnp.zeros_like(hi)
    if spec.right is not None:
        hi = jnp.minimum(hi, jnp.maximum(r1 + shift + spec.right, 0))
    if spec.window_left is not None:
        lo = jnp.maximum(r0 + shift - spec.window_left, 0)
    first, last = _flags(block)
    plo = lo // page
    phi = jnp.maximum((hi + page - 1) // page - 1, plo)
    return tuple(a.astype(jnp.int32) for a in (seq, block, first, last, glo, ghi, shift, L, lo, hi, plo, phi))


def _kernel(seq_ref, block_ref, first_ref, last_ref, glo_ref, ghi_ref, shift_ref, len_ref, lo_ref, hi_ref, plo_ref,
            phi_ref, table_ref, tok_ref, q_ref, *refs, spec: AttentionSpec, KV: int, bq: int, page: int, pps: int,
            steps: int):
    k_refs, v_refs = refs[:pps], refs[pps:2 * pps]
    out_ref, m_sc, l_sc, acc_sc, o_sc = refs[2 * pps:]
    w, j = pl.program_id(0), pl.program_id(1)
    keys = pps * page

    @pl.when(j == 0)
    def _():
        m_sc[...] = jnp.full_like(m_sc, -jnp.inf)
        l_sc[...] = jnp.zeros_like(l_sc)
        acc_sc[...] = jnp.zeros_like(acc_sc)

    @pl.when((j == 0) & (first_ref[w] == 1))
    def _():
        o_sc[...] = jnp.zeros_like(o_sc)

    tok = block_ref[w] * bq + tok_ref[...]  # [BQ * G, 1]
    rows_in = (tok >= glo_ref[w]) & (tok < ghi_ref[w])
    key0 = j * keys

    @pl.when((key0 < hi_ref[w]) & (key0 + keys > lo_ref[w]))
    def _():
        s = key0 + lax.broadcasted_iota(jnp.int32, (1, keys), 1)
        allowed = rows_in & (s < len_ref[w])
        positions = allowed_positions(spec, tok, s, 0, shift_ref[w])  # key position tok + shift
        if positions is not None:
            allowed = allowed & positions
        precision = lax.Precision.HIGHEST if q_ref.dtype == jnp.float32 else None
        for kh in range(KV):
            q = q_ref[kh]
            k = jnp.concatenate([r[:, kh, :] for r in k_refs], axis=0) if pps > 1 else k_refs[0][:, kh, :]
            z = spec.scale * lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=precision,
                                             preferred_element_type=_F32)
            if spec.logit_soft_cap is not None:
                z = spec.logit_soft_cap * jnp.tanh(z / spec.logit_soft_cap)
            z = jnp.where(allowed, z, -jnp.inf)
            m_prev = m_sc[kh]
            m_new = jnp.maximum(m_prev, jnp.max(z, axis=1, keepdims=True))
            m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
            p = jnp.exp(z - m_safe)
            alpha = jnp.exp(m_prev - m_safe)
            l_sc[kh] = alpha * l_sc[kh] + jnp.sum(p, axis=1, keepdims=True)
            v = jnp.concatenate([r[:, kh, :] for r in v_refs], axis=0) if pps > 1 else v_refs[0][:, kh, :]
            acc_sc[kh] = alpha * acc_sc[kh] + jnp.dot(p.astype(v.dtype), v, precision=precision, preferred_element_type=_F32)
            m_sc[kh] = m_new

    @pl.when(j == steps - 1)
    def _():
        l = l_sc[...]
        o = jnp.where(l > 0, acc_sc[...] / jnp.where(l > 0, l, 1.0), 0.0)
        o_sc[...] = jnp.where(rows_in[None], o, o_sc[...])

        @pl.when(last_ref[w] == 1)
        def _():
            out_ref[...] = o_sc[...].astype(out_ref.dtype)


def ragged_paged_attention(q, k_pages, v_pages, cu_q_lens, kv_lens, page_table, *, spec: AttentionSpec,
                           config: RaggedPagedAttentionTpuConfig):
    # Sharded heads launch per device on their own query and kv heads (split_heads_launch); with
    # one kv head the query heads stay whole: block_q * G must stay a multiple of 8.
    run = lambda *a: _launch(*a, spec=spec, config=config)  # noqa: E731
    return split_heads_launch(run, mqa_split_queries=False)(q, k_pages, v_pages, cu_q_lens, kv_lens, page_table)


def _launch(q, k_pages, v_pages, cu_q_lens, kv_lens, page_table, *, spec: AttentionSpec,
            config: RaggedPagedAttentionTpuConfig):
    T, N, H = q.shape
    P, page, KV, _ = k_pages.shape
    HV = v_pages.shape[3]
    S, maxp = page_table.shape
    G = N // KV
    bq = config.block_q
    if (bq * G) % 8:
        raise ValueError(f"RaggedPagedAttentionTpuConfig.block_q: block_q * G = {bq} * {G} must be a multiple of 8")
    pps = min(max(1, config.keys_per_step // page), maxp)
    steps = -(-maxp // pps)
    kv_lens, page_table = clamped_tables(kv_lens, page_table, P, page)
    items = _items(cu_q_lens, kv_lens, T, bq, page, spec)
    table = page_table.reshape(-1)
    qt = q.reshape(T, KV, G, H).transpose(1, 0, 2, 3).reshape(KV, T * G, H)
    tok = (jnp.arange(bq * G, dtype=jnp.int32) // G)[:, None]

    def page_map(c):
        def index(w, j, seq, block, first, last, glo, ghi, shift, L, lo, hi, plo, phi, tbl):
            p = jnp.clip(j * pps + c, plo[w], phi[w])
            return tbl[jnp.maximum(seq[w], 0) * maxp + jnp.minimum(p, maxp - 1)], 0, 0, 0
        return index

    rows_map = lambda w, j, seq, block, *_: (0, block[w], 0)  # noqa: E731
    kv_spec = lambda c, d: pl.BlockSpec((None, page, KV, d), page_map(c))  # noqa: E731
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=13,
        grid=(items[0].shape[0], steps),
        in_specs=[pl.BlockSpec((bq * G, 1), lambda *_: (0, 0)), pl.BlockSpec((KV, bq * G, H), rows_map)]
        + [kv_spec(c, H) for c in range(pps)] + [kv_spec(c, HV) for c in range(pps)],
        out_specs=pl.BlockSpec((KV, bq * G, HV), rows_map),
        scratch_shapes=[pltpu.VMEM((KV, bq * G, 1), _F32), pltpu.VMEM((KV, bq * G, 1), _F32),
                        pltpu.VMEM((KV, bq * G, HV), _F32), pltpu.VMEM((KV, bq * G, HV), _F32)],
    )
    kernel = functools.partial(_kernel, spec=spec, KV=KV, bq=bq, page=page, pps=pps, steps=steps)
    out = pl.pallas_call(
        kernel, grid_spec=grid_spec, out_shape=jax.ShapeDtypeStruct((KV, T * G, HV), q.dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary", "arbitrary")),
        interpret=pltpu.InterpretParams() if interpret_enabled() else False,
    )(*items, table, tok, qt, *([k_pages] * pps), *([v_pages] * pps))
    return out.reshape(KV, T, G, HV).transpose(1, 0, 2, 3).reshape(T, N, HV)


def supports(q, k_pages, v_pages, cu_q_lens, kv_lens, page_table, *, spec: AttentionSpec) -> str | None:
    del v_pages, cu_q_lens, kv_lens, page_table, spec
    if jnp.dtype(q.dtype) not in _DTYPES:
        return f"dtype {jnp.dtype(q.dtype).name} is not float32/bfloat16"
    if k_pages.shape[1] % 8:
        return f"page size {k_pages.shape[1]} is not a multiple of 8 (TPU sublanes)"
    return None


RAGGED_PAGED_ATTENTION = Implementation(fn=ragged_paged_attention, platforms={"tpu"}, interpretable=True, supports=supports,
                                        config_type=RaggedPagedAttentionTpuConfig, heuristic_config=heuristic_config)
