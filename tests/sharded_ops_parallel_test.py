"""Row-wise ops on batch- / token-sharded arrays under plain jax.jit (no shard_map), 8 devices.

A kernel launch has no partitioning rule of its own; kernels/common/partitioning.py gives the
row-wise ones one (rows split, feature / vocabulary axis replicated, weight gradients summed
per shard then all-reduced). Checked here:

  * the shared norm and add+RMSNorm shells (kernels/common/norms.py, add_rms_norm.py) around
    stand-in Pallas row kernels (`interpret=True`: pure HLO, which XLA cannot split by
    itself): results and gradients equal the unsharded call, outputs keep the input's
    sharding, and the compiled program's only collectives are all-reduces of weight-sized
    (or scalar) values: no all-gather of activations. Removing the wrapper fails this.
  * every op (rms_norm, layer_norm, add_rms_norm, rope, rope_qk, cross_entropy) with the
    XLA backend, and linear_cross_entropy's chunk loop (xla_chunked: wrapped like the kernel
    backends, each device loops over its own tokens): the same HLO check; with the Mosaic TPU
    kernels in their CPU interpreter:
    sharded equals unsharded (the interpreters run as host callbacks, which cannot live
    inside a partitioned launch, so interpreted kernels are gathered: the HLO check of the
    real kernels runs on GPUs, below).
  * on >= 2 GPUs: the HLO check for the Triton and Pallas GPU kernels themselves.

Needs 8 devices on CPU: XLA_FLAGS=--xla_force_host_platform_device_count=8 before JAX starts
(set by parallel_env when this file is the first to import jax; FORGEAX_TEST_DEVICES=2: the
meshes of a 2-GPU host).
"""

from __future__ import annotations

import parallel_env  # first: XLA_FLAGS before jax starts

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import conformance
from forgeax import ops
from forgeax.core.runtime import interpret_mode
from forgeax.kernels.common.add_rms_norm import AddRmsNormKernels, differentiable_add_rms_norm
from forgeax.kernels.common.norms import NormKernels, differentiable_norm

ON_GPU = parallel_env.skip_unless_devices(cpu=8, gpu=2)

_COLLECTIVE = parallel_env.COLLECTIVE


