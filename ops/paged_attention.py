"""Decode attention over a KV cache: `paged_attention` (a paged cache) and `decode_attention`
(a contiguous cache, split-K flash decoding). Forward only."""

from __future__ import annotations

import jax.numpy as jnp
from jaxtyping import Array, Float, Integer

from forgeax.core import KernelConfig, Selection, define_op
from forgeax.kernels.common.paged import PagedSpec, check_paged_shapes, check_page_table, forward_only, is_concrete
from forgeax.ops import checks


def _features(args, kwargs) -> dict:
    """What rules/paged_attention.json and rules/decode_attention.json may read of a call."""
    q, k = args[0], args[1]
    return {"dtype": q.dtype.name, "group": q.shape[1] // k.shape[2], "head_dim": q.shape[2],
            "soft_cap": kwargs["spec"].logit_soft_cap is not None}


def _define(name: str):
    """The op `name`: each backend's `<NAME>` of its paged_attention module, rules/<name>.json."""
    modules = {
        "xla": "forgeax.kernels.xla.paged_attention",
        "triton": "forgeax.kernels.triton.paged_attention",
        "pallas_tpu": "forgeax.kernels.pallas.tpu.paged_attention",
    }
    return define_op(
        name,
        {backend: f"{module}:{name.upper()}" for backend, module in modules.items()},
        selection=Selection.load("forgeax.ops", f"rules/{name}.json"),
        features=_features,
    )


PAGED_ATTENTION = _define("paged_attention")
DECODE_ATTENTION = _define("decode_attention")


def _forward_only(name: str, call):
    """`call(*arrays)` that raises a clear error under jax.grad / jax.vjp instead of differentiating."""
    return forward_only(call, lambda: TypeError(
        f"{name} is forward-only (decoding is inference): it has no gradient. "
        "Differentiate forgeax.ops.attention instead, or stop_gradient its inputs."))


def _spec(q, scale, window, logit_soft_cap, return_lse, num_splits=None) -> PagedSpec:
    scale, logit_soft_cap = checks.scale_and_soft_cap(scale, logit_soft_cap, q.shape[-1])
    left, right = checks.window(window, False)
    if num_splits is not None and (isinstance(num_splits, bool) or not isinstance(num_splits, int) or num_splits < 1):
        raise ValueError(f"num_splits: expected None or an int >= 1, got {num_splits!r}")
    return PagedSpec(scale=float(scale), window_left=left, window_right=right, logit_soft_cap=logit_soft_cap,
                     return_lse=bool(return_lse), num_splits=num_splits)


def _check_q(q) -> None:
    checks.floating_array("q", q)
    if q.ndim != 3:
        raise ValueError(f"q: expected [B, N, H] (one decode query per request), got shape {tuple(q.shape)}")


def paged_attention(
    q: Float[Array, "B N H"],
    k_pages: Float[Array, "P page KV H"],
    v_pages: Float[Array, "P page KV Hv"],
    lengths: Integer[Array, "B"],
    page_table: Integer[Array, "B M"],
    *,
    scale: float | None = None,
    window: tuple[int | None, int | None] | None = None,
    logit_soft_cap: float | None = None,
    return_lse: bool = False,
    backend: str | None = None,
    config: KernelConfig | None = None,
) -> Float[Array, "B N Hv"] | tuple[Float[Array, "B N Hv"], Float[Array, "B N"]]:
    """One decode step of attention over a paged KV cache (continuous batching, as in vLLM).

    Request b has L = lengths[b] keys: key s is k_pages[page_table[b, s // page], s % page] (page =
    k_pages.shape[1]). Its one query sits at the last key (position L - 1), so this is
    `ops.attention(q[:, None], k_b, v_b, causal=True, window=..., logit_soft_cap=...)` over those L
    keys, with the same math: z = scale <q, k> (scale defaults to 1/sqrt(H)), z = cap tanh(z / cap)
    with a soft cap, softmax over the allowed keys, out = p @ v; GQA/MQA: query head n reads kv head
    n // (N // KV). `window=(left, right)` as in ops.attention: keys in [L-1-left, L-1+right]
    (right cannot reach past the last key). L = 0 returns 0 (lse -inf).

    Page table: a request reads only its first cdiv(L, page) entries; the rest may hold anything.
    With concrete (not traced) lengths and page_table, an entry it reads outside [0, num_pages) or a
    length outside [0, max_pages * page] is a ValueError; under jit they cannot be checked and are
    clamped into range (a wrong but in-bounds page is read). Changing lengths/page_table values
    under jit does not recompile.

    Forward only: decoding is inference, and jax.grad / jax.vjp through it raise a TypeError.

    Args:
      q: `[B, N, H]`; k_pages: `[num_pages, page, KV, H]`; v_pages: `[num_pages, page, KV, Hv]`
        (one dtype: f32/bf16/f16); lengths: `[B]` int; page_table: `[B, max_pages]` int.
      return_lse: also return lse `[B, N]` f32 (e.g. to merge with attention over other keys).
      backend: None (the best for the platform), "xla" (the reference: gathers the pages),
        "triton" (split-K over pages, GPU), "pallas_tpu" (Mosaic TPU).
      config: a kernel config of the chosen backend (e.g. `PagedAttentionConfig` for triton).

    Returns:
      out `[B, N, Hv]` in q's dtype, or (out, lse) with return_lse.
    """
    _check_q(q)
    for name, a in (("k_pages", k_pages), ("v_pages", v_pages)):
        checks.floating_array(name, a)
    B, N, H = q.shape
    check_paged_shapes(k_pages, v_pages, page_table, lengths, B, head_dim=H)
    if k_pages.dtype != q.dtype:
        raise TypeError(f"k_pages, v_pages: dtype {k_pages.dtype} must equal q's {q.dtype}")
    checks.kv_heads_divide("k_pages", N, k_pages.shape[2], "KV")
    check_page_table(page_table, lengths, k_pages.shape[0], k_pages.shape[1])
    spec = _spec(q, scale, window, logit_soft_cap, return_lse)
    call = lambda *a: PAGED_ATTENTION(*a, spec=spec, backend=backend, config=config)  # noqa: E731
    out, lse = _forward_only("paged_attention", call)(q, k_pages, v_pages, lengths.astype(jnp.int32),
                                                      page_table.astype(jnp.int32))
    return (out, lse) if return_lse else out


