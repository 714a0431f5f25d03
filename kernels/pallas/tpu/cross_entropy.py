"""Cross-entropy as Mosaic TPU Pallas kernels (forward and backward).

NOT RUN ON A TPU: proven in Pallas' TPU interpreter (tests/cross_entropy_test.py under
FORGEAX_INTERPRET=1) and by cross-lowering on CPU (tests/lowering_pallas_tpu_cross_entropy_test.py).
The tile (`CrossEntropyPallasTpuConfig`) is reasoned about (VMEM budget, grid steps), not measured.

logits are viewed as (N, V) rows, targets as an (N, 1) int32 column, -1 marking an ignored
token (the wrapper maps ignore_index and out-of-range targets to -1). Per row, in f32, with
z = cap * tanh(x / cap) or z = x:

    lse  = m + log(sum_v exp(z_v - m)),  m = max_v z_v   (online, per vocab block)
    loss = lse - (1 - ls) * z_t - ls / V * sum_v z_v + z_loss * lse^2
    dloss/dx_v = s * (p_v * (1 + 2 z_loss lse) - (1 - ls) [v == t] - ls / V) * dz/dx
    with p_v = exp(z_v - lse), dz/dx = 1 - (z / cap)^2, s = the row's cotangent.

Both kernels run on a grid (row blocks, vocab blocks) of (block_rows, block_v) tiles:
  * `_fwd_kernel`: vocab axis "arbitrary" (sequential); running max, sum of exp, target logit
    and sum of z in (block_rows, 1) f32 VMEM scratch; the last vocab block writes loss and lse.
  * `_bwd_kernel`: every tile independent; recomputes p from the saved lse and writes
    s * dloss/dx in the logits' dtype. Forward + backward read the logits twice and write
    the gradient once, the HBM floor. The reduction is XLA on the per-token losses.

TPU block rules: the last two block dims are multiples of (8, 128) or equal the array's.
Rows: all N, or a multiple of 8 (f32) / 16 (bf16, f16). Vocabulary: all V when V <= block_v,
else block_v (a multiple of 128); the last vocab block then reads past V (NaN in the
interpreter) and an iota mask (`where`, never a multiply: 0 * NaN is NaN) keeps those lanes
out of every sum. Rows past N in a ragged row block compute garbage whose writes are dropped.
Vocabulary-parallel (axis_name, inside shard_map): `_fwd_kernel(partials=True)` writes the
slice's (lse, z[target], sum z), combined with one pmax + one psum (kernels/common/losses.py);
`_bwd_kernel` takes the global lse and V. `supports` refuses dtypes other than f32/bf16/f16.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from forgeax.kernels.common.batching import fold_vmap_into_rows
from forgeax.kernels.common.partitioning import ROWS, rowwise
from forgeax.kernels.common.losses import (
    LossSpec, RowKernels, reduce_loss, split_per_token, valid_targets, vocab_parallel_per_token, vocab_range,
)
from forgeax.kernels.pallas.interpret import without_effects
from forgeax.core.config import KernelConfig
from forgeax.core.registry import Implementation
from forgeax.core.runtime import interpret_enabled

__all__ = ["CROSS_ENTROPY", "CrossEntropyPallasTpuConfig", "Tiling", "grad_rows", "loss_rows", "tiling"]

_F32 = jnp.float32
_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))

_VMEM_LIMIT = 32 << 20  # the scoped VMEM we ask for (v5e's default is 16 MiB; every current chip has >= 64 MiB)


def _row_align(dtype) -> int:
    """Row-block multiple: 8 sublanes of 32 bits, 16 rows for 16-bit dtypes."""
    return 8 * (4 // jnp.dtype(dtype).itemsize)


@dataclasses.dataclass(frozen=True, kw_only=True)
class CrossEntropyPallasTpuConfig(KernelConfig):
    """The (block_rows, block_v) tile of both kernels.

    block_rows: a multiple of 16 (legal for every dtype; all N rows when N is smaller).
    block_v: a multiple of 128 lanes (all V when V is smaller). 128 x 4096 is 2 MiB per f32
    temporary and 1 MiB per bf16 buffer: the backward's double-buffered x and dx tiles (4 MiB
    in bf16, 8 in f32) plus a few f32 temporaries stay well under the VMEM limit, and at
    (8192, 128256) the 2048 grid steps move 1 MiB each, so the ~0.35 us per-step overhead
    stays small against the DMA time.
    """

    block_rows: int = 128
    block_v: int = 4096

    def validate(self) -> None:
        super().validate()
        name = type(self).__name__
        if self.block_rows % 16:
            raise ValueError(f"{name}.block_rows: expected a multiple of 16, got {self.block_rows}")
        if self.block_v % 128:
            raise ValueError(f"{name}.block_v: expected a multiple of 128, got {self.block_v}")


def heuristic_block_v() -> int:
    """The default vocabulary block. The TPU interpreter pays per grid step: on CPU it takes 4x
    wider blocks (V=50257 still runs 4 blocks, the last one masked)."""
    return 16384 if interpret_enabled() else CrossEntropyPallasTpuConfig.block_v


def heuristic_config(logits, targets, *, spec: LossSpec) -> CrossEntropyPallasTpuConfig:
    del logits, targets, spec
    return CrossEntropyPallasTpuConfig(block_v=heuristic_block_v())


def candidate_configs(logits, targets, *, spec: LossSpec) -> list[CrossEntropyPallasTpuConfig]:
    """Tiles worth timing on a TPU (none measured yet): rows x lanes around the default."""
    del logits, targets, spec
    return [CrossEntropyPallasTpuConfig(block_rows=r, block_v=v) for r in (64, 128, 256) for v in (2048, 4096, 8192)]


@dataclasses.dataclass(frozen=True)
class Tiling:
    """Block shape and grid of one (N, V) call; shared by the forward and backward."""

    rows: int
    vocab: int
    block_rows: int
    block_v: int

    @property
    def grid(self) -> tuple[int, int]:
        return (pl.cdiv(self.rows, self.block_rows), pl.cdiv(self.vocab, self.block_v))

    @property
    def ragged_v(self) -> bool:
        return self.vocab % self.block_v != 0

    def tile(self):  # (block_rows, block_v) slab of an (N, V) array
        return pl.BlockSpec((self.block_rows, self.block_v), lambda i, j: (i, j))

    def column(self):  # (block_rows, 1) slab of an (N, 1) per-row array, fixed across vocab blocks
        return pl.BlockSpec((self.block_rows, 1), lambda i, j: (i, 0))


def tiling(rows: int, vocab: int, dtype, config: CrossEntropyPallasTpuConfig) -> Tiling:
    """Legal TPU blocks for (rows, vocab) logits of `dtype` under `config`."""
    align = _row_align(dtype)
    br = rows if rows <= config.block_rows else config.block_rows // align * align
    bv = vocab if vocab <= config.block_v else config.block_v
    return Tiling(rows, vocab, br, bv)


# ----------------------------------------------------------------------------- kernels


def _logits_tile(x_ref, t: Tiling, cap: float):
    """(x, z, th, cols, in_range) for this grid step's tile, all f32 but the bool mask.

    cols are global vocabulary ids; in_range is None when every lane is inside V.
    """
    x = x_ref[...].astype(_F32)
    th = jnp.tanh(x * (1.0 / cap)) if cap else None  # a constant multiply, not a division
    z = cap * th if cap else x
    cols = pl.program_id(1) * t.block_v + jax.lax.broadcasted_iota(jnp.int32, x.shape, 1)
    in_range = cols < t.vocab if t.ragged_v else None
    return x, z, th, cols, in_range


def _fwd_kernel(x_ref, t_ref, *refs, t: Tiling, spec: LossSpec, partials: bool = False):
    # partials (vocabulary-parallel): outputs (lse, z[target] or 0, sum z) of this slice, not (loss, lse).
    if partials:
        lse_ref, zt_ref, zs_ref, m_sc, s_sc, zt_sc, zsum_sc = refs
    else:
        loss_ref, lse_ref, m_sc, s_sc, zt_sc, zsum_sc = refs
    j = pl.program_id(1)

    @pl.when(j == 0)
    def _init():
        m_sc[...] = jnp.full(m_sc.shape, -jnp.inf, _F32)
        s_sc[...] = jnp.zeros(s_sc.shape, _F32)
        zt_sc[...] = jnp.zeros(zt_sc.shape, _F32)
        zsum_sc[...] = jnp.zeros(zsum_sc.shape, _F32)

    _, z, _, cols, in_range = _logits_tile(x_ref, t, spec.soft_cap)
    target = t_ref[...]  # (block_rows, 1); -1 never matches a column
    z_max = z if in_range is None else jnp.where(in_range, z, -jnp.inf)
    m_old = m_sc[...]
    m_new = jnp.maximum(m_old, jnp.max(z_max, axis=1, keepdims=True))
    # m_old = -inf on the first block: exp(-inf) = 0 scales the empty sum (m_new is finite).
    s_sc[...] = s_sc[...] * jnp.exp(m_old - m_new) + jnp.sum(jnp.exp(z_max - m_new), axis=1, keepdims=True)
    m_sc[...] = m_new
    zt_sc[...] += jnp.sum(jnp.where(cols == target, z, 0.0), axis=1, keepdims=True)
    if spec.label_smoothing:
        z_in = z if in_range is None else jnp.where(in_range, z, 0.0)
        zsum_sc[...] += jnp.sum(z_in, axis=1, keepdims=True)

    @pl.when(j == pl.num_programs(1) - 1)
    def _finish():
        lse = m_sc[...] + jnp.log(s_sc[...])
        if partials:
            lse_ref[...], zt_ref[...], zs_ref[...] = lse, zt_sc[...], zsum_sc[...]
            return
        loss = lse - (1.0 - spec.label_smoothing) * zt_sc[...]
        if spec.label_smoothing:
            loss = loss - (spec.label_smoothing / t.vocab) * zsum_sc[...]
        if spec.z_loss:
            loss = loss + spec.z_loss * lse * lse
        loss_ref[...] = jnp.where(target >= 0, loss, 0.0)
        lse_ref[...] = lse


def _bwd_kernel(x_ref, t_ref, lse_ref, ct_ref, dx_ref, *, t: Tiling, spec: LossSpec, vocab: int):
    _, z, th, cols, _ = _logits_tile(x_ref, t, spec.soft_cap)
    target = t_ref[...]
    valid = target >= 0
    lse = lse_ref[...]
    scale = jnp.where(valid, ct_ref[...], 0.0)  # (block_rows, 1)
    p_scale = scale * (1.0 + 2.0 * spec.z_loss * lse)  # d(lse + z_loss lse^2)/dlse
    g = jnp.exp(z - lse) * p_scale - jnp.where(cols == target, scale * (1.0 - spec.label_smoothing), 0.0)
    if spec.label_smoothing:
        g = g - scale * (spec.label_smoothing / vocab)  # the global vocabulary
    if spec.soft_cap:
        g = g * (1.0 - th * th)  # d(cap tanh(x / cap))/dx
    # Exact zeros on ignored rows, even for inf/NaN logits. Lanes past V are dropped on write.
    dx_ref[...] = jnp.where(valid, g, 0.0).astype(dx_ref.dtype)


# ----------------------------------------------------------------------------- launchers


def _pallas(kernel, *, t: Tiling, in_specs, out_specs, out_shape, semantics, cost, scratch_shapes=(), interpret):
    call = pl.pallas_call(
        kernel,
        grid=t.grid,
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        scratch_shapes=scratch_shapes,
        compiler_params=pltpu.CompilerParams(dimension_semantics=semantics, vmem_limit_bytes=_VMEM_LIMIT),
        cost_estimate=cost,
        interpret=pltpu.InterpretParams() if interpret else False,
    )
    return without_effects(call, out_shape) if interpret else call


@functools.lru_cache(maxsize=None)
def _fwd_call(t: Tiling, dtype, spec: LossSpec, interpret: bool, partials: bool = False):
    """(N, V) logits, (N, 1) int32 targets -> (loss, lse), each (N, 1) f32; partials:
    (lse, z[target], sum z) of this vocabulary slice."""
    col_f32 = jax.ShapeDtypeStruct((t.rows, 1), _F32)
    size = t.rows * t.vocab
    outs = 3 if partials else 2
    return _pallas(
        functools.partial(_fwd_kernel, t=t, spec=spec, partials=partials),
        t=t,
        in_specs=[t.tile(), t.column()],
        out_specs=[t.column()] * outs,
        out_shape=[col_f32] * outs,
        scratch_shapes=[pltpu.VMEM((t.block_rows, 1), _F32) for _ in range(4)],
        semantics=("parallel", "arbitrary"),
        cost=pl.CostEstimate(flops=6 * size, transcendentals=size * (2 if spec.soft_cap else 1), bytes_accessed=size * dtype.itemsize),
        interpret=interpret,
    )


@functools.lru_cache(maxsize=None)
def _bwd_call(t: Tiling, dtype, spec: LossSpec, interpret: bool, grad_dtype=None, vocab=None):
    """(N, V) logits, (N, 1) int32 targets, lse, cotangent (N, 1) f32 -> dx (N, V) in grad_dtype (default: the logits')."""
    size = t.rows * t.vocab
    grad_dtype = dtype if grad_dtype is None else jnp.dtype(grad_dtype)  # (np.dtype is falsy: no `or`)
    return _pallas(
        functools.partial(_bwd_kernel, t=t, spec=spec, vocab=vocab or t.vocab),
        t=t,
        in_specs=[t.tile(), t.column(), t.column(), t.column()],
        out_specs=t.tile(),
        out_shape=jax.ShapeDtypeStruct((t.rows, t.vocab), grad_dtype),
        semantics=("parallel", "parallel"),
        cost=pl.CostEstimate(
            flops=8 * size, transcendentals=size * (2 if spec.soft_cap else 1),
            bytes_accessed=size * (dtype.itemsize + grad_dtype.itemsize),
        ),
        interpret=interpret,
    )


def _loss_rows(x2, t, *, spec: LossSpec, config):
    rows, v = x2.shape
    return _fwd_call(tiling(rows, v, x2.dtype, config), jnp.dtype(x2.dtype), spec, interpret_enabled())(x2, t)


def _grad_rows(x2, t, lse, ct, *, spec: LossSpec, config, grad_dtype=None, vocab=None):
    rows, v = x2.shape
    # The row block must suit both the logits' and the gradient's dtype (16 rows for 16-bit).
    grad_dtype = jnp.dtype(x2.dtype if grad_dtype is None else grad_dtype)
    narrow = min(jnp.dtype(x2.dtype), grad_dtype, key=lambda d: d.itemsize)
    call = _bwd_call(tiling(rows, v, narrow, config), jnp.dtype(x2.dtype), spec, interpret_enabled(), grad_dtype, vocab)
    return call(x2, t, lse, ct)


def _stats_rows(x2, t, *, spec: LossSpec, config):
    rows, v = x2.shape
    return _fwd_call(tiling(rows, v, x2.dtype, config), jnp.dtype(x2.dtype), spec, interpret_enabled(), True)(x2, t)


# Row kernels under vmap: a batch axis folds into the rows (every argument is per row).
# Every argument's leading axes (all but the last) are rows, which the SPMD partitioner splits
# over any mesh axes (kernels/common/partitioning.py); the kernels see them flat.
def _rowwise(fn, spec, config, n_args, **kwargs):
    kernel = functools.partial(fn, spec=spec, config=config, **kwargs)
    outs = ROWS if fn is _grad_rows else (ROWS,) * (3 if fn is _stats_rows else 2)

    def launch(*args):
        return rowwise(kernel, (ROWS,) * n_args, outs, row_ndim=args[0].ndim - 1)(*args)

    return fold_vmap_into_rows(launch, row_args=tuple(range(n_args)))


# ----------------------------------------------------------------------------- row entry points
# For callers that own the differentiation (the linear_cross_entropy chunk loop):
# 2-D logits, 1-D per-row arrays, no custom_vjp; `spec` the call's LossSpec.


def loss_rows(logits2d, targets, spec: LossSpec, config: CrossEntropyPallasTpuConfig):
    """(loss [N], lse [N]) f32 of 2-D logits; targets int32 [N], -1 = ignored (loss 0). One launch."""
    loss, lse = _rowwise(_loss_rows, spec, config, 2)(logits2d, targets[:, None])
    return loss[:, 0], lse[:, 0]


def grad_rows(logits2d, targets, lse, scale, spec: LossSpec, config: CrossEntropyPallasTpuConfig, grad_dtype=None, vocab=None):
    """scale[:, None] * d loss_row / d logits in grad_dtype (default the logits'), given the
    rows' lse and scale (f32 [N]); exact zeros on ignored rows. One launch. Vocabulary-parallel:
    targets from `losses.local_targets`, lse the global one, vocab the global V."""
    col = lambda a: a.astype(_F32)[:, None]  # noqa: E731
    return _rowwise(_grad_rows, spec, config, 4, grad_dtype=grad_dtype, vocab=vocab)(logits2d, targets[:, None], col(lse), col(scale))


def stats_rows(logits2d, local_targets, spec: LossSpec, config: CrossEntropyPallasTpuConfig):
    """(lse, z[target] or 0, sum_v z) [N] f32 of one vocabulary slice (`losses.vocab_parallel_loss`)."""
    return tuple(a[:, 0] for a in _rowwise(_stats_rows, spec, config, 2)(logits2d, local_targets[:, None]))


def vocab_parallel_kernels(vocab: int, spec: LossSpec, config: CrossEntropyPallasTpuConfig, grad_dtype=None):
    """(stats, grad) of `losses.vocab_parallel_loss` / `vocab_parallel_per_token` (hashable
    partials); vocab: the global vocabulary (static)."""
    return (functools.partial(stats_rows, spec=spec, config=config),
            functools.partial(grad_rows, spec=spec, config=config, grad_dtype=grad_dtype, vocab=vocab))



# ----------------------------------------------------------------------------- public entry point


def cross_entropy(logits, targets, *, spec: LossSpec = LossSpec(), config: CrossEntropyPallasTpuConfig | None = None):
    """The op's contract (forgeax.ops.cross_entropy) on one device; config None: `heuristic_config`."""
    config = config or heuristic_config(logits, targets, spec=spec)
    v = vocab_range(spec, logits.shape[-1])[1]  # the global vocabulary
    t = targets.astype(jnp.int32)  # leading axes kept: a token-sharded [B, T, V] stays sharded
    valid = valid_targets(t, v, spec)
    if t.size == 0:  # no tokens: nothing to launch (a zero-size grid is not a kernel)
        loss = jnp.zeros(targets.shape, _F32)
    elif spec.axis_name is not None:  # vocabulary-parallel: partial statistics + collectives
        loss = vocab_parallel_per_token(*vocab_parallel_kernels(v, spec, config), logits, jnp.where(valid, t, -1), spec)
    else:  # rows and a sharded vocabulary split under plain jit (vocabulary-parallel per device)
        loss = split_per_token(row_kernels(spec, config), logits, jnp.where(valid, t, -1), spec)
    return reduce_loss(loss, valid, spec.reduction)


def row_kernels(spec: LossSpec, config: CrossEntropyPallasTpuConfig) -> RowKernels:
    """The raw kernels on 1-D per-row arrays (`losses.split_per_token`'s contract)."""
    bound = dict(spec=spec, config=config)
    return RowKernels(
        loss=functools.partial(_columns, _loss_rows, bound=bound),
        stats=functools.partial(_columns, _stats_rows, bound=bound),
        grad=functools.partial(_raw_grad, bound=bound),
    )


def _columns(fn, x2, t, *, bound):
    return tuple(a[:, 0] for a in fn(x2, t[:, None], **bound))


def _raw_grad(x2, t, lse, scale, vocab, *, bound):
    col = lambda a: a.astype(_F32)[:, None]  # noqa: E731
    return _grad_rows(x2, t[:, None], col(lse), col(scale), vocab=vocab, **bound)


def _supports(logits, targets, *, spec: LossSpec = LossSpec()):
    del targets, spec
    if jnp.dtype(logits.dtype) not in _DTYPES:
        return f"logits dtype {jnp.dtype(logits.dtype).name} is not one of float32/bfloat16/float16"
    if logits.shape[-1] == 0:
        return "empty vocabulary axis"
    return None


CROSS_ENTROPY = Implementation(
    fn=cross_entropy,
    platforms={"tpu"},
    interpretable=True,
    supports=_supports,
    config_type=CrossEntropyPallasTpuConfig,
    heuristic_config=heuristic_config,
    candidate_configs=candidate_configs,
)
