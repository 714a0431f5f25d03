"""linear_recurrence: every runnable backend against the sequential-scan reference, and the math.

On CPU this runs under FORGEAX_INTERPRET=1 (xla, xla_scan and the Mosaic TPU interpreter; Triton's
interpreter in linear_recurrence_triton_interpret_test.py); on a GPU it runs the real kernels on
every case: `pytest tests/linear_recurrence_test.py`.
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
from forgeax.kernels.xla import linear_recurrence as xla_recurrence

DTYPES = {"f32": jnp.float32, "bf16": jnp.bfloat16, "f16": jnp.float16}
BACKENDS = conformance.runnable_backends("linear_recurrence")
_INTERPRETED = interface.current_platform() == "cpu"


def _decays(key, shape, regime: str):
    """a in one regime: 'mixed' uniform in (-1, 1) (signs flip), 'near1' in (0.99, 1) (long
    memory: T = 1000 keeps ~e^-5 of the start), 'near0' in (0, 0.01) (almost memoryless)."""
    u = jax.random.uniform(key, shape, jnp.float32)
    return {"mixed": 2 * u - 1, "near1": 1 - 0.01 * u, "near0": 0.01 * u}[regime]


def _inputs(shape, dtype, regime, with_h0, seed):
    kx, ka, kh = jax.random.split(jax.random.key(seed), 3)
    b, _, d = shape
    x = conformance.random_array(kx, shape, dtype)
    a = _decays(ka, shape, regime).astype(dtype)
    h0 = conformance.random_array(kh, (b, d), jnp.float32) if with_h0 else None
    return x, a, h0


def _public(x, a, h0, *, backend=None, **options):
    return ops.linear_recurrence(x, a, initial_state=h0, backend=backend, **options)


def _reference(x, a, h0, config=None, **options):
    del config  # the kernel's config, not the reference's
    return xla_recurrence.linear_recurrence(x, a, h0, **options)


# ([B, T, D], dtype, reverse, initial_state, a regime): T in {1, 63, 65, 1000}, D not a power of
# two (40, 130, 24), each dtype, both directions, with and without h0, every regime.
CASES = [
    ((2, 1, 40), "f32", False, True, "mixed"),
    ((2, 63, 40), "bf16", True, True, "near1"),
    ((1, 65, 130), "f32", False, False, "near0"),
    ((2, 65, 24), "f16", True, False, "mixed"),
    ((1, 1000, 16), "f32", False, True, "near1"),
    ((1, 1000, 8), "bf16", True, True, "mixed"),
]
# On CPU (CI time: compiles and interpreters) each backend takes a subset that still covers both
# directions, h0 and T = 1000; on a GPU every backend runs every case.
CPU_CASES = {"xla_scan": {0, 1, 2, 3, 5}, "triton": {0, 1, 2}, "pallas_tpu": {1, 2}}


@pytest.mark.parametrize("index", range(len(CASES)), ids=lambda i: str(CASES[i]))
@pytest.mark.parametrize("backend", [b for b in BACKENDS if b != "xla"])  # "xla" is the reference itself
def test_linear_recurrence_matches_reference(backend, index):
    shape, dtype, reverse, with_h0, regime = CASES[index]
    if _INTERPRETED and index not in CPU_CASES.get(backend, range(len(CASES))):
        pytest.skip(f"{backend} on CPU: the trimmed case set; every case runs on the GPU")
    x, a, h0 = _inputs(shape, DTYPES[dtype], regime, with_h0, seed=index)
    case = conformance.Case(f"linear_recurrence{shape}{regime}", _public, _reference, (x, a, h0),
                            {"reverse": reverse}, (0, 1, 2) if with_h0 else (0, 1))
    conformance.assert_conforms(case, backend)


@pytest.mark.parametrize("reverse", [False, True])
def test_triton_tree_scan_matches_reference(reverse):
    """The Triton kernel's in-tile tree scan (the GPU's default; the interpreter's default scans
    rows one by one) in the chained schedule over three chunks, the last partial in time and the
    second channel block partial (24 = 16 + 8); small: the interpreter runs a tree scan one
    Python call per element."""
    if "triton" not in BACKENDS:
        pytest.skip("the Triton backend does not run here")
    from forgeax.kernels.triton.linear_recurrence import LinearRecurrenceConfig

    x, a, h0 = _inputs((1, 21, 24), jnp.float32, "mixed", True, seed=17)
    config = LinearRecurrenceConfig(block_t=8, block_d=16, vector=2, tile_scan="tree")
    case = conformance.Case("linear_recurrence tiles", _public, _reference, (x, a, h0),
                            {"reverse": reverse, "config": config}, (0, 1, 2))
    conformance.assert_conforms(case, "triton")


# (schedule, block_t, chunk_tiles, reverse): T = 45 is 6 tiles of 8 or 12 of 4 (the last partial;
# more chunks than the carry ring's 4 slots, or 4 chunks of 3 tiles), D = 24 is two channel
# blocks of 16 (the last partial).
SCHEDULES = [("chained", 8, 1, False), ("chained", 4, 3, True), ("walk", 8, 1, True)]


@pytest.mark.parametrize("schedule,block_t,chunk_tiles,reverse", SCHEDULES, ids=str)
def test_triton_schedules_match_reference(schedule, block_t, chunk_tiles, reverse):
    if "triton" not in BACKENDS:
        pytest.skip("the Triton backend does not run here")
    from forgeax.kernels.triton.linear_recurrence import LinearRecurrenceConfig

    x, a, h0 = _inputs((1, 45, 24), jnp.bfloat16, "near1", True, seed=19)
    config = LinearRecurrenceConfig(block_t=block_t, block_d=16, vector=2, schedule=schedule, chunk_tiles=chunk_tiles,
                                    tile_scan="sequential")
    case = conformance.Case(f"linear_recurrence {schedule}", _public, _reference, (x, a, h0),
                            {"reverse": reverse, "config": config}, (0, 1, 2))
    conformance.assert_conforms(case, "triton")


@pytest.mark.skipif(_INTERPRETED, reason="every candidate config compiled for the GPU")
def test_triton_candidate_configs_match_reference():
    """Every config the autotuner may pick, on an awkward shape, forward and gradients."""
    if "triton" not in BACKENDS:
        pytest.skip("the Triton backend does not run here")
    from forgeax.kernels.triton.linear_recurrence import candidate_configs

    x, a, h0 = _inputs((3, 1000, 300), jnp.bfloat16, "near1", True, seed=23)
    for reverse in (False, True):
        for config in candidate_configs(x, a, h0, reverse=reverse):
            case = conformance.Case(f"linear_recurrence {config}", _public, _reference, (x, a, h0),
                                    {"reverse": reverse, "config": config}, (0, 1, 2))
            conformance.assert_conforms(case, "triton")


def test_triton_config_errors_name_the_field():
    pytest.importorskip("triton")
    from forgeax.kernels.triton.linear_recurrence import LinearRecurrenceConfig

    for field, value in (("block_t", 24), ("vector", 1), ("schedule", "scan"), ("tile_scan", "fast"),
                         ("num_warps", 3), ("chunk_tiles", 0)):
        with pytest.raises(ValueError, match=rf"LinearRecurrenceConfig\.{field}:"):
            LinearRecurrenceConfig(**{"block_t": 16, "block_d": 16, field: value})


@pytest.mark.skipif(_INTERPRETED, reason="the GPU's larger shapes")
@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("backend", BACKENDS)
def test_linear_recurrence_large_matches_reference(backend, reverse):
    x, a, h0 = _inputs((3, 4097, 1000), jnp.bfloat16, "near1", True, seed=7)
    case = conformance.Case("linear_recurrence large", _public, _reference, (x, a, h0), {"reverse": reverse}, (0, 1, 2))
    conformance.assert_conforms(case, backend)


@pytest.mark.parametrize("backend", [b for b in BACKENDS if b != "xla"])
def test_zero_decay_is_the_input_with_finite_gradients(backend):
    """a = 0: h = x exactly (no 0 * inf, no NaN), dx = g, da = g * h_{t-1}, dh0 = 0."""
    x, _, h0 = _inputs((2, 17, 24), jnp.float32, "mixed", True, seed=3)
    a = jnp.zeros_like(x)
    g = conformance.random_array(jax.random.key(9), x.shape, jnp.float32)
    def run(x, a, h0):
        h, pull = jax.vjp(lambda x, a, h0: _public(x, a, h0, backend=backend), x, a, h0)
        return (h,) + pull(g)

    h, dx, da, dh0 = jax.jit(run)(x, a, h0)
    np.testing.assert_array_equal(np.asarray(h), np.asarray(x))
    np.testing.assert_array_equal(np.asarray(dx), np.asarray(g))
    h_prev = jnp.concatenate([h0[:, None], x[:, :-1]], axis=1)
    np.testing.assert_allclose(np.asarray(da), np.asarray(g * h_prev), rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(dh0), np.zeros_like(np.asarray(dh0)))


@pytest.mark.parametrize("backend", BACKENDS)
def test_final_state_chains_chunks(backend):
    if _INTERPRETED and backend == "pallas_tpu":
        pytest.skip("Mosaic TPU interpreter: initial_state and reverse are covered by the conformance cases")
    """Running [0, 40) then [40, 65) from the first chunk's final state equals one run over 65,
    both directions (reverse chains the later chunk first)."""
    x, a, _ = _inputs((2, 65, 24), jnp.float32, "near1", False, seed=5)

    @functools.partial(jax.jit, static_argnums=2)
    def chain(x, a, reverse):
        run = functools.partial(ops.linear_recurrence, reverse=reverse, return_final_state=True, backend=backend)
        whole, final = run(x, a)
        first, second = (slice(40, None), slice(None, 40)) if reverse else (slice(None, 40), slice(40, None))
        h1, s1 = run(x[:, first], a[:, first])
        h2, s2 = run(x[:, second], a[:, second], initial_state=s1)
        return whole, final, jnp.concatenate([h2, h1] if reverse else [h1, h2], axis=1), s2

    for reverse in (False, True):
        whole, final, chained, chained_final = chain(x, a, reverse)
        assert conformance.relative_error(chained, whole) < 1e-6
        assert conformance.relative_error(chained_final, final) < 1e-6


def test_reference_is_the_textbook_loop():
    """The reference against a plain numpy loop in float64, both directions."""
    x, a, h0 = _inputs((2, 9, 5), jnp.float32, "mixed", True, seed=11)
    xn, an, hn = (np.asarray(v, np.float64) for v in (x, a, h0))
    for reverse in (False, True):
        want, h = np.zeros_like(xn), hn.copy()
        for t in (range(8, -1, -1) if reverse else range(9)):
            h = an[:, t] * h + xn[:, t]
            want[:, t] = h
        got = ops.linear_recurrence(x, a, initial_state=h0, reverse=reverse, backend="xla")
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("backend", [b for b in BACKENDS if b != "xla"])
def test_vmap_matches_reference(backend):
    x, a, h0 = _inputs((3, 17, 24), jnp.float32, "mixed", True, seed=13)
    xs = x[None].repeat(2, 0) * jnp.array([1.0, -0.5])[:, None, None, None]
    as_, hs = a[None].repeat(2, 0), h0[None].repeat(2, 0)
    got = jax.jit(jax.vmap(lambda x, a, h: _public(x, a, h, backend=backend)))(xs, as_, hs)
    want = jax.jit(jax.vmap(lambda x, a, h: _reference(x, a, h)))(xs, as_, hs)
    assert conformance.relative_error(got, want) < 1e-5


def test_bad_inputs_raise_errors_that_name_the_argument():
    x = jnp.ones((2, 5, 4), jnp.float32)
    cases = [
        (lambda: ops.linear_recurrence(x[0], x[0]), ValueError, "x"),
        (lambda: ops.linear_recurrence(x.astype(jnp.int32), x), TypeError, "x"),
        (lambda: ops.linear_recurrence([1.0], x), TypeError, "x"),
        (lambda: ops.linear_recurrence(x, x[:, :4]), ValueError, "a"),
        (lambda: ops.linear_recurrence(x, x.astype(jnp.int8)), TypeError, "a"),
        (lambda: ops.linear_recurrence(x, x, initial_state=x), ValueError, "initial_state"),
        (lambda: ops.linear_recurrence(x, x, initial_state=jnp.ones((2, 5))), ValueError, "initial_state"),
        (lambda: ops.linear_recurrence(x, x, initial_state=jnp.ones((2, 4), jnp.int32)), TypeError, "initial_state"),
        (lambda: ops.linear_recurrence(x, x, reverse=1), TypeError, "reverse"),
        (lambda: ops.linear_recurrence(x, x, return_final_state="yes"), TypeError, "return_final_state"),
        (lambda: ops.linear_recurrence(x, x, backend="cuda"), ValueError, "backend"),
    ]
    for call, error, name in cases:
        with pytest.raises(error, match=rf"^{name}:"):
            call()