def _mesh(spec=P("data")):
    """(n / 2, 2) over ("data", "seq"); on 2 devices every device goes to the axis `spec` splits
    ("data" when it names both), so a tokens- or heads-sharded case is split there too."""
    n = len(jax.devices())
    if n >= 4:
        shape = (n // 2, 2)
    else:
        named = {a for entry in spec if entry is not None for a in ((entry,) if isinstance(entry, str) else entry)}
        shape = (1, n) if "seq" in named and "data" not in named else (n, 1)
    return jax.make_mesh(shape, ("data", "seq"), axis_types=(jax.sharding.AxisType.Auto,) * 2)


# (name, spec of the leading [B, T] axes): batch-, token- and batch x token-sharded.
SHARDINGS = {"batch": P("data"), "tokens": P(None, "seq"), "batch_tokens": P("data", "seq")}




def assert_no_activation_collectives(fn, *args, reduced_elements: int):
    """The compiled program of fn(*args) moves no activations: only all-reduces of at most
    `reduced_elements` values, the per-device weight gradients and the scalar loss TOGETHER: XLA
    on GPUs combines a program's all-reduces into one contiguous buffer (dscale [128] and the loss
    [] reduce as one f32[129]); on CPU each stays separate."""
    hlo = jax.jit(fn).lower(*args).compile().as_text()
    found = [(kind, shape) for shape, kind in _COLLECTIVE.findall(hlo)]
    bad = [(k, s) for k, s in found if k != "all-reduce" or parallel_env.elements(s) > reduced_elements]
    assert not bad, f"activation-sized collectives in the compiled program: {bad}"
    return found


def _put(x, spec):
    return jax.device_put(x, NamedSharding(_mesh(spec), spec))


def _assert_same(got, want, tol=1e-5):
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert g.shape == w.shape and g.dtype == w.dtype
        # A scalar loss sums many terms in another order per shard: 1e-4 there.
        assert conformance.relative_error(g, w) < (max(tol, 1e-4) if g.ndim == 0 else tol)


# ----------------------------------------------------------------------------- stand-in row kernels


def _row_call(body, ins, outs):
    """A Pallas kernel over blocks of 2 rows, HLO-interpreted on CPU."""
    rows = ins[0][0].shape[0]

    def spec(a, per_row):
        return pl.BlockSpec((2,) + a.shape[1:], lambda i: (i,) + (0,) * (len(a.shape) - 1)) if per_row else \
            pl.BlockSpec(a.shape, lambda i: (0,) * len(a.shape))

    return pl.pallas_call(
        body, grid=(pl.cdiv(rows, 2),),
        in_specs=[spec(a, r) for a, r in ins], out_specs=[spec(o, True) for o in outs],
        out_shape=list(outs), interpret=True,
    )(*[a for a, _ in ins])


def _norm_stats(x, eps):
    rstd = jax.lax.rsqrt(jnp.mean(x * x, axis=1, keepdims=True) + eps)
    return x * rstd, rstd


def _rms_fwd(x, scale, offset, *, eps):
    del offset
    rows, d = x.shape

    def body(x_ref, w_ref, y_ref, r_ref):
        xhat, rstd = _norm_stats(x_ref[...].astype(jnp.float32), eps)
        y_ref[...] = (xhat * w_ref[...]).astype(y_ref.dtype)
        r_ref[...] = rstd

    f32 = jnp.float32
    return tuple(_row_call(body, [(x, True), (scale.astype(f32).reshape(1, d), False)],
                           [jax.ShapeDtypeStruct(x.shape, x.dtype), jax.ShapeDtypeStruct((rows, 1), f32)]))


def _rms_dx(x, w, rstd, g):
    xhat = x * rstd
    g = g * w
    return rstd * (g - xhat * jnp.mean(g * xhat, axis=1, keepdims=True)), xhat


def _rms_bwd(x, scale, rstd, dy, *, eps):
    del eps
    rows, d = x.shape

    def body(x_ref, w_ref, r_ref, dy_ref, dx_ref, p_ref):
        dy = dy_ref[...].astype(jnp.float32)
        dx, xhat = _rms_dx(x_ref[...].astype(jnp.float32), w_ref[...], r_ref[...], dy)
        dx_ref[...] = dx.astype(dx_ref.dtype)
        p_ref[...] = dy * xhat  # per-row dscale terms, summed below (the shard's partial sum)

    f32 = jnp.float32
    dx, partial = _row_call(body, [(x, True), (scale.astype(f32).reshape(1, d), False), (rstd, True), (dy, True)],
                            [jax.ShapeDtypeStruct(x.shape, x.dtype), jax.ShapeDtypeStruct((rows, d), f32)])
    return dx, jnp.sum(partial, axis=0), None


def _add_fwd(x, r, scale, *, eps):
    s = (x + r).astype(x.dtype)
    y, rstd = _rms_fwd(s, scale, None, eps=eps)
    return y, s, rstd


def _add_bwd(s, scale, rstd, dn, dsum, *, eps):
    ds, dscale, _ = _rms_bwd(s, scale, rstd, dn, eps=eps)
    return (ds.astype(jnp.float32) + dsum.astype(jnp.float32)).astype(s.dtype), dscale


STAND_IN_NORM = differentiable_norm(NormKernels(forward=_rms_fwd, backward=_rms_bwd))
STAND_IN_ADD = differentiable_add_rms_norm(AddRmsNormKernels(forward=_add_fwd, backward=_add_bwd))


def _norm_loss(norm):
    return lambda x, w: jnp.sum(norm(x, w, None, eps=1e-6) * jnp.cos(x.astype(jnp.float32)))


def _add_loss(x, r, w):
    normed, s = STAND_IN_ADD(x, r, w, eps=1e-6)
    return jnp.sum(normed * jnp.cos(x)) + jnp.sum(s * jnp.sin(r))


@pytest.mark.parametrize("sharding", SHARDINGS)
def test_norm_shell_splits_rows_without_gathering(sharding):
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((4, 6, 40), np.float32))
    w = jnp.asarray(rng.standard_normal(40, np.float32))
    xs = _put(x, SHARDINGS[sharding])
    fwd = lambda x, w: STAND_IN_NORM(x, w, None, eps=1e-6)  # noqa: E731
    grad = jax.grad(_norm_loss(STAND_IN_NORM), argnums=(0, 1))
    y = jax.jit(fwd)(xs, w)
    _assert_same(y, jax.jit(fwd)(x, w))
    assert parallel_env.same_sharding(y, xs)
    dx, dw = jax.jit(grad)(xs, w)
    _assert_same((dx, dw), jax.jit(grad)(x, w))
    assert parallel_env.same_sharding(dx, xs)
    found = assert_no_activation_collectives(grad, xs, w, reduced_elements=40)
    assert ("all-reduce", "f32[40]{0}") in found  # dscale: per-shard partial sums, one all-reduce


