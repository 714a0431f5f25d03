"""Gated MLP as Triton dual-GEMM kernels (forward and the backward's recompute), NVIDIA GPUs.

x `[M, K]`, gate/up weights `[K, N]` each or one fused `[K, 2, N]` (read in place: the same
buffer with row stride 2N, the up columns at offset N). kernels/common/gated_mlp.py folds the
leading axes, holds the custom_vjp and runs the backward's plain products as XLA dots.

  * `_forward_kernel`: one program per `[BLOCK_M, BLOCK_N]` tile of h. It walks K once,
    loading each x tile once for two products (two f32 accumulators: gate and up), and
    writes only h = act(gate) * up in x's dtype: the `[M, 2N]` pre-activations never reach
    memory.
  * `_backward_kernel`: the same dual GEMM recomputes gate and up for a tile of dh, and its
    epilogue writes dpre = [dh * up * act'(gate) | dh * act(gate)] as `[M, 2N]` (plus h when the
    down projection needs dw_down = h^T dy). dx = dpre @ [w_gate | w_up]^T and
    dW = x^T @ dpre are XLA dots (cuBLAS already runs plain GEMMs at the matmul ceiling; a
    Triton copy would add nothing but compile time).

Tiles are visited in groups of GROUP_M row blocks (the tile index is swizzled) so consecutive
programs share weight columns in L2. Rows past M and columns past N are clamped on load
(`% M`, `% N`: always in bounds, no masks in the main loop) and masked on store; a K tail is
masked to zero. bf16/f16 inputs multiply natively with f32 accumulation; f32 inputs use
3 TF32 products (about f32 accuracy). Sizes and strides are constexprs (alignment is then
provable, so loads vectorise).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import triton
import triton.language as tl

from forgeax.core.config import KernelConfig
from forgeax.core.registry import Implementation
from forgeax.core.runtime import interpret_enabled
from forgeax.kernels.common.gated_mlp import ACTIVATIONS, differentiable_gated_mlp, hidden_size, supports_float_rows
from forgeax.kernels.triton.elementwise import dot, tanh
from forgeax.kernels.triton.launch import check_matmul_tiles, fit_matmul_tiles, triton_call

_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


# ----------------------------------------------------------------------------- kernels


@triton.jit
def _act(g, ACT: tl.constexpr):
    """(act(g), act'(g)) in f32; ACT indexes ("silu", "gelu", "gelu_tanh", "relu"). Constants:
    1/sqrt(2), 1/sqrt(2 pi), sqrt(2/pi), 3 * 0.044715."""
    if ACT == 0:
        s = tl.sigmoid(g)
        return g * s, s * (1.0 + g * (1.0 - s))
    elif ACT == 1:
        cdf = 0.5 * (1.0 + tl.erf(g * 0.7071067811865476))
        return g * cdf, cdf + g * tl.exp(-0.5 * g * g) * 0.3989422804014327
    elif ACT == 2:
        t = tanh(0.7978845608028654 * (g + 0.044715 * g * g * g))
        d_inner = 0.7978845608028654 * (1.0 + 0.134145 * g * g)
        return 0.5 * g * (1.0 + t), 0.5 * (1.0 + t) + 0.5 * g * (1.0 - t * t) * d_inner
    else:
        return tl.maximum(g, 0.0), tl.where(g > 0.0, 1.0, 0.0)


@triton.jit
def _tile(M: tl.constexpr, N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(row block, column block) of this program, grouped GROUP_M row blocks at a time."""
    pid = tl.program_id(0)
    blocks_m = tl.cdiv(M, BLOCK_M)
    blocks_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * blocks_n
    first_m = (pid // per_group) * GROUP_M
    group_size = tl.minimum(blocks_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_size
    pid_n = (pid % per_group) // group_size
    return pid_m, pid_n


@triton.jit
def _dual_gemm(X, WG, WU, rm, rn,
               K: tl.constexpr, W_STRIDE: tl.constexpr, UP_OFFSET: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT: tl.constexpr):
    """(x[rm] @ w_gate[:, rn], x[rm] @ w_up[:, rn]) in f32; rm, rn already in bounds."""
    rk = tl.arange(0, BLOCK_K)
    x_ptrs = X + rm[:, None] * K + rk[None, :]
    wg_ptrs = WG + rk[:, None] * W_STRIDE + rn[None, :]
    wu_ptrs = WU + UP_OFFSET + rk[:, None] * W_STRIDE + rn[None, :]
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        if K % BLOCK_K == 0:
            a = tl.load(x_ptrs)
            bg = tl.load(wg_ptrs)
            bu = tl.load(wu_ptrs)
        else:
            k_ok = rk < K - k
            a = tl.load(x_ptrs, mask=k_ok[None, :], other=0.0)
            bg = tl.load(wg_ptrs, mask=k_ok[:, None], other=0.0)
            bu = tl.load(wu_ptrs, mask=k_ok[:, None], other=0.0)
        acc_g = dot(a, bg, acc_g, DOT)
        acc_u = dot(a, bu, acc_u, DOT)
        x_ptrs += BLOCK_K
        wg_ptrs += BLOCK_K * W_STRIDE
        wu_ptrs += BLOCK_K * W_STRIDE
    return acc_g, acc_u


@triton.jit
def _offsets(M: tl.constexpr, N: tl.constexpr, BIG: tl.constexpr,
             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    pid_m, pid_n = _tile(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    om = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    on = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    if BIG:  # element offsets would overflow int32
        om = om.to(tl.int64)
    store_mask = (om < M)[:, None] & (on < N)[None, :]
    return om % M, on % N, om, on, store_mask


@triton.jit
def _forward_kernel(
    X, WG, WU,  # x [M, K]; gate/up weights (fused: the same buffer twice)
    H, PRE,  # out: h [M, N] in x's dtype; [gate | up] [M, 2N] (written when STORE_PRE)
    M: tl.constexpr, N: tl.constexpr, K: tl.constexpr, W_STRIDE: tl.constexpr, UP_OFFSET: tl.constexpr,
    ACT: tl.constexpr, DOT: tl.constexpr, BIG: tl.constexpr, STORE_PRE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    rm, rn, om, on, store_mask = _offsets(M, N, BIG, BLOCK_M, BLOCK_N, GROUP_M)
    gate, up = _dual_gemm(X, WG, WU, rm, rn, K, W_STRIDE, UP_OFFSET, BLOCK_M, BLOCK_N, BLOCK_K, DOT)
    a, _ = _act(gate, ACT)
    tl.store(H + om[:, None] * N + on[None, :], (a * up).to(H.dtype.element_ty), mask=store_mask)
    if STORE_PRE:
        pre = PRE + om[:, None] * (2 * N) + on[None, :]
        tl.store(pre, gate.to(PRE.dtype.element_ty), mask=store_mask)
        tl.store(pre + N, up.to(PRE.dtype.element_ty), mask=store_mask)


@triton.jit
def _backward_kernel(
    X, WG, WU, DH,  # x [M, K]; weights as in the forward; dh [M, N]
    DPRE, H,  # out: dpre [M, 2N] = [d_gate | d_up]; h [M, N] (written when WANT_H)
    M: tl.constexpr, N: tl.constexpr, K: tl.constexpr, W_STRIDE: tl.constexpr, UP_OFFSET: tl.constexpr,
    ACT: tl.constexpr, DOT: tl.constexpr, BIG: tl.constexpr, WANT_H: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    rm, rn, om, on, store_mask = _offsets(M, N, BIG, BLOCK_M, BLOCK_N, GROUP_M)
    gate, up = _dual_gemm(X, WG, WU, rm, rn, K, W_STRIDE, UP_OFFSET, BLOCK_M, BLOCK_N, BLOCK_K, DOT)
    dh = tl.load(DH + om[:, None] * N + on[None, :], mask=store_mask, other=0.0).to(tl.float32)
    a, da = _act(gate, ACT)
    dpre = DPRE + om[:, None] * (2 * N) + on[None, :]
    tl.store(dpre, (dh * up * da).to(DPRE.dtype.element_ty), mask=store_mask)
    tl.store(dpre + N, (dh * a).to(DPRE.dtype.element_ty), mask=store_mask)
    if WANT_H:
        tl.store(H + om[:, None] * N + on[None, :], (a * up).to(H.dtype.element_ty), mask=store_mask)


# ----------------------------------------------------------------------------- configs


@dataclasses.dataclass(frozen=True, kw_only=True)
class GatedMLPConfig(KernelConfig):
    """Tiles and launch parameters of both dual-GEMM kernels.

    block_m, block_n: the output tile (two f32 accumulators of this size per program);
    block_k: the K step; powers of two >= 16. group_m: row blocks per L2 group.
    num_warps, num_stages: Triton's launch width and software-pipelining depth.
    save_preactivations: under differentiation the forward also writes [gate | up] (x's dtype,
      [M, 2N]) for the backward, which then skips its dual GEMM (6 matmul passes for fwd+bwd
      instead of 8, 2MN more elements held). Off: the `[M, 2N]` never reaches memory.
    """

    block_m: int = 128
    block_n: int = 128
    block_k: int = 64
    group_m: int = 8
    num_warps: int = 8
    num_stages: int = 3
    save_preactivations: bool = False

    def validate(self) -> None:
        super().validate()
        check_matmul_tiles(self)


def _dims(x, w_gate, w_up):
    k = int(x.shape[-1])
    return int(math.prod(x.shape[:-1])), hidden_size(w_gate, w_up), k


def heuristic_config(x, w_gate, w_up, w_down=None, *, spec) -> GatedMLPConfig:
    """128 x 128 output tiles, K steps of 64, 8 warps, 3 stages: the shape of a Hopper bf16
    Triton GEMM at its best, here with two accumulators (128 f32 registers per thread for both);
    3 stages of x and two weight tiles take 144 KiB of shared memory. The interpreter pays per
    program and per op: 32-wide tiles there (still several programs and K steps per test)."""
    del w_down, spec
    m, n, k = _dims(x, w_gate, w_up)
    if interpret_enabled():
        return fit_matmul_tiles(GatedMLPConfig(block_m=32, block_n=32, block_k=32, group_m=2, num_warps=4, num_stages=1), m, n, k)
    if jnp.dtype(x.dtype) == jnp.float32:  # f32 tiles are twice the bytes
        return fit_matmul_tiles(GatedMLPConfig(block_m=64, block_n=64, block_k=32, num_warps=4, num_stages=3), m, n, k)
    return fit_matmul_tiles(GatedMLPConfig(), m, n, k)


def candidate_configs(x, w_gate, w_up, w_down=None, *, spec) -> list[GatedMLPConfig]:
    """The search space: the heuristic and tiles around it (an autotuner times them on the GPU)."""
    m, n, k = _dims(x, w_gate, w_up)
    base = heuristic_config(x, w_gate, w_up, w_down, spec=spec)
    out = [base, base.replace(save_preactivations=True)]
    for bm, bn, bk, warps, stages in ((128, 64, 64, 4, 4), (128, 64, 64, 8, 4), (64, 128, 64, 4, 4), (128, 128, 32, 8, 4),
                                      (128, 128, 64, 8, 4), (256, 64, 64, 8, 3), (128, 256, 32, 8, 3), (64, 64, 64, 4, 5)):
        for group in (8, 16):
            cfg = fit_matmul_tiles(GatedMLPConfig(block_m=bm, block_n=bn, block_k=bk, group_m=group, num_warps=warps, num_stages=stages), m, n, k)
            if cfg not in out:
                out.append(cfg)
    return out


# ----------------------------------------------------------------------------- launches


def _weight_args(w_gate, w_up, n):
    """(gate buffer, up buffer, row stride, up offset): the fused weight is read in place."""
    if w_up is None:
        return w_gate, w_gate, 2 * n, n
    return w_gate, w_up, n, 0


def _common(x, w_gate, w_up, activation, config):
    m, k = x.shape
    n = hidden_size(w_gate, w_up)
    cfg = fit_matmul_tiles(config, m, n, k)
    wg, wu, stride, offset = _weight_args(w_gate, w_up, n)
    interpret = interpret_enabled()
    dot_mode = 2 if interpret else (1 if jnp.dtype(x.dtype) == jnp.float32 else 0)
    grid = (triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n),)
    meta = dict(M=m, N=n, K=k, W_STRIDE=stride, UP_OFFSET=offset, ACT=ACTIVATIONS.index(activation), DOT=dot_mode,
                BIG=m * max(k, 2 * n) >= 2**31, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
                GROUP_M=cfg.group_m)
    return (wg, wu), grid, cfg, meta


def _forward(x, w_gate, w_up, activation, config, store_pre):
    (wg, wu), grid, cfg, meta = _common(x, w_gate, w_up, activation, config)
    m, n = meta["M"], meta["N"]
    pre_shape = (m, 2 * n) if store_pre else (1, 1)  # a placeholder the kernel never writes
    return triton_call(x, wg, wu, kernel=_forward_kernel,
                       out_shape=(jax.ShapeDtypeStruct((m, n), x.dtype), jax.ShapeDtypeStruct(pre_shape, x.dtype)),
                       grid=grid, num_warps=cfg.num_warps, num_stages=cfg.num_stages, STORE_PRE=store_pre, **meta)


def forward(x, w_gate, w_up, *, activation, config):
    return _forward(x, w_gate, w_up, activation, config, False)[0]


def forward_saving(x, w_gate, w_up, *, activation, config):
    return _forward(x, w_gate, w_up, activation, config, True)


def backward(x, w_gate, w_up, dh, *, activation, config, want_h):
    (wg, wu), grid, cfg, meta = _common(x, w_gate, w_up, activation, config)
    m, n = meta["M"], meta["N"]
    h_shape = (m, n) if want_h else (1, 1)  # a placeholder the kernel never writes
    dpre, h = triton_call(x, wg, wu, dh.astype(x.dtype), kernel=_backward_kernel,
                          out_shape=(jax.ShapeDtypeStruct((m, 2 * n), x.dtype), jax.ShapeDtypeStruct(h_shape, x.dtype)),
                          grid=grid, num_warps=cfg.num_warps, num_stages=cfg.num_stages, WANT_H=want_h, **meta)
    return dpre, h if want_h else None


_DIFFERENTIABLE = differentiable_gated_mlp(forward, backward, forward_saving)


def gated_mlp(x, w_gate, w_up, w_down=None, *, spec, config: GatedMLPConfig):
    return _DIFFERENTIABLE(x, w_gate, w_up, w_down, spec, config)


GATED_MLP = Implementation(
    fn=gated_mlp,
    platforms={"gpu"},
    interpretable=True,
    supports=supports_float_rows,
    config_type=GatedMLPConfig,
    heuristic_config=heuristic_config,
    candidate_configs=candidate_configs,
)
