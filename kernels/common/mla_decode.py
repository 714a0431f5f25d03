"""Multi-head latent attention decode: what every backend of `ops.mla_decode` shares.

The math and layout are in ops/mla_decode.py's docstring. Every backend takes
(q_latent [B, N, L], q_rope [B, N, R], kv_latent, k_rope, lengths [B] int32, page_table or None)
with a `paged.PagedSpec` (scale, return_lse; no window, no soft cap) and returns (out [B, N, L] in
q_latent's dtype, lse [B, N] f32). The caller has clamped lengths into [0, S] (contiguous) or
[0, max_pages * page_size] (paged) and page ids into [0, num_pages).
"""

from __future__ import annotations

from forgeax.kernels.common import paged
from forgeax.kernels.common.paged import PagedSpec
from forgeax.kernels.common.partitioning import split_launch

# DeepSeek-V2/V3's attention scale: 1 / sqrt(qk_head_dim), qk_head_dim = qk_nope_head_dim 128 +
# qk_rope_head_dim 64 (before the absorption of W_UK into the query, which leaves scores unchanged).
DEEPSEEK_QK_HEAD_DIM = 192


def spec_reason(spec: PagedSpec) -> str | None:
    """Why a backend refuses `spec` (mla_decode has no window and no soft cap), or None."""
    if spec.window_left is not None or spec.window_right is not None or spec.logit_soft_cap is not None:
        return "mla_decode takes no window or logit_soft_cap"
    return None


def forward_only(run, backend: str):
    """`run(*args)` that raises under jax.grad / jax.vjp: the kernels are forward-only (serving)."""
    return paged.forward_only(run, lambda: NotImplementedError(
        f"mla_decode: the {backend} kernel is forward-only (decode serving) and has no gradient; "
        "differentiate ops.mla_decode with backend='xla' (the reference, plain JAX autodiff)"))


def split_mla_launch(launch):
    """`launch(q_latent, q_rope, kv_latent, k_rope, lengths, page_table)` -> (out, lse) as a launch
    the SPMD partitioner splits over the requests B and the query heads N
    (kernels/common/partitioning.py `split_launch`). The latent cache is shared by every head:
    a contiguous cache [B, S, .] splits with the requests and is replicated over the heads
    split; a page pool [P, page, .] (with page_table [B, M], split with the requests) is
    replicated. The key axes stay whole on each device."""

    def call(q_latent, q_rope, kv_latent, k_rope, lengths, page_table):
        heads = ("b", "h", None)
        cache = (None, None, None) if page_table is not None else ("b", None, None)
        dims = (heads, heads, cache, cache, ("b",), ("b", None))
        return split_launch(launch, dims, ((heads, ()), (("b", "h"), ())))(
            q_latent, q_rope, kv_latent, k_rope, lengths, page_table)

    return call
