"""Multi-head latent attention decode as a Mosaic TPU kernel (forward only), with interpreter support.

q_latent [B, N, L], q_rope [B, N, R]; cache kv_latent / k_rope contiguous [B, S, L|R] or pages
[P, page_size, L|R] with page_table [B, M] (ops/mla_decode.py has the math). Grid
(B, N / block_h, key blocks), the key axis "arbitrary": block j of request b is keys
[j*bk, (j+1)*bk), bk = block_n (contiguous) or page_size (paged: the block is page
page_table[b, j], read through the scalar-prefetched, flattened page table). lengths are
scalar-prefetched too: blocks past a request's length are skipped (pl.when) and their index maps
clamped to its last live block, so they fetch nothing new. One latent tile serves all block_h
heads and both products, in f32 with m, l, acc in VMEM scratch:
    z = scale * (q_latent kv^T + q_rope k_rope^T), -inf past the length
    m' = max(m, rowmax z); a = exp(m - m'); p = exp(z - m'); l = a l + rowsum p; acc = a acc + p kv
    last block: out = acc / l, lse = m + log l   (l == 0: out 0, lse -inf)
No split-K: the key axis runs sequentially on one core; requests and head tiles are "parallel".
lse leaves the kernel lane-replicated as [B, N, 128] (a dense store) and is sliced in XLA.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from forgeax.core.config import KernelConfig
from forgeax.core.registry import Implementation
from forgeax.core.runtime import interpret_enabled
from forgeax.kernels.common.mla_decode import forward_only, spec_reason, split_mla_launch
from forgeax.kernels.common.paged import PagedSpec

_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))
_LANES = 128
_VMEM_LIMIT = 48 << 20


@dataclasses.dataclass(frozen=True, kw_only=True)
class MlaDecodeTpuConfig(KernelConfig):
    """block_h: heads per program (a multiple of 16 dividing N, else all N); block_n: keys per
    step of a contiguous cache (a multiple of 16; S itself when larger; a paged cache steps by
    page_size)."""

    block_h: int = 128
    block_n: int = 512

    def validate(self) -> None:
        super().validate()
        for name in ("block_h", "block_n"):
            if getattr(self, name) % 16:
                raise ValueError(f"MlaDecodeTpuConfig.{name}: expected a multiple of 16, got {getattr(self, name)}")


def heuristic_config(*args, **kwargs) -> MlaDecodeTpuConfig:
    """128 heads x 512 keys at L = 512: a 512 KB bf16 latent tile (double-buffered 1 MB) and a
    256 KB f32 accumulator, well inside VMEM. The interpreter takes small key blocks (more steps
    for the tests to cover)."""
    del args, kwargs
    return MlaDecodeTpuConfig(block_n=16) if interpret_enabled() else MlaDecodeTpuConfig()


def _kernel(len_ref, pt_ref, ql_ref, qr_ref, kv_ref, kr_ref, o_ref, lse_ref, m_sc, l_sc, acc_sc,
            *, scale: float, bk: int, steps: int):
    del pt_ref  # read by the index maps only
    b, j = pl.program_id(0), pl.program_id(2)
    length = len_ref[b]

    @pl.when(j == 0)
    def _():
        m_sc[...] = jnp.full_like(m_sc, -jnp.inf)
        l_sc[...] = jnp.zeros_like(l_sc)
        acc_sc[...] = jnp.zeros_like(acc_sc)

    @pl.when(j * bk < length)
    def _():
        s_col = j * bk + jax.lax.broadcasted_iota(jnp.int32, (bk, 1), 0)
        kv = jnp.where(s_col < length, kv_ref[...], jnp.zeros_like(kv_ref[...]))  # a tail block may hold garbage
        kr = jnp.where(s_col < length, kr_ref[...], jnp.zeros_like(kr_ref[...]))
        nt = (((1,), (1,)), ((), ()))
        z = (jax.lax.dot_general(ql_ref[...], kv, nt, preferred_element_type=jnp.float32)
             + jax.lax.dot_general(qr_ref[...], kr, nt, preferred_element_type=jnp.float32)) * scale
        s_row = j * bk + jax.lax.broadcasted_iota(jnp.int32, z.shape, 1)
        z = jnp.where(s_row < length, z, -jnp.inf)
        m_prev = m_sc[...][:, :1]
        m_new = jnp.maximum(m_prev, jnp.max(z, axis=1, keepdims=True))  # finite: key j*bk is live
        a = jnp.exp(m_prev - m_new)
        p = jnp.exp(z - m_new)
        l_sc[...] = jnp.broadcast_to(a * l_sc[...][:, :1] + jnp.sum(p, axis=1, keepdims=True), l_sc.shape)
        m_sc[...] = jnp.broadcast_to(m_new, m_sc.shape)
        acc_sc[...] = a * acc_sc[...] + jnp.dot(p.astype(kv.dtype), kv, preferred_element_type=jnp.float32)

    @pl.when(j == steps - 1)
    def _():
        l = l_sc[...]
        nonempty = l > 0
        safe = jnp.where(nonempty, l, 1.0)
        o_ref[...] = (acc_sc[...] / safe[:, :1]).astype(o_ref.dtype)  # acc is 0 when empty
        lse_ref[...] = jnp.where(nonempty, m_sc[...] + jnp.log(safe), -jnp.inf)


def _block_h(n: int, want: int) -> int:
    return want if (want < n and n % want == 0) else n


def _launch(q_latent, q_rope, kv_latent, k_rope, lengths, page_table, *, spec: PagedSpec, config: MlaDecodeTpuConfig):
    B, N, L = q_latent.shape
    R = q_rope.shape[2]
    paged = page_table is not None
    bh = _block_h(N, config.block_h)
    if paged:
        bk = kv_latent.shape[1]
        steps = page_table.shape[1]
        table = page_table.astype(jnp.int32).reshape(-1)
    else:
        S = kv_latent.shape[1]
        bk = config.block_n if config.block_n < S else S
        steps = -(-S // bk)
        table = jnp.zeros((1,), jnp.int32)
    lengths = lengths.astype(jnp.int32)

    def live(b, j, lens):
        """j clamped to request b's last live block (0 when it has no key)."""
        return jnp.minimum(j, jax.lax.div(jnp.maximum(lens[b] + bk - 1, bk), bk) - 1)  # non-negative: no floor fix-up

    if paged:
        def cache_map(b, h, j, lens, pt):
            del h
            return pt[b * steps + live(b, j, lens)], 0, 0
    else:
        def cache_map(b, h, j, lens, pt):
            del h, pt
            return b, live(b, j, lens), 0

    q_map = lambda b, h, j, lens, pt: (b, h, 0)  # noqa: E731
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=2,
        grid=(B, N // bh, steps),
        in_specs=[pl.BlockSpec((None, bh, L), q_map), pl.BlockSpec((None, bh, R), q_map),
                  pl.BlockSpec((None, bk, L), cache_map), pl.BlockSpec((None, bk, R), cache_map)],
        out_specs=[pl.BlockSpec((None, bh, L), q_map), pl.BlockSpec((None, bh, _LANES), q_map)],
        scratch_shapes=[pltpu.VMEM((bh, _LANES), jnp.float32), pltpu.VMEM((bh, _LANES), jnp.float32),
                        pltpu.VMEM((bh, L), jnp.float32)],
    )
    out, lse = pl.pallas_call(
        functools.partial(_kernel, scale=spec.scale, bk=bk, steps=steps),
        grid_spec=grid_spec,
        out_shape=[jax.ShapeDtypeStruct((B, N, L), q_latent.dtype), jax.ShapeDtypeStruct((B, N, _LANES), jnp.float32)],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary"),
                                             vmem_limit_bytes=_VMEM_LIMIT),
        interpret=pltpu.InterpretParams() if interpret_enabled() else False,
    )(lengths, table, q_latent, q_rope, kv_latent, k_rope)
    return out, lse[:, :, 0]


@functools.cache
def _forward(spec: PagedSpec, config: MlaDecodeTpuConfig):
    return forward_only(split_mla_launch(functools.partial(_launch, spec=spec, config=config)), "pallas_tpu")


def mla_decode(q_latent, q_rope, kv_latent, k_rope, lengths, page_table, *, spec: PagedSpec, config: MlaDecodeTpuConfig):
    return _forward(spec, config)(q_latent, q_rope, kv_latent, k_rope, lengths, page_table)


def supports(q_latent, q_rope, kv_latent, k_rope, lengths, page_table, *, spec: PagedSpec) -> str | None:
    del q_rope, k_rope, lengths
    if jnp.dtype(q_latent.dtype) not in _DTYPES:
        return f"dtype {jnp.dtype(q_latent.dtype).name} is not float32/bfloat16"
    if page_table is not None and kv_latent.shape[1] % 8:
        return f"page_size {kv_latent.shape[1]} is not a multiple of 8 (a TPU sublane tile)"
    return spec_reason(spec)


MLA_DECODE = Implementation(fn=mla_decode, platforms={"tpu"}, interpretable=True, supports=supports,
                            config_type=MlaDecodeTpuConfig, heuristic_config=heuristic_config)
