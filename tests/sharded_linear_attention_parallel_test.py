"""Gated linear / lightning attention, linear_recurrence and sparse_attention on sharded arrays
under plain jax.jit (no shard_map), 8 CPU devices (>= 2 GPUs for the real kernels).

Their kernel launches are split by kernels/common/partitioning.py `split_launch` inside the
custom_vjps: GLA / lightning over batch rows and heads (kernels/common/gated_linear_attention.py
`split_by_sequences`; with cu_seqlens heads only), linear_recurrence over batch and channels
(kernels/common/linear_recurrence.py `with_vjp`), sparse_attention over batch and heads
(kernels/common/sparse_attention.py `differentiable_sparse_attention`). Checked here:

  * on CPU, those shells around stand-in kernels: the XLA references behind a Pallas copy kernel
    (HLO-interpreted: XLA cannot split it, so without the launch split a sharded input is
    gathered). Values and gradients equal the unsharded call, and the compiled program has no
    collective but all-reduces of <= `small` values (a lightning `decay` gradient): no all-gather
    of activations. The real kernels run interpreted on CPU, which is never partitioned
    (docs/sharding.md).
  * on >= 2 GPUs: the same checks through the ops with the Triton kernels.
"""

from __future__ import annotations

import parallel_env  # noqa: F401  (first: 8 CPU devices before jax starts)

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import conformance
from forgeax import ops
from forgeax.kernels.common import gated_linear_attention as gla
from forgeax.kernels.common.linear_recurrence import with_vjp
from forgeax.kernels.common.sparse_attention import SparseAttentionSpec, differentiable_sparse_attention
from forgeax.kernels.xla import gated_linear_attention as xla_gla
from forgeax.kernels.xla import linear_recurrence as xla_lr
from forgeax.kernels.xla import sparse_attention as xla_sparse

ON_GPU = parallel_env.skip_unless_devices(cpu=8, gpu=2)
BACKENDS = ["triton"] if ON_GPU else ["stand_in"]

_COLLECTIVE = parallel_env.COLLECTIVE


def _mesh():
    n = len(jax.devices())
    shape = (n // 2, 2) if n >= 4 else (n, 1)
    return jax.make_mesh(shape, ("data", "heads"), axis_types=(jax.sharding.AxisType.Auto,) * 2)




def assert_no_activation_collectives(hlo: str, *, small: int):
    """The compiled program moves no activations: only all-reduces of <= `small` elements."""
    found = [(kind, shape) for shape, kind in _COLLECTIVE.findall(hlo)]
    bad = [(k, s) for k, s in found if k != "all-reduce" or parallel_env.elements(s) > small]
    assert not bad, f"activation-sized collectives in the compiled program: {bad}"


def _check(fn, arrays, specs, *, small: int = 1, tol: float = 1e-5):
    """fn(*arrays) -> scalar: value and gradients (float arrays) sharded == unsharded, no gathers."""
    mesh = _mesh()
    sharded = tuple(a if s is None else jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip(arrays, specs))
    diff = tuple(i for i, a in enumerate(arrays) if jnp.issubdtype(a.dtype, jnp.floating))
    value_and_grad = jax.jit(jax.value_and_grad(fn, argnums=diff))
    compiled = value_and_grad.lower(*sharded).compile()
    got, want = compiled(*sharded), value_and_grad(*arrays)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert g.shape == w.shape and g.dtype == w.dtype
        assert conformance.relative_error(g, w) < (max(tol, 1e-4) if g.ndim == 0 else tol)
    assert parallel_env.same_sharding(got[1][0], sharded[0])  # the gradient stays sharded like its input
    assert_no_activation_collectives(compiled.as_text(), small=small)


def _opaque(x):
    """x through a Pallas copy kernel over the rows of its [-1, last axis] view, HLO-interpreted:
    XLA's partitioner cannot split its loop, so a sharded x reaching it unsplit is gathered."""
    flat = x.reshape(-1, x.shape[-1])
    spec = pl.BlockSpec((1, flat.shape[1]), lambda i: (i, 0))

    def copy(x_ref, o_ref):
        o_ref[...] = x_ref[...]

    return pl.pallas_call(copy, grid=(flat.shape[0],), in_specs=[spec], out_specs=spec,
                          out_shape=jax.ShapeDtypeStruct(flat.shape, flat.dtype), interpret=True)(flat).reshape(x.shape)


def _rand(seed, shape, scale=1.0):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape, np.float32) * scale)


