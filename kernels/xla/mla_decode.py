"""Multi-head latent attention decode reference: plain jax.numpy, f32 math.

A paged cache is first gathered into [B, max_pages * page_size, ...] (kernels/common/paged.py),
then, per request b, head n and key s < lengths[b]:

    z[s]   = scale * (<q_latent[n], kv_latent[s]> + <q_rope[n], k_rope[s]>)
    out[n] = sum_s softmax(z)[s] * kv_latent[s]          [L], in q_latent's dtype
    lse[n] = log(sum_s exp(z[s]))                        f32; -inf and out = 0 when lengths[b] = 0

The gradient is JAX autodiff of this function (the kernels are forward-only).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Integer

from forgeax.core.registry import Implementation
from forgeax.kernels.common import paged
from forgeax.kernels.common.mla_decode import spec_reason

_HIGHEST = jax.lax.Precision.HIGHEST


def mla_decode(
    q_latent: Float[Array, "B N L"],
    q_rope: Float[Array, "B N R"],
    kv_latent: Float[Array, "B S L"] | Float[Array, "P PS L"],
    k_rope: Float[Array, "B S R"] | Float[Array, "P PS R"],
    lengths: Integer[Array, " B"],
    page_table: Integer[Array, "B M"] | None,
    *,
    spec: paged.PagedSpec,
) -> tuple[Float[Array, "B N L"], Float[Array, "B N"]]:
    if page_table is not None:
        kv_latent = paged.gather_pages(kv_latent, page_table)
        k_rope = paged.gather_pages(k_rope, page_table)
    S = kv_latent.shape[1]
    f32 = lambda a: a.astype(jnp.float32)  # noqa: E731
    z = (jnp.einsum("bnl,bsl->bns", f32(q_latent), f32(kv_latent), precision=_HIGHEST)
         + jnp.einsum("bnr,bsr->bns", f32(q_rope), f32(k_rope), precision=_HIGHEST)) * spec.scale
    ok = (jnp.arange(S)[None, :] < jnp.clip(lengths, 0, S)[:, None])[:, None, :]  # [B, 1, S]
    z = jnp.where(ok, z, -jnp.inf)
    m = jnp.max(z, axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)  # a request with no key: no NaN from -inf - -inf
    e = jnp.where(ok, jnp.exp(z - m), 0.0)
    l = jnp.sum(e, axis=-1, keepdims=True)
    nonempty = l > 0
    p = e / jnp.where(nonempty, l, 1.0)
    out = jnp.einsum("bns,bsl->bnl", p, f32(kv_latent), precision=_HIGHEST)
    lse = jnp.where(nonempty, m + jnp.log(jnp.where(nonempty, l, 1.0)), -jnp.inf)[..., 0]
    return out.astype(q_latent.dtype), lse


def _supports(*args, spec: paged.PagedSpec) -> str | None:
    del args
    return spec_reason(spec)


MLA_DECODE = Implementation(fn=mla_decode, supports=_supports)
