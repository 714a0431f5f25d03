"""Rotary position embedding as one Triton kernel (forward and backward), q and k together.

q: [B, T, N, H], k: [B, T, K, H] (GQA: K <= N, any K), positions [B, T] int32, viewed as
TOKENS = B*T rows of heads. Program i owns tokens [i*BLOCK_T, (i+1)*BLOCK_T):

  1. loads their positions and inv_freq[:R/2] (a [R/2] f32 input, computed on the host from
     the options: Llama-3.1 scaling costs nothing in the kernel), and forms
     angle = f32(p) * inv_freq (as the reference rounds it);
  2. reduces the angle to [-pi, pi] (angle - k * 2pi, 2pi split in two f32 constants so that
     k * C1 is exact) and takes cos/sin with the GPU's fast approximations (one MUFU op each,
     |error| < 1e-6 there; accurate only near zero, and positions reach 10^5, hence the
     reduction). Each thread evaluates them for the frequencies of the elements it holds, a
     few times per token: cheap next to the loads, and no [T, R/2] table crosses HBM;
  3. walks q's heads, then k's, BLOCK_N at a time: two loads (a_i, b_i) of a
     [BLOCK_T, BLOCK_N, BLOCK_HALF] tile, the rotation in f32, two stores; elements
     R..H-1 are copied through.
Every input element is read once and every output element written once: the op's floor.
The backward is the same kernel on (dq, dk) with sin negated (the inverse rotation).
Sizes are constexprs (vector-alignment proofs; the interpreter needs constexpr loop bounds).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import triton
import triton.language as tl
from triton.language.extra import libdevice

from forgeax.core.config import KernelConfig
from forgeax.core.registry import Implementation
from forgeax.core.runtime import interpret_enabled
from forgeax.kernels.common.batching import fold_vmap_into_rows
from forgeax.kernels.common.partitioning import split_launch
from forgeax.kernels.common.rope import RopeSpec, inverse_frequencies
from forgeax.kernels.triton.launch import triton_call

_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
_TWO_PI_HI = 6.28125  # 201/32: 8 significant bits, so k * _TWO_PI_HI is exact for k < 2^16
_TWO_PI_LO = 2 * math.pi - 6.28125


# ----------------------------------------------------------------------------- kernel


@triton.jit
def _rotate_heads(X, Y, tok, tok_ok, cos, sin, first, second, pair_ok,
                  N: tl.constexpr, H: tl.constexpr, ROT: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_TAIL: tl.constexpr):
    """Rotates heads [0, N) of tokens `tok` of X [TOKENS, N, H] into Y."""
    row = tok[:, None, None] * (N * H)
    for c in range(0, N, BLOCK_N):
        heads = c + tl.arange(0, BLOCK_N)
        base = row + heads[None, :, None] * H
        ok = tok_ok[:, None, None] & (heads < N)[None, :, None]
        m = ok & pair_ok[None, None, :]
        a = tl.load(X + base + first[None, None, :], mask=m, other=0.0).to(tl.float32)
        b = tl.load(X + base + second[None, None, :], mask=m, other=0.0).to(tl.float32)
        tl.store(Y + base + first[None, None, :], (a * cos - b * sin).to(Y.dtype.element_ty), mask=m)
        tl.store(Y + base + second[None, None, :], (b * cos + a * sin).to(Y.dtype.element_ty), mask=m)
        if ROT < H:  # the pass-through tail
            cols = ROT + tl.arange(0, BLOCK_TAIL)
            mt = ok & (cols < H)[None, None, :]
            tail = tl.load(X + base + cols[None, None, :], mask=mt, other=0.0)
            tl.store(Y + base + cols[None, None, :], tail, mask=mt)


@triton.jit
def _rope_kernel(
    Q, K, POS, FREQ,  # inputs: q [TOKENS, NQ, H], k [TOKENS, NK, H], positions [TOKENS] i32, inv_freq [HALF] f32
    QO, KO,  # outputs: like q and k (KO unused when NK == 0)
    TOKENS: tl.constexpr, NQ: tl.constexpr, NK: tl.constexpr, H: tl.constexpr, ROT: tl.constexpr,
    INTERLEAVED: tl.constexpr, SIGN: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_NQ: tl.constexpr, BLOCK_NK: tl.constexpr,
    BLOCK_HALF: tl.constexpr, BLOCK_TAIL: tl.constexpr,
    TWO_PI_HI: tl.constexpr, TWO_PI_LO: tl.constexpr, FAST_TRIG: tl.constexpr,
):
    HALF: tl.constexpr = ROT // 2
    tok = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    if TOKENS * (NQ + NK) * H >= 2**31:  # element offsets would overflow int32
        tok = tok.to(tl.int64)
    tok_ok = tok < TOKENS
    i = tl.arange(0, BLOCK_HALF)
    pair_ok = i < HALF
    pos = tl.load(POS + tok, mask=tok_ok, other=0).to(tl.float32)
    freq = tl.load(FREQ + i, mask=pair_ok, other=0.0)
    angle = pos[:, None] * freq[None, :]
    turns = tl.floor(angle * (1.0 / (TWO_PI_HI + TWO_PI_LO)) + 0.5)
    reduced = (angle - turns * TWO_PI_HI) - turns * TWO_PI_LO
    if FAST_TRIG:  # one MUFU op each (|error| < 1e-6 on [-pi, pi]); libdevice's sinf/cosf cost ~30 instructions
        cos = libdevice.fast_cosf(reduced)
        sin = libdevice.fast_sinf(reduced)
        zero = reduced == 0.0  # position 0 (or a multiple of 2pi) is exactly the identity
        cos = tl.where(zero, 1.0, cos)
        sin = tl.where(zero, 0.0, sin)
    else:  # Triton's interpreter has no libdevice
        cos = tl.cos(reduced)
        sin = tl.sin(reduced)
    cos = cos[:, None, :]
    sin = (SIGN * sin)[:, None, :]
    if INTERLEAVED:
        first = 2 * i
        second = 2 * i + 1
    else:
        first = i
        second = i + HALF
    _rotate_heads(Q, QO, tok, tok_ok, cos, sin, first, second, pair_ok, NQ, H, ROT, BLOCK_NQ, BLOCK_TAIL)
    if NK > 0:
        _rotate_heads(K, KO, tok, tok_ok, cos, sin, first, second, pair_ok, NK, H, ROT, BLOCK_NK, BLOCK_TAIL)


# ----------------------------------------------------------------------------- config


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


@dataclasses.dataclass(frozen=True, kw_only=True)
class RopeConfig(KernelConfig):
    """block_tokens: tokens per program (cos/sin are computed once per token and frequency and
    reused for every head); block_heads: heads per tile; num_warps: warps per program."""

    block_tokens: int
    block_heads: int
    num_warps: int = 4

    def validate(self) -> None:
        super().validate()
        for name in ("block_tokens", "block_heads"):
            value = getattr(self, name)
            if value & (value - 1):
                raise ValueError(f"RopeConfig.{name}: expected a power of two, got {value}")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"RopeConfig.num_warps: expected 1, 2, 4, 8 or 16, got {self.num_warps}")


def _dims(q, k=None):
    heads = max(q.shape[2], 0 if k is None else k.shape[2])
    return q.shape[0] * q.shape[1], heads


def heuristic_config(q, *args, spec: RopeSpec, **kwargs) -> RopeConfig:
    """Tiles of ~2048 pairs (16 per thread at 4 warps: two 16-byte bf16 vectors per load): at
    N = 32, H = 128 one token's heads per tile, one token per program. The interpreter pays per
    program, so there it takes many tokens per program."""
    del kwargs
    k = args[0] if args and hasattr(args[0], "shape") and args[0].ndim == 4 else None
    tokens, heads = _dims(q, k)
    block_half = _pow2_at_least(spec.half)
    block_heads = min(_pow2_at_least(max(heads, 1)), max(1, 2048 // block_half))
    per_token = block_heads * block_half
    token_cap = _pow2_at_least(max(tokens, 1))
    if interpret_enabled():
        return RopeConfig(block_tokens=min(token_cap, max(1, 16384 // per_token)), block_heads=block_heads)
    return RopeConfig(block_tokens=min(token_cap, max(1, 2048 // per_token)), block_heads=block_heads, num_warps=4)


def candidate_configs(q, *args, spec: RopeSpec, **kwargs) -> list[RopeConfig]:
    base = heuristic_config(q, *args, spec=spec, **kwargs)
    r = base.replace
    return [base, r(num_warps=8), r(block_tokens=base.block_tokens * 2), r(block_tokens=base.block_tokens * 2, num_warps=8),
            r(block_tokens=base.block_tokens * 4, num_warps=8), r(block_heads=max(1, base.block_heads // 2), num_warps=2)]


# ----------------------------------------------------------------------------- launch


def _launch(q, k, positions, *, spec: RopeSpec, config: RopeConfig, sign: float):
    """(rotated q, rotated k or None); q [B, T, N, H], k [B, T, K, H] or None, positions [B, T]."""
    b, t, nq, h = q.shape
    tokens = b * t
    nk = 0 if k is None else k.shape[2]
    if tokens == 0 or nq * h == 0:
        return q, k
    block_heads = config.block_heads
    out_shape = (jax.ShapeDtypeStruct(q.shape, q.dtype),
                 jax.ShapeDtypeStruct(k.shape if nk else (1,), q.dtype))
    qo, ko = triton_call(
        q, q if k is None or nk == 0 else k, positions.reshape(tokens).astype(jnp.int32),
        jnp.asarray(inverse_frequencies(spec)),
        kernel=_rope_kernel,
        out_shape=out_shape,
        grid=(triton.cdiv(tokens, config.block_tokens),),
        num_warps=config.num_warps,
        num_stages=1,
        TOKENS=tokens, NQ=nq, NK=nk, H=h, ROT=spec.rotary_dim,
        INTERLEAVED=spec.interleaved, SIGN=sign,
        BLOCK_T=config.block_tokens,
        BLOCK_NQ=min(block_heads, _pow2_at_least(nq)), BLOCK_NK=min(block_heads, _pow2_at_least(max(nk, 1))),
        BLOCK_HALF=_pow2_at_least(spec.half), BLOCK_TAIL=_pow2_at_least(max(h - spec.rotary_dim, 1)),
        TWO_PI_HI=_TWO_PI_HI, TWO_PI_LO=_TWO_PI_LO, FAST_TRIG=not interpret_enabled(),
    )
    if k is None:
        return qo, None
    return qo, (ko if nk else k)


@functools.cache
def _differentiable(spec: RopeSpec, config: RopeConfig):
    """rope_qk(q, k, positions) with a custom_vjp (k may be None); vmap folds into the batch axis."""

    def rotate(q, k, positions, sign):
        def local(q, k, positions):
            return _launch(q, k, positions, spec=spec, config=config, sign=sign)

        # The SPMD partitioner splits the launch over the batch, token and head axes (any mesh
        # axes; query and key heads the same number of ways).
        heads = ("b", "t", "h", None)
        launch = split_launch(local, (heads, heads, ("b", "t")), ((heads, ()), (heads, ())))
        return fold_vmap_into_rows(launch, row_args=(0, 1, 2))(q, k, positions)

    @jax.custom_vjp
    def run(q, k, positions):
        return rotate(q, k, positions, 1.0)

    def run_fwd(q, k, positions):
        return rotate(q, k, positions, 1.0), positions

    def run_bwd(positions, cotangents):
        dq, dk = cotangents
        dq, dk = rotate(dq, dk, positions, -1.0)  # the inverse rotation
        return dq, dk, None  # integer positions: no gradient

    run.defvjp(run_fwd, run_bwd)
    return run


def rope(x, positions, *, spec: RopeSpec, config: RopeConfig):
    return _differentiable(spec, config)(x, None, positions)[0]


def rope_qk(q, k, positions, *, spec: RopeSpec, config: RopeConfig):
    return _differentiable(spec, config)(q, k, positions)


def _supports(*arrays, spec: RopeSpec) -> str | None:
    del spec
    for x in arrays:
        if jnp.dtype(x.dtype) not in _DTYPES:
            return f"dtype {jnp.dtype(x.dtype).name} is not one of float32/bfloat16/float16"
    return None


def _supports_rope(x, positions, *, spec):
    del positions
    return _supports(x, spec=spec)


def _supports_rope_qk(q, k, positions, *, spec):
    del positions
    return _supports(q, k, spec=spec)


ROPE = Implementation(fn=rope, platforms={"gpu"}, interpretable=True, supports=_supports_rope, config_type=RopeConfig,
                      heuristic_config=heuristic_config, candidate_configs=candidate_configs)
ROPE_QK = Implementation(fn=rope_qk, platforms={"gpu"}, interpretable=True, supports=_supports_rope_qk,
                         config_type=RopeConfig, heuristic_config=heuristic_config, candidate_configs=candidate_configs)
