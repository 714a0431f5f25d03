"""add_rms_norm: every runnable backend against the XLA reference.

On CPU this runs under FORGEAX_INTERPRET=1 (the Mosaic TPU interpreter; Triton's interpreter in
add_rms_norm_triton_interpret_test.py); on a GPU the real kernels: `pytest tests/add_rms_norm_test.py`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import conformance
from forgeax import core as interface
from forgeax import ops
from forgeax.kernels.xla import add_rms_norm as reference

DTYPES = {"f32": jnp.float32, "bf16": jnp.bfloat16, "f16": jnp.float16}
EPS = 1e-5
BACKENDS = conformance.runnable_backends("add_rms_norm")

# (shape, dtype): one short row, D not a power of two, many rows of a real model width (bf16
# only in the interpreters), a head-sized row, odd D, leading axes.
CASES = [((1, 7), "f32"), ((3, 5, 1000), "bf16"), ((3, 5, 1000), "f32"), ((257, 4096), "bf16"), ((2, 3, 128), "f16"),
         ((33, 96), "f32"), ((5, 3000), "bf16"), ((4, 17, 80), "f16")]


def _inputs(shape, dtype, seed):
    kx, kr, ks = jax.random.split(jax.random.key(seed), 3)
    x = conformance.random_array(kx, shape, dtype, scale=0.5)
    residual = conformance.random_array(kr, shape, dtype, scale=2.0, mean=0.5)
    scale = conformance.random_array(ks, shape[-1:], jnp.float32, mean=1.0, scale=0.5)
    return x, residual, scale


def _stacked(x, residual, scale, *, backend=None, **kwargs):
    """(normed, s) as one array (the harness compares one output; its cotangent reaches both)."""
    return jnp.stack(ops.add_rms_norm(x, residual, scale, backend=backend, **kwargs))


def _stacked_reference(x, residual, scale, **kwargs):
    return jnp.stack(reference.add_rms_norm(x, residual, scale, **kwargs))


@pytest.mark.parametrize("shape,dtype", CASES, ids=str)
@pytest.mark.parametrize("backend", BACKENDS)
def test_add_rms_norm_matches_reference(backend, shape, dtype):
    x, residual, scale = _inputs(shape, DTYPES[dtype], seed=hash((shape, dtype)) % 1000)
    case = conformance.Case(f"add_rms_norm{shape}", _stacked, _stacked_reference, (x, residual, scale), {"eps": EPS}, (0, 1, 2))
    conformance.assert_conforms(case, backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_sum_is_the_plain_add_and_normed_is_rms_norm_of_it(backend):
    for dtype in (jnp.float32, jnp.bfloat16):
        x, residual, scale = _inputs((6, 384), dtype, seed=3)
        normed, s = ops.add_rms_norm(x, residual, scale, eps=EPS, backend=backend)
        np.testing.assert_array_equal(np.asarray(s), np.asarray(x + residual))
        want = ops.rms_norm(x + residual, scale, eps=EPS, backend="xla")
        assert conformance.relative_error(normed, want) < conformance.TOLERANCE[jnp.dtype(dtype)] / 10


@pytest.mark.parametrize("backend", BACKENDS)
def test_zero_rows_stay_finite(backend):
    x, residual, scale = _inputs((8, 256), jnp.float32, seed=4)
    residual = residual.at[3].set(-x[3])
    normed, s = ops.add_rms_norm(x, residual, scale, eps=EPS, backend=backend)
    assert bool(jnp.all(normed[3] == 0)) and bool(jnp.all(jnp.isfinite(normed)))
    grads = jax.grad(lambda x, r: jnp.sum(ops.add_rms_norm(x, r, scale, eps=EPS, backend=backend)[0] ** 2), argnums=(0, 1))(x, residual)
    assert all(bool(jnp.all(jnp.isfinite(g))) for g in grads)


@pytest.mark.parametrize("backend", BACKENDS)
def test_every_candidate_config_matches_reference(backend):
    impl = interface.OPS["add_rms_norm"].implementation(backend)
    if impl.candidate_configs is None:
        pytest.skip(f"{backend} has no configs")
    x, residual, scale = _inputs((40, 256), jnp.float32, seed=5)
    ct = conformance.random_array(jax.random.key(6), (2, 40, 256), jnp.float32)
    want = jax.vjp(functools.partial(_stacked_reference, eps=EPS), x, residual, scale)[1](ct)
    for config in impl.candidate_configs(x, residual, scale, eps=EPS):
        got = jax.vjp(functools.partial(_stacked, eps=EPS, backend=backend, config=config), x, residual, scale)[1](ct)
        for g, w in zip(got, want):
            assert conformance.relative_error(g, w) < 1e-5, config


@pytest.mark.parametrize("backend", BACKENDS)
def test_vmap_and_jit_match_reference(backend):
    x, residual, scale = _inputs((3, 4, 256), jnp.float32, seed=7)
    ct = conformance.random_array(jax.random.key(8), (2, 4, 256), jnp.float32)

    def loss(fn, x, r, s):
        return jnp.sum(fn(x, r, s) * ct)

    ours = functools.partial(_stacked, eps=EPS, backend=backend)
    ref = functools.partial(_stacked_reference, eps=EPS)
    for in_axes in ((0, 0, None), (0, 0, 0)):
        scales = scale if in_axes[2] is None else jnp.stack([scale, scale * 2, scale - 1])
        got = jax.jit(jax.vmap(jax.grad(functools.partial(loss, ours), argnums=(0, 1, 2)), in_axes=in_axes))(x, residual, scales)
        want = jax.vmap(jax.grad(functools.partial(loss, ref), argnums=(0, 1, 2)), in_axes=in_axes)(x, residual, scales)
        for g, w in zip(got, want):
            assert conformance.relative_error(g, w) < 1e-5, in_axes


def test_bad_inputs_raise_errors_that_name_the_argument():
    x = jnp.ones((4, 8), jnp.float32) * jnp.arange(8.0)
    scale = jnp.ones((8,))
    cases = [
        (lambda: ops.add_rms_norm(x, x[:3], scale), ValueError, "residual"),
        (lambda: ops.add_rms_norm(x, x.astype(jnp.bfloat16), scale), TypeError, "residual"),
        (lambda: ops.add_rms_norm(x, x.astype(jnp.int32), scale), TypeError, "residual"),
        (lambda: ops.add_rms_norm(x, x, jnp.ones((7,))), ValueError, "scale"),
        (lambda: ops.add_rms_norm(x.astype(jnp.int32), x, scale), TypeError, "x"),
        (lambda: ops.add_rms_norm([[1.0]], x, scale), TypeError, "x"),
        (lambda: ops.add_rms_norm(x, x, scale, eps=0.0), ValueError, "eps"),
        (lambda: ops.add_rms_norm(x, x, scale, backend="cuda"), ValueError, "backend"),
    ]
    for call, error, name in cases:
        with pytest.raises(error, match=rf"^{name}:"):
            call()
