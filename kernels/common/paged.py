"""Paged KV caches: the layout, page-table checks and the gather every paged reference uses.

Layout (vLLM's): a pool of pages k_pages / v_pages [num_pages, page_size, KV, H]; request b owns
the pages page_table[b, 0], page_table[b, 1], ... ([B, max_pages] int32), so its key s lives at
k_pages[page_table[b, s // page_size], s % page_size]. A request of length L reads only the first
cdiv(L, page_size) entries of its row; the entries after them are never read and may hold any
value (e.g. -1 or a padding page).

Out-of-range entries: `check_page_table` raises (naming the argument) when the page table and the
lengths are concrete; under jit they are not inspectable, so every kernel CLAMPS a page id into
[0, num_pages) (reads a wrong but valid page, never out of bounds memory). Lengths are clamped
into [0, max_pages * page_size] the same way.

Position rule (the decode case of kernels/common/attention.py, with T = 1): the query of request
b sits at key position pos = L - 1 (the last key), so key s is allowed iff s < L and, with a
window (left, right), pos - left <= s <= pos + right (right never binds: s <= pos already).
L = 0 allows no key: the output is 0 and the lse -inf.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from forgeax.kernels.common.partitioning import split_launch

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class PagedSpec:
    """Static options of one paged/decode attention call (hashable: a jit static argument)."""

    scale: float = 1.0
    window_left: int | None = None
    window_right: int | None = None
    logit_soft_cap: float | None = None
    return_lse: bool = False
    num_splits: int | None = None  # decode_attention's split count (None: the backend's config)


def cdiv(a, b):
    return -(-a // b)


def pages_for(lengths: Array, page_size: int) -> Array:
    """How many pages each request reads: cdiv(clamped length, page_size) (int32)."""
    return (jnp.maximum(lengths.astype(jnp.int32), 0) + page_size - 1) // page_size


def clamp_page_ids(page_table: Array, num_pages: int) -> Array:
    """Page ids clamped into [0, num_pages) (what every kernel reads under jit)."""
    return jnp.clip(page_table.astype(jnp.int32), 0, num_pages - 1)


def clamp_lengths(lengths: Array, max_pages: int, page_size: int) -> Array:
    return jnp.clip(lengths.astype(jnp.int32), 0, max_pages * page_size)


def is_concrete(x) -> bool:
    """True when x's values can be read now (not a tracer)."""
    return not isinstance(x, jax.core.Tracer)


def check_paged_shapes(k_pages, v_pages, page_table, lengths, batch: int, *, kv_heads: int | None = None,
                       head_dim: int | None = None) -> None:
    """Shape and dtype checks of a paged cache; each error names the argument.

    k_pages [P, page_size, KV, H], v_pages [P, page_size, KV, Hv], page_table [batch, M] integer,
    lengths [batch] integer. kv_heads / head_dim, when given, must match k_pages.
    """
    for name, a in (("k_pages", k_pages), ("v_pages", v_pages)):
        if not hasattr(a, "shape") or a.ndim != 4:
            raise ValueError(f"{name}: expected [num_pages, page_size, kv_heads, head_dim], got shape {getattr(a, 'shape', None)}")
    if tuple(v_pages.shape[:3]) != tuple(k_pages.shape[:3]):
        raise ValueError(f"v_pages: expected [num_pages, page_size, kv_heads] = {tuple(k_pages.shape[:3])} like k_pages, got {tuple(v_pages.shape)}")
    if k_pages.dtype != v_pages.dtype:
        raise TypeError(f"v_pages: dtype {v_pages.dtype} must equal k_pages' {k_pages.dtype}")
    if k_pages.shape[0] == 0 or k_pages.shape[1] == 0:
        raise ValueError(f"k_pages: needs at least one page of at least one slot, got shape {tuple(k_pages.shape)}")
    if kv_heads is not None and k_pages.shape[2] != kv_heads:
        raise ValueError(f"k_pages: kv_heads {k_pages.shape[2]} does not match {kv_heads}")
    if head_dim is not None and k_pages.shape[3] != head_dim:
        raise ValueError(f"k_pages: head_dim {k_pages.shape[3]} must equal q's head_dim {head_dim}")
    for name, a, rank in (("page_table", page_table, 2), ("lengths", lengths, 1)):
        if not (hasattr(a, "dtype") and jnp.issubdtype(a.dtype, jnp.integer)):
            raise TypeError(f"{name}: expected an integer array, got {getattr(a, 'dtype', type(a).__name__)}")
        if a.ndim != rank or a.shape[0] != batch:
            want = f"[{batch}, max_pages]" if rank == 2 else f"[{batch}]"
            raise ValueError(f"{name}: expected shape {want}, got {tuple(a.shape)}")
    if page_table.shape[1] == 0:
        raise ValueError("page_table: needs at least one column (max_pages >= 1)")


