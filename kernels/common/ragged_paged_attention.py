"""Ragged paged attention: the contract every backend implements, and its shared pieces.

Layout (after `forgeax.ops.ragged_paged_attention` has checked the call):
    q [T, N, H]; k_pages [P, page_size, KV, H]; v_pages [P, page_size, KV, Hv]; N % KV == 0
    (query head n reads kv head n // (N // KV)); cu_q_lens [S + 1], kv_lens [S],
    page_table [S, max_pages], all int32. The cache layout and its clamping rules are
    kernels/common/paged.py's.

Sequence i owns the query rows [cu_q_lens[i], cu_q_lens[i + 1]) (q_len of them) and the keys
0 .. kv_len - 1 of its pages. Query j of the sequence sits at key position
pos = kv_len - q_len + j (its LAST query is aligned with its LAST key, as in ops.attention with
T = q_len, S = kv_len), so the position rule is `attention.allowed_positions(spec, j, s, q_len,
kv_len)` plus s < kv_len. Then, in f32, exactly ops.attention's math (scale, soft cap, -inf
where not allowed, softmax, 0 for a row with no allowed key). Rows that belong to no sequence
(before cu_q_lens[0] or from cu_q_lens[-1] on) give 0, as does a sequence with kv_len 0.

Backend signature: fn(q, k_pages, v_pages, cu_q_lens, kv_lens, page_table, *, spec) -> out
[T, N, Hv] in q's dtype; `spec` is an `AttentionSpec` (causal, scale, window, soft cap).

Work items (what the kernel grids walk): `row_groups` numbers the row ranges as groups for
kernels/common/ragged_dot.py's `row_tiles` (group 0: rows before cu_q_lens[0]; group i + 1:
sequence i; the tail group: rows past cu_q_lens[-1]), so a static-size table of (group, first
row, end row) tiles covers every row exactly once.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from forgeax.kernels.common.paged import clamp_lengths, clamp_page_ids
from forgeax.kernels.common.partitioning import split_launch
from forgeax.kernels.common.ragged_dot import row_tiles

Array = jax.Array

def row_groups(cu_q_lens: Array) -> Array:
    """Group sizes [S + 1] for `row_tiles`: rows before cu_q_lens[0], then each sequence's rows."""
    cu = cu_q_lens.astype(jnp.int32)
    return jnp.concatenate([cu[:1], cu[1:] - cu[:-1]])


def work_items(cu_q_lens: Array, num_rows: int, block_q: int) -> tuple[Array, Array, Array]:
    """(sequence [W], first row [W], end row [W]) int32 tiles of at most block_q rows.

    W = cdiv(num_rows, block_q) + S + 2 (static). sequence is -1 for rows of no sequence (they
    give 0); entries past the real tiles have end row <= first row (nothing to do)."""
    num_seqs = cu_q_lens.shape[0] - 1
    group, row0, row1, _ = row_tiles(row_groups(cu_q_lens), num_rows, block_q)
    seq = jnp.where((group >= 1) & (group <= num_seqs), group - 1, -1).astype(jnp.int32)
    return seq, row0, row1


def clamped_tables(kv_lens: Array, page_table: Array, num_pages: int, page_size: int) -> tuple[Array, Array]:
    """kv_lens and page ids clamped as kernels/common/paged.py says (what kernels read under jit)."""
    return clamp_lengths(kv_lens, page_table.shape[1], page_size), clamp_page_ids(page_table, num_pages)



def split_heads_launch(fn, *, mqa_split_queries: bool = True):
    """`fn(q, k_pages, v_pages, cu_q_lens, kv_lens, page_table)` -> out [T, N, Hv] as a launch the
    SPMD partitioner splits over the heads (kernels/common/partitioning.py `split_launch`): query
    heads N and kv heads KV split the same number of ways (whole GQA groups per device); with one
    kv head and `mqa_split_queries`, the query heads split alone (a kernel whose blocks need
    whole groups passes False). The packed token axis T, the pages and the sequence tables stay
    whole (replicated) on every device."""

    def call(q, k_pages, v_pages, cu_q_lens, kv_lens, page_table):
        kv = "h" if k_pages.shape[2] > 1 or not mqa_split_queries else None
        cache = (None, None, kv, None)
        heads = (None, "h", None)
        dims = (heads, cache, cache, (None,), (None,), (None, None))
        return split_launch(lambda *a: (fn(*a),), dims, ((heads, ()),))(
            q, k_pages, v_pages, cu_q_lens, kv_lens, page_table)[0]

    return call
