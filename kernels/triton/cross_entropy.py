"""Cross-entropy as Triton kernels: one program per row, online softmax over V.

logits are viewed as (N, V) rows, targets as (N,) int32 with -1 marking an
ignored token (ignore_index and out-of-range targets are mapped to -1 by the
wrapper). Per row, in f32, with z = cap * tanh(x / cap) or z = x:

    lse  = log(sum_v exp(z_v))                       (online, blocks of BLOCK_V)
    loss = lse - (1 - ls) * z_t - ls / V * sum_v z_v + z_loss * lse^2
    dloss/dx_v = s * (p_v * (1 + 2 z_loss lse) - (1 - ls) [v == t] - ls / V) * dz/dx
    with p_v = exp(z_v - lse), dz/dx = 1 - (z / cap)^2, s = the row's cotangent.

Kernels (the row math lives once, in the `_row_*` helpers):
  * `_loss_kernel`: one pass over the row -> loss [N], lse [N] (f32).
  * `_grad_kernel`: one pass over the row, given lse and the per-row cotangent
    s -> dx [N, V] in the logits' dtype (0 on ignored rows).
  * `_loss_grad_kernel`: both, back to back in one program (the "gradient in
    the forward pass" of Liger-Kernel): the second read of the row is likely
    an L2 hit, and the unscaled gradient (s = 1) is stored for the backward,
    which then only scales it by the cotangent.

Two ways to differentiate (`CrossEntropyTritonConfig.grad_in_forward`):
  * False (default): forward = `_loss_kernel`, residuals (logits, lse);
    backward = `_grad_kernel`. HBM traffic for fwd+bwd: read logits twice and
    write the gradient once, the floor; a forward alone reads logits once.
  * True: forward = `_loss_grad_kernel`, residual = the unscaled gradient;
    backward = an XLA elementwise scale (one more read and write of the
    gradient unless XLA fuses it into the consumer). The logits are dead
    after the forward, as in Liger-Kernel.
Vocabulary-parallel (spec.axis_name, inside shard_map): `_stats_kernel` writes the slice's
(lse, z_t, sum z), combined by kernels/common/losses.py (pmax + psum); `_grad_kernel` takes the
global lse and VG, the global vocabulary (grad_in_forward does not apply).
The reduction ("mean"/"sum") is XLA on the per-token losses, so its gradient
reaches the kernels as the per-token cotangent: the valid-token count stays on
device. Sizes, strides and the float options are constexprs (vector loads;
constexpr loop bounds for the interpreter).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import triton
import triton.language as tl

from forgeax.kernels.common.batching import fold_vmap_into_rows
from forgeax.kernels.common.partitioning import ROWS, rowwise
from forgeax.core.config import KernelConfig
from forgeax.kernels.common.losses import (
    LossSpec, RowKernels, reduce_loss, split_per_token, valid_targets, vocab_parallel_per_token, vocab_range,
)
from forgeax.kernels.triton.elementwise import tanh
from forgeax.kernels.triton.launch import triton_call
from forgeax.core.registry import Implementation
from forgeax.core.runtime import interpret_enabled

_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


# ----------------------------------------------------------------------------- kernels


@triton.jit
def _soft_cap(x, CAP: tl.constexpr):
    """cap * tanh(x / cap); the identity when CAP == 0."""
    z = x
    if CAP > 0:
        z = CAP * tanh(x * (1.0 / CAP))  # a constant multiply, not a division per element
    return z


@triton.jit
def _row_stats(X, row_start, target, V: tl.constexpr, BLOCK_V: tl.constexpr, CAP: tl.constexpr, LS: tl.constexpr):
    """(lse, z[target] or 0 when target is not in [0, V), sum_v z (0 when LS == 0)) of one row."""
    cols = tl.arange(0, BLOCK_V)
    m = float("-inf")  # running max
    d = 0.0  # running sum of exp(z - m)
    z_sum = tl.zeros([BLOCK_V], dtype=tl.float32)  # per-lane partial sums of z (label smoothing)
    for start in range(0, V, BLOCK_V):
        mask = start + cols < V
        x = tl.load(X + row_start + start + cols, mask=mask, other=0.0).to(tl.float32)
        z = tl.where(mask, _soft_cap(x, CAP), float("-inf"))
        m_new = tl.maximum(m, tl.max(z, axis=0))
        d = d * tl.exp(m - m_new) + tl.sum(tl.exp(z - m_new), axis=0)
        m = m_new
        if LS > 0:
            z_sum += tl.where(mask, z, 0.0)
    here = (target >= 0) & (target < V)  # vocabulary-parallel: the class may live on another shard
    z_t = _soft_cap(tl.load(X + row_start + tl.where(here, target, 0)).to(tl.float32), CAP)
    return m + tl.log(d), tl.where(here, z_t, 0.0), tl.sum(z_sum, axis=0)


@triton.jit
def _row_loss(X, row_start, target, V: tl.constexpr, BLOCK_V: tl.constexpr, CAP: tl.constexpr, LS: tl.constexpr, Z_LOSS: tl.constexpr):
    """(loss, lse) of one row; loss is 0 when target < 0 (ignored)."""
    lse, z_t, z_sum = _row_stats(X, row_start, target, V, BLOCK_V, CAP, LS)
    loss = lse - (1.0 - LS) * z_t
    if LS > 0:
        loss -= LS / V * z_sum
    if Z_LOSS > 0:
        loss += Z_LOSS * lse * lse
    return tl.where(target >= 0, loss, 0.0), lse


@triton.jit
def _row_grad(X, DX, row_start, target, lse, scale, V: tl.constexpr, VG: tl.constexpr, BLOCK_V: tl.constexpr, CAP: tl.constexpr, LS: tl.constexpr, Z_LOSS: tl.constexpr):
    """Writes scale * dloss/dx for one row (zeros when target < 0). VG: the global vocabulary
    (V's ls / V term; > V when vocabulary-parallel, where lse is the global one)."""
    cols = tl.arange(0, BLOCK_V)
    valid = target >= 0
    scale = tl.where(valid, scale, 0.0)
    p_scale = scale * (1.0 + 2.0 * Z_LOSS * lse)  # d(lse + z_loss lse^2)/dlse
    hit = scale * (1.0 - LS)
    for start in range(0, V, BLOCK_V):
        mask = start + cols < V
        x = tl.load(X + row_start + start + cols, mask=mask, other=0.0).to(tl.float32)
        if CAP > 0:
            th = tanh(x * (1.0 / CAP))
            z = CAP * th
        else:
            z = x
        g = tl.exp(z - lse) * p_scale - tl.where(start + cols == target, hit, 0.0)
        if LS > 0:
            g -= scale * (LS / VG)
        if CAP > 0:
            g *= 1.0 - th * th  # d(cap tanh(x / cap))/dx
        g = tl.where(valid, g, 0.0)  # exact zeros on ignored rows, even for inf/nan logits
        tl.store(DX + row_start + start + cols, g.to(DX.dtype.element_ty), mask=mask)


@triton.jit
def _row_start(row, ROWS: tl.constexpr, V: tl.constexpr):
    if ROWS * V >= 2**31:  # element offsets would overflow int32
        row = row.to(tl.int64)
    return row * V


@triton.jit
def _loss_kernel(X, T, LOSS, LSE, ROWS: tl.constexpr, V: tl.constexpr, BLOCK_V: tl.constexpr, CAP: tl.constexpr, LS: tl.constexpr, Z_LOSS: tl.constexpr):
    row = tl.program_id(0)
    target = tl.load(T + row)
    loss, lse = _row_loss(X, _row_start(row, ROWS, V), target, V, BLOCK_V, CAP, LS, Z_LOSS)
    tl.store(LOSS + row, loss)
    tl.store(LSE + row, lse)


@triton.jit
def _grad_kernel(X, T, LSE, SCALE, DX, ROWS: tl.constexpr, V: tl.constexpr, VG: tl.constexpr, BLOCK_V: tl.constexpr, CAP: tl.constexpr, LS: tl.constexpr, Z_LOSS: tl.constexpr):
    row = tl.program_id(0)
    _row_grad(X, DX, _row_start(row, ROWS, V), tl.load(T + row), tl.load(LSE + row), tl.load(SCALE + row), V, VG, BLOCK_V, CAP, LS, Z_LOSS)


@triton.jit
def _stats_kernel(X, T, LSE, ZT, ZSUM, ROWS: tl.constexpr, V: tl.constexpr, BLOCK_V: tl.constexpr, CAP: tl.constexpr, LS: tl.constexpr, Z_LOSS: tl.constexpr):
    row = tl.program_id(0)
    lse, z_t, z_sum = _row_stats(X, _row_start(row, ROWS, V), tl.load(T + row), V, BLOCK_V, CAP, LS)
    tl.store(LSE + row, lse)
    tl.store(ZT + row, z_t)
    tl.store(ZSUM + row, z_sum)


@triton.jit
def _loss_grad_kernel(X, T, LOSS, LSE, DX, ROWS: tl.constexpr, V: tl.constexpr, BLOCK_V: tl.constexpr, CAP: tl.constexpr, LS: tl.constexpr, Z_LOSS: tl.constexpr):
    row = tl.program_id(0)
    start = _row_start(row, ROWS, V)
    target = tl.load(T + row)
    loss, lse = _row_loss(X, start, target, V, BLOCK_V, CAP, LS, Z_LOSS)
    tl.store(LOSS + row, loss)
    tl.store(LSE + row, lse)
    _row_grad(X, DX, start, target, lse, 1.0, V, V, BLOCK_V, CAP, LS, Z_LOSS)


# ----------------------------------------------------------------------------- configs

_WARPS = (1, 2, 4, 8, 16, 32)


def check_row_launch(config) -> None:
    """Validates a row-kernel launch (`block_v`, `num_warps`), naming the field."""
    name = type(config).__name__
    if config.block_v < 16 or config.block_v & (config.block_v - 1):
        raise ValueError(f"{name}.block_v: expected a power of two >= 16, got {config.block_v}")
    if config.num_warps not in _WARPS:
        raise ValueError(f"{name}.num_warps: expected one of {_WARPS}, got {config.num_warps}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class CrossEntropyTritonConfig(KernelConfig):
    """Launch of the row kernels; see the module docstring for `grad_in_forward`.

    block_v: vocabulary elements per loop step (a power of two; capped at the
      next power of two >= V). num_warps: upper bound on warps per program
      (fewer for short rows, so each thread keeps >= 8 elements per step).
    The defaults were the fastest forward+backward at Llama-3's (8192, 128256)
    bf16 on an H200 (2048 x 2, 4096 x 4 and 8192 x 16 warps within 4%;
    grad_in_forward about 1.8x slower: its extra scaling pass).
    """

    block_v: int = 8192
    num_warps: int = 8
    grad_in_forward: bool = False

    def validate(self) -> None:
        super().validate()
        check_row_launch(self)


def heuristic_block_v() -> int:
    """The row kernels' default vocabulary block. Triton's interpreter pays per block operation,
    not per element: there it takes 4x larger blocks (V=50257 still runs two blocks)."""
    return 32768 if interpret_enabled() else CrossEntropyTritonConfig.block_v


def heuristic_config(logits, targets, *, spec: LossSpec) -> CrossEntropyTritonConfig:
    del logits, targets, spec
    return CrossEntropyTritonConfig(block_v=heuristic_block_v())


def candidate_configs(logits, targets, *, spec: LossSpec) -> list[CrossEntropyTritonConfig]:
    """The launches worth timing: block_v x warps around the default, with either differentiation."""
    del logits, targets, spec
    return [
        CrossEntropyTritonConfig(block_v=block_v, num_warps=warps, grad_in_forward=gif)
        for block_v in (2048, 4096, 8192, 16384)
        for warps in (2, 4, 8, 16)
        for gif in (False, True)
    ]


def _launch(kernel, args, out_shape, rows: int, v: int, spec: LossSpec, config, aliases=None, **constexprs):
    block_v = min(config.block_v, triton.next_power_of_2(v))
    num_warps = max(1, min(config.num_warps, block_v // 256))
    # aliases: {input index: output index} written in place (GPU only; the interpreter copies).
    extra = {"input_output_aliases": aliases} if aliases and not interpret_enabled() else {}
    return triton_call(
        *args,
        kernel=kernel,
        out_shape=out_shape,
        grid=(rows,),
        **extra,
        num_warps=num_warps,
        num_stages=1,
        ROWS=rows, V=v, BLOCK_V=block_v,
        CAP=float(spec.soft_cap), LS=float(spec.label_smoothing), Z_LOSS=float(spec.z_loss),
        **constexprs,
    )


def _loss_rows(x2, t, *, spec, config):
    rows, v = x2.shape
    row_f32 = jax.ShapeDtypeStruct((rows,), jnp.float32)
    return _launch(_loss_kernel, (x2, t), (row_f32, row_f32), rows, v, spec, config)


# grad_dtype: the gradient's dtype (default the logits'); fused linear CE reads
# f32 logits and wants the gradient in the matmul dtype.
# in_place: the gradient overwrites the logits (same dtype; each block is read before
# it is written, by the program that owns the row).
# vocab: the global vocabulary when vocabulary-parallel (then t holds local_targets), else None.
def _grad_rows(x2, t, lse, scale, *, spec, config, grad_dtype=None, in_place=False, vocab=None):
    rows, v = x2.shape
    dx = jax.ShapeDtypeStruct(x2.shape, grad_dtype or x2.dtype)
    aliases = {0: 0} if in_place and dx.dtype == x2.dtype else None
    return _launch(_grad_kernel, (x2, t, lse, scale), dx, rows, v, spec, config, aliases, VG=int(vocab or v))


def _stats_rows(x2, t, *, spec, config):
    rows, v = x2.shape
    row_f32 = jax.ShapeDtypeStruct((rows,), jnp.float32)
    return _launch(_stats_kernel, (x2, t), (row_f32,) * 3, rows, v, spec, config)


def _loss_grad_rows(x2, t, *, spec, config, grad_dtype=None, in_place=False):
    rows, v = x2.shape
    row_f32 = jax.ShapeDtypeStruct((rows,), jnp.float32)
    dx = jax.ShapeDtypeStruct(x2.shape, grad_dtype or x2.dtype)
    aliases = {0: 2} if in_place and dx.dtype == x2.dtype else None
    return _launch(_loss_grad_kernel, (x2, t), (row_f32, row_f32, dx), rows, v, spec, config, aliases)


# Row kernels under vmap: a batch axis folds into the rows (every argument is per row).
# Every argument's leading axes (all but the logits' vocabulary axis) are rows, which the SPMD
# partitioner splits over any mesh axes (kernels/common/partitioning.py); the kernels see them flat.
def _rowwise(fn, spec, config, n_args, **static):
    kernel = functools.partial(fn, spec=spec, config=config, **static)
    outs = ROWS if fn is _grad_rows else (ROWS,) * (3 if fn in (_loss_grad_rows, _stats_rows) else 2)

    def launch(*args):
        return rowwise(kernel, (ROWS,) * n_args, outs, row_ndim=args[0].ndim - 1)(*args)

    return fold_vmap_into_rows(launch, row_args=tuple(range(n_args)))


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _per_token(x2, t, spec, config):
    return _rowwise(_loss_rows, spec, config, 2)(x2, t)[0]


def _per_token_fwd(x2, t, spec, config):
    if config.grad_in_forward:
        loss, _, grad = _rowwise(_loss_grad_rows, spec, config, 2)(x2, t)
        return loss, (grad, None, None)
    loss, lse = _rowwise(_loss_rows, spec, config, 2)(x2, t)
    return loss, (x2, t, lse)


def _per_token_bwd(spec, config, residuals, ct):
    if config.grad_in_forward:
        grad = residuals[0]
        dx = (grad.astype(jnp.float32) * ct[..., None]).astype(grad.dtype)
    else:
        x2, t, lse = residuals
        dx = _rowwise(_grad_rows, spec, config, 4)(x2, t, lse, ct.astype(jnp.float32))
    return dx, None  # integer targets: no cotangent


_per_token.defvjp(_per_token_fwd, _per_token_bwd)


# ----------------------------------------------------------------------------- row functions for other ops
# For callers that own the differentiation (the linear_cross_entropy chunk loop): `spec` is the
# call's LossSpec (its label_smoothing, z_loss and logit_soft_cap are used), `config` any config
# with `block_v` and `num_warps` (checked by `check_row_launch`).


def loss_rows(logits2d, targets, spec: LossSpec, config):
    """(loss [N], lse [N]) f32 of 2-D logits; targets int32 [N], -1 = ignored (loss 0)."""
    return _rowwise(_loss_rows, spec, config, 2)(logits2d, targets)


def loss_and_grad_rows(logits2d, targets, spec: LossSpec, config, grad_dtype=None, in_place=False):
    """(loss, lse, d loss_row / d logits in grad_dtype): one kernel, the row read twice.

    in_place: the gradient is written over `logits2d` when the dtypes match
    (XLA copies the logits first if they are still live).
    """
    return _rowwise(_loss_grad_rows, spec, config, 2, grad_dtype=grad_dtype, in_place=in_place)(logits2d, targets)


def grad_rows(logits2d, targets, lse, scale, spec: LossSpec, config, grad_dtype=None, in_place=False, vocab=None):
    """scale[:, None] * d loss_row / d logits, given the rows' lse (f32 [N]) and scale (f32 [N]).
    Vocabulary-parallel: targets from `losses.local_targets`, lse the global one, vocab the global V."""
    return _rowwise(_grad_rows, spec, config, 4, grad_dtype=grad_dtype, in_place=in_place, vocab=vocab)(logits2d, targets, lse, scale)


def stats_rows(logits2d, local_targets, spec: LossSpec, config):
    """(lse, z[target] or 0, sum_v z) [N] f32 of one vocabulary slice (`losses.vocab_parallel_loss`)."""
    return _rowwise(_stats_rows, spec, config, 2)(logits2d, local_targets)


def vocab_parallel_kernels(vocab: int, spec: LossSpec, config, grad_dtype=None, in_place=False):
    """(stats, grad) of `losses.vocab_parallel_loss` / `vocab_parallel_per_token` (hashable
    partials); vocab: the global vocabulary (static)."""
    return (functools.partial(stats_rows, spec=spec, config=config),
            functools.partial(grad_rows, spec=spec, config=config, grad_dtype=grad_dtype, vocab=vocab, in_place=in_place))



# ----------------------------------------------------------------------------- public entry point


def cross_entropy(logits, targets, *, spec: LossSpec = LossSpec(), config: CrossEntropyTritonConfig | None = None):
    """The op's contract (forgeax.ops.cross_entropy); config None: `heuristic_config`."""
    config = config or heuristic_config(logits, targets, spec=spec)
    v = vocab_range(spec, logits.shape[-1])[1]  # the global vocabulary
    t = targets.astype(jnp.int32)  # leading axes kept: a token-sharded [B, T, V] stays sharded
    valid = valid_targets(t, v, spec)
    if spec.axis_name is not None:  # vocabulary-parallel: partial statistics + collectives
        loss = vocab_parallel_per_token(*vocab_parallel_kernels(v, spec, config), logits, jnp.where(valid, t, -1), spec)
        return reduce_loss(loss, valid, spec.reduction)
    if config.grad_in_forward:  # rows split under plain jit; a sharded vocabulary is gathered
        loss = _per_token(logits, jnp.where(valid, t, -1), spec, config)
    else:  # rows and a sharded vocabulary split under plain jit (vocabulary-parallel per device)
        loss = split_per_token(row_kernels(spec, config), logits, jnp.where(valid, t, -1), spec)
    return reduce_loss(loss, valid, spec.reduction)


def row_kernels(spec: LossSpec, config) -> RowKernels:
    """The raw row kernels (`losses.split_per_token`'s contract), spec and config bound."""
    return RowKernels(
        loss=functools.partial(_loss_rows, spec=spec, config=config),
        stats=functools.partial(_stats_rows, spec=spec, config=config),
        grad=functools.partial(_raw_grad, spec=spec, config=config),
    )


def _raw_grad(x2, t, lse, scale, vocab, *, spec, config):
    return _grad_rows(x2, t, lse, scale, spec=spec, config=config, vocab=vocab)


def _supports(logits, targets, *, spec: LossSpec = LossSpec()):
    del targets, spec
    if logits.dtype not in _DTYPES:
        return f"logits dtype {jnp.dtype(logits.dtype).name} is not one of float32/bfloat16/float16"
    if logits.shape[-1] == 0 or logits.size == 0:
        return "empty logits"
    return None


CROSS_ENTROPY = Implementation(
    fn=cross_entropy,
    platforms={"gpu"},
    interpretable=True,
    supports=_supports,
    config_type=CrossEntropyTritonConfig,
    heuristic_config=heuristic_config,
    candidate_configs=candidate_configs,
)
