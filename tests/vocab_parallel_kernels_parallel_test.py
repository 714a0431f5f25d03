"""Vocabulary-parallel kernel backends (axis_name) of cross_entropy and linear_cross_entropy.

Inside shard_map each device holds a contiguous V/n slice of the logits (cross_entropy) or of
the weight (linear_cross_entropy); the kernels compute per-row partials over the slice (lse,
target logit, sum of logits), one pmax + one psum combine them (kernels/common/losses.py), and
the backward kernels take the global lse. Loss and gradients must equal the XLA reference, and
the compiled program may move only per-row statistics (all-reduces of [rows] values), never
the logits.

On CPU (JAX_PLATFORMS=cpu, 8 devices): the Triton kernels run in Triton's interpreter inside
shard_map. The Mosaic TPU interpreter synchronises every launch across the mesh's devices and
deadlocks against XLA's collectives there, so the Pallas TPU kernels are checked under
`jax.vmap(axis_name=...)` (the same collectives, one device). On >= 2 GPUs: Triton and the
Mosaic GPU linear_cross_entropy natively.

Needs 8 devices on CPU: XLA_FLAGS=--xla_force_host_platform_device_count=8 before JAX starts
(set here when this file is the first to import jax), and TRITON_INTERPRET=1 before Triton.
"""

from __future__ import annotations

import parallel_env  # first: XLA_FLAGS before jax starts

parallel_env.interpret_triton_on_cpu()

import functools
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import conformance
from forgeax import ops
from forgeax.core.runtime import interpret_mode
from forgeax.kernels.common.losses import LossSpec
from forgeax.kernels.xla import cross_entropy as ce_reference
from forgeax.kernels.xla import linear_cross_entropy as lce_reference

ON_GPU = parallel_env.skip_unless_devices(cpu=8, gpu=2)

IGNORE = -100
VOCAB = 1000 if not ON_GPU else 4096
OPTIONS = dict(label_smoothing=0.1, z_loss=1e-3, logit_soft_cap=5.0)
_COLLECTIVE = parallel_env.COLLECTIVE


def _kernels():
    """Interpreters on CPU (decided at trace time), native kernels on GPUs."""
    return interpret_mode(not ON_GPU)


def _mesh(*shape_names):
    names = tuple(n for n, _ in shape_names)
    return jax.make_mesh(tuple(s for _, s in shape_names), names, axis_types=(jax.sharding.AxisType.Auto,) * len(names))


def _v_ways():
    return min(len(jax.devices()), 8)


def _targets(rng, shape, vocab):
    t = rng.integers(0, vocab, shape, dtype=np.int32)
    flat = t.reshape(-1)
    flat[::5] = IGNORE
    flat[1] = vocab + 3  # out of range: ignored
    flat[2] = vocab - 1  # on the last shard
    flat[3] = 0
    return jnp.asarray(t)


def _ce_inputs(tokens, dtype, seed):
    rng = np.random.default_rng(seed)
    logits = jnp.asarray((3.0 * rng.standard_normal((tokens, VOCAB), np.float32))).astype(dtype)
    return logits, _targets(rng, (tokens,), VOCAB)


def _lce_inputs(tokens, hidden, dtype, seed):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((tokens, hidden), np.float32)).astype(dtype)
    w = jnp.asarray(3.0 / np.sqrt(hidden) * rng.standard_normal((hidden, VOCAB), np.float32)).astype(dtype)
    return x, w, _targets(rng, (tokens,), VOCAB)


def _collectives(fn, *args):
    hlo = jax.jit(fn).lower(*args).compile().as_text()
    return [(kind, shape) for shape, kind in _COLLECTIVE.findall(hlo)]


