"""mean_pool: every runnable backend against the XLA reference, and the math.

On CPU this runs under FORGEAX_INTERPRET=1 (the xla backend; Triton's interpreter in
mean_pool_triton_interpret_test.py); on a GPU it runs the real kernels: `pytest tests/mean_pool_test.py`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import conformance
from forgeax import core as interface
from forgeax import ops
from forgeax.kernels.xla import mean_pool as xla_mean_pool

DTYPES = {"f32": jnp.float32, "bf16": jnp.bfloat16, "f16": jnp.float16}
BACKENDS = conformance.runnable_backends("mean_pool")
_INTERPRETED = interface.current_platform() == "cpu"


def _public(x, lengths, segment_ids, *, backend=None, num_segments=None):
    return ops.mean_pool(x, lengths=lengths, segment_ids=segment_ids, num_segments=num_segments, backend=backend)


def _reference(x, lengths, segment_ids, *, num_segments=None):
    if lengths is None and segment_ids is None:
        lengths = jnp.full((x.shape[0],), x.shape[1], jnp.int32)
    return xla_mean_pool.mean_pool(x, lengths, segment_ids, num_segments=num_segments)


def _case(shape, dtype, mode, seed):
    """(args, kwargs) of one call: 'plain' (no mask), 'lengths' (0, T, beyond T and in between),
    'segments' (S = 6: ids -1 (padding), 0..4 and 7 (out of range: ignored); segment 5 empty)."""
    kx, ks = jax.random.split(jax.random.key(seed))
    b, t, _ = shape
    x = conformance.random_array(kx, shape, DTYPES[dtype])
    if mode == "plain":
        return (x, None, None), {}
    if mode == "lengths":
        choices = jnp.array([0, t, t + 5, max(1, t // 2), 1], jnp.int32)
        return (x, choices[jnp.arange(b) % 5][::-1], None), {}
    ids = jax.random.choice(ks, jnp.array([-1, 0, 1, 2, 3, 4, 7], jnp.int32), (b, t))
    return (x, None, ids), {"num_segments": 6}


# ([B, T, D], dtype, mode): T in {1, 63, 65, 1000}, D not a power of two, each dtype and mode.
CASES = [
    ((2, 1, 24), "f32", "lengths"),
    ((3, 63, 40), "bf16", "segments"),
    ((2, 65, 130), "f32", "plain"),
    ((5, 65, 24), "f16", "lengths"),
    ((2, 1000, 72), "bf16", "lengths"),
    ((2, 1000, 40), "f32", "segments"),
]


@pytest.mark.parametrize("index", range(len(CASES)), ids=lambda i: str(CASES[i]))
@pytest.mark.parametrize("backend", [b for b in BACKENDS if b != "xla"] or ["xla"])
def test_mean_pool_matches_reference(backend, index):
    shape, dtype, mode = CASES[index]
    args, kwargs = _case(shape, dtype, mode, seed=index)
    case = conformance.Case(f"mean_pool{shape}{mode}", _public, _reference, args, kwargs, (0,))
    conformance.assert_conforms(case, backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_lengths_and_segments_give_zeros_and_zero_gradient(backend):
    x = conformance.random_array(jax.random.key(1), (2, 9, 16), jnp.float32)
    ids = jnp.array([[0] * 4 + [2] * 5, [-1] * 9], jnp.int32)  # segment 1 empty; row 1 all padding

    @jax.jit
    def run(x):
        pooled, pull = jax.vjp(lambda x: ops.mean_pool(x, lengths=jnp.array([0, 9]), backend=backend), x)
        packed, pull_packed = jax.vjp(lambda x: ops.mean_pool(x, segment_ids=ids, num_segments=3, backend=backend), x)
        return pooled, pull(jnp.ones_like(pooled))[0], packed, pull_packed(jnp.ones_like(packed))[0]

    pooled, dx, packed, dx_packed = (np.asarray(v) for v in run(x))
    np.testing.assert_array_equal(pooled[0], 0.0)
    np.testing.assert_array_equal(dx[0], 0.0)
    np.testing.assert_allclose(pooled[1], np.asarray(x[1]).mean(0), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(dx[1], np.full((9, 16), 1 / 9), rtol=1e-6)
    np.testing.assert_array_equal(packed[0, 1], 0.0)
    np.testing.assert_array_equal(packed[1], 0.0)
    np.testing.assert_array_equal(dx_packed[1], 0.0)
    np.testing.assert_allclose(dx_packed[0], np.repeat([1 / 4, 1 / 5], [4, 5])[:, None] * np.ones(16), rtol=1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
def test_packed_segments_equal_separate_sequences(backend):
    """Three sequences packed into one row (lengths 5, 11, 3, then padding) pool as each alone."""
    x = conformance.random_array(jax.random.key(2), (1, 23, 40), jnp.float32)
    ids = jnp.array([[0] * 5 + [1] * 11 + [2] * 3 + [-1] * 4], jnp.int32)
    packed = jax.jit(lambda x: ops.mean_pool(x, segment_ids=ids, num_segments=3, backend=backend))(x)
    starts, lengths = [0, 5, 16], [5, 11, 3]
    for s, (start, n) in enumerate(zip(starts, lengths)):
        alone = ops.mean_pool(x[:, start:start + n], backend="xla")
        assert conformance.relative_error(packed[:, s], alone) < 1e-6


def test_bad_inputs_raise_errors_that_name_the_argument():
    x = jnp.ones((2, 5, 4), jnp.float32)
    ids = jnp.zeros((2, 5), jnp.int32)
    cases = [
        (lambda: ops.mean_pool(x[0]), ValueError, "x"),
        (lambda: ops.mean_pool(x.astype(jnp.int32)), TypeError, "x"),
        (lambda: ops.mean_pool(x, lengths=jnp.ones((3,), jnp.int32)), ValueError, "lengths"),
        (lambda: ops.mean_pool(x, lengths=jnp.ones((2,), jnp.float32)), TypeError, "lengths"),
        (lambda: ops.mean_pool(x, lengths=[1, 2]), TypeError, "lengths"),
        (lambda: ops.mean_pool(x, segment_ids=ids), ValueError, "num_segments"),
        (lambda: ops.mean_pool(x, segment_ids=ids, num_segments=0), ValueError, "num_segments"),
        (lambda: ops.mean_pool(x, segment_ids=ids, num_segments=2.0), TypeError, "num_segments"),
        (lambda: ops.mean_pool(x, num_segments=2), ValueError, "num_segments"),
        (lambda: ops.mean_pool(x, segment_ids=ids[:, :4], num_segments=2), ValueError, "segment_ids"),
        (lambda: ops.mean_pool(x, segment_ids=ids.astype(jnp.float32), num_segments=2), TypeError, "segment_ids"),
        (lambda: ops.mean_pool(x, segment_ids=ids, lengths=jnp.ones((2,), jnp.int32), num_segments=2), ValueError,
         "segment_ids"),
        (lambda: ops.mean_pool(x, backend="cuda"), ValueError, "backend"),
    ]
    for call, error, name in cases:
        with pytest.raises(error, match=rf"^{name}:"):
            call()
