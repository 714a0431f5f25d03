"""gated_linear_attention / lightning_attention: every runnable backend against the recurrence.

The reference is backend "xla": the recurrence S_t = diag(exp(g_t)) S_{t-1} + k_t^T v_t as a
scan over T in f32; its autodiff is the gradient oracle (for q, k, v, g, the initial state, and
through the final state). On CPU this runs under FORGEAX_INTERPRET=1 (the Mosaic TPU
interpreter; Triton's interpreter in gated_linear_attention_triton_interpret_test.py); on a GPU
it runs the real kernels: `pytest tests/gated_linear_attention_test.py`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import conformance
from forgeax import core as interface
from forgeax import ops

BACKENDS = conformance.runnable_backends("gated_linear_attention")
LIGHTNING_BACKENDS = conformance.runnable_backends("lightning_attention")
DTYPES = {"f32": jnp.float32, "bf16": jnp.bfloat16}
_ON_CPU = interface.current_platform() == "cpu"


def _interpreted(backend: str) -> bool:
    return _ON_CPU and backend not in ("xla", "xla_chunked")


def _inputs(b, t, n, kd, vd, dtype, seed, *, gate_scale=1.0, seqs=None):
    keys = jax.random.split(jax.random.key(seed), 5)
    q, k = (conformance.random_array(x, (b, t, n, kd), dtype) for x in keys[:2])
    v = conformance.random_array(keys[2], (b, t, n, vd), dtype)
    # log(sigmoid(x)) gates: decays from ~0.05 to ~1, some close to 1 (long memory).
    g = jax.nn.log_sigmoid(gate_scale * (2.0 + 2.0 * jax.random.normal(keys[3], (b, t, n, kd)))).astype(dtype)
    init = conformance.random_array(keys[4], (seqs or b, n, kd, vd), jnp.float32, scale=0.5)
    return q, k, v, g, init


def _flat(o, final):
    """One array for the harness: o (upcast) and the final state, so both carry a cotangent."""
    return jnp.concatenate([o.astype(jnp.float32).ravel(), final.ravel()])


def _gla(q, k, v, g, init, cu_seqlens=None, *, backend=None, **options):
    o, final = ops.gated_linear_attention(q, k, v, g, initial_state=init, cu_seqlens=cu_seqlens, return_final_state=True,
                                          backend=backend, **options)
    return _flat(o, final)


def _gla_reference(q, k, v, g, init, cu_seqlens=None, **options):
    return _gla(q, k, v, g, init, cu_seqlens, backend="xla", **options)


def _case(name, args, options, dtype, diff=(0, 1, 2, 3, 4), public=_gla, reference=_gla_reference):
    tol = conformance.TOLERANCE[jnp.dtype(dtype)]
    return conformance.Case(name, public, reference, args, options, diff, output_dtype=jnp.float32, forward_tolerance=tol)


# (B, T, N, K, V, chunk_size, dtype, with initial state): T = 1, 63, 65 around the chunk sizes
# 16 and 64; V != K; T = 1000 for xla_chunked only.
CASES = [
    (2, 1, 2, 16, 16, 16, "f32", True),
    (1, 63, 2, 16, 32, 16, "bf16", True),
    (1, 65, 1, 32, 16, 64, "f32", False),
    (1, 63, 1, 16, 16, 64, "bf16", True),
    (1, 1000, 2, 16, 8, 64, "f32", True),
]


def _skip_reference(backend: str) -> None:
    if backend == "xla":
        pytest.skip("xla is the reference: compared with itself it checks nothing")


@pytest.mark.parametrize("case", CASES, ids=str)
@pytest.mark.parametrize("backend", BACKENDS)
def test_gla_matches_recurrence(backend, case):
    _skip_reference(backend)
    b, t, n, kd, vd, chunk, dtype, with_init = case
    if _interpreted(backend) and case not in CASES[1:3]:
        pytest.skip(f"{backend} interpreter: the CPU run keeps to two cases (one token: the packed test); run on the GPU")
    q, k, v, g, init = _inputs(b, t, n, kd, vd, DTYPES[dtype], seed=t + chunk + kd)
    args = (q, k, v, g, init if with_init else None)
    diff = (0, 1, 2, 3, 4) if with_init else (0, 1, 2, 3)
    conformance.assert_conforms(_case(f"gla{case[:5]}", args, {"chunk_size": chunk}, DTYPES[dtype], diff), backend)


def _packed():
    # Lengths 10, 0 (empty), 30, 1, 37: boundaries inside chunks, an empty sequence, one token.
    lengths = [10, 0, 30, 1, 37]
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(lengths)]), jnp.int32)
    return (*_inputs(1, int(cu[-1]), 2, 16, 16, jnp.float32, seed=5, seqs=len(lengths)), cu)


def test_gla_reference_packed_sequences_equal_separate_calls():
    q, k, v, g, init, cu = _packed()
    o, final = ops.gated_linear_attention(q, k, v, g, initial_state=init, cu_seqlens=cu, return_final_state=True,
                                          backend="xla")
    for i, (start, end) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        if start == end:
            np.testing.assert_array_equal(np.asarray(final[i]), np.asarray(init[i]))  # empty: the state passes through
            continue
        one = lambda x: x[:, start:end]  # noqa: E731
        o_i, final_i = ops.gated_linear_attention(one(q), one(k), one(v), one(g), initial_state=init[i:i + 1],
                                                  return_final_state=True, backend="xla")
        assert conformance.relative_error(o[:, start:end], o_i) < 1e-6, i
        assert conformance.relative_error(final[i], final_i[0]) < 1e-6, i


@pytest.mark.parametrize("backend", BACKENDS)
def test_gla_packed_sequences_match_the_reference(backend):
    # The reference's packing equals separate calls (above): matching it, forward and gradients
    # (initial states and final states of every sequence included), is matching separate calls.
    _skip_reference(backend)
    conformance.assert_conforms(_case("gla packed", _packed(), {"chunk_size": 16}, jnp.float32), backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_gla_decoding_steps_continue_the_chunked_prefill(backend):
    if _interpreted(backend):
        pytest.skip(f"{backend} interpreter: its final states are checked by the conformance cases; run on the GPU")
    q, k, v, g, init = _inputs(2, 21, 2, 16, 16, jnp.float32, seed=7)
    prefix = 17
    o, final = ops.gated_linear_attention(q, k, v, g, initial_state=init, return_final_state=True, chunk_size=16,
                                          backend=backend)
    _, state = ops.gated_linear_attention(q[:, :prefix], k[:, :prefix], v[:, :prefix], g[:, :prefix], initial_state=init,
                                          return_final_state=True, chunk_size=16, backend=backend)
    for t in range(prefix, 21):
        o_t, state = ops.gated_linear_attention_step(q[:, t], k[:, t], v[:, t], g[:, t], state)
        assert conformance.relative_error(o_t, o[:, t]) < 1e-5, t
    assert conformance.relative_error(state, final) < 1e-5


@pytest.mark.parametrize("backend", BACKENDS)
def test_gla_strongly_negative_gates_stay_finite(backend):
    # Gates of -50 at one step in four, else the usual log-sigmoid gates (some 0): the state
    # forgets everything at those steps and remembers between them (runs that cross 16-row
    # blocks); exp of running gate sums like +50 * 8 would overflow if any backend took them.
    # Chunks of 32 (the Triton kernels' exact path then has an off-diagonal 16-row block pair).
    _skip_reference(backend)
    q, k, v, g, init = _inputs(1, 70, 2, 16, 16, jnp.float32, seed=9)
    g = jnp.where(jax.random.bernoulli(jax.random.key(3), 0.25, g.shape), -50.0, g)
    g = jnp.where(jax.random.bernoulli(jax.random.key(4), 0.1, g.shape), 0.0, g)
    conformance.assert_conforms(_case("gla g=-50", (q, k, v, g, init), {"chunk_size": 32}, jnp.float32), backend)


def _lightning(q, k, v, decay, init, *, backend=None, **options):
    o, final = ops.lightning_attention(q, k, v, decay=decay, initial_state=init, return_final_state=True,
                                       backend=backend, **options)
    return _flat(o, final)


def _lightning_reference(q, k, v, decay, init, **options):
    return _lightning(q, k, v, decay, init, backend="xla", **options)


@pytest.mark.parametrize("backend", LIGHTNING_BACKENDS)
def test_lightning_matches_recurrence_with_decay_gradient(backend):
    q, k, v, _, init = _inputs(1, 20, 3, 16, 16, jnp.float32, seed=13)
    decay = jnp.asarray([0.01, 0.3, 2.0], jnp.float32)  # slow, medium, fast forgetting heads
    if backend != "xla" and not _interpreted(backend):  # interpreters: the forward below (dg is tested above)
        case = _case("lightning", (q, k, v, decay, init), {"chunk_size": 16}, jnp.float32, public=_lightning,
                     reference=_lightning_reference)
        conformance.assert_conforms(case, backend)
    want = ops.gated_linear_attention(q, k, v, jnp.broadcast_to(-decay[:, None], q.shape), initial_state=init, backend="xla")
    got = ops.lightning_attention(q, k, v, decay=decay, initial_state=init, backend=backend)
    assert conformance.relative_error(got, want) < 1e-5


def test_bad_inputs_name_the_argument():
    q, k, v, g, init = _inputs(1, 8, 2, 16, 16, jnp.float32, seed=1)
    with pytest.raises(ValueError, match="g:"):
        ops.gated_linear_attention(q, k, v, g[:, :4])
    with pytest.raises(ValueError, match="k:"):
        ops.gated_linear_attention(q, k[..., :8], v, g)
    with pytest.raises(TypeError, match="v:"):
        ops.gated_linear_attention(q, k, v.astype(jnp.bfloat16), g)
    with pytest.raises(ValueError, match="chunk_size"):
        ops.gated_linear_attention(q, k, v, g, chunk_size=48)
    with pytest.raises(ValueError, match="initial_state"):
        ops.gated_linear_attention(q, k, v, g, initial_state=init[..., :3])
    with pytest.raises(ValueError, match="cu_seqlens"):
        ops.gated_linear_attention(q, k, v, g, cu_seqlens=jnp.asarray([0, 3, 7], jnp.int32))
    with pytest.raises(TypeError, match="cu_seqlens"):
        ops.gated_linear_attention(q, k, v, g, cu_seqlens=jnp.asarray([0.0, 8.0]))
    with pytest.raises(ValueError, match="cu_seqlens"):
        ops.gated_linear_attention(jnp.concatenate([q, q]), jnp.concatenate([k, k]), jnp.concatenate([v, v]),
                                   jnp.concatenate([g, g]), cu_seqlens=jnp.asarray([0, 8], jnp.int32))
    with pytest.raises(ValueError, match="scale"):
        ops.gated_linear_attention(q, k, v, g, scale=-1.0)
    with pytest.raises(ValueError, match="decay"):
        ops.lightning_attention(q, k, v, decay=jnp.ones((3,)))
    with pytest.raises(ValueError, match="state"):
        ops.gated_linear_attention_step(q[:, 0], k[:, 0], v[:, 0], g[:, 0], init[:, :1])
    with pytest.raises(ValueError, match="backend"):
        ops.gated_linear_attention(q, k, v, g, backend="nope")