# ----------------------------------------------------------------------------- gated linear attention


@functools.cache
def _stand_in_gla(scale: float, chunk: int):
    """The kernels' shell (kernels/triton/gated_linear_attention.py) around the XLA chunked form."""
    core = functools.partial(xla_gla.chunked_core, scale=scale, chunk=chunk)

    def forward(q, k, v, g, init, starts, ends):
        o, final = core(_opaque(q), k, v, g, init, starts, ends)
        return _opaque(o), final

    def backward(q, k, v, g, init, starts, ends, do, dfinal):
        return jax.vjp(lambda *a: core(*a, starts, ends), _opaque(q), k, v, g, init)[1]((do, dfinal))

    inputs = (gla.LAYOUT,) * 4 + (gla.STATES, gla.TABLE, gla.TABLE)
    local_forward = gla.split_by_sequences(forward, inputs, (gla.LAYOUT, gla.STATES))
    local_backward = gla.split_by_sequences(backward, inputs + (gla.LAYOUT, gla.STATES), (gla.LAYOUT,) * 4 + (gla.STATES,))

    @jax.custom_vjp
    def run(q, k, v, g, init, starts, ends):
        return local_forward(q, k, v, g, init, starts, ends)

    def run_fwd(*args):
        return run(*args), args

    def run_bwd(args, cotangents):
        return (*local_backward(*args, *cotangents), None, None)

    run.defvjp(run_fwd, run_bwd)
    return run


def _gla(backend, q, k, v, g, init, cu_seqlens, *, lightning=False):
    if backend == "stand_in":
        gates = gla.lightning_gates(q, g) if lightning else g
        o, final = gla.on_layout(_stand_in_gla(q.shape[3] ** -0.5, 16), q, k, v, gates, init, cu_seqlens, 16)
        return o.astype(q.dtype), final
    options = dict(initial_state=init, return_final_state=True, chunk_size=16, cu_seqlens=cu_seqlens, backend=backend)
    if lightning:
        return ops.lightning_attention(q, k, v, decay=g, **options)
    return ops.gated_linear_attention(q, k, v, g, **options)


def _gla_loss(backend, lightning, cu_seqlens=None):
    def loss(q, k, v, g, init):
        o, final = _gla(backend, q, k, v, g, init, cu_seqlens, lightning=lightning)
        return jnp.sum(jnp.cos(o.astype(jnp.float32))) + jnp.sum(jnp.sin(final))
    return loss


def _gla_inputs(b, t, n, seqs, lightning):
    q, k = _rand(1, (b, t, n, 16)), _rand(2, (b, t, n, 16))
    v = _rand(3, (b, t, n, 16))
    g = jnp.abs(_rand(4, (n,))) * 0.3 if lightning else jax.nn.log_sigmoid(_rand(4, (b, t, n, 16)) + 2.0)
    return q, k, v, g, _rand(5, (seqs, n, 16, 16), 0.3)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("lightning", [False, True], ids=["gla", "lightning"])
@pytest.mark.parametrize("sharding", ["batch_heads", "heads"])
def test_gla_splits_batch_and_heads(backend, lightning, sharding):
    # T = 20: a padded last chunk of 16.
    q, k, v, g, init = _gla_inputs(4, 20, 4, 4, lightning)
    lead = "data" if sharding == "batch_heads" else None
    act, state = P(lead, None, "heads"), P(lead, "heads")
    gate = None if lightning else act  # lightning's decay [N] replicated; its gradient: one all-reduce of N values
    # (+ 1: XLA GPU merges it and the scalar loss's all-reduce into one flat f32[N + 1])
    _check(_gla_loss(backend, lightning), (q, k, v, g, init), (act, act, act, gate, state), small=4 + 1)


