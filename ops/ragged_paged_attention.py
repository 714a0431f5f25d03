"""Mixed prefill + decode attention over a paged KV cache (continuous batching): `ragged_paged_attention`."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Integer

from forgeax.core import KernelConfig, Selection, define_op
from forgeax.kernels.common.attention import AttentionSpec
from forgeax.kernels.common.paged import check_page_table, check_paged_shapes, is_concrete
from forgeax.ops import checks
from forgeax.ops.paged_attention import _forward_only


def _features(args, kwargs) -> dict:
    """What rules/ragged_paged_attention.json may read of a call."""
    q, k_pages = args[0], args[1]
    spec: AttentionSpec = kwargs["spec"]
    return {"dtype": q.dtype.name, "group": q.shape[1] // k_pages.shape[2], "head_dim": q.shape[2],
            "page_size": k_pages.shape[1], "causal": spec.causal, "window": spec.window_left is not None,
            "soft_cap": spec.logit_soft_cap is not None}


RAGGED_PAGED_ATTENTION = define_op(
    "ragged_paged_attention",
    {
        "xla": "forgeax.kernels.xla.ragged_paged_attention:RAGGED_PAGED_ATTENTION",
        "triton": "forgeax.kernels.triton.ragged_paged_attention:RAGGED_PAGED_ATTENTION",
        "pallas_tpu": "forgeax.kernels.pallas.tpu.ragged_paged_attention:RAGGED_PAGED_ATTENTION",
    },
    selection=Selection.load("forgeax.ops", "rules/ragged_paged_attention.json"),
    features=_features,
)


def _check_cu_q_lens(cu_q_lens, num_rows: int) -> int:
    checks.integer_array("cu_q_lens", cu_q_lens)
    if cu_q_lens.ndim != 1 or cu_q_lens.shape[0] < 2:
        raise ValueError(f"cu_q_lens: expected shape [S + 1] with S >= 1 sequences, got {tuple(cu_q_lens.shape)}")
    if is_concrete(cu_q_lens):
        cu = np.asarray(cu_q_lens).astype(np.int64)
        down = np.nonzero(np.diff(cu) < 0)[0]
        if down.size:
            i = int(down[0])
            raise ValueError(f"cu_q_lens: must be nondecreasing, got cu_q_lens[{i}] = {cu[i]} > "
                             f"cu_q_lens[{i + 1}] = {cu[i + 1]}")
        if cu[0] < 0 or cu[-1] > num_rows:
            raise ValueError(f"cu_q_lens: values must lie in [0, q.shape[0] = {num_rows}], got first {cu[0]} "
                             f"and last {cu[-1]}")
    return int(cu_q_lens.shape[0]) - 1


def ragged_paged_attention(
    q: Float[Array, "T N H"],
    k_pages: Float[Array, "P page KV H"],
    v_pages: Float[Array, "P page KV Hv"],
    cu_q_lens: Integer[Array, "S+1"],
    kv_lens: Integer[Array, "S"],
    page_table: Integer[Array, "S M"],
    *,
    causal: bool = True,
    scale: float | None = None,
    window: tuple[int | None, int | None] | None = None,
    logit_soft_cap: float | None = None,
    backend: str | None = None,
    config: KernelConfig | None = None,
) -> Float[Array, "T N Hv"]:
    """Attention for a batch of sequences that mixes prefills and decodes (continuous batching).

    Sequence i has q_len = cu_q_lens[i + 1] - cu_q_lens[i] queries, the rows
    q[cu_q_lens[i] : cu_q_lens[i + 1]] (packed along axis 0), and kv_len = kv_lens[i] keys in its
    pages: key s is k_pages[page_table[i, s // page], s % page] (page = k_pages.shape[1]); its cache
    already holds the keys of its own new tokens. Its LAST query is aligned with its LAST key: query
    j sits at key position kv_len - q_len + j. Per sequence this is exactly
        ops.attention(q_i[None], k_i[None], v_i[None], causal=causal, window=window, ...)
    over its kv_len contiguous keys (same masks, windows, soft cap and f32 math; scale defaults to
    1/sqrt(H)); GQA/MQA: query head n reads kv head n // (N // KV). A decode is q_len = 1 (then
    this equals ops.paged_attention); a fresh prefill has q_len = kv_len; chunked prefill has
    q_len < kv_len. Rows before cu_q_lens[0] or from cu_q_lens[-1] on (padding) give 0, so does a
    sequence with kv_len = 0, and a query row that no key may be seen by.

    Checks: with concrete (not traced) values, cu_q_lens must be nondecreasing within
    [0, q.shape[0]], kv_lens within [0, max_pages * page] and every page a sequence reads in
    [0, num_pages), else ValueError naming the argument. Under jit they cannot be checked: page ids
    and kv_lens are clamped into range (kernels/common/paged.py); a decreasing cu_q_lens is
    undefined. Changing their values under jit does not recompile.

    Forward only (serving): jax.grad / jax.vjp through it raise a TypeError; train with
    ops.attention.

    Args:
      q: `[T, N, H]`; k_pages: `[num_pages, page, KV, H]`; v_pages: `[num_pages, page, KV, Hv]`; one
        dtype (f32/bf16/f16). cu_q_lens: `[S + 1]` int; kv_lens: `[S]` int; page_table:
        `[S, max_pages]` int.
      causal: mask keys after each query's position (default True, what serving needs).
      window: `(left, right)` as in ops.attention (right is 0 when causal).
      backend: None (the best for the platform), "xla" (the reference: gathers each row's pages),
        "triton" (GPU, one launch: query tiles of each prefill x kv heads, online softmax over its
        pages; decodes (q_len x G <= 16 rows) as split-K runs over their keys, merged by lse),
        "pallas_tpu" (Mosaic TPU, scalar-prefetched tables).
      config: a kernel config of the chosen backend.

    Returns:
      `[T, N, Hv]` in q's dtype.
    """
    checks.floating_array("q", q)
    if q.ndim != 3:
        raise ValueError(f"q: expected [T, N, H] (every sequence's queries packed along axis 0), got shape {tuple(q.shape)}")
    if q.shape[0] == 0:
        raise ValueError("q: expected at least one query row")
    for name, a in (("k_pages", k_pages), ("v_pages", v_pages)):
        checks.floating_array(name, a)
    T, N, H = q.shape
    num_seqs = _check_cu_q_lens(cu_q_lens, T)
    checks.integer_array("kv_lens", kv_lens, (num_seqs,), "[S], S = len(cu_q_lens) - 1")
    check_paged_shapes(k_pages, v_pages, page_table, kv_lens, num_seqs, head_dim=H)
    if k_pages.dtype != q.dtype:
        raise TypeError(f"k_pages, v_pages: dtype {k_pages.dtype} must equal q's {q.dtype}")
    checks.kv_heads_divide("k_pages", N, k_pages.shape[2], "KV")
    check_page_table(page_table, kv_lens, k_pages.shape[0], k_pages.shape[1], lengths_name="kv_lens")
    scale, logit_soft_cap = checks.scale_and_soft_cap(scale, logit_soft_cap, H)
    left, right = checks.window(window, bool(causal))
    spec = AttentionSpec(causal=bool(causal), scale=float(scale), window_left=left, window_right=right,
                         logit_soft_cap=logit_soft_cap)
    call = lambda *a: RAGGED_PAGED_ATTENTION(*a, spec=spec, backend=backend, config=config)  # noqa: E731
    return _forward_only("ragged_paged_attention", call)(
        q, k_pages, v_pages, cu_q_lens.astype(jnp.int32), kv_lens.astype(jnp.int32), page_table.astype(jnp.int32))