@pytest.mark.parametrize("sharding", ["batch", "tokens"])
def test_add_rms_norm_shell_splits_rows_without_gathering(sharding):
    rng = np.random.default_rng(1)
    x, r = (jnp.asarray(rng.standard_normal((4, 6, 24), np.float32)) for _ in range(2))
    w = jnp.asarray(rng.standard_normal(24, np.float32))
    xs, rs = (_put(a, SHARDINGS[sharding]) for a in (x, r))
    fwd = lambda x, r, w: STAND_IN_ADD(x, r, w, eps=1e-6)  # noqa: E731
    grad = jax.grad(_add_loss, argnums=(0, 1, 2))
    out = jax.jit(fwd)(xs, rs, w)
    _assert_same(out, jax.jit(fwd)(x, r, w))
    assert all(parallel_env.same_sharding(o, xs) for o in out)
    _assert_same(jax.jit(grad)(xs, rs, w), jax.jit(grad)(x, r, w))
    assert_no_activation_collectives(grad, xs, rs, w, reduced_elements=24)


def test_uneven_row_shards_equal_unsharded():
    # B = 3 over 4 devices (uneven, padded shards): such row axes are left whole by the wrapper.
    rng = np.random.default_rng(2)
    x = jnp.asarray(rng.standard_normal((3, 5, 16), np.float32))
    w = jnp.asarray(rng.standard_normal(16, np.float32))
    sharding = NamedSharding(_mesh(P("data")), P("data"))
    grad = jax.grad(_norm_loss(STAND_IN_NORM), argnums=(0, 1))
    constrained = lambda x, w: grad(jax.lax.with_sharding_constraint(x * 1.0, sharding), w)  # noqa: E731
    _assert_same(jax.jit(constrained)(x, w), jax.jit(grad)(x, w))


def test_unsharded_call_has_no_partitioning_op():
    x = jnp.ones((3, 5, 16), jnp.float32)
    w = jnp.ones((16,), jnp.float32)
    text = jax.jit(jax.grad(_norm_loss(STAND_IN_NORM), argnums=(0, 1))).lower(x, w).as_text()
    assert "CustomSPMDPartitioning" not in text


# ----------------------------------------------------------------------------- the ops


