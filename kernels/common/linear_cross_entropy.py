"""The chunk loop of a fused linear + cross-entropy, shared by its backends.

linear_cross_entropy(x, W, t) = cross_entropy(x @ W + b, t) without the [N, V]
logits: tokens are processed in chunks of C rows (lax.scan, a device loop, no
host syncs), and per chunk only the logits [C, V] and their gradient
[C, V] (in the matmul dtype) are live. A backend supplies the per-chunk
cross-entropy as `ChunkKernels` (row statistics and the closed-form gradient
with respect to the logits); everything else is here:

  * reduction "mean"/"sum" (`_summed`, a custom_vjp): the gradient is computed
    in the forward (as Liger-Kernel does). Per chunk: logits (matmul 1), the
    per-token loss and g = d loss / d logits, then immediately
        dx_chunk = g @ W^T        (matmul 2, f32 accumulation, rounded once)
        dW      += x_chunk^T @ g  (matmul 3)       db += sum_rows(g)
    so fwd+bwd costs 3 matmuls, the floor. The backward only scales the saved
    dx, dW, db by the incoming scalar cotangent. Without differentiation the
    primal runs the loss-only loop (1 matmul).
  * reduction "none" (`_per_token`): the per-token cotangent is unknown in the
    forward, so the forward keeps lse [N] and the backward reruns the loop
    with g scaled per row by the cotangent (4 matmuls in all, still chunked).

dW accumulates in f32 for an f32 weight, else in the weight's dtype as
`dW + dot(x_c^T, g)`, which XLA GPU fuses into the cuBLAS call (beta=1, in
place; an f32 accumulator for a bf16 [4096, 128256] weight would be 2.1 GB).
A chunk's logits are f32 (`ChunkKernels.f32_logits`) or stored in the matmul
dtype (Triton: then overwritten by the gradient, half the bytes). Tokens are
padded to a multiple of C with ignored targets. The options arrive as one
LossSpec and reach the kernels unchanged, with the backend's kernel config.
`spec.axis_name` (vocabulary-parallel, W and b sharded over V): the kernels
combine row statistics with collectives; each chunk's dx is psum-ed unless x
varies along the axis (or vma checking is off: shard_map's transpose does it).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from forgeax.core.config import KernelConfig
from forgeax.kernels.common.losses import LossSpec, reduce_loss, valid_targets
from forgeax.kernels.common.partitioning import ROWS, VOCAB_COLS, VOCAB_SUM, vocab_rowwise

# The default chunk keeps its logits under this many bytes: at Llama-3's
# V=128256, 2048 tokens of bf16 logits (Triton: the gradient overwrites them)
# or 1024 tokens of f32 logits (XLA: + 0.26 GB of bf16 gradient).
LOGITS_CHUNK_BYTES = 512 * 2**20
# ...but at least this many tokens when there are that many, so that the
# three matmuls per chunk stay large (x^T @ g has K = C).
MIN_CHUNK = 512


def default_chunk_size(tokens: int, vocab: int, itemsize: int = 4) -> int:
    """Tokens per chunk for `chunk_size=None` (vocab: the local vocabulary; itemsize: of a logit)."""
    chunk = max(MIN_CHUNK, LOGITS_CHUNK_BYTES // (itemsize * vocab) // 128 * 128)
    if tokens <= chunk:
        return max(tokens, 1)
    count = -(-tokens // chunk)
    even = -(-tokens // count)  # the same number of chunks, the least padding
    return min(chunk, -(-even // 8) * 8)


@dataclasses.dataclass(frozen=True)
class _Plan:
    """The static facts of one call's loop (hashable: a custom_vjp nondiff argument)."""

    spec: LossSpec
    config: KernelConfig | None  # the backend's kernel config, handed to its ChunkKernels
    chunk: int
    psum_dx: bool  # psum each chunk's dx over spec.axis_name
    psum_ct: bool  # psum the incoming cotangent over spec.axis_name (shard_map with check_vma=False)
    kernels: ChunkKernels


@dataclasses.dataclass(frozen=True)
class ChunkKernels:
    """Per-chunk cross-entropy on f32 logits [C, V_local] and int32 targets [C]
    (global class ids; -1 marks an ignored token, already mapped by the shell);
    `spec` is the call's LossSpec, `config` the backend's kernel config (None without one).

      loss(logits, t, spec, config) -> (loss [C] f32, 0 where ignored; lse [C] f32)
      loss_and_grad(logits, t, spec, config, dtype) -> (loss, lse, g [C, V_local] in dtype)
          g = d loss_row / d logits (cotangent 1 per row, 0 on ignored rows)
      grad(logits, t, lse, scale [C] f32, spec, config, dtype) -> scale[:, None] * g
    With spec.axis_name the statistics are global (the same on every device).
    """

    loss: Callable[..., Any]
    loss_and_grad: Callable[..., Any]
    grad: Callable[..., Any]
    # False: the logits chunk is stored in the matmul dtype (bf16 for bf16 x and
    # W; f32 accumulation, bias added in f32, one rounding), half the bytes.
    f32_logits: bool = True
    # True: the loop does not compute the logits; the kernels receive the tuple
    # (x_c [C, H], W [H, V_local], b [V_local] or None) in place of `logits` and
    # fuse the matmul themselves (the Mosaic GPU kernels).
    fused_matmul: bool = False


