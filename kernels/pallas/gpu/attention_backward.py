"""The pallas_gpu attention backward: which kernels a config runs, and in what order.

`backward` (the contract's backward, kernels/common/attention.py) takes lse to the log2 domain
(lse * log2(e), +inf for an empty row), lays the operands over whole tiles (`Tails`) and runs
the kernels of attention_backward_kernels.py one of two ways:
  * dQ then dK/dV: `_dq` (delta = rowsum(dO * O) - dlse from XLA or, `delta_in_dq_kernel`,
    computed by the dQ kernel and returned for the dK/dV kernel), then `_dkv`, in one launch or
    one per part (`one_dkv_launch` off, at head_dim > 128).
  * dK/dV then dq from its dz^T tiles (`dz_tiles`; `_dz_tiles` says when): `_dkv` also stores
    each dz^T tile it computes, packed to the (key tile, query block) pairs the band lets meet
    (`_dz_layout`), and `_dq_from_dz` takes dq = scale * dz k from them. The tiles' memory is
    bounded by running both once per chunk of query heads (`head_chunks`, at most
    `dz_chunk_bytes` of tiles each; `_dz_backward`): a chunk's launches wait for the previous
    chunk's dq, so XLA gives every chunk's tiles one buffer, and dk, dv of a kv head split over
    chunks are carried in f32 from one to the next (summed in the unchunked order).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax.numpy as jnp
from jax import lax

from forgeax.kernels.common.attention import AttentionSpec
from forgeax.kernels.common.attention_chunks import HeadChunk, head_chunks
from forgeax.kernels.pallas.gpu.attention_backward_kernels import _dkv, _dkv_query_block, _dq, _dq_from_dz
from forgeax.kernels.pallas.gpu.attention_tiles import LOG2E, Band, PackedTiles, Tails, tails_of
from forgeax.kernels.pallas.gpu.warpgroups import CTA, F32

if TYPE_CHECKING:
    from forgeax.kernels.pallas.gpu.attention import AttentionConfig


def _dz_layout(spec: AttentionSpec, tails: Tails) -> PackedTiles:
    """Where `_dkv` puts each dz^T tile (128 keys x one query block of 64) of a head: one entry per
    (key tile, query block) pair the band lets meet (`PackedTiles`), so a causal call stores
    half of [S, T] and a windowed one only its band."""
    return PackedTiles.of(Band.keys_by_query(spec, tails), tails.S_padded // CTA,
                          _dkv_query_block(tails.head_dim, ("dk", "dv")), tails.T_padded)


def _dz_tiles(spec: AttentionSpec, tails: Tails, B: int, N: int, K: int, dt,
              config: AttentionConfig) -> tuple[PackedTiles, list[HeadChunk]] | None:
    """The dz^T tiles' layout (`_dz_layout`) and the head chunks that take turns in their memory
    (`head_chunks`, at most `config.dz_chunk_bytes` each) when the backward takes dq from them
    (`_dq_from_dz`), else None: where `config.dz_tiles` asks for them, at head dims <= 128 (whose
    dK/dV query block is a warpgroup's 64 rows), v no wider than q/k, while the B*N heads'
    packed tiles fit `config.dz_tiles_max_bytes` and some chunk fits `dz_chunk_bytes`."""
    if not config.dz_tiles or tails.head_dim > 128 or tails.value_head_dim > tails.head_dim:
        return None
    layout = _dz_layout(spec, tails)
    head_bytes = B * layout.entries * CTA * layout.blk * jnp.dtype(dt).itemsize
    if N * head_bytes > config.dz_tiles_max_bytes:
        return None
    chunks = head_chunks(B, K, N // K, tails.S_padded // CTA, head_bytes, config.dz_chunk_bytes,
                         config.dz_chunk_min_tiles)
    return None if chunks is None else (layout, chunks)


def _dz_backward(q, k, v, dout, lse2, delta, segments, spec, tails: Tails, config: AttentionConfig,
                 layout: PackedTiles, chunks: list[HeadChunk]):
    """(dq, dk, dv) by `_dkv` with dz^T tiles then `_dq_from_dz`, one chunk of query heads at a
    time. Each chunk's launches wait for the previous chunk's dq (an optimization barrier), so
    its dz^T tiles are dead before the next chunk's are written and XLA gives both one buffer."""
    B, Tp, N, H = q.shape
    K = k.shape[2]
    dqs, dks, dvs = {}, {}, {}
    carried = after = None
    for c in chunks:
        q_in = q if after is None else lax.optimization_barrier((q, after))[0]
        dk, dv, dz = _dkv(q_in, k, v, dout, lse2, delta, *segments, spec, tails, config, dz_tiles=layout, chunk=c,
                          carried=carried)
        after = _dq_from_dz(q, k, dz, layout, *segments, spec, tails, config, chunk=c)
        dqs.setdefault(c.k0, []).append(after.reshape(B, Tp, c.kv, c.g, H))
        carried = (dk, dv) if c.carry_out else None
        if not c.carry_out:
            dks[c.k0], dvs[c.k0] = dk, dv
    if len(chunks) == 1:
        return after, dk, dv
    # The chunks' dq, dk, dv in head order: one copy of each (dq: kv heads k0.., their group's g0..).
    dq = jnp.concatenate([jnp.concatenate(dqs[k0], axis=3) for k0 in sorted(dqs)], axis=2).reshape(B, Tp, N, H)
    dk = jnp.concatenate([dks[k0] for k0 in sorted(dks)], axis=2)
    dv = jnp.concatenate([dvs[k0] for k0 in sorted(dvs)], axis=2)
    assert dk.shape[2] == K
    return dq, dk, dv


def backward(q, k, v, bias, mask, q_segment_ids, kv_segment_ids, dropout_seed, out, lse, dout, dlse, spec,
             config: AttentionConfig):
    """(dq, dk, dv, None) of the contract (kernels/common/attention.py) by the kernels `config` picks."""
    del bias, mask, dropout_seed  # refused by `supports`
    tails = tails_of(q, k, v)
    H, dt = tails.head_dim, q.dtype
    dlse = jnp.broadcast_to(dlse, lse.shape).astype(F32)
    # log2-domain lse; an empty row (lse = -inf) gets +inf so that exp2(s - lse) = 0; so do the
    # rows past T (`Tails`), whose dO is 0.
    lse2 = tails.row_stats(jnp.where(jnp.isfinite(lse), lse * LOG2E, jnp.inf), jnp.inf)
    q, k, v = tails.tma_rows(q), tails.tma_cols(k), tails.tma_cols(v, value=True)
    out, dout = tails.tma_rows(out.astype(dt), value=True), tails.tma_rows(dout.astype(dt), value=True)
    segments = tails.ids(q_segment_ids, kv_segment_ids)
    rows = slice(0, tails.T)
    xla_delta = lambda: tails.row_stats(
        jnp.einsum("btnh,btnh->bnt", dout[:, rows].astype(F32), out[:, rows].astype(F32)) - dlse)
    dz_tiles = _dz_tiles(spec, tails, q.shape[0], q.shape[2], k.shape[2], dt, config)
    if dz_tiles is not None:  # dK/dV first, then dq from its dz^T tiles
        dq, dk, dv = _dz_backward(q, k, v, dout, lse2, xla_delta(), segments, spec, tails, config, *dz_tiles)
    else:
        # delta in the dQ kernel needs a key block that holds a tile's O rows (`_dq`); under a
        # left window and with segment ids it always comes from XLA.
        if (config.delta_in_dq_kernel and spec.window_left is None and q_segment_ids is None
                and config.dq_block_kv >= CTA and tails.value_head_dim == H):
            dq, delta = _dq(q, k, v, dout, out, lse2, tails.row_stats(dlse), *segments, spec, tails, config,
                            fused_delta=True)
        else:
            delta = xla_delta()
            (dq,) = _dq(q, k, v, dout, out, lse2, delta, *segments, spec, tails, config, fused_delta=False)
        if config.one_dkv_launch:
            dk, dv = _dkv(q, k, v, dout, lse2, delta, *segments, spec, tails, config)
        else:  # one accumulator per launch (`_dkv`)
            (dk,) = _dkv(q, k, v, dout, lse2, delta, *segments, spec, tails, config, parts=("dk",))
            (dv,) = _dkv(q, k, v, dout, lse2, delta, *segments, spec, tails, config, parts=("dv",))
    return tails.real_rows(dq, tails.H), tails.real_cols(dk, tails.H), tails.real_cols(dv, tails.Hv), None
