"""Masked mean over the sequence axis as Triton kernels (forward and backward).

x: [B, T, D]; lengths [B] (output [B, D]) or segment_ids [B, T] with S segments (output
[B, S, D]); semantics in kernels/xla/mean_pool.py. Lengths are segment ids in disguise: row t of
batch b is in segment 0 when t < lengths[b], else in none (S = 1).

Forward: program (b, j) owns channels [j*BLOCK_D, (j+1)*BLOCK_D) of batch row b and walks T,
BLOCK_T rows per tile (the next tile's loads issued before this tile's sums), summing in f32:
with one segment a masked column sum; with S > 1 a one-hot [S_PAD, BLOCK_T] x [BLOCK_T, BLOCK_D]
product on the tensor cores (exact: the one-hot is 0/1, f32 accumulation; f32 x in IEEE
precision, not TF32). The sums are scaled by 1 / count
(counted in XLA from the ids: [B, T] integers, no x traffic) and stored. x is read once.
Backward: dx[b, t] = g[b, s] / count[b, s] for the row's segment s, 0 outside any: one gather
per row over a (b, T-tile, D-tile) grid, with g / count formed in XLA ([B, S, D], small).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import triton
import triton.language as tl

from forgeax.core.config import KernelConfig
from forgeax.core.registry import Implementation
from forgeax.core.runtime import interpret_enabled
from forgeax.kernels.common.batching import fold_vmap_into_rows
from forgeax.kernels.common.partitioning import split_launch
from forgeax.kernels.triton.launch import triton_call

_F32 = jnp.float32
_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
MAX_SEGMENTS = 128  # the one-hot product's rows (S_PAD): its f32 accumulator lives in registers


@triton.jit
def _segments(SEG, LEN, b, t, T: tl.constexpr, HAS_SEG: tl.constexpr, S: tl.constexpr):
    """Segment id of rows t of batch b: in [0, S), or -1 for none (rows past T, padding ids)."""
    ok = t < T
    if HAS_SEG:
        ids = tl.load(SEG + b * T + t, mask=ok, other=-1)
        return tl.where((ids >= 0) & (ids < S), ids, -1)
    n = tl.load(LEN + b)
    return tl.where(ok & (t < n), 0, -1)


@triton.jit
def _forward_kernel(
    X, SEG, LEN, INV,  # x [B, T, D]; segment ids [B, T] i32 or lengths [B] i32; 1 / count [B, S] f32
    OUT,  # [B, S, D], x's dtype
    T: tl.constexpr, D: tl.constexpr, S: tl.constexpr, S_PAD: tl.constexpr, HAS_SEG: tl.constexpr,
    TILES: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, WIDE: tl.constexpr, IEEE: tl.constexpr,
):
    b = tl.program_id(0)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    d_ok = d < D
    if WIDE:
        b = b.to(tl.int64)
    rows = tl.arange(0, BLOCK_T)
    if WIDE:  # t * D would overflow int32
        rows = rows.to(tl.int64)
    if S == 1:
        acc = tl.zeros([BLOCK_D], tl.float32)
    else:
        acc = tl.zeros([S_PAD, BLOCK_D], tl.float32)
        s = tl.arange(0, S_PAD)
    ids_next = _segments(SEG, LEN, b, rows, T, HAS_SEG, S)
    m = (ids_next >= 0)[:, None] & d_ok[None, :]
    x_next = tl.load(X + b * T * D + rows[:, None] * D + d[None, :], mask=m, other=0.0)
    for c in range(TILES):
        x = x_next
        ids = ids_next
        # Issue the next tile's loads before this tile's sums (fully masked past the end).
        t = (c + 1) * BLOCK_T + rows
        ids_next = _segments(SEG, LEN, b, t, T, HAS_SEG, S)
        m = (ids_next >= 0)[:, None] & d_ok[None, :]
        x_next = tl.load(X + b * T * D + t[:, None] * D + d[None, :], mask=m, other=0.0)
        if S == 1:
            acc += tl.sum(x.to(tl.float32), axis=0)
        else:
            if IEEE:  # f32 x, or the interpreter (whose dot multiplies bf16 bit patterns)
                one_hot = (s[:, None] == ids[None, :]).to(tl.float32)
                acc = tl.dot(one_hot, x.to(tl.float32), acc, input_precision="ieee")
            else:
                acc = tl.dot((s[:, None] == ids[None, :]).to(x.dtype), x, acc)
    if S == 1:
        inv = tl.load(INV + b)
        tl.store(OUT + b * D + d, (acc * inv).to(OUT.dtype.element_ty), mask=d_ok)
    else:
        inv = tl.load(INV + b * S + s, mask=s < S, other=0.0)
        out = (acc * inv[:, None]).to(OUT.dtype.element_ty)
        tl.store(OUT + b * S * D + s[:, None] * D + d[None, :], out, mask=(s < S)[:, None] & d_ok[None, :])


@triton.jit
def _backward_kernel(
    GS, SEG, LEN,  # g / count [B, S, D] f32; segment ids [B, T] i32 or lengths [B] i32
    DX,  # [B, T, D], x's dtype
    T: tl.constexpr, D: tl.constexpr, S: tl.constexpr, HAS_SEG: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, WIDE: tl.constexpr,
):
    b = tl.program_id(0)
    t = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    d = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
    d_ok = d < D
    if WIDE:
        b = b.to(tl.int64)
        t = t.to(tl.int64)
    ids = _segments(SEG, LEN, b, t, T, HAS_SEG, S)
    inside = (ids >= 0)[:, None] & d_ok[None, :]
    g = tl.load(GS + b * S * D + ids[:, None] * D + d[None, :], mask=inside, other=0.0)
    out = DX + b * T * D + t[:, None] * D + d[None, :]
    tl.store(out, g.to(DX.dtype.element_ty), mask=(t < T)[:, None] & d_ok[None, :])


# ----------------------------------------------------------------------------- config


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


@dataclasses.dataclass(frozen=True, kw_only=True)
class MeanPoolConfig(KernelConfig):
    """block_t: rows per tile; block_d: channels per program (forward: B * D / block_d programs
    walking T; backward: tiles of block_t x block_d); num_warps."""

    block_t: int
    block_d: int
    num_warps: int = 4

    def validate(self) -> None:
        super().validate()
        for name in ("block_t", "block_d"):
            value = getattr(self, name)
            if value & (value - 1) or value < 16:
                raise ValueError(f"MeanPoolConfig.{name}: expected a power of two >= 16 (a tl.dot operand's side), "
                                 f"got {value}")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"MeanPoolConfig.num_warps: expected 1, 2, 4, 8 or 16, got {self.num_warps}")


def heuristic_config(x, lengths=None, segment_ids=None, *, num_segments=None) -> MeanPoolConfig:
    """The forward has only B * D / block_d programs to spread over the SMs, each walking all of T:
    narrow channel blocks (64) and 64-row tiles keep several programs per SM with a tile in flight
    each. The interpreter takes whole small axes."""
    del lengths, segment_ids, num_segments
    _, t, d = x.shape
    if interpret_enabled():
        return MeanPoolConfig(block_t=max(16, min(64, _pow2_at_least(t))), block_d=max(16, min(128, _pow2_at_least(d))))
    return MeanPoolConfig(block_t=64, block_d=min(64, max(16, _pow2_at_least(d))))


def candidate_configs(x, lengths=None, segment_ids=None, *, num_segments=None) -> list[MeanPoolConfig]:
    base = heuristic_config(x, lengths, segment_ids, num_segments=num_segments)
    r = base.replace
    return [base, r(block_d=32, num_warps=2), r(block_d=128), r(block_t=128, num_warps=8), r(block_t=32)]


# ----------------------------------------------------------------------------- launch


def _counts(x, lengths, segment_ids, s: int):
    """Rows per segment, [B, S] f32 (lengths: [B, 1])."""
    t = x.shape[1]
    if segment_ids is None:
        return jnp.clip(lengths, 0, t).astype(_F32)[:, None]
    ids = jnp.where((segment_ids >= 0) & (segment_ids < s), segment_ids, s)
    return jax.vmap(lambda row: jnp.bincount(row, length=s + 1)[:s])(ids).astype(_F32)


def _ids_and_lengths(x, lengths, segment_ids):
    b = x.shape[0]
    seg = jnp.zeros((1,), jnp.int32) if segment_ids is None else segment_ids.astype(jnp.int32)
    lens = jnp.zeros((1,), jnp.int32) if lengths is None else lengths.astype(jnp.int32).reshape(b)
    return seg, lens


def _forward(x, lengths, segment_ids, inv, *, s: int, config: MeanPoolConfig):
    b, t, d = x.shape
    seg, lens = _ids_and_lengths(x, lengths, segment_ids)
    return triton_call(
        x, seg, lens, inv, kernel=_forward_kernel, out_shape=jax.ShapeDtypeStruct((b, s, d), x.dtype),
        grid=(b, triton.cdiv(d, config.block_d)), num_warps=config.num_warps, num_stages=1,
        T=t, D=d, S=s, S_PAD=max(16, _pow2_at_least(s)), HAS_SEG=segment_ids is not None,
        TILES=triton.cdiv(t, config.block_t), BLOCK_T=config.block_t, BLOCK_D=config.block_d,
        WIDE=b * t * d >= 2**31, IEEE=jnp.dtype(x.dtype) == jnp.dtype(_F32) or interpret_enabled())


def _backward(gs, lengths, segment_ids, *, t: int, x_dtype, s: int, config: MeanPoolConfig):
    b, _, d = gs.shape
    x_shape = (b, t, d)
    seg, lens = _ids_and_lengths(gs, lengths, segment_ids)
    return triton_call(
        gs, seg, lens, kernel=_backward_kernel, out_shape=jax.ShapeDtypeStruct(x_shape, x_dtype),
        grid=(b, triton.cdiv(t, config.block_t), triton.cdiv(d, config.block_d)), num_warps=config.num_warps,
        num_stages=1, T=t, D=d, S=s, HAS_SEG=segment_ids is not None,
        BLOCK_T=config.block_t, BLOCK_D=config.block_d, WIDE=b * t * d >= 2**31)


# Axis labels of the launches' arrays: the batch B and the channels D may be split (each device's
# kernel pools its own batch rows and channels); T and the segments S stay whole.
_X, _LENGTHS, _IDS, _PER_B = ("b", None, "d"), ("b",), ("b", None), ("b", None)


def _split(fn, *arg_dims):
    """fn (one [B, S|T, D] output) as a launch the SPMD partitioner splits over B and D
    (kernels/common/partitioning.py `split_launch`) instead of gathering x."""
    launch = split_launch(lambda *args: (fn(*args),), arg_dims, ((_X, ()),))
    return lambda *args: launch(*args)[0]


def differentiable_mean_pool(forward, backward, s: int):
    """mean_pool(x, lengths, segment_ids) with a custom_vjp from two kernels,
    forward(x, lengths, segment_ids, inv [B, S]) -> [B, S, D] and
    backward(g / count [B, S, D], lengths, segment_ids) -> dx [B, T, D]; vmap folds into the batch
    axis, and the SPMD partitioner splits B and D (`_split`)."""
    forward = fold_vmap_into_rows(_split(forward, _X, _LENGTHS, _IDS, _PER_B), row_args=(0, 1, 2, 3))
    backward = fold_vmap_into_rows(_split(backward, _X, _LENGTHS, _IDS), row_args=(0, 1, 2))

    @jax.custom_vjp
    def run(x, lengths, segment_ids):
        inv = 1.0 / jnp.maximum(_counts(x, lengths, segment_ids, s), 1.0)
        return forward(x, lengths, segment_ids, inv)

    def run_fwd(x, lengths, segment_ids):
        inv = 1.0 / jnp.maximum(_counts(x, lengths, segment_ids, s), 1.0)
        return forward(x, lengths, segment_ids, inv), (lengths, segment_ids, inv)

    def run_bwd(residuals, g):
        lengths, segment_ids, inv = residuals
        gs = g.astype(_F32) * inv[..., None]
        dx = backward(gs, lengths, segment_ids)
        return dx, None, None  # integer ids and lengths: no gradient

    run.defvjp(run_fwd, run_bwd)
    return run


@functools.cache
def _differentiable(s: int, t: int, x_dtype: jnp.dtype, config: MeanPoolConfig):
    return differentiable_mean_pool(functools.partial(_forward, s=s, config=config),
                                    functools.partial(_backward, t=t, x_dtype=x_dtype, s=s, config=config), s)


def mean_pool(x, lengths, segment_ids, *, num_segments, config: MeanPoolConfig):
    s = 1 if segment_ids is None else num_segments
    if x.size == 0 or s == 0:
        return jnp.zeros((x.shape[0], x.shape[2]) if segment_ids is None else (x.shape[0], s, x.shape[2]), x.dtype)
    out = _differentiable(s, x.shape[1], jnp.dtype(x.dtype), config)(x, lengths, segment_ids)
    return out[:, 0] if segment_ids is None else out


def _supports(x, lengths, segment_ids, *, num_segments) -> str | None:
    if jnp.dtype(x.dtype) not in _DTYPES:
        return f"x: dtype {jnp.dtype(x.dtype).name} is not one of float32/bfloat16/float16"
    if segment_ids is not None and num_segments > MAX_SEGMENTS:
        return f"num_segments: {num_segments} > {MAX_SEGMENTS} (the one-hot product's rows are held in registers)"
    return None


MEAN_POOL = Implementation(fn=mean_pool, platforms={"gpu"}, interpretable=True, supports=_supports,
                           config_type=MeanPoolConfig, heuristic_config=heuristic_config,
                           candidate_configs=candidate_configs)
