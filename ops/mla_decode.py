"""Multi-head latent attention (DeepSeek-V2/V3) decode over a compressed cache: `mla_decode`.

Layout (absorbed projections, one decode query per request): a token's cache entry is a latent
c_kv [L] (L = kv_lora_rank = 512) and a decoupled rope key k_pe [R] (R = 64), SHARED by all N query
heads (MQA-like). With W_UK absorbed into the query, head n's query is q_latent[n] = q_nope[n] @
W_UK[n] ([L]) plus q_rope[n] ([R], rope already applied); the value is the latent itself and the
caller applies W_UV (and W_O) to the output. Per request b, head n, key s < lengths[b], in f32:

    z[s]   = scale * (<q_latent[b, n], kv_latent[b, s]> + <q_rope[b, n], k_rope[b, s]>)
    out[b, n] = sum_s softmax(z)[s] * kv_latent[b, s]         [L], in q_latent's dtype
    lse[b, n] = log(sum_s exp(z[s]))                           f32

This is ops.attention with one kv head, k = concat(kv_latent, k_rope) [L + R], v = kv_latent and
the keys past lengths[b] masked. lengths[b] = 0 gives out 0 and lse -inf.

Caches: contiguous kv_latent [B, S, L], k_rope [B, S, R]; or paged (kernels/common/paged.py):
pools kv_latent [P, page_size, L], k_rope [P, page_size, R] and page_table [B, max_pages], key s of
request b at row s % page_size of page page_table[b, s // page_size]. Concrete out-of-range
lengths or used page ids raise; traced ones are clamped (lengths into [0, S] or [0, max_pages *
page_size], page ids into [0, P)).

Forward-only (serving): the kernels raise under jax.grad / jax.vjp; backend="xla" is the
differentiable reference.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
from jaxtyping import Array, Float, Integer

from forgeax.core import KernelConfig, Selection, define_op
from forgeax.kernels.common import paged
from forgeax.kernels.common.mla_decode import DEEPSEEK_QK_HEAD_DIM
from forgeax.ops import checks

__all__ = ["mla_decode"]


def _features(args, kwargs) -> dict:
    """What the selection rules (rules/mla_decode.json) read of a call."""
    del kwargs
    q_latent, q_rope, kv_latent, _, _, page_table = args
    return {"batch": int(q_latent.shape[0]), "heads": int(q_latent.shape[1]), "latent": int(q_latent.shape[2]),
            "rope": int(q_rope.shape[2]), "paged": page_table is not None,
            "page_size": int(kv_latent.shape[1]) if page_table is not None else 0, "dtype": q_latent.dtype.name}


MLA_DECODE = define_op(
    "mla_decode",
    {
        "xla": "forgeax.kernels.xla.mla_decode:MLA_DECODE",
        "triton": "forgeax.kernels.triton.mla_decode:MLA_DECODE",
        "pallas_tpu": "forgeax.kernels.pallas.tpu.mla_decode:MLA_DECODE",
    },
    selection=Selection.load("forgeax.ops", "rules/mla_decode.json"),
    features=_features,
)


def mla_decode(
    q_latent: Float[Array, "B N L"],
    q_rope: Float[Array, "B N R"],
    kv_latent: Float[Array, "B S L"] | Float[Array, "P page_size L"],
    k_rope: Float[Array, "B S R"] | Float[Array, "P page_size R"],
    lengths: Integer[Array, " B"],
    *,
    page_table: Integer[Array, "B max_pages"] | None = None,
    scale: float | None = None,
    return_lse: bool = False,
    backend: str | None = None,
    config: KernelConfig | None = None,
) -> Float[Array, "B N L"] | tuple[Float[Array, "B N L"], Float[Array, "B N"]]:
    """One decode step of multi-head latent attention over a latent cache (module docstring).

    Args:
      q_latent: `[B, N, L]` absorbed queries (q_nope @ W_UK per head); f32/bf16/f16.
      q_rope: `[B, N, R]` rope part of the queries (rope applied), q_latent's dtype.
      kv_latent: the latent cache, `[B, S, L]`, or `[P, page_size, L]` pages with page_table.
      k_rope: the rope keys, `[B, S, R]`, or `[P, page_size, R]` pages; q_latent's dtype.
      lengths: `[B]` integer, how many keys request b has (0 allowed: out 0, lse -inf).
      page_table: None (contiguous cache) or `[B, max_pages]` integer page ids.
      scale: the score scale; None is DeepSeek-V2/V3's 1 / sqrt(192) (qk_head_dim = 128 nope +
        64 rope), whatever L and R are. Models with YaRN (DeepSeek-V3 at 128k) multiply it by
        mscale^2: pass their value.
      return_lse: also return lse `[B, N]` f32 (natural log), e.g. to merge with other partials.
      backend: None (best for this device), "xla" (reference, differentiable), "triton" (split-K
        over the keys, GPU), "pallas_tpu" ("pallas"), or a registered name.
      config: a kernel config of the chosen backend (None: tuned or heuristic).

    Returns:
      out `[B, N, L]` in q_latent's dtype (apply W_UV per head after), or (out, lse).
      Forward-only kernels: under a gradient use backend="xla".
    """
    checks.floating_array("q_latent", q_latent)
    if q_latent.ndim != 3:
        raise ValueError(f"q_latent: expected 3 axes [B, N, L], got shape {tuple(q_latent.shape)}")
    B, N, L = (int(d) for d in q_latent.shape)
    if min(B, N, L) == 0:
        raise ValueError(f"q_latent: expected non-empty [B, N, L], got shape {tuple(q_latent.shape)}")
    dtype = jnp.dtype(q_latent.dtype)
    for name, a in (("q_rope", q_rope), ("kv_latent", kv_latent), ("k_rope", k_rope)):
        checks.floating_array(name, a)
        if jnp.dtype(a.dtype) != dtype:
            raise TypeError(f"{name}: expected q_latent's dtype {dtype.name}, got {jnp.dtype(a.dtype).name}")
        if a.ndim != 3:
            raise ValueError(f"{name}: expected 3 axes, got shape {tuple(a.shape)}")
    R = int(q_rope.shape[2])
    if tuple(q_rope.shape[:2]) != (B, N) or R == 0:
        raise ValueError(f"q_rope: expected shape [B, N, R] = ({B}, {N}, R >= 1) (q_latent's B and N), got {tuple(q_rope.shape)}")
    lead = "[P, page_size" if page_table is not None else "[B, S"
    if kv_latent.shape[2] != L:
        raise ValueError(f"kv_latent: expected {lead}, L={L}] (q_latent's latent dim), got {tuple(kv_latent.shape)}")
    if tuple(k_rope.shape) != tuple(kv_latent.shape[:2]) + (R,):
        raise ValueError(f"k_rope: expected {lead}, R] = {tuple(kv_latent.shape[:2]) + (R,)} (kv_latent's first "
                         f"two axes, q_rope's R), got {tuple(k_rope.shape)}")
    if kv_latent.shape[0] == 0 or kv_latent.shape[1] == 0:
        raise ValueError(f"kv_latent: expected at least one key slot, got shape {tuple(kv_latent.shape)}")
    checks.integer_array("lengths", lengths, (B,), "[B]")
    if page_table is None:
        S = int(kv_latent.shape[1])
        if kv_latent.shape[0] != B:
            raise ValueError(f"kv_latent: expected [B={B}, S, L] (q_latent's batch; for a paged cache pass "
                             f"page_table), got {tuple(kv_latent.shape)}")
        if paged.is_concrete(lengths):
            import numpy as np  # noqa: PLC0415

            lens = np.asarray(lengths).astype(np.int64)
            bad = np.nonzero((lens < 0) | (lens > S))[0]
            if bad.size:
                raise ValueError(f"lengths: lengths[{int(bad[0])}] = {int(lens[bad[0]])} is outside [0, S = {S}]")
        lengths = jnp.clip(jnp.asarray(lengths).astype(jnp.int32), 0, S)
    else:
        if not (hasattr(page_table, "ndim") and page_table.ndim == 2):
            raise ValueError(f"page_table: expected shape [B={B}, max_pages], got {getattr(page_table, 'shape', type(page_table).__name__)}")
        checks.integer_array("page_table", page_table, (B, int(page_table.shape[1])), "[B, max_pages]")
        if page_table.shape[1] == 0:
            raise ValueError("page_table: needs at least one column (max_pages >= 1)")
        num_pages, page_size = int(kv_latent.shape[0]), int(kv_latent.shape[1])
        paged.check_page_table(page_table, lengths, num_pages, page_size)
        lengths = paged.clamp_lengths(jnp.asarray(lengths), int(page_table.shape[1]), page_size)
        page_table = paged.clamp_page_ids(jnp.asarray(page_table), num_pages)
    if scale is None:
        scale = 1.0 / math.sqrt(DEEPSEEK_QK_HEAD_DIM)
    else:
        checks.positive_float("scale", scale)
    if not isinstance(return_lse, bool):
        raise TypeError(f"return_lse: expected a bool, got {return_lse!r}")
    spec = paged.PagedSpec(scale=float(scale), return_lse=return_lse)
    out, lse = MLA_DECODE(q_latent, q_rope, kv_latent, k_rope, lengths, page_table, spec=spec, backend=backend,
                          config=config)
    return (out, lse) if return_lse else out