def check_page_table(page_table, lengths, num_pages: int, page_size: int, *, lengths_name: str = "lengths") -> None:
    """When concrete: lengths in [0, max_pages * page_size] and every USED page id in [0, num_pages).

    Traced values cannot be checked; the kernels clamp them instead (module docstring).
    """
    if not (is_concrete(page_table) and is_concrete(lengths)):
        return
    table = np.asarray(page_table)
    lens = np.asarray(lengths).astype(np.int64)
    max_pages = table.shape[1]
    bad = np.nonzero((lens < 0) | (lens > max_pages * page_size))[0]
    if bad.size:
        b = int(bad[0])
        raise ValueError(f"{lengths_name}: {lengths_name}[{b}] = {int(lens[b])} is outside [0, max_pages * page_size = {max_pages * page_size}]")
    used = np.arange(max_pages)[None, :] < ((lens + page_size - 1) // page_size)[:, None]
    wrong = used & ((table < 0) | (table >= num_pages))
    if wrong.any():
        b, j = (int(i) for i in np.argwhere(wrong)[0])
        raise ValueError(f"page_table: page_table[{b}, {j}] = {int(table[b, j])} is outside [0, num_pages = {num_pages}) "
                         f"but request {b} (length {int(lens[b])}) reads it")


def gather_pages(pages: Array, page_table: Array) -> Array:
    """pages [P, page_size, ...] and page_table [B, M] -> [B, M * page_size, ...] (ids clamped).

    Row b holds request b's keys in order: key s at index s (entries past its length are whatever
    pages the unused table entries name; callers mask them by length).
    """
    B, M = page_table.shape
    ids = clamp_page_ids(page_table, pages.shape[0])
    out = jnp.take(pages, ids.reshape(-1), axis=0)  # [B * M, page_size, ...]
    return out.reshape((B, M * pages.shape[1]) + tuple(pages.shape[2:]))


def allowed_keys(spec: PagedSpec, lengths: Array, s: Array) -> Array:
    """bool [B, S]: key s allowed for the decode query of each request (module docstring).

    lengths [B] int32 (already clamped), s [S] key indices.
    """
    L = lengths[:, None]
    pos = L - 1
    ok = s[None, :] < L
    if spec.window_left is not None:
        ok = ok & (s[None, :] >= pos - spec.window_left)
    if spec.window_right is not None:
        ok = ok & (s[None, :] <= pos + spec.window_right)
    return ok


def contiguous_as_pages(k: Array, page_size: int) -> tuple[Array, Array]:
    """A contiguous cache k [B, S, KV, H] as pages: ([B * M, page_size, KV, H], page_table [B, M]).

    M = cdiv(S, page_size); S is padded with zeros to M * page_size (the padding lies past every
    length, so it is masked). The page table is the identity: page_table[b, j] = b * M + j.
    """
    B, S = k.shape[:2]
    M = cdiv(S, page_size)
    if M * page_size != S:
        k = jnp.pad(k, ((0, 0), (0, M * page_size - S)) + ((0, 0),) * (k.ndim - 2))
    pages = k.reshape((B * M, page_size) + tuple(k.shape[2:]))
    table = jnp.arange(B * M, dtype=jnp.int32).reshape(B, M)
    return pages, table


def forward_only(run, error):
    """`run(*args)` behind a custom_vjp whose forward rule raises `error()`: the serving ops and
    kernels (paged, decode, ragged paged attention; the MLA decode kernels) are forward-only, and
    jax.grad / jax.vjp through them fails at trace time with a message saying what to do."""

    @jax.custom_vjp
    def wrapped(*args):
        return run(*args)

    def fwd(*args):
        del args
        raise error()

    def bwd(res, cotangent):  # never reached: fwd raises
        del res, cotangent
        raise AssertionError("unreachable")

    wrapped.defvjp(fwd, bwd)
    return wrapped  # not functools.wraps: it would copy run's __dict__ (a custom_vmap's `fun`) over the custom_vjp's


def split_decode_launch(run):
    """`run(q, k, v, lengths, page_table)` -> (out, lse or None) as a launch the SPMD partitioner
    splits over the requests B and the heads (kernels/common/partitioning.py `split_launch`).

    q [B, N, H], lengths [B], page_table [B, M] (None: a contiguous cache k, v [B, S, KV, H],
    whose B is split with the requests; a page pool [P, page, KV, H] is not per request and
    stays replicated over the batch split). Heads: query heads N and kv heads KV split the same
    number of ways (each device keeps whole GQA groups); with one kv head (MQA) the query heads
    split alone and every device reads the one kv head. out [B, N, Hv], lse [B, N] follow q.
    The key axes (S, the pages) stay whole on each device."""

    def launch(q, k, v, lengths, page_table):
        kv = "h" if k.shape[2] > 1 else None
        cache = (None, None, kv, None) if page_table is not None else ("b", None, kv, None)
        heads = ("b", "h", None)
        dims = (heads, cache, cache, ("b",), ("b", None))
        return split_launch(run, dims, ((heads, ()), (("b", "h"), ())))(q, k, v, lengths, page_table)

    return launch