# XLA GPU combines independent all-reduces and concatenates their operands into one flat buffer
# (AllReduceContiguous): the psum of a row's statistics (sum of exponentials, target logit, sum
# of logits: kernels/common/losses.py), or every chunk's dx psum hoisted out of the chunk loop,
# arrives as one f32[3 * rows] / f32[K, C, H] all-reduce. XLA CPU keeps them apart.
ROW_STATISTICS = 4  # at most this many f32 values per row move (pmax-ed max + the psum-ed sums)


def _assert_only_row_statistics_move(fn, *args, limit: int, logits: int):
    """Every collective is an all-reduce of at most `limit` elements (row statistics, combined or
    not; scalars), `limit` well under `logits`, the elements of one device's logits (or chunk)."""
    assert limit < logits, (limit, logits)  # else a moved logits block would pass
    found = _collectives(fn, *args)
    assert found, "expected the pmax / psum of the row statistics"
    sizes = [int(np.prod([int(d) for d in re.findall(r"\d+", dims)] or [1]))
             for _, shape in found for dims in re.findall(r"\[([\d,]*)\]", shape)]
    bad = [(k, s) for k, s in found if k != "all-reduce"]
    assert not bad and max(sizes) <= limit, f"logits-sized or non-all-reduce collectives: {found}"


# ----------------------------------------------------------------------------- cross_entropy, shard_map


def _ce_sharded(backend, mesh, tokens_axis, **kwargs):
    none = kwargs.get("reduction") == "none"
    fn = functools.partial(ops.cross_entropy, axis_name="v", backend=backend, **kwargs)
    body = fn if none or tokens_axis is None else (lambda x, t: jax.lax.psum(fn(x, t), tokens_axis))
    batch = P(tokens_axis)
    return jax.shard_map(body, mesh=mesh, in_specs=(P(tokens_axis, "v"), batch), out_specs=batch if none else P())