def _matmul_dtype(x, w):
    return jnp.promote_types(x.dtype, w.dtype)


def _logits(xc, w, b, opts):
    if opts.kernels.fused_matmul:
        return xc, w, b
    dt = _matmul_dtype(xc, w)
    out = jnp.float32 if opts.kernels.f32_logits or b is not None else dt
    z = lax.dot_general(xc.astype(dt), w.astype(dt), (((1,), (0,)), ((), ())), preferred_element_type=out)
    if b is not None:
        z = z + b.astype(jnp.float32)
    return z if opts.kernels.f32_logits else z.astype(dt)


def _chunked(x2, t, opts):
    """[N, H], [N] -> [K, C, H], [K, C] (padding rows are ignored tokens)."""
    n = x2.shape[0]
    count = -(-n // opts.chunk)
    pad = count * opts.chunk - n
    if pad:
        x2 = jnp.pad(x2, ((0, pad), (0, 0)))
        t = jnp.pad(t, (0, pad), constant_values=-1)
    return x2.reshape(count, opts.chunk, x2.shape[1]), t.reshape(count, opts.chunk)


def _rows(a, n):
    """[K, C, ...] -> the first n rows of [K * C, ...]."""
    return a.reshape((-1,) + a.shape[2:])[:n]


def _loss_loop(x2, w, b, t, opts):
    xs, ts = _chunked(x2, t, opts)

    def body(_, chunk):
        xc, tc = chunk
        return None, opts.kernels.loss(_logits(xc, w, b, opts), tc, opts.spec, opts.config)

    _, (loss, lse) = lax.scan(body, None, (xs, ts))
    return _rows(loss, x2.shape[0]), _rows(lse, x2.shape[0])


def _zeros(shape, dtype, *likes):
    """Zeros varying along every shard_map axis that one of `likes` varies along (a scan
    carry must keep its type, and the accumulated gradients vary where their inputs do)."""
    vma = tuple(sorted(frozenset().union(*map(_varying, likes)), key=str))
    z = jnp.zeros(shape, dtype)
    return lax.pcast(z, vma, to="varying") if vma else z


def _match(ct, like):
    """psum `ct` over the axes it varies along and its primal does not (the transpose of
    the implicit pvary autodiff would insert), e.g. dW over a data-parallel axis."""
    if ct is None:
        return None
    extra = tuple(sorted(_varying(ct) - _varying(like), key=str))
    return lax.psum(ct, extra) if extra else ct


def _grad_loop(x2, w, b, t, opts, lse=None, scale=None):
    """(loss or None, dx [N, H] x.dtype, dW, db f32 or None): the chunked gradient.

    Without lse: the gradient of sum(loss) (loss_and_grad); with lse and
    per-row `scale`: the gradient of sum(scale * loss) (grad), loss is None.
    """
    n, dt = x2.shape[0], _matmul_dtype(x2, w)
    xs, ts = _chunked(x2, t, opts)
    extra = ()
    if lse is not None:
        pad = xs.shape[0] * opts.chunk - n
        extra = tuple(jnp.pad(a, (0, pad)).reshape(ts.shape) for a in (lse, scale.astype(jnp.float32)))
    acc_dtype = jnp.float32 if w.dtype == jnp.float32 else w.dtype
    likes = (x2, w, t) + extra + ((b,) if b is not None else ())
    init = (_zeros(w.shape, acc_dtype, *likes), None if b is None else _zeros(b.shape, jnp.float32, *likes))

    def body(carry, chunk):
        dw, db = carry
        xc, tc = chunk[:2]
        logits = _logits(xc, w, b, opts)
        if lse is None:
            loss, _, g = opts.kernels.loss_and_grad(logits, tc, opts.spec, opts.config, dt)
        else:
            loss, g = None, opts.kernels.grad(logits, tc, chunk[2], chunk[3], opts.spec, opts.config, dt)
        dx = lax.dot_general(g, w.astype(dt), (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
        if opts.psum_dx:
            dx = lax.psum(dx, opts.spec.axis_name)
        # dW += x_c^T @ g: f32 accumulation inside the matmul, one rounding per chunk when
        # the accumulator is bf16/f16. Written as `acc + dot(out=acc dtype)` so that XLA GPU
        # fuses the add into the cuBLAS call (beta=1, in place): adding an f32 product
        # instead materialises it ([H, V] f32, 2.1 GB at Llama-3 sizes) and is 11% slower.
        dw = dw + lax.dot_general(xc.astype(dt), g, (((0,), (0,)), ((), ())), preferred_element_type=acc_dtype)
        if db is not None:
            db = db + jnp.sum(g.astype(jnp.float32), axis=0)
        return (dw, db), (loss, dx.astype(x2.dtype))

    (dw, db), (loss, dx) = lax.scan(body, init, (xs, ts) + extra)
    # dW and db stay per-device sums here: inside shard_map the caller scales them by its (maybe
    # per-device) cotangent first, then `_match`es them to the weight's type.
    return (None if loss is None else _rows(loss, n)), _match(_rows(dx, n), x2), dw, db


def _split(fn, arg_kinds, out_kinds, opts):
    """fn(*args, opts) (a whole chunk loop) as a launch the SPMD partitioner splits by tokens and,
    when W's vocabulary axis is sharded, by vocabulary (kernels/common/partitioning.py
    `vocab_rowwise`): each device loops over its own rows and W slice, vocabulary-parallel over
    the mesh axes that split V (its row statistics and dx all-reduced there); dW and db are
    summed per device, then all-reduced over the row axes. None arguments / outputs are left
    out of the launch. Vocabulary-parallel calls run inside shard_map already: unchanged."""
    if opts.spec.axis_name is not None:
        return lambda *args: fn(*args, opts)

    def call(x, *args):
        args = (x,) + args
        present = [i for i, a in enumerate(args) if a is not None]
        out_present = []

        def local(*given, axis_name):
            full = [None] * len(args)
            for i, a in zip(present, given):
                full[i] = a
            own = opts
            if axis_name is not None:  # this device's slice of V: x is replicated along it
                own = dataclasses.replace(opts, spec=dataclasses.replace(opts.spec, axis_name=axis_name), psum_dx=True)
            outs = fn(*full, own)
            out_present[:] = [i for i, o in enumerate(outs) if o is not None]
            return tuple(o for o in outs if o is not None)

        lead = x.ndim - 1  # which outputs exist: trace on flat rows, as the launch does
        flat = [jax.ShapeDtypeStruct((-1,) + a.shape[lead:] if arg_kinds[i] == ROWS else a.shape, a.dtype)
                for i, a in ((i, args[i]) for i in present)]
        rows = math.prod(x.shape[:lead])
        flat = [jax.ShapeDtypeStruct((rows,) + f.shape[1:], f.dtype) if f.shape[:1] == (-1,) else f for f in flat]
        jax.eval_shape(lambda *g: local(*g, axis_name=None), *flat)
        kinds = [arg_kinds[i] for i in present]
        okinds = [out_kinds[i] for i in out_present]
        outs = vocab_rowwise(local, kinds, okinds, row_ndim=x.ndim - 1)(*[args[i] for i in present])
        full = [None] * len(out_kinds)
        for i, o in zip(out_present, outs):
            full[i] = o
        return tuple(full)

    return call


def _loss_rows(x2, w, b, t, opts):
    return _split(_loss_loop, (ROWS, VOCAB_COLS, VOCAB_COLS, ROWS), (ROWS, ROWS), opts)(x2, w, b, t)


def _grad_rows(x2, w, b, t, opts, lse=None, scale=None):
    def loop(x2, w, b, t, lse, scale, opts):
        return _grad_loop(x2, w, b, t, opts, lse=lse, scale=scale)

    kinds = (ROWS, VOCAB_COLS, VOCAB_COLS, ROWS, ROWS, ROWS)
    return _split(loop, kinds, (ROWS, ROWS, VOCAB_SUM, VOCAB_SUM), opts)(x2, w, b, t, lse, scale)


def _scaled(g, s, like):
    """s * g in f32, summed over the shard_map axes it varies along and `like` does not (a
    replicated weight's gradient under data parallelism inside shard_map: typed like `like`),
    in `like`'s dtype (the cotangent of `like`); None stays None."""
    return None if g is None else _match(g.astype(jnp.float32) * s, like).astype(like.dtype)


def _cotangent(ct, opts):
    ct = ct.astype(jnp.float32)
    return lax.psum(ct, opts.spec.axis_name) if opts.psum_ct else ct


# ----------------------------------------------------------------------------- sum (and mean)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _summed(x2, w, b, t, opts):
    return jnp.sum(_loss_rows(x2, w, b, t, opts)[0])


def _summed_fwd(x2, w, b, t, opts):
    loss, dx, dw, db = _grad_rows(x2, w, b, t, opts)
    return jnp.sum(loss), (dx, dw, db, w, b)


def _summed_bwd(opts, residuals, ct):
    dx, dw, db, w, b = residuals
    s = _cotangent(ct, opts)
    return _scaled(dx, s, dx), _scaled(dw, s, w), _scaled(db, s, b), None


_summed.defvjp(_summed_fwd, _summed_bwd)


# ----------------------------------------------------------------------------- none


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _per_token(x2, w, b, t, opts):
    return _loss_rows(x2, w, b, t, opts)[0]


def _per_token_fwd(x2, w, b, t, opts):
    loss, lse = _loss_rows(x2, w, b, t, opts)
    return loss, (x2, w, b, t, lse)


def _per_token_bwd(opts, residuals, ct):
    x2, w, b, t, lse = residuals
    _, dx, dw, db = _grad_rows(x2, w, b, t, opts, lse=lse, scale=_cotangent(ct, opts))
    return dx, _scaled(dw, 1.0, w), _scaled(db, 1.0, b), None


_per_token.defvjp(_per_token_fwd, _per_token_bwd)


# ----------------------------------------------------------------------------- the op


def _axis_names(axis_name) -> tuple:
    return axis_name if isinstance(axis_name, tuple) else (axis_name,)


def _varying(a) -> frozenset:
    """The shard_map axes `a` varies along (empty outside shard_map or with check_vma=False)."""
    aval = jax.typeof(a)
    mat = getattr(aval, "mat", None)  # jax 0.11: ManualAxisType; older: aval.vma
    return frozenset(mat.varying if mat is not None else getattr(aval, "vma", ()) or ())


def linear_cross_entropy_with(kernels: ChunkKernels, heuristic_config: Callable[..., Any] | None = None) -> Callable[..., Any]:
    """The backend function (the op's contract, options in a LossSpec) over `kernels`:
    fn(x, weight, targets, bias=None, *, spec, chunk_size=None, config=None); config None takes
    `heuristic_config(x, weight, targets, bias, spec=, chunk_size=)` (the backend's own)."""

    def linear_cross_entropy(x, weight, targets, bias=None, *, spec: LossSpec = LossSpec(), chunk_size=None, config=None):
        if config is None and heuristic_config is not None:
            config = heuristic_config(x, weight, targets, bias, spec=spec, chunk_size=chunk_size)
        h, v_local = weight.shape
        logit_bytes = jnp.dtype(_matmul_dtype(x, weight)).itemsize
        axis_name = spec.axis_name
        # Without axis_name the leading axes stay (the partitioner splits any of them, see _split).
        x2 = x.reshape(-1, h) if axis_name is not None else x
        t = (targets.reshape(-1) if axis_name is not None else targets).astype(jnp.int32)
        vocab = v_local if axis_name is None else v_local * lax.axis_size(axis_name)
        valid = valid_targets(t, vocab, spec)
        psum_dx = psum_ct = False
        if axis_name is not None:
            # With vma checking on, a sharded weight varies along the axis; x that
            # does not gets the psum of the per-shard partial dx (what autodiff
            # through the reference does). With it off (nothing varies), shard_map's
            # transpose psums dx itself but hands each device 1/n of the loss's
            # cotangent, which the reference's psum transposes back: we psum it.
            names = frozenset(_axis_names(axis_name))
            checked = names <= _varying(weight)
            psum_dx, psum_ct = checked and not (names & _varying(x)), not checked
        chunk = int(chunk_size or default_chunk_size(x2.size // max(h, 1), v_local, 4 if kernels.f32_logits else logit_bytes))
        plan = _Plan(spec, config, chunk, psum_dx, psum_ct, kernels)
        t = jnp.where(valid, t, -1)
        if spec.reduction == "none":
            return _per_token(x2, weight, bias, t, plan).reshape(targets.shape)
        return reduce_loss(_summed(x2, weight, bias, t, plan), valid, spec.reduction)

    return linear_cross_entropy


_KERNEL_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


def supports_single_device(x, weight, targets, bias=None, *, spec: LossSpec = LossSpec(), **options) -> str | None:
    """`supports` of the kernel backends built on this loop (vocabulary-parallel included)."""
    del targets, bias, options, spec
    for name, a in (("x", x), ("weight", weight)):
        if jnp.dtype(a.dtype) not in _KERNEL_DTYPES:
            return f"{name} dtype {jnp.dtype(a.dtype).name} is not one of float32/bfloat16/float16"
    if x.size == 0:
        return "no tokens"
    return None