def decode_attention(
    q: Float[Array, "B N H"],
    k: Float[Array, "B S KV H"],
    v: Float[Array, "B S KV Hv"],
    lengths: Integer[Array, "B"],
    *,
    num_splits: int | None = None,
    scale: float | None = None,
    window: tuple[int | None, int | None] | None = None,
    logit_soft_cap: float | None = None,
    return_lse: bool = False,
    backend: str | None = None,
    config: KernelConfig | None = None,
) -> Float[Array, "B N Hv"] | tuple[Float[Array, "B N Hv"], Float[Array, "B N"]]:
    """One decode step of attention over a contiguous KV cache (split-K flash decoding).

    The same math as `paged_attention` (its docstring), with request b's keys k[b, :L], L =
    lengths[b] in [0, S] (a ValueError outside it when concrete, clamped under jit). The Triton
    backend is the paged kernel reading the cache in place (no page table, no copy): each
    (request, kv head) is split into `num_splits` ranges of keys, each program runs an online
    softmax over its range, and the partial results merge by their lse. num_splits=None lets the
    backend fill the GPU (enough programs for every SM); it changes rounding only.

    Forward only: jax.grad / jax.vjp through it raise a TypeError.

    Args:
      q: `[B, N, H]`; k: `[B, S, KV, H]`; v: `[B, S, KV, Hv]`, one dtype (f32/bf16/f16), N % KV == 0;
      lengths: `[B]` int.
      backend: None, "xla" (the reference), "triton", "pallas_tpu".

    Returns:
      out `[B, N, Hv]` in q's dtype, or (out, lse `[B, N]` f32) with return_lse.
    """
    _check_q(q)
    for name, a in (("k", k), ("v", v)):
        checks.floating_array(name, a)
        if a.ndim != 4:
            raise ValueError(f"{name}: expected [B, S, KV, H], got shape {tuple(a.shape)}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v: expected one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    B, N, H = q.shape
    if k.shape[0] != B or k.shape[3] != H:
        raise ValueError(f"k: expected [B={B}, S, KV, H={H}], got {tuple(k.shape)}")
    if tuple(v.shape[:3]) != tuple(k.shape[:3]):
        raise ValueError(f"v: expected [B, S, KV] = {tuple(k.shape[:3])} like k, got {tuple(v.shape)}")
    checks.kv_heads_divide("k", N, k.shape[2], "KV")
    checks.integer_array("lengths", lengths, (B,), "[B]")
    if is_concrete(lengths):
        import numpy as np  # noqa: PLC0415

        lens = np.asarray(lengths)
        bad = np.nonzero((lens < 0) | (lens > k.shape[1]))[0]
        if bad.size:
            raise ValueError(f"lengths: lengths[{int(bad[0])}] = {int(lens[bad[0]])} is outside [0, S = {k.shape[1]}]")
    spec = _spec(q, scale, window, logit_soft_cap, return_lse, num_splits)
    call = lambda *a: DECODE_ATTENTION(*a, spec=spec, backend=backend, config=config)  # noqa: E731
    out, lse = _forward_only("decode_attention", call)(q, k, v, lengths.astype(jnp.int32))
    return (out, lse) if return_lse else out