@pytest.mark.parametrize("case", ["sum_data_x_vocab", "none_all_options", "mean_bf16"])
def test_triton_cross_entropy_vocab_parallel(case):
    reduction, dtype = {"sum_data_x_vocab": ("sum", jnp.float32), "none_all_options": ("none", jnp.float32),
                        "mean_bf16": ("mean", jnp.bfloat16)}[case]
    data = 2 if case == "sum_data_x_vocab" else 1
    mesh = _mesh(("data", data), ("v", _v_ways() // data))
    kwargs = dict(OPTIONS, reduction=reduction) if case != "sum_data_x_vocab" else dict(reduction="sum", label_smoothing=0.2)
    logits, targets = _ce_inputs(6, dtype, seed=len(case))
    with _kernels():
        sharded = _ce_sharded("triton", mesh, "data" if data > 1 else None, **kwargs)
        cot = jnp.asarray(np.random.default_rng(0).standard_normal((6,) if reduction == "none" else (), np.float32))
        got, pull = jax.vjp(lambda x: sharded(x, targets), logits)
        grad = pull(cot)[0]
    ref = lambda x: ce_reference.cross_entropy(x, targets, spec=LossSpec(**kwargs))  # noqa: E731
    want, pull = jax.vjp(ref, logits.astype(jnp.float32))
    assert conformance.relative_error(got, want) < 1e-5
    assert grad.dtype == logits.dtype
    assert conformance.relative_error(grad, pull(cot)[0]) < (1e-5 if dtype == jnp.float32 else 1e-2)


def test_triton_cross_entropy_moves_row_statistics_only():
    mesh = _mesh(("v", _v_ways()))
    logits, targets = _ce_inputs(6, jnp.float32, seed=7)
    with _kernels():
        sharded = _ce_sharded("triton", mesh, None, reduction="none", **OPTIONS)
        fn = jax.grad(lambda x: jnp.sum(sharded(x, targets) * jnp.arange(6.0)))
        _assert_only_row_statistics_move(fn, logits, limit=ROW_STATISTICS * 6, logits=6 * VOCAB // _v_ways())


@pytest.mark.skipif(not ON_GPU, reason="selection on GPUs (the CPU priority is XLA)")
def test_selection_keeps_triton_for_vocab_parallel():
    mesh = _mesh(("v", _v_ways()))
    logits, targets = _ce_inputs(4, jnp.float32, seed=5)
    fn = jax.shard_map(lambda x, t: ops.cross_entropy(x, t, axis_name="v"), mesh=mesh, in_specs=(P(None, "v"), P()), out_specs=P())
    assert ops.explain(fn, logits, targets).backends() == ("triton",)


# ----------------------------------------------------------------------------- linear_cross_entropy, shard_map


def _lce_sharded(backend, mesh, tokens_axis=None, check_vma=True, **kwargs):
    batch = P(tokens_axis)
    none = kwargs.get("reduction") == "none"
    fn = lambda x, w, t: ops.linear_cross_entropy(x, w, t, axis_name="v", backend=backend, **kwargs)  # noqa: E731
    return jax.shard_map(fn, mesh=mesh, in_specs=(batch, P(None, "v"), batch), out_specs=batch if none else P(),
                         check_vma=check_vma)


def _check_lce(sharded, x, w, t, cot, tol, loss_tol, **kwargs):
    # f32 matmuls in full f32, here and in the reference: at DEFAULT precision XLA GPU rounds f32
    # operands to TF32 (10-bit mantissa), and "mean"/"sum" compute dx = g @ W^T before scaling by
    # the cotangent while autodiff rounds the scaled g: a per-row difference up to 2^-11 in dx,
    # far above 1e-5 (the f32 tolerance), with both sides right to TF32 precision.
    with _kernels(), jax.default_matmul_precision("highest"):
        got, pull = jax.vjp(lambda x, w: sharded(x, w, t), x, w)
        grads = pull(cot)
    up = lambda a: a.astype(jnp.float32)  # noqa: E731
    with jax.default_matmul_precision("highest"):
        want, pull = jax.vjp(lambda x, w: lce_reference.linear_cross_entropy(x, w, t, spec=LossSpec(**kwargs)), up(x), up(w))
        wants = pull(cot)
    assert conformance.relative_error(got, want) < loss_tol, (got, want)
    for name, g, r, a in zip("xw", grads, wants, (x, w)):
        assert g.dtype == a.dtype and g.shape == a.shape, name
        assert conformance.relative_error(g, r) < tol, (name, conformance.relative_error(g, r))


LCE_BACKENDS = ["triton"] + (["pallas_gpu"] if ON_GPU else [])


def _lce_case(backend, tokens, dtype, seed):
    if backend == "pallas_gpu":  # the wgmma kernel: bf16, H a multiple of 64
        return _lce_inputs(tokens, 64, jnp.bfloat16, seed)
    return _lce_inputs(tokens, 32, dtype, seed)


@pytest.mark.parametrize("backend", LCE_BACKENDS)
def test_linear_cross_entropy_vocab_parallel_mean(backend):
    mesh = _mesh(("v", _v_ways()))
    kwargs = dict(OPTIONS, reduction="mean")
    x, w, t = _lce_case(backend, 13, jnp.float32, seed=1)
    bf16 = x.dtype == jnp.bfloat16
    _check_lce(_lce_sharded(backend, mesh, chunk_size=4, **kwargs), x, w, t, jnp.float32(0.7),
               2e-2 if bf16 else 1e-5, 2e-3 if bf16 else 1e-5, **kwargs)


@pytest.mark.parametrize("backend", LCE_BACKENDS)
def test_linear_cross_entropy_vocab_parallel_with_data_parallel_tokens(backend):
    mesh = _mesh(("data", 2), ("v", _v_ways() // 2))
    kwargs = dict(reduction="none", label_smoothing=0.1, z_loss=1e-3)
    x, w, t = _lce_case(backend, 6, jnp.float32, seed=2)
    bf16 = x.dtype == jnp.bfloat16
    _check_lce(_lce_sharded(backend, mesh, "data", chunk_size=2, **kwargs), x, w, t, jnp.arange(6.0),
               2e-2 if bf16 else 1e-5, 2e-3 if bf16 else 1e-5, **kwargs)


def test_triton_linear_cross_entropy_without_vma_checks():
    mesh = _mesh(("v", _v_ways()))
    kwargs = dict(reduction="sum", z_loss=1e-3)
    x, w, t = _lce_inputs(11, 32, jnp.float32, seed=3)
    _check_lce(_lce_sharded("triton", mesh, check_vma=False, chunk_size=4, **kwargs), x, w, t, jnp.float32(1.3),
               1e-5, 1e-5, **kwargs)


def test_triton_linear_cross_entropy_moves_no_logits():
    # dx is psum-ed per chunk ([C, H]: x is replicated over the vocabulary axis; XLA GPU may
    # hoist the psums out of the loop: one [K, C, H], all of dx); the row statistics are [C];
    # nothing of [C, V] or [H, V] moves.
    mesh = _mesh(("v", _v_ways()))
    x, w, t = _lce_inputs(8, 32, jnp.float32, seed=4)
    with _kernels():
        sharded = _lce_sharded("triton", mesh, chunk_size=4, reduction="mean", label_smoothing=0.1)
        fn = jax.grad(lambda x, w: sharded(x, w, t), argnums=(0, 1))
        _assert_only_row_statistics_move(fn, x, w, limit=8 * 32, logits=4 * VOCAB // _v_ways())


# ----------------------------------------------------------------------------- Pallas TPU (vmap on CPU)


def _vmapped(fn, n, in_axes):
    """fn over n vocabulary shards with jax.vmap(axis_name="v"): the collectives of shard_map, one device."""
    return jax.vmap(fn, in_axes=in_axes, out_axes=0, axis_name="v")


@pytest.mark.skipif(ON_GPU or jax.default_backend() == "tpu", reason="the CPU stand-in for a TPU mesh")
@pytest.mark.parametrize("reduction", ["none", "sum"])
def test_pallas_tpu_cross_entropy_vocab_parallel_under_vmap(reduction):
    n = 4
    kwargs = dict(OPTIONS, reduction=reduction)
    logits, targets = _ce_inputs(6, jnp.float32, seed=8)
    fn = functools.partial(ops.cross_entropy, axis_name="v", backend="pallas_tpu", **kwargs)

    def sharded(x):
        shards = x.reshape(x.shape[0], n, -1).transpose(1, 0, 2)  # [n, N, V / n]
        return _vmapped(fn, n, (0, None))(shards, targets)[0]  # every shard holds the global loss

    cot = jnp.asarray(np.random.default_rng(0).standard_normal((6,) if reduction == "none" else (), np.float32))
    with _kernels():  # jitted: vmap's axis must be bound when the collectives lower
        got, grad = jax.jit(lambda x: (lambda o, pull: (o, pull(cot)[0]))(*jax.vjp(sharded, x)))(logits)
    want, pull = jax.vjp(lambda x: ce_reference.cross_entropy(x, targets, spec=LossSpec(**kwargs)), logits)
    assert conformance.relative_error(got, want) < 1e-5
    assert conformance.relative_error(grad, pull(cot)[0]) < 1e-5


@pytest.mark.skipif(ON_GPU or jax.default_backend() == "tpu", reason="the CPU stand-in for a TPU mesh")
def test_pallas_tpu_linear_cross_entropy_chunk_kernels_under_vmap():
    # The chunk kernels of the Mosaic TPU backend against xla_chunked's (the oracle's closed
    # form), both vocabulary-parallel over 4 vmapped shards.
    from forgeax.kernels.pallas.tpu import linear_cross_entropy as tpu_lce

    n = 4
    spec = LossSpec(axis_name="v", **OPTIONS)
    logits, targets = _ce_inputs(6, jnp.float32, seed=9)
    t = jnp.where((targets >= 0) & (targets < VOCAB), targets, -1)
    shards = logits.reshape(6, n, -1).transpose(1, 0, 2)
    config = tpu_lce.heuristic_config(None, None, None, spec=spec)

    def run(kernels, cfg):
        def one(z):
            loss, lse = kernels.loss(z, t, spec, cfg)
            return loss, lse, kernels.grad(z, t, lse, jnp.arange(1.0, 7.0), spec, cfg, jnp.float32)
        return _vmapped(one, n, 0)(shards)

    with _kernels():
        got = jax.jit(lambda: run(tpu_lce.CHUNK_KERNELS, config))()
    want = jax.jit(lambda: run(lce_reference.CHUNK_KERNELS, None))()
    for g, w in zip(got, want):
        assert conformance.relative_error(g, w) < 1e-5


@pytest.mark.skipif(ON_GPU or jax.default_backend() == "tpu", reason="on GPUs: the shard_map tests above")
def test_pallas_gpu_linear_cross_entropy_chunk_kernels_under_vmap():
    # The fused wgmma kernel (Mosaic GPU interpreter) takes the matmul operands: its statistics
    # over each shard's W slice, combined over 2 vmapped shards, against xla_chunked's on the
    # same bf16-rounded logits.
    from forgeax.kernels.pallas.gpu import linear_cross_entropy as gpu_lce

    n, hidden, vocab, tokens = 2, 64, 512, 8
    rng = np.random.default_rng(10)
    x = jnp.asarray(rng.standard_normal((tokens, hidden)), jnp.bfloat16)
    w = jnp.asarray(0.3 * rng.standard_normal((hidden, vocab)), jnp.bfloat16)
    t = _targets(rng, (tokens,), vocab)
    t = jnp.where((t >= 0) & (t < vocab), t, -1)
    spec = LossSpec(axis_name="v", **OPTIONS)
    shards = w.reshape(hidden, n, -1).transpose(1, 0, 2)

    def run(kernels, cfg, fused):
        def one(w_slice):
            if fused:
                operands = (x, w_slice, None)
            else:
                operands = jnp.dot(x, w_slice, preferred_element_type=jnp.float32).astype(jnp.bfloat16).astype(jnp.float32)
            loss, lse = kernels.loss(operands, t, spec, cfg)
            return loss, lse, kernels.grad(operands, t, lse, jnp.arange(1.0, tokens + 1.0), spec, cfg, jnp.float32)
        return _vmapped(one, n, 0)(shards)

    with _kernels():
        got = jax.jit(lambda: run(gpu_lce.CHUNK_KERNELS, gpu_lce.heuristic_config(x, w, t, spec=spec), True))()
    want = jax.jit(lambda: run(lce_reference.CHUNK_KERNELS, None, False))()
    for g, r in zip(got, want):
        assert conformance.relative_error(g, r) < 1e-5


# ----------------------------------------------------------------------------- plain jit, vocabulary-sharded logits

from jax.sharding import NamedSharding  # noqa: E402

from forgeax.kernels.common import losses  # noqa: E402

PLAIN_SPEC = LossSpec(label_smoothing=0.1, z_loss=1e-3, logit_soft_cap=5.0, reduction="none")


def _stand_in_stats(x2, t, spec=PLAIN_SPEC):
    z, _ = losses.soft_capped(x2.astype(jnp.float32), spec)
    m = jnp.max(z, axis=-1)
    lse = m + jnp.log(jnp.sum(jnp.exp(z - m[:, None]), axis=-1))
    here = (t >= 0) & (t < z.shape[-1])
    picked = jnp.take_along_axis(z, jnp.clip(t, 0, z.shape[-1] - 1)[:, None], axis=-1)[:, 0]
    return lse, jnp.where(here, picked, 0.0), jnp.sum(z, axis=-1)


# Stand-ins for a backend's raw row kernels (kernels/common/losses.py RowKernels): the
# interpreted kernels cannot run inside a partitioned launch, so on CPU the shell is checked
# with these; on GPUs the Triton kernels themselves (below).
STAND_IN = losses.RowKernels(
    loss=lambda x2, t: losses.combine_partials(*_stand_in_stats(x2, t), t, PLAIN_SPEC, x2.shape[-1]),
    stats=_stand_in_stats,
    grad=lambda x2, t, lse, s, vocab: losses.logits_grad(x2.astype(jnp.float32), t, lse, s, PLAIN_SPEC, x2.dtype, vocab=vocab),
)

PLAIN_SHARDINGS = {"vocab": P(None, None, "v"), "batch_vocab": P("data", None, "v"), "tokens_vocab": P(None, "data", "v"),
                   "vocab_over_both": P(None, None, ("data", "v")), "batch": P("data")}


def _plain_mesh():
    n = len(jax.devices())
    return _mesh(("data", 2), ("v", n // 2)) if n >= 4 else _mesh(("data", 1), ("v", n))


def _plain_case(spec_name, loss_fn, dtype=jnp.float32):
    mesh = _plain_mesh()
    rng = np.random.default_rng(11)
    logits = jnp.asarray(3.0 * rng.standard_normal((4, 6, VOCAB), np.float32)).astype(dtype)
    t = _targets(rng, (4, 6), VOCAB)
    weights = jnp.arange(24.0).reshape(4, 6)
    spec = PLAIN_SHARDINGS[spec_name]
    xs = jax.device_put(logits, NamedSharding(mesh, spec))
    ts = jax.device_put(t, NamedSharding(mesh, P(*tuple(spec)[:2])))
    fn = jax.value_and_grad(lambda x, t: jnp.sum(loss_fn(x, t) * weights))
    got = jax.jit(fn)(xs, ts)
    want = jax.value_and_grad(lambda x: jnp.sum(ce_reference.cross_entropy(x, t, spec=PLAIN_SPEC) * weights))(
        logits.astype(jnp.float32))
    assert conformance.relative_error(got[0], want[0]) < 1e-5
    assert conformance.relative_error(got[1], want[1]) < (1e-5 if dtype == jnp.float32 else 1e-2)
    assert parallel_env.same_sharding(got[1], xs)  # the gradient stays vocabulary-sharded
    v_ways = math.prod(mesh.shape[a] for a in (spec[2] if isinstance(spec[2], tuple) else (spec[2],)))
    _assert_only_row_statistics_move(fn, xs, ts, limit=ROW_STATISTICS * 24, logits=24 * VOCAB // v_ways)


@pytest.mark.parametrize("sharding", PLAIN_SHARDINGS)
def test_plain_jit_vocabulary_sharded_shell(sharding):
    def loss_fn(x, t):
        t = jnp.where((t >= 0) & (t < VOCAB), t, -1)
        return losses.split_per_token(STAND_IN, x, t, PLAIN_SPEC)

    if sharding == "batch":  # no vocabulary split: rows only, nothing but the scalar sum moves
        mesh = _plain_mesh()
        x = jnp.ones((4, 6, VOCAB))
        fn = jax.grad(lambda x: jnp.sum(loss_fn(x, jnp.zeros((4, 6), jnp.int32))))
        hlo = jax.jit(fn).lower(jax.device_put(x, NamedSharding(mesh, P("data")))).compile().as_text()
        assert "all-gather" not in hlo
        return
    _plain_case(sharding, loss_fn)


@pytest.mark.skipif(not ON_GPU, reason="needs >= 2 GPUs (interpreted kernels are not partitioned)")
@pytest.mark.parametrize("sharding", ["vocab", "batch_vocab", "tokens_vocab"])
def test_gpu_triton_cross_entropy_plain_jit_vocabulary_sharded(sharding):
    options = {k: v for k, v in vars(PLAIN_SPEC).items() if k not in ("axis_name",)}
    _plain_case(sharding, lambda x, t: ops.cross_entropy(x, t, backend="triton", **options), jnp.bfloat16)


def _lce_plain_case(backend, x_spec, w_spec, dtype=jnp.float32):
    mesh = _plain_mesh()
    rng = np.random.default_rng(12)
    hidden = 64
    x = jnp.asarray(rng.standard_normal((4, 6, hidden), np.float32)).astype(dtype)
    w = jnp.asarray(0.3 * rng.standard_normal((hidden, VOCAB), np.float32)).astype(dtype)
    t = _targets(rng, (4, 6), VOCAB)
    kwargs = dict(reduction="none", label_smoothing=0.1, z_loss=1e-3)
    weights = jnp.arange(24.0).reshape(4, 6)
    args = (jax.device_put(x, NamedSharding(mesh, x_spec)), jax.device_put(w, NamedSharding(mesh, w_spec)),
            jax.device_put(t, NamedSharding(mesh, x_spec)))
    fn = jax.value_and_grad(lambda x, w, t: jnp.sum(
        ops.linear_cross_entropy(x, w, t, backend=backend, chunk_size=4, **kwargs) * weights), argnums=(0, 1))
    got = jax.jit(fn)(*args)
    up = lambda a: a.astype(jnp.float32)  # noqa: E731
    want = jax.value_and_grad(lambda x, w: jnp.sum(
        lce_reference.linear_cross_entropy(x, w, t, spec=LossSpec(**kwargs)) * weights), argnums=(0, 1))(up(x), up(w))
    bf16 = dtype == jnp.bfloat16
    assert conformance.relative_error(got[0], want[0]) < (2e-3 if bf16 else 1e-5)
    for g, r in zip(got[1], want[1]):
        assert conformance.relative_error(g, r) < (2e-2 if bf16 else 1e-5)
    assert parallel_env.same_sharding(got[1][1], args[1])  # dW stays vocabulary-sharded
    found = _collectives(fn, *args)
    v_ways = math.prod(mesh.shape[a] for a in (w_spec[1] if isinstance(w_spec[1], tuple) else (w_spec[1],)))
    # Row statistics, the chunks' dx [C, H], and (tokens also split) dW's slice summed over "data".
    limit = hidden * VOCAB // v_ways
    sizes = {s: max([int(np.prod([int(d) for d in ds.split(",") if d] or [1])) for ds in re.findall(r"\[([\d,]*)\]", s)] or [1])
             for _, s in found}
    bad = [(k, s) for k, s in found if k != "all-reduce" or sizes[s] > limit]
    assert not bad, f"gathers or oversized collectives: {bad}"


LCE_PLAIN = {"vocab": (P(), P(None, "v")), "tokens_vocab": (P("data"), P(None, "v")),
             "vocab_over_both": (P(), P(None, ("data", "v")))}


@pytest.mark.parametrize("sharding", LCE_PLAIN)
def test_plain_jit_vocabulary_sharded_linear_cross_entropy_chunk_loop(sharding):
    # xla_chunked's chunk loop goes through the same launch shell as the kernel backends
    # (kernels/common/linear_cross_entropy.py _split); it is not interpreted, so it is
    # partitioned on CPU too.
    _lce_plain_case("xla_chunked", *LCE_PLAIN[sharding])


@pytest.mark.skipif(not ON_GPU, reason="needs >= 2 GPUs (interpreted kernels are not partitioned)")
@pytest.mark.parametrize("backend", ["triton", "pallas_gpu"])
@pytest.mark.parametrize("sharding", ["vocab", "tokens_vocab"])
def test_gpu_linear_cross_entropy_plain_jit_vocabulary_sharded(backend, sharding):
    _lce_plain_case(backend, *LCE_PLAIN[sharding], jnp.bfloat16)
