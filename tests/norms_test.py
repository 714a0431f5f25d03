"""rms_norm / layer_norm: every runnable backend against the XLA reference.

On CPU this runs under FORGEAX_INTERPRET=1 (Pallas interpreters; the Triton
interpreter in its own target with TRITON_INTERPRET=1); on a GPU it runs the
real kernels: `pytest tests/norms_test.py` against the installed wheel.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import conformance
from forgeax import ops
from forgeax.kernels.xla import norms as reference
from forgeax import core as interface

DTYPES = {"f32": jnp.float32, "bf16": jnp.bfloat16, "f16": jnp.float16}
# Awkward shapes: a single short row, D not a power of two, many rows of a
# real model width, a tiny head-sized row; plus odd D for masked tails.
SHAPES = [(1, 7), (3, 5, 1000), (257, 4096), (2, 3, 128), (33, 96), (5, 3000)]
EPS = 1e-5

# The Mosaic GPU interpreter costs milliseconds per memory operation: on CPU it
# gets the small shapes only (its full sweep runs on the GPU).
INTERPRET_MAX_ELEMENTS = {"pallas_gpu": 16 * 4096}
ORDERED_EFFECT_INTERPRETERS = ("pallas_gpu", "pallas_tpu")

RMS_BACKENDS = conformance.runnable_backends("rms_norm")
LN_BACKENDS = conformance.runnable_backends("layer_norm")


# In the CPU interpreters, shapes above this many elements run in bf16 only
# (f32 and f16 are covered by every smaller shape; the GPU runs them all).
INTERPRET_LARGE_ELEMENTS = 1 << 18


def _skip_if_too_slow_here(backend: str, shape: tuple[int, ...], dtype: str) -> None:
    if interface.current_platform() != "cpu" or backend == "xla":
        return
    limit = INTERPRET_MAX_ELEMENTS.get(backend)
    if limit and np.prod(shape) > limit:
        pytest.skip(f"{backend} interpreter: {shape} is too slow on CPU; run on the GPU")
    if np.prod(shape) > INTERPRET_LARGE_ELEMENTS and dtype != "bf16":
        pytest.skip(f"{backend} interpreter: {shape} runs in bf16 only on CPU; {dtype} is covered at smaller shapes")


def _inputs(shape, dtype, seed, *, x_mean=0.0):
    kx, ks, ko = jax.random.split(jax.random.key(seed), 3)
    d = shape[-1]
    x = conformance.random_array(kx, shape, dtype, scale=2.0, mean=x_mean)
    scale = conformance.random_array(ks, (d,), jnp.float32, mean=1.0, scale=0.5)
    offset = conformance.random_array(ko, (d,), jnp.float32, scale=0.5)
    return x, scale, offset


def _rms_case(shape, dtype, seed=0, **kw):
    x, scale, _ = _inputs(shape, dtype, seed, **kw)
    return conformance.Case(f"rms_norm{shape}", ops.rms_norm, reference.rms_norm, (x, scale), {"eps": EPS}, (0, 1))


def _ln_case(shape, dtype, with_offset, seed=0, **kw):
    x, scale, offset = _inputs(shape, dtype, seed, **kw)
    args = (x, scale, offset if with_offset else None)
    diff = (0, 1, 2) if with_offset else (0, 1)
    return conformance.Case(f"layer_norm{shape}", ops.layer_norm, reference.layer_norm, args, {"eps": EPS}, diff)


def _supported(op, case, backend):
    impl = interface.OPS[op].implementation(backend)
    reason = impl.supports(*case.args, **case.kwargs)
    if reason is not None:
        pytest.skip(f"{backend} does not support {case.name} ({reason}); selection falls back")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("backend", RMS_BACKENDS)
def test_rms_norm_matches_reference(backend, shape, dtype):
    _skip_if_too_slow_here(backend, shape, dtype)
    case = _rms_case(shape, DTYPES[dtype], seed=hash((shape, dtype)) % 1000)
    _supported("rms_norm", case, backend)
    conformance.assert_conforms(case, backend)


@pytest.mark.parametrize("with_offset", [True, False], ids=["offset", "no_offset"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("backend", LN_BACKENDS)
def test_layer_norm_matches_reference(backend, shape, dtype, with_offset):
    _skip_if_too_slow_here(backend, shape, dtype)
    # A non-zero mean makes the centring matter (a kernel that skipped it would fail).
    case = _ln_case(shape, DTYPES[dtype], with_offset, seed=hash((shape, dtype, with_offset)) % 1000, x_mean=3.0)
    _supported("layer_norm", case, backend)
    conformance.assert_conforms(case, backend)


@pytest.mark.parametrize("backend", RMS_BACKENDS)
def test_f16_input_whose_square_overflows_f16_stays_finite(backend):
    # x ~ 300: x*x = 9e4 > f16 max (65504). Statistics in f32 keep this finite.
    x, scale, offset = _inputs((4, 256), jnp.float16, seed=3)
    x = (x.astype(jnp.float32) * 150.0).astype(jnp.float16)
    for fn, ref, args in ((ops.rms_norm, reference.rms_norm, (x, scale)), (ops.layer_norm, reference.layer_norm, (x, scale, offset))):
        out = fn(*args, eps=EPS, backend=backend)
        assert bool(jnp.all(jnp.isfinite(out)))
        assert conformance.relative_error(out, ref(*[a.astype(jnp.float32) for a in args], eps=EPS)) < 2e-3


@pytest.mark.parametrize("backend", RMS_BACKENDS)
def test_zero_rows_give_zero_output_and_finite_gradient(backend):
    x, scale, offset = _inputs((8, 256), jnp.float32, seed=4)
    x = x.at[3].set(0.0)
    y = ops.rms_norm(x, scale, eps=EPS, backend=backend)
    assert bool(jnp.all(y[3] == 0)) and bool(jnp.all(jnp.isfinite(y)))
    g = jax.grad(lambda x: jnp.sum(ops.layer_norm(x, scale, offset, eps=EPS, backend=backend) ** 2))(x)
    assert bool(jnp.all(jnp.isfinite(g)))


@pytest.mark.parametrize("backend", RMS_BACKENDS)
def test_vmap_jit_checkpoint_match_reference(backend):
    x, scale, offset = _inputs((3, 4, 256), jnp.float32, seed=5)
    cot = conformance.random_array(jax.random.key(9), x.shape, jnp.float32)

    def loss(norm, x, scale, offset):
        return jnp.sum(norm(x, scale, offset) * cot[0])

    ours = functools.partial(ops.layer_norm, eps=EPS, backend=backend)
    ref = functools.partial(reference.layer_norm, eps=EPS)
    # The Pallas Mosaic interpreters run through ordered io_callbacks, which
    # jax.checkpoint cannot differentiate; the real kernel has no effects.
    if not (backend in ORDERED_EFFECT_INTERPRETERS and interface.current_platform() == "cpu"):
        ours = jax.checkpoint(ours)
    for in_axes in ((0, None, None), (0, 0, None)):
        scales = scale if in_axes[1] is None else jnp.stack([scale, scale * 2, scale - 1])
        got = jax.jit(jax.vmap(jax.grad(functools.partial(loss, ours), argnums=(0, 1, 2)), in_axes=in_axes))(x, scales, offset)
        want = jax.vmap(jax.grad(functools.partial(loss, ref), argnums=(0, 1, 2)), in_axes=in_axes)(x, scales, offset)
        for g, w in zip(got, want):
            assert conformance.relative_error(g, w) < 1e-5, in_axes
    y = jax.vmap(lambda r: ops.rms_norm(r, scale, eps=EPS, backend=backend))(x)
    assert conformance.relative_error(y, reference.rms_norm(x, scale, eps=EPS)) < 1e-5


# ---------------------------------------------------------------- bad input: each error names the argument


def test_bad_inputs_raise_errors_that_name_the_argument():
    x = jnp.ones((4, 8), jnp.float32) * jnp.arange(8.0)
    scale = jnp.ones((8,))
    cases = [
        (lambda: ops.rms_norm(x, jnp.ones((7,))), ValueError, "scale"),
        (lambda: ops.rms_norm(x, jnp.ones((8, 1))), ValueError, "scale"),
        (lambda: ops.layer_norm(x, scale, jnp.ones((9,))), ValueError, "offset"),
        (lambda: ops.rms_norm(x.astype(jnp.int32), scale), TypeError, "x"),
        (lambda: ops.rms_norm(jnp.float32(1.0), jnp.ones((1,))), ValueError, "x"),
        (lambda: ops.rms_norm([[1.0]], scale), TypeError, "x"),
        (lambda: ops.rms_norm(x, scale, eps=0.0), ValueError, "eps"),
        (lambda: ops.layer_norm(x, scale, eps=-1e-5), ValueError, "eps"),
        (lambda: ops.rms_norm(x, scale, eps="small"), TypeError, "eps"),
        (lambda: ops.rms_norm(x, scale, backend="cuda"), ValueError, "backend"),
    ]
    for call, error, name in cases:
        with pytest.raises(error, match=rf"^{name}:"):
            call()


def test_explicit_backend_that_cannot_run_raises_unsupported_with_reason():
    x = jnp.ones((4, 8))
    conformance.assert_pallas_tpu_unsupported(lambda: ops.rms_norm(x, jnp.ones((8,)), backend="pallas_tpu"))


# ---------------------------------------------------------------- Triton launch configs


@pytest.mark.skipif("triton" not in LN_BACKENDS, reason="triton not runnable here")
def test_triton_explicit_config_matches_reference():
    """A TritonNormConfig other than the heuristic's (small tiles, several backward programs each
    looping over row tiles, no prefetch) reaches the kernels and still matches the reference,
    forward and gradients; `resolve_config` returns it as passed."""
    from forgeax.kernels.triton import norms as triton_norms

    x, scale, offset = _inputs((37, 200), jnp.float32, seed=3)
    config = triton_norms.TritonNormConfig(fwd_block_rows=4, fwd_num_warps=2, bwd_block_rows=2, bwd_num_warps=2,
                                           bwd_programs_per_sm=1, bwd_num_stages=1, bwd_prefetch=False)
    assert config != triton_norms.heuristic_config(x, scale, offset, eps=EPS)
    impl = interface.OPS["layer_norm"].implementation("triton")
    assert impl.resolve_config((x, scale, offset), {"eps": EPS}, config, "cpu") == (config, "explicit")

    def public(x, scale, offset, *, eps, backend):
        del backend
        return triton_norms.layer_norm(x, scale, offset, eps=eps, config=config)

    case = conformance.Case("layer_norm(37, 200)", public, reference.layer_norm, (x, scale, offset), {"eps": EPS},
                            (0, 1, 2))
    conformance.assert_conforms(case, "triton")


def test_triton_config_errors_name_the_field():
    pytest.importorskip("triton")
    from forgeax.kernels.triton import norms as triton_norms

    base = triton_norms.default_config(4096, 4096, jnp.bfloat16)
    for field, value in (("fwd_block_rows", 3), ("bwd_num_warps", 3), ("bwd_programs_per_sm", 0),
                         ("bwd_num_stages", 0), ("bwd_prefetch", 1)):
        with pytest.raises(ValueError, match=rf"TritonNormConfig\.{field}:"):
            base.replace(**{field: value})
    with pytest.raises(TypeError):
        triton_norms.TritonNormConfig(1, 1, 1, 1, 1)  # keyword-only
    assert triton_norms.TritonNormConfig.from_dict(base.to_dict()) == base
    x = jax.ShapeDtypeStruct((8, 512, 4096), jnp.bfloat16)
    p = jax.ShapeDtypeStruct((4096,), jnp.bfloat16)
    candidates = triton_norms.candidate_configs(x, p, eps=EPS)
    assert candidates[0] == triton_norms.heuristic_config(x, p, eps=EPS) == base
    assert len(set(candidates)) == len(candidates) > 4