@pytest.mark.parametrize("backend", BACKENDS)
def test_packed_gla_splits_heads(backend):
    # cu_seqlens (B = 1): three sequences, one empty; heads split, every sequence whole.
    cu = jnp.asarray([0, 7, 7, 20], jnp.int32)
    q, k, v, g, init = _gla_inputs(1, 20, 4, 3, False)
    act = P(None, None, "heads")
    _check(_gla_loss(backend, False, cu), (q, k, v, g, init), (act, act, act, act, P(None, "heads")))


# ----------------------------------------------------------------------------- linear recurrence


@functools.cache
def _stand_in_recurrence(reverse: bool):
    """The kernels' shell around the XLA reference; the backward rebuilds x from h."""
    def forward(x, a, h0):
        return _opaque(xla_lr.linear_recurrence(_opaque(x), a, h0, reverse=reverse))

    def backward(g, a, h, h0):
        h_prev = xla_lr.shift_in(h, h0, reverse=reverse)
        x = h - a * h_prev  # the inputs that gave h
        if h0 is None:
            dx, da = jax.vjp(lambda x, a: xla_lr.linear_recurrence(x, a, None, reverse=reverse), x, a)[1](g)
            return _opaque(dx), da, None
        dx, da, dh0 = jax.vjp(lambda *xs: xla_lr.linear_recurrence(*xs, reverse=reverse), x, a, h0)[1](g)
        return _opaque(dx), da, dh0

    return with_vjp(forward, backward)


def _recurrence_loss(backend, reverse, with_h0):
    def loss(x, a, h0):
        h0 = h0 if with_h0 else None
        if backend == "stand_in":
            h = _stand_in_recurrence(reverse)(x, a, h0)
        else:
            h = ops.linear_recurrence(x, a, initial_state=h0, reverse=reverse, backend=backend)
        return jnp.sum(jnp.cos(h))
    return loss


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("reverse,with_h0", [(False, True), (True, False)])
def test_linear_recurrence_splits_batch_and_channels(backend, reverse, with_h0):
    x, a, h0 = _rand(6, (4, 13, 24)), jax.nn.sigmoid(_rand(7, (4, 13, 24))), _rand(8, (4, 24))
    _check(_recurrence_loss(backend, reverse, with_h0), (x, a, h0),
           (P("data", None, "heads"), P("data", None, "heads"), P("data", "heads")))


# ----------------------------------------------------------------------------- sparse attention


def _stand_in_sparse():
    def reference(q, k, v, idx, spec):
        return xla_sparse.reference(q, k, v, idx, spec=dataclasses.replace(spec, return_lse=True))

    def forward(q, k, v, idx, *, spec):
        out, lse = reference(_opaque(q), k, v, idx, spec)
        return _opaque(out), lse

    def backward(q, k, v, idx, out, lse, dout, dlse, *, spec):
        return jax.vjp(lambda q, k, v: reference(q, k, v, idx, spec), _opaque(q), k, v)[1]((dout, dlse))

    return differentiable_sparse_attention(forward, backward)


STAND_IN_SPARSE = _stand_in_sparse()


def _sparse_loss(backend):
    def loss(q, k, v, idx):
        if backend == "stand_in":
            spec = SparseAttentionSpec(block_size=16, causal=True, scale=q.shape[3] ** -0.5)
            out, _ = STAND_IN_SPARSE(q, k, v, idx, spec=spec)
        else:
            out = ops.sparse_attention(q, k, v, block_indices=idx, block_size=16, causal=True, backend=backend)
        return jnp.sum(jnp.cos(out.astype(jnp.float32)))
    return loss


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("sharding", ["batch_heads", "heads"])
def test_sparse_attention_splits_batch_and_heads(backend, sharding):
    # GQA: 4 query heads on 2 kv heads, both split over "heads" (each device one group).
    q, k, v = _rand(9, (4, 40, 4, 16)), _rand(10, (4, 40, 2, 16)), _rand(11, (4, 40, 2, 16))
    idx = jnp.asarray(np.random.default_rng(12).integers(-1, 3, (4, 2, 3, 2)), jnp.int32)
    lead = "data" if sharding == "batch_heads" else None
    act = P(lead, None, "heads")
    _check(_sparse_loss(backend), (q, k, v, idx), (act, act, act, P(lead, "heads")))