def _row_inputs(seed, shape, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    return jnp.asarray(rng.standard_normal(shape, np.float32)).astype(dtype)


def _cases(backend):
    """(name, fn(*arrays) -> scalar loss, arrays) for each row-wise op."""
    d, b, t = 128, 4, 6
    x, r = _row_inputs(0, (b, t, d)), _row_inputs(1, (b, t, d))
    w, o = _row_inputs(2, (d,)), _row_inputs(3, (d,))
    q, k = _row_inputs(4, (b, t, 4, 64)), _row_inputs(5, (b, t, 2, 64))
    pos = jnp.asarray(np.random.default_rng(6).integers(0, 1000, (b, t)), jnp.int32)
    logits = _row_inputs(7, (b, t, 300)) * 3
    targets = jnp.asarray(np.random.default_rng(8).integers(0, 300, (b, t)), jnp.int32).at[0, 1].set(-100)
    cos = lambda a: jnp.cos(a.astype(jnp.float32))  # noqa: E731
    be = dict(backend=backend)
    lce = dict(backend="xla_chunked" if backend == "xla" else backend)  # the chunk loop, not the materialised reference
    lce_w = _row_inputs(9, (d, 300)) * 0.1
    return {
        "rms_norm": (lambda x, w: jnp.sum(ops.rms_norm(x, w, **be) * cos(x)), (x, w)),
        "layer_norm": (lambda x, w, o: jnp.sum(ops.layer_norm(x, w, o, **be) * cos(x)), (x, w, o)),
        "add_rms_norm": (lambda x, r, w: sum(jnp.sum(a * cos(x)) for a in ops.add_rms_norm(x, r, w, **be)), (x, r, w)),
        "rope": (lambda q, pos: jnp.sum(ops.rope(q, pos, **be) * cos(q)), (q, pos)),
        "rope_qk": (lambda q, k, pos: sum(jnp.sum(a * cos(a)) for a in ops.rope_qk(q, k, pos, **be)), (q, k, pos)),
        "cross_entropy": (lambda lg, tg: ops.cross_entropy(lg, tg, label_smoothing=0.1, **be), (logits, targets)),
        # Chunked over tokens inside each device's rows; dW [H, V] is all-reduced (data parallelism's own cost).
        "linear_cross_entropy": (lambda h, w, tg: ops.linear_cross_entropy(h, w, tg, chunk_size=8, **lce),
                                 (x, lce_w, targets)),
        "linear_cross_entropy_none": (lambda h, w, tg: jnp.sum(cos(h[..., 0]) * ops.linear_cross_entropy(
            h, w, tg, chunk_size=8, reduction="none", **lce)), (x, lce_w, targets)),
    }


def _rows(a):
    # Every row-wise argument has the [B, T] = [4, 6] leading axes; weights stay replicated.
    return a.shape[:2] == (4, 6)


def _shard(arrays, spec):
    return tuple(_put(a, spec) if _rows(a) else a for a in arrays)


def _check_op(fn, arrays, spec, *, hlo: bool):
    sharded = _shard(arrays, spec)
    diff = tuple(i for i, a in enumerate(arrays) if jnp.issubdtype(a.dtype, jnp.floating))
    # What may be all-reduced: the replicated weights' gradients (per-shard partial sums) and the loss.
    weight_elements = sum(arrays[i].size for i in diff if not _rows(arrays[i])) + 1
    value_and_grad = jax.value_and_grad(fn, argnums=diff)
    got = jax.jit(value_and_grad)(*sharded)
    _assert_same(got, jax.jit(value_and_grad)(*arrays))
    if hlo:
        assert parallel_env.same_sharding(got[1][0], sharded[0])
        assert_no_activation_collectives(value_and_grad, *sharded, reduced_elements=weight_elements)


OPS = list(_cases("xla"))


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("sharding", ["batch", "tokens"])
def test_xla_backend_partitions_naturally(op, sharding):
    fn, arrays = _cases("xla")[op]
    _check_op(fn, arrays, SHARDINGS[sharding], hlo=True)


# Interpreted on CPU: correct under sharding (the interpreters run gathered; see the docstring).
INTERPRETED = {"rms_norm": "pallas_tpu", "layer_norm": "pallas_tpu", "add_rms_norm": "pallas_tpu",
               "rope_qk": "pallas_tpu", "cross_entropy": "pallas_tpu"}


@pytest.mark.skipif(ON_GPU, reason="CPU interpreters")
@pytest.mark.parametrize("op", INTERPRETED)
def test_interpreted_kernels_equal_unsharded(op):
    with interpret_mode():
        fn, arrays = _cases(INTERPRETED[op])[op]
        _check_op(fn, arrays, SHARDINGS["batch_tokens"], hlo=False)


def _attention_case(backend):
    """Batch-sharded causal GQA attention with a bias broadcast over the batch (its gradient: a SUM)."""
    q, k, v = _row_inputs(10, (4, 6, 4, 32)), _row_inputs(11, (4, 6, 2, 32)), _row_inputs(12, (4, 6, 2, 32))
    bias = _row_inputs(13, (1, 1, 6, 6))
    fn = lambda q, k, v, bias: jnp.sum(jnp.cos(ops.attention(q, k, v, bias=bias, causal=True, backend=backend)))  # noqa: E731
    return fn, (q, k, v, bias)


@pytest.mark.skipif(ON_GPU, reason="the GPU test below covers the kernels")
def test_attention_chunk_loop_splits_the_batch():
    # xla_chunked is built from the same shell (kernels/common/attention.py) as the kernel backends:
    # its launches go through the batch split (dbias: per-device sums, all-reduced). Its XLA loop
    # would split by batch by itself too, so the no-gather proof for kernels is the GPU test below.
    fn, arrays = _attention_case("xla_chunked")
    _check_op(fn, arrays, SHARDINGS["batch"], hlo=True)


@pytest.mark.skipif(not ON_GPU, reason="needs >= 2 GPUs")
@pytest.mark.parametrize("backend", ["triton", "pallas_gpu"])
def test_gpu_attention_kernels_split_the_batch(backend):
    fn, arrays = _attention_case(backend)
    try:
        jax.jit(fn).lower(*arrays)
    except Exception as e:  # noqa: BLE001 - the backend refuses this call (UnsupportedError)
        pytest.skip(f"attention on {backend}: {e}")
    _check_op(fn, arrays, SHARDINGS["batch"], hlo=True)


@pytest.mark.skipif(not ON_GPU, reason="needs >= 2 GPUs")
@pytest.mark.parametrize("backend", ["triton", "pallas_gpu"])
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("sharding", ["batch", "tokens"])
def test_gpu_kernels_split_rows_without_gathering(op, backend, sharding):
    fn, arrays = _cases(backend)[op]
    try:
        jax.jit(fn).lower(*arrays)
    except Exception as e:  # noqa: BLE001 - the op has no such backend (UnsupportedError)
        pytest.skip(f"{op} on {backend}: {e}")
    _check_op(fn, arrays, SHARDINGS[sharding], hlo=True)


# ----------------------------------------------------------------------------- heads-sharded (tensor parallelism)

# [B, T, N, H] with the heads axis N split over "seq" (the second mesh axis): GQA with 8 query
# and 4 kv heads keeps whole groups on a device when both split the same number of ways.
HEADS = {"heads": P(None, None, "seq"), "batch_heads": P("data", None, "seq")}


def _heads_attention_case(backend, bias_shape):
    q, k, v = _row_inputs(20, (4, 6, 8, 32)), _row_inputs(21, (4, 6, 4, 32)), _row_inputs(22, (4, 6, 4, 32))
    bias = _row_inputs(23, bias_shape)
    fn = lambda q, k, v, bias: jnp.sum(jnp.cos(ops.attention(q, k, v, bias=bias, causal=True, backend=backend)))  # noqa: E731
    return fn, (q, k, v, bias)


def _check_heads(fn, arrays, spec):
    mesh = _mesh(spec)
    put = lambda a, s: jax.device_put(a, NamedSharding(mesh, s))  # noqa: E731
    bias = arrays[3]
    bias_spec = P(spec[0] if bias.shape[0] == arrays[0].shape[0] else None, "seq" if bias.shape[1] == arrays[0].shape[2] else None)
    sharded = tuple(put(a, spec) for a in arrays[:3]) + (put(bias, bias_spec),)
    value_and_grad = jax.value_and_grad(fn, argnums=(0, 1, 2, 3))
    got = jax.jit(value_and_grad)(*sharded)
    _assert_same(got, jax.jit(value_and_grad)(*arrays))
    assert parallel_env.same_sharding(got[1][0], sharded[0])
    # A bias broadcast over a split axis (batch or heads) has its gradient (this device's share of
    # it: [1, 8 / heads split, 6, 6]) summed over that axis; the loss is all-reduced too.
    summed = [axis for axis, size, full in ((spec[0], bias.shape[0], arrays[0].shape[0]), (spec[2], bias.shape[1], arrays[0].shape[2]))
              if axis is not None and size != full and mesh.shape[axis] > 1]
    bias_share = math.prod(NamedSharding(mesh, bias_spec).shard_shape(bias.shape)) if summed else 0
    assert_no_activation_collectives(value_and_grad, *sharded, reduced_elements=bias_share + 1)


@pytest.mark.parametrize("sharding", HEADS)
@pytest.mark.parametrize("bias_shape", [(1, 1, 6, 6), (4, 8, 6, 6)])
def test_attention_shell_splits_the_heads(sharding, bias_shape):
    # xla_chunked runs through the shared attention shell's launch split (kernels/common/attention.py);
    # a bias broadcast over batch and heads is replicated and its gradient all-reduced (36 values).
    fn, arrays = _heads_attention_case("xla_chunked" if not ON_GPU else "triton", bias_shape)
    _check_heads(fn, arrays, HEADS[sharding])


@pytest.mark.skipif(not ON_GPU, reason="needs >= 2 GPUs (interpreted kernels are not partitioned)")
@pytest.mark.parametrize("backend", ["triton", "pallas_gpu"])
@pytest.mark.parametrize("sharding", HEADS)
def test_gpu_attention_kernels_split_the_heads(backend, sharding):
    fn, arrays = _heads_attention_case(backend, (1, 8, 6, 6))
    try:
        jax.jit(fn).lower(*arrays)
    except Exception as e:  # noqa: BLE001 - the backend refuses this call (UnsupportedError)
        pytest.skip(f"attention on {backend}: {e}")
    _check_heads(fn, arrays, HEADS[sharding])


@pytest.mark.skipif(not ON_GPU, reason="needs >= 2 GPUs (interpreted kernels are not partitioned)")
@pytest.mark.parametrize("sharding", HEADS)
def test_gpu_rope_kernels_split_the_heads(sharding):
    q, k = _row_inputs(24, (4, 6, 8, 64)), _row_inputs(25, (4, 6, 4, 64))
    pos = jnp.asarray(np.random.default_rng(26).integers(0, 1000, (4, 6)), jnp.int32)
    fn = lambda q, k, pos: sum(jnp.sum(a * jnp.cos(a)) for a in ops.rope_qk(q, k, pos, backend="triton"))  # noqa: E731
    spec = HEADS[sharding]
    mesh = _mesh(spec)
    sharded = (jax.device_put(q, NamedSharding(mesh, spec)), jax.device_put(k, NamedSharding(mesh, spec)),
               jax.device_put(pos, NamedSharding(mesh, P(spec[0]))))
    value_and_grad = jax.value_and_grad(fn, argnums=(0, 1))
    _assert_same(jax.jit(value_and_grad)(*sharded), jax.jit(value_and_grad)(q, k, pos))
    assert_no_activation_collectives(value_and_grad, *sharded, reduced_elements=1)


def test_vmap_of_partitioned_launches():
    """custom_partitioning has no batching rule: a vmapped call of a partitioned launch (here
    linear_cross_entropy's xla_chunked chunk loop, which is partitioned whenever it is not
    interpreted) runs the launch unpartitioned, and equals the reference."""
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.standard_normal((3, 5, 32), np.float32))
    w = jnp.asarray(0.3 * rng.standard_normal((32, 100), np.float32))
    t = jnp.asarray(rng.integers(0, 100, (3, 5)), jnp.int32)

    def batched(backend):
        loss = lambda x, w, t: ops.linear_cross_entropy(x, w, t, backend=backend, chunk_size=2)  # noqa: E731
        return jax.jit(jax.vmap(jax.value_and_grad(loss, argnums=(0, 1)), in_axes=(0, None, 0)))(x, w, t)

    # GPUs run f32 matmuls in TF32 by default, and the two algorithms round different values
    # (2.5e-4 apart on an H100): compare them with f32 matmuls.
    with jax.default_matmul_precision("highest"):
        _assert_same(batched("xla_chunked"), batched("xla"))
