"""gated_mlp, newton_schulz, mean_pool and ragged_dot on sharded arrays under plain jax.jit.

Each kernel backend wraps its launches so that XLA's SPMD partitioner runs every device's kernel
on its own shard (kernels/common/partitioning.py): gated_mlp over the rows of x and the hidden
axis N of the weights (tensor parallelism), newton_schulz over the leading batch axes,
mean_pool over the batch and feature axes, ragged_dot over the rows M (each shard's group
sizes cut from the global offsets), the output axis and the contraction axis (and so moe_mlp
with its expert weights split along F). Checked: sharded
equals unsharded (forward and gradients), and the compiled program's collectives are the
expected partial-sum all-reduces only, never an all-gather of an activation.

On CPU, interpreted kernels are not partitioned (host callbacks), so the shells run around
stand-in Pallas kernels (`interpret=True`: plain HLO loops with dynamic slices, which XLA
cannot split by itself; without the wrappers it all-gathers their operands). On >= 2 GPUs the
same tests run the Triton and Mosaic GPU kernels themselves.
"""

from __future__ import annotations

import parallel_env  # first: XLA_FLAGS before jax starts

parallel_env.interpret_triton_on_cpu()

import dataclasses  # noqa: E402
import functools  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from jax.experimental import pallas as pl  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import conformance  # noqa: E402
from forgeax import ops  # noqa: E402
from forgeax.core import Implementation, register_backend  # noqa: E402
from forgeax.kernels.common import newton_schulz as ns_common  # noqa: E402
from forgeax.kernels.common.gated_mlp import GatedMLPSpec, activate_and_derivative, differentiable_gated_mlp, split_weights  # noqa: E402
from forgeax.kernels.common.ragged_dot import differentiable_ragged_dot, group_bounds  # noqa: E402

ON_GPU = parallel_env.skip_unless_devices(cpu=8, gpu=2)
IMPLS = ["triton", "pallas_gpu"] if ON_GPU else ["stand_in"]
F32 = jnp.float32

_COLLECTIVE = parallel_env.COLLECTIVE


def _mesh():
    n = len(jax.devices())
    return jax.make_mesh((n // 2, 2), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)


def _put(x, *spec):
    return jax.device_put(x, NamedSharding(_mesh(), P(*spec)))




def _run(fn, *args):
    """(fn(*args), [(kind, elements)] of the collectives in its compiled program)."""
    compiled = jax.jit(fn).lower(*args).compile()
    return compiled(*args), [(kind, parallel_env.elements(shape)) for shape, kind in _COLLECTIVE.findall(compiled.as_text())]


def _collectives(fn, *args):
    return _run(fn, *args)[1]


def assert_only_reductions(found, *, max_elements: int):
    """No all-gather / all-to-all / permute among the collectives `found`: only all-reduces (or
    reduce-scatters) of partial sums of at most `max_elements` each (per device). XLA GPU merges
    independent all-reduces into one flat buffer (all the weight gradients and the scalar loss of
    a backward pass: 3 * 128 * 256 + 1 elements for gated_mlp), so callers pass the sum of the
    partial sums that may be reduced together; XLA CPU keeps them apart."""
    bad = [(k, e) for k, e in found if k not in ("all-reduce", "reduce-scatter") or e > max_elements]
    assert not bad, f"unexpected collectives in the compiled program: {bad} (all: {found})"
    return found


def _assert_same(got, want, tol):
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert g.shape == w.shape and g.dtype == w.dtype
        assert conformance.relative_error(g, w) < (max(tol, 1e-4) if g.ndim == 0 else tol)


def _tol(dtype):
    return 1e-5 if jnp.dtype(dtype) == jnp.dtype(F32) else 3e-2


def _check(fn, arrays, sharded, diff, tol):
    """value_and_grad of fn: sharded equals unsharded. Returns (its sharded result, the
    collectives of its compiled program)."""
    value_and_grad = jax.value_and_grad(fn, argnums=diff)
    got, found = _run(value_and_grad, *sharded)
    _assert_same(got, jax.jit(value_and_grad)(*arrays), tol)
    return got, found


def _random(seed, shape, dtype=F32, scale=1.0):
    return (jnp.asarray(np.random.default_rng(seed).standard_normal(shape, np.float32)) * scale).astype(dtype)


# ----------------------------------------------------------------------------- stand-in kernels


def _blocked(body, ins, outs, block=2):
    """A Pallas kernel over blocks of `block` along axis 0 of the per-row arrays (flag True; others
    whole), HLO-interpreted: XLA cannot split it, the launch wrappers must."""
    rows = ins[0][0].shape[0]

    def spec(shape, per_row):
        if per_row:
            return pl.BlockSpec((block,) + tuple(shape[1:]), lambda i: (i,) + (0,) * (len(shape) - 1))
        return pl.BlockSpec(tuple(shape), lambda i: (0,) * len(shape))

    return pl.pallas_call(
        body, grid=(pl.cdiv(rows, block),),
        in_specs=[spec(a.shape, r) for a, r in ins], out_specs=[spec(o.shape, r) for o, r in outs],
        out_shape=[o for o, _ in outs], interpret=True,
    )(*[a for a, _ in ins])


def _mm(a, b):
    return jnp.dot(a.astype(F32), b.astype(F32), precision=jax.lax.Precision.HIGHEST)


def _gm_forward(x, w_gate, w_up, *, activation, config, saving=False):
    del config
    wg, wu = split_weights(w_gate, w_up)
    m, n = x.shape[0], wg.shape[1]

    def body(x_ref, g_ref, u_ref, h_ref, *pre_ref):
        g, u = _mm(x_ref[...], g_ref[...]), _mm(x_ref[...], u_ref[...])
        h_ref[...] = (activate_and_derivative(g, activation)[0] * u).astype(h_ref.dtype)
        if pre_ref:
            pre_ref[0][...] = jnp.concatenate([g, u], axis=1).astype(x_ref.dtype)

    outs = [(jax.ShapeDtypeStruct((m, n), x.dtype), True)] + [(jax.ShapeDtypeStruct((m, 2 * n), x.dtype), True)] * saving
    res = _blocked(body, [(x, True), (wg, False), (wu, False)], outs)
    return tuple(res) if saving else res[0]


def _gm_backward(x, w_gate, w_up, dh, *, activation, config, want_h):
    del config
    wg, wu = split_weights(w_gate, w_up)
    m, n = x.shape[0], wg.shape[1]

    def body(x_ref, g_ref, u_ref, dh_ref, dpre_ref, h_ref):
        g, u = _mm(x_ref[...], g_ref[...]), _mm(x_ref[...], u_ref[...])
        a, da = activate_and_derivative(g, activation)
        d = dh_ref[...].astype(F32)
        dpre_ref[...] = jnp.concatenate([d * u * da, d * a], axis=1).astype(dpre_ref.dtype)
        h_ref[...] = (a * u).astype(h_ref.dtype)

    outs = [(jax.ShapeDtypeStruct((m, 2 * n), x.dtype), True), (jax.ShapeDtypeStruct((m, n), x.dtype), True)]
    dpre, h = _blocked(body, [(x, True), (wg, False), (wu, False), (dh, True)], outs)
    return dpre, h if want_h else None


@dataclasses.dataclass(frozen=True)
class _Saving:
    save_preactivations: bool


STAND_IN_GATED_MLP = differentiable_gated_mlp(_gm_forward, _gm_backward, functools.partial(_gm_forward, saving=True))


def _gated_mlp(impl, save=False):
    if impl == "stand_in":
        return lambda x, wg, wu, wd: STAND_IN_GATED_MLP(x, wg, wu, wd, GatedMLPSpec("silu"), _Saving(save))
    if not save:
        return lambda x, wg, wu, wd: ops.gated_mlp(x, wg, wu, wd, backend=impl)
    from forgeax.kernels.triton.gated_mlp import heuristic_config  # noqa: PLC0415 (the kernel that saves them)

    def saving(x, wg, wu, wd):
        config = heuristic_config(x, wg, wu, wd, spec=GatedMLPSpec("silu")).replace(save_preactivations=True)
        return ops.gated_mlp(x, wg, wu, wd, backend=impl, config=config)

    return saving


def _dtype(impl):
    return jnp.bfloat16 if impl == "pallas_gpu" else F32


def _supported_or_skip(fn, *arrays):
    try:
        jax.jit(fn).lower(*arrays)
    except Exception as e:  # noqa: BLE001 - the backend refuses this call (UnsupportedError)
        pytest.skip(f"not supported here: {e}")


# ----------------------------------------------------------------------------- gated_mlp


def _gm_arrays(impl, k, n, k_out, fused, lead=(4, 6)):
    dt = _dtype(impl)
    x = _random(0, (*lead, k), dt)
    wg, wu = _random(1, (k, n), dt, k ** -0.5), _random(2, (k, n), dt, k ** -0.5)
    wd = None if k_out is None else _random(3, (n, k_out), dt, n ** -0.5)
    if fused:
        return x, jnp.stack([wg, wu], axis=1), None, wd
    return x, wg, wu, wd


def _gm_loss(mlp):
    return lambda x, wg, wu, wd: jnp.sum(jnp.sin(mlp(x, wg, wu, wd).astype(F32)))


def _diff(arrays):
    return tuple(i for i, a in enumerate(arrays) if a is not None)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("save", [False, True], ids=["recompute", "saved_pre"])
def test_gated_mlp_rows_split_without_gathering(impl, save):
    if save and impl != "stand_in" and impl != "triton":
        pytest.skip(f"{impl} has no saved pre-activations")
    k, n, k_out = (128, 256, 128) if ON_GPU else (24, 40, 16)
    arrays = _gm_arrays(impl, k, n, k_out, fused=False)
    fn = _gm_loss(_gated_mlp(impl, save))
    _supported_or_skip(fn, *arrays)
    sharded = (_put(arrays[0], "data", "model"),) + arrays[1:]  # [B, T] over both mesh axes
    got, found = _check(fn, arrays, sharded, _diff(arrays), _tol(arrays[0].dtype))
    assert parallel_env.same_sharding(got[1][0], sharded[0])
    # Weight gradients: each device's partial sums, all-reduced; no activation moves.
    # dw_gate, dw_up, dw_down and the loss, one all-reduce each or merged.
    assert_only_reductions(found, max_elements=2 * k * n + n * k_out + 1)
    assert any(kind == "all-reduce" and e >= k * n for kind, e in found)  # dw_gate / dw_up (alone or merged)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("fused", [False, True], ids=["separate", "fused"])
@pytest.mark.parametrize("down", [None, "down"])
def test_gated_mlp_tensor_parallel_weights(impl, fused, down):
    # Megatron: w_gate / w_up split along N ("model"), w_down along its N input axis, x's rows
    # along "data". Forward: no communication without w_down, one all-reduce of y with it;
    # backward: the all-reduce of dx (x is replicated over "model") and of the weight gradients
    # over "data".
    k, n, k_out = (128, 256, 128) if ON_GPU else (24, 40, 16)
    lead = (8, 5)
    arrays = _gm_arrays(impl, k, n, k_out if down else None, fused, lead)
    mlp = _gated_mlp(impl)
    _supported_or_skip(_gm_loss(mlp), *arrays)
    x, wg, wu, wd = arrays
    w_spec = (None, None, "model") if fused else (None, "model")
    sharded = (_put(x, "data"), _put(wg, *w_spec), None if wu is None else _put(wu, *w_spec),
               None if wd is None else _put(wd, "model", None))
    _, found = _check(_gm_loss(mlp), arrays, sharded, _diff(arrays), _tol(x.dtype))
    rows = lead[0] // _mesh().shape["data"] * lead[1]
    assert_only_reductions(found, max_elements=max(rows * max(k, k_out), k * n))
    y, forward = _run(mlp, *sharded)
    if wd is None:
        assert tuple(y.sharding.spec)[-1] == "model"  # h stays split along N
        assert not forward, "the forward without w_down needs no communication"
    else:
        assert [kind for kind, _ in forward] in (["all-reduce"], ["reduce-scatter"])


# ----------------------------------------------------------------------------- newton_schulz


def _ns_gram(x, c, alpha, beta, config):
    del config
    b, m, _ = x.shape

    def body(x_ref, *refs):
        out_ref = refs[-1]
        xb = x_ref[0].astype(F32)
        acc = alpha * jnp.dot(xb, xb.T, precision=jax.lax.Precision.HIGHEST)
        if c is not None:
            acc = acc + beta * refs[0][0].astype(F32)
        out_ref[0] = acc.astype(out_ref.dtype)

    ins = [(x, True)] + ([] if c is None else [(c, True)])
    return _blocked(body, ins, [(jax.ShapeDtypeStruct((b, m, m), ns_common.ITERATION_DTYPE), True)], block=1)[0]


def _ns_update(bm, x, a, config):
    del config

    def body(b_ref, x_ref, out_ref):
        xb = x_ref[0].astype(F32)
        out_ref[0] = (a * xb + jnp.dot(b_ref[0].astype(F32), xb, precision=jax.lax.Precision.HIGHEST)).astype(out_ref.dtype)

    return _blocked(body, [(bm, True), (x, True)], [(jax.ShapeDtypeStruct(x.shape, ns_common.ITERATION_DTYPE), True)],
                    block=1)[0]


STAND_IN_NS = ns_common.newton_schulz_with(ns_common.Kernels(gram=_ns_gram, update=_ns_update))


@pytest.mark.parametrize("impl", IMPLS)
def test_newton_schulz_splits_the_batch_of_matrices(impl):
    m, n = (64, 128) if ON_GPU else (16, 24)
    g = _random(4, (4, 2, n, m))  # M > N: transposed inside, per matrix
    if impl == "stand_in":
        fn = lambda g: jnp.sum(jnp.cos(STAND_IN_NS(g, spec=ns_common.NewtonSchulzSpec(steps=2)).astype(F32)))  # noqa: E731
    else:
        fn = lambda g: jnp.sum(jnp.cos(ops.newton_schulz(g, steps=2, backend=impl).astype(F32)))  # noqa: E731
    _supported_or_skip(fn, g)
    sharded = _put(g, "data", "model")
    got, found = _check(fn, (g,), (sharded,), (0,), 2e-2)  # bf16 iterations: a last-bit difference grows
    assert parallel_env.same_sharding(got[1][0], sharded)
    assert_only_reductions(found, max_elements=1)  # the scalar loss only: each matrix whole on its device


# ----------------------------------------------------------------------------- mean_pool


def _mp_ids(lengths, segment_ids, t):
    if segment_ids is None:
        return jnp.where(jnp.arange(t)[None, :] < lengths[:, None], 0, -1).astype(jnp.int32)
    return segment_ids


def _onehot(ids, s):
    return (jnp.arange(s)[:, None] == ids[None, :]).astype(F32)  # [S, T]


def _mp_forward(x, lengths, segment_ids, inv, *, s):
    b, t, d = x.shape

    def body(x_ref, ids_ref, inv_ref, out_ref):
        out_ref[0] = (_mm(_onehot(ids_ref[0], s), x_ref[0]) * inv_ref[0][:, None]).astype(out_ref.dtype)

    ins = [(x, True), (_mp_ids(lengths, segment_ids, t), True), (inv, True)]
    return _blocked(body, ins, [(jax.ShapeDtypeStruct((b, s, d), x.dtype), True)], block=1)[0]


def _mp_backward(gs, lengths, segment_ids, *, t, x_dtype, s):
    b, _, d = gs.shape

    def body(g_ref, ids_ref, dx_ref):
        dx_ref[0] = _mm(_onehot(ids_ref[0], s).T, g_ref[0]).astype(dx_ref.dtype)

    ins = [(gs, True), (_mp_ids(lengths, segment_ids, t), True)]
    return _blocked(body, ins, [(jax.ShapeDtypeStruct((b, t, d), x_dtype), True)], block=1)[0]


def _mean_pool(impl, segments):
    if impl != "stand_in":
        return lambda x, lengths, ids: ops.mean_pool(x, lengths=lengths, segment_ids=ids,
                                                     num_segments=segments, backend="triton")
    from forgeax.kernels.triton.mean_pool import differentiable_mean_pool  # noqa: PLC0415

    s = segments or 1

    def fn(x, lengths, ids):
        t = x.shape[1]
        if ids is None and lengths is None:
            lengths = jnp.full((x.shape[0],), t, jnp.int32)
        pool = differentiable_mean_pool(functools.partial(_mp_forward, s=s),
                                        functools.partial(_mp_backward, t=t, x_dtype=x.dtype, s=s), s)
        out = pool(x, lengths, ids)
        return out if ids is not None else out[:, 0]

    return fn


@pytest.mark.parametrize("impl", ["triton"] if ON_GPU else ["stand_in"])
@pytest.mark.parametrize("segments", [None, 3], ids=["lengths", "segments"])
def test_mean_pool_splits_batch_and_features(impl, segments):
    b, t, d = 8, 7, (128 if ON_GPU else 24)
    x = _random(5, (b, t, d))
    rng = np.random.default_rng(6)
    lengths = None if segments else jnp.asarray(rng.integers(0, t + 1, (b,)), jnp.int32)
    ids = jnp.asarray(rng.integers(-1, segments, (b, t)), jnp.int32) if segments else None
    pool = _mean_pool(impl, segments)
    fn = lambda x, lengths, ids: jnp.sum(jnp.sin(pool(x, lengths, ids)))  # noqa: E731
    sharded = (_put(x, "data", None, "model"), None if lengths is None else _put(lengths, "data"),
               None if ids is None else _put(ids, "data", None))
    got, found = _check(fn, (x, lengths, ids), sharded, (0,), 1e-5)
    assert parallel_env.same_sharding(got[1][0], sharded[0])
    assert_only_reductions(found, max_elements=1)  # the scalar loss only
    out, forward = _run(pool, *sharded)
    want = P("data", "model") if out.ndim == 2 else P("data", None, "model")
    assert parallel_env.same_sharding(out, NamedSharding(_mesh(), want)) and not forward


# ----------------------------------------------------------------------------- ragged_dot


def _row_groups(group_sizes, m):
    """Each row's group (G past the last group's end), [m, 1] int32."""
    _, ends = group_bounds(group_sizes, m)
    return jnp.sum(jnp.arange(m)[:, None] >= ends[None, :], axis=1).astype(jnp.int32)[:, None]


def _rd_forward(lhs, rhs, group_sizes, *, out_dtype, config, transpose_rhs):
    del config
    rhs = jnp.swapaxes(rhs, 1, 2) if transpose_rhs else rhs
    m, g, n = lhs.shape[0], rhs.shape[0], rhs.shape[2]

    def body(l_ref, r_ref, gid_ref, out_ref):
        acc = sum(jnp.where(gid_ref[...] == e, _mm(l_ref[...], r_ref[e]), 0.0) for e in range(g))
        out_ref[...] = acc.astype(out_ref.dtype)

    ins = [(lhs, True), (rhs, False), (_row_groups(group_sizes, m), True)]
    return _blocked(body, ins, [(jax.ShapeDtypeStruct((m, n), out_dtype), True)])[0]


def _rd_transposed(lhs, dout, group_sizes, *, out_dtype, config):
    del config
    m, k, n, g = lhs.shape[0], lhs.shape[1], dout.shape[1], group_sizes.shape[0]

    def body(l_ref, d_ref, gid_ref, out_ref, acc_ref):
        @pl.when(pl.program_id(0) == 0)
        def _():
            acc_ref[...] = jnp.zeros_like(acc_ref)

        for e in range(g):
            rows = jnp.where(gid_ref[...] == e, l_ref[...].astype(F32), 0.0)
            acc_ref[e] += _mm(rows.T, d_ref[...])
        out_ref[...] = acc_ref[...].astype(out_ref.dtype)

    ins = [(lhs, True), (dout, True), (_row_groups(group_sizes, m), True)]
    outs = [(jax.ShapeDtypeStruct((g, k, n), out_dtype), False), (jax.ShapeDtypeStruct((g, k, n), F32), False)]
    return _blocked(body, ins, outs)[0]


STAND_IN_RD, STAND_IN_RD_T = differentiable_ragged_dot(_rd_forward, _rd_transposed)


def _ragged(impl):
    if impl == "stand_in":
        return lambda lhs, rhs, gs: STAND_IN_RD(lhs, rhs, gs, lhs.dtype, None)
    return lambda lhs, rhs, gs: ops.ragged_dot(lhs, rhs, gs, backend=impl)


def _rd_arrays(impl, m, k, n, g=3):
    dt = _dtype(impl)
    # Group boundaries inside the row shards, an empty group, and rows past the last group.
    sizes = jnp.asarray([m // 3 + 1, 0, m // 2], jnp.int32)[:g]
    return _random(7, (m, k), dt), _random(8, (g, k, n), dt, k ** -0.5), sizes


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("split", ["rows", "n", "rows_n"])
def test_ragged_dot_splits_rows_and_output_columns(impl, split):
    m, k, n = (256, 128, 256) if ON_GPU else (16, 8, 12)
    lhs, rhs, sizes = _rd_arrays(impl, m, k, n)
    rd = _ragged(impl)
    fn = lambda lhs, rhs, gs: jnp.sum(jnp.sin(rd(lhs, rhs, gs).astype(F32)))  # noqa: E731
    _supported_or_skip(fn, lhs, rhs, sizes)
    rows = {"rows": (("data", "model"),), "n": (), "rows_n": ("data",)}[split]
    sharded = (_put(lhs, *rows), _put(rhs, None, None, "model") if "n" in split else rhs, sizes)
    _, found = _check(fn, (lhs, rhs, sizes), sharded, (0, 1), _tol(lhs.dtype))
    out, forward = _run(rd, *sharded)
    assert not forward
    if split == "rows":  # each device's rows, the replicated rhs's gradient all-reduced
        assert_only_reductions(found, max_elements=rhs.size + 1)  # (+ the loss, merged on GPUs)
        assert any(kind == "all-reduce" and e >= rhs.size for kind, e in found)
    else:  # out split along N: no communication; d lhs is a partial sum over the N shards
        assert tuple(out.sharding.spec)[-1] == "model"
        assert_only_reductions(found, max_elements=m * k + rhs.size + 1)


@pytest.mark.parametrize("impl", IMPLS)
def test_ragged_dot_megatron_pair(impl):
    # An expert MLP's two grouped products in Megatron form: w1 split along its output axis,
    # w2 along its input (contraction) axis: the hidden activation stays split, the second
    # product's partial sums are all-reduced once; rows split along "data".
    m, d, f = (256, 128, 256) if ON_GPU else (16, 8, 12)
    x, w1, sizes = _rd_arrays(impl, m, d, f)
    w2 = _random(9, (3, f, d), x.dtype, f ** -0.5)
    rd = _ragged(impl)
    fn = lambda x, w1, w2, gs: jnp.sum(jnp.sin(rd(jnp.tanh(rd(x, w1, gs)).astype(x.dtype), w2, gs).astype(F32)))  # noqa: E731
    _supported_or_skip(fn, x, w1, w2, sizes)
    sharded = (_put(x, "data"), _put(w1, None, None, "model"), _put(w2, None, "model", None), sizes)
    _, found = _check(fn, (x, w1, w2, sizes), sharded, (0, 1, 2), _tol(x.dtype))
    forward = _collectives(lambda x, w1, w2, gs: rd(jnp.tanh(rd(x, w1, gs)).astype(x.dtype), w2, gs), *sharded)
    assert [kind for kind, _ in forward] in (["all-reduce"], ["reduce-scatter"])
    # dx's and the second product's partial sums, dw1 / dw2 over "data", the loss (maybe merged).
    assert_only_reductions(found, max_elements=m // _mesh().shape["data"] * max(d, f) + w1.size + w2.size + 1)


def test_ragged_dot_transposed_splits_rows():
    if ON_GPU:
        rdt = lambda lhs, dout, gs: ops.ragged_dot_transposed(lhs, dout, gs, backend="triton")  # noqa: E731
    else:
        rdt = lambda lhs, dout, gs: STAND_IN_RD_T(lhs, dout, gs, lhs.dtype, None)  # noqa: E731
    m, k, n = (256, 128, 256) if ON_GPU else (16, 8, 12)
    lhs, _, sizes = _rd_arrays("triton", m, k, n)
    dout = _random(10, (m, n))
    fn = lambda lhs, dout, gs: jnp.sum(jnp.sin(rdt(lhs, dout, gs)))  # noqa: E731
    sharded = (_put(lhs, ("data", "model")), _put(dout, ("data", "model")), sizes)
    _, found = _check(fn, (lhs, dout, sizes), sharded, (0, 1), 1e-5)
    assert_only_reductions(found, max_elements=3 * k * n + 1)  # (+ the loss, merged on GPUs)
    forward = _collectives(rdt, *sharded)
    assert forward in ([("all-reduce", 3 * k * n)], [("reduce-scatter", 3 * k * n)])  # the [G, K, N] partial sums


# moe_mlp's grouped products through a registered backend: the stand-in kernels on CPU.
register_backend("ragged_dot", "sharded_stand_in",
                 Implementation(fn=lambda lhs, rhs, gs, *, spec: STAND_IN_RD(lhs, rhs, gs, jnp.dtype(spec.out_dtype), None)))


@pytest.mark.parametrize("impl", IMPLS)
def test_moe_mlp_expert_weights_split_along_f(impl):
    # Tensor-parallel experts: w_gate / w_up split along F, w_down along its F input axis; tokens
    # replicated (the routing sort would gather sharded tokens). The gate/up products keep h
    # split, the down product's partial sums are all-reduced once ([A, D], A = tokens x top_k).
    e, d, f, n, top_k = (4, 128, 256, 64, 2) if ON_GPU else (4, 8, 12, 16, 2)
    dt = _dtype(impl)
    x, logits = _random(11, (n, d), dt), _random(12, (n, e))
    wg, wu = _random(13, (e, d, f), dt, d ** -0.5), _random(14, (e, d, f), dt, d ** -0.5)
    wd = _random(15, (e, f, d), dt, f ** -0.5)
    backend = "sharded_stand_in" if impl == "stand_in" else impl
    moe = lambda x, lg, wg, wu, wd: ops.moe_mlp(x, lg, wg, wu, wd, top_k=top_k, backend=backend)  # noqa: E731
    fn = lambda *a: jnp.sum(jnp.sin(moe(*a).astype(F32)))  # noqa: E731
    arrays = (x, logits, wg, wu, wd)
    _supported_or_skip(fn, *arrays)
    sharded = (x, logits, _put(wg, None, None, "model"), _put(wu, None, None, "model"), _put(wd, None, "model", None))
    _, found = _check(fn, arrays, sharded, (0, 2, 3, 4), _tol(dt))
    assert_only_reductions(found, max_elements=n * top_k * d + 1)  # (+ the loss, merged on GPUs)
    assert [kind for kind, _ in _collectives(moe, *sharded)] in (["all-reduce"], ["reduce-scatter"])


@pytest.mark.skipif(ON_GPU, reason="the stand-in shells")
def test_unsharded_calls_have_no_partitioning_op():
    # On one device the wrappers lower to the kernels themselves (the same program as before).
    arrays = _gm_arrays("stand_in", 24, 40, 16, fused=False)
    text = jax.jit(jax.grad(_gm_loss(_gated_mlp("stand_in")), argnums=(0, 1, 2, 3))).lower(*arrays).as_text()
    assert "CustomSPMDPartitioning" not in text
    lhs, rhs, sizes = _rd_arrays("stand_in", 16, 8, 12)
    rd = _ragged("stand_in")
    text = jax.jit(jax.grad(lambda a, b: jnp.sum(jnp.sin(rd(a, b, sizes))), argnums=(0, 1))).lower(lhs, rhs).as_text()
    assert "CustomSPMDPartitioning" not in text
