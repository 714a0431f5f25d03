"""rope / rope_qk: every runnable backend against the XLA reference and against the math.

On CPU this runs under FORGEAX_INTERPRET=1 (the Mosaic TPU interpreter; Triton's interpreter
in rope_triton_interpret_test.py); on a GPU it runs the real kernels: `pytest tests/rope_test.py`.
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
from forgeax.kernels.common.rope import RopeSpec, inverse_frequencies

DTYPES = {"f32": jnp.float32, "bf16": jnp.bfloat16, "f16": jnp.float16}
ROPE_BACKENDS = conformance.runnable_backends("rope")
QK_BACKENDS = conformance.runnable_backends("rope_qk")

# [B, T, N, H]: one token; T = 17 with odd N and H = 80 (half 40: not a power of two);
# H = 128 and 64; T = 4097 (the interpreters get it only on the XLA backend).
SHAPES = [(1, 1, 3, 64), (2, 17, 3, 80), (1, 17, 5, 128), (2, 9, 2, 64), (1, 4097, 1, 64)]
OPTIONS = {
    "neox": {},
    "gptj": {"interleaved": True},
    "partial": {"rotary_dim": 32},
    "partial_gptj_llama3": {"rotary_dim": 48, "interleaved": True, "scaling": ops.Llama3Scaling()},
    "llama3_theta": {"theta": 500000.0, "scaling": ops.Llama3Scaling(factor=32.0, original_max_position=2048)},
}
MAX_POSITION = 20000  # past the Llama-3.1 original context, so every scaling band is used


def _slow_here(backend: str, shape) -> bool:
    return interface.current_platform() == "cpu" and backend != "xla" and shape[1] > 1000


def _inputs(shape, dtype, seed, *, k_heads=None, positions_1d=False):
    kx, kk, kp = jax.random.split(jax.random.key(seed), 3)
    b, t, n, h = shape
    x = conformance.random_array(kx, shape, dtype)
    k = conformance.random_array(kk, (b, t, k_heads, h), dtype) if k_heads is not None else None
    positions = jax.random.randint(kp, (t,) if positions_1d else (b, t), 0, MAX_POSITION, jnp.int32)
    return x, k, positions


def _reference_rope(x, positions, **options):
    return ops.rope(x, positions, backend="xla", **options)


def _qk_concat(q, k, positions, *, backend=None, **options):
    """rope_qk as one array (the harness compares one output): rotated q and k along the heads."""
    return jnp.concatenate(ops.rope_qk(q, k, positions, backend=backend, **options), axis=2)


def _qk_reference(q, k, positions, **options):
    return _qk_concat(q, k, positions, backend="xla", **options)


def _options_for(shape, name):
    options = dict(OPTIONS[name])
    if options.get("rotary_dim", 0) > shape[-1]:
        options["rotary_dim"] = shape[-1] // 2 // 2 * 2
    return options


# (shape, options, dtype): every layout and option on awkward shapes, each dtype somewhere.
ROPE_CASES = [
    ((1, 1, 3, 64), "neox", "f32"),
    ((2, 17, 3, 80), "gptj", "bf16"),
    ((2, 17, 3, 80), "partial", "f32"),
    ((1, 17, 5, 128), "partial_gptj_llama3", "bf16"),
    ((2, 9, 2, 64), "llama3_theta", "f32"),
    ((1, 17, 5, 128), "neox", "bf16"),
    ((1, 17, 5, 128), "neox", "f16"),
    ((1, 4097, 1, 64), "neox", "bf16"),
]
# ((B, T, N, H), K heads of k, options, dtype).
QK_CASES = [
    ((2, 17, 4, 128), 1, "neox", "bf16"),
    ((2, 17, 4, 128), 1, "partial_gptj_llama3", "bf16"),
    ((1, 9, 3, 80), 3, "partial_gptj_llama3", "f32"),
    ((1, 1, 8, 64), 2, "neox", "f16"),
    ((1, 4097, 2, 64), 1, "neox", "f32"),
]


@pytest.mark.parametrize("shape,options,dtype", ROPE_CASES, ids=str)
@pytest.mark.parametrize("backend", ROPE_BACKENDS)
def test_rope_matches_reference(backend, shape, options, dtype):
    if _slow_here(backend, shape):
        pytest.skip(f"{backend} interpreter: T={shape[1]} is too slow on CPU; run on the GPU")
    x, _, positions = _inputs(shape, DTYPES[dtype], seed=hash((shape, options, dtype)) % 1000, positions_1d=shape[0] == 2)
    case = conformance.Case(f"rope{shape}", ops.rope, _reference_rope, (x, positions), _options_for(shape, options), (0,))
    conformance.assert_conforms(case, backend)


@pytest.mark.parametrize("shape,k_heads,options,dtype", QK_CASES, ids=str)
@pytest.mark.parametrize("backend", QK_BACKENDS)
def test_rope_qk_matches_reference_with_gqa(backend, shape, k_heads, options, dtype):
    if _slow_here(backend, shape):
        pytest.skip(f"{backend} interpreter: T={shape[1]} is too slow on CPU; run on the GPU")
    q, k, positions = _inputs(shape, DTYPES[dtype], seed=hash((shape, options, dtype)) % 1000, k_heads=k_heads)
    case = conformance.Case(f"rope_qk{shape}k{k_heads}", _qk_concat, _qk_reference, (q, k, positions),
                            _options_for(shape, options), (0, 1))
    conformance.assert_conforms(case, backend)


# ---------------------------------------------------------------- the math, independently of the reference


def _complex_rope(x, positions, *, theta, rotary_dim, interleaved):
    """x's pairs as complex numbers times e^{i angle}, in float64 numpy (angles rounded to f32 as the op does)."""
    x = np.asarray(x, np.float64)
    half = rotary_dim // 2
    inv = (1.0 / theta ** (np.arange(0, rotary_dim, 2) / rotary_dim)).astype(np.float32)
    angle = (np.asarray(positions, np.float32)[..., None] * inv).astype(np.float64)[:, :, None, :]
    if interleaved:
        z = x[..., 0:rotary_dim:2] + 1j * x[..., 1:rotary_dim:2]
    else:
        z = x[..., :half] + 1j * x[..., half:rotary_dim]
    z = z * np.exp(1j * angle)
    out = x.copy()
    if interleaved:
        out[..., 0:rotary_dim:2], out[..., 1:rotary_dim:2] = z.real, z.imag
    else:
        out[..., :half], out[..., half:rotary_dim] = z.real, z.imag
    return out


@pytest.mark.parametrize("interleaved", [False, True], ids=["neox", "gptj"])
@pytest.mark.parametrize("backend", ROPE_BACKENDS)
def test_rope_equals_complex_multiplication(backend, interleaved):
    x, _, positions = _inputs((2, 9, 3, 80), jnp.float32, seed=11)
    for rotary_dim in (80, 48):
        got = ops.rope(x, positions, theta=10000.0, rotary_dim=rotary_dim, interleaved=interleaved, backend=backend)
        want = _complex_rope(x, positions, theta=10000.0, rotary_dim=rotary_dim, interleaved=interleaved)
        assert conformance.relative_error(got, want) < 5e-6, rotary_dim


@pytest.mark.parametrize("backend", ROPE_BACKENDS)
def test_position_zero_is_the_identity_and_the_tail_passes_through(backend):
    for dtype in (jnp.float32, jnp.bfloat16):
        x, _, positions = _inputs((2, 5, 3, 80), dtype, seed=12)
        zero = ops.rope(x, jnp.zeros_like(positions), backend=backend)
        np.testing.assert_array_equal(np.asarray(zero), np.asarray(x))
        partial = ops.rope(x, positions, rotary_dim=32, interleaved=True, backend=backend)
        np.testing.assert_array_equal(np.asarray(partial[..., 32:]), np.asarray(x[..., 32:]))
        assert not np.array_equal(np.asarray(partial[..., :32]), np.asarray(x[..., :32]))


@pytest.mark.parametrize("backend", ROPE_BACKENDS)
def test_interleaved_is_half_split_of_the_deinterleaved_head(backend):
    x, _, positions = _inputs((1, 7, 3, 64), jnp.float32, seed=13)
    r = 48
    order = np.concatenate([np.arange(0, r, 2), np.arange(1, r, 2), np.arange(r, 64)])  # GPT-J pairs -> NeoX halves
    inverse = np.argsort(order)
    gptj = ops.rope(x, positions, rotary_dim=r, interleaved=True, backend=backend)
    neox = ops.rope(x[..., order], positions, rotary_dim=r, backend=backend)[..., inverse]
    assert conformance.relative_error(gptj, neox) < 5e-6


@pytest.mark.parametrize("backend", QK_BACKENDS)
def test_rope_qk_equals_rope_of_each(backend):
    q, k, positions = _inputs((2, 5, 6, 64), jnp.bfloat16, seed=14, k_heads=2)
    rq, rk = ops.rope_qk(q, k, positions, interleaved=True, backend=backend)
    np.testing.assert_array_equal(np.asarray(rq), np.asarray(ops.rope(q, positions, interleaved=True, backend=backend)))
    np.testing.assert_array_equal(np.asarray(rk), np.asarray(ops.rope(k, positions, interleaved=True, backend=backend)))


@pytest.mark.parametrize("backend", ROPE_BACKENDS)
def test_gradient_is_the_inverse_rotation(backend):
    x, _, positions = _inputs((1, 6, 2, 64), jnp.float32, seed=15)
    ct = conformance.random_array(jax.random.key(16), x.shape, jnp.float32)
    _, pullback = jax.vjp(lambda x: ops.rope(x, positions, backend=backend), x)
    (dx,) = pullback(ct)
    # Rotating the gradient forward again gives the cotangent back (a rotation is orthogonal).
    back = ops.rope(dx, positions, backend=backend)
    assert conformance.relative_error(back, ct) < 5e-6


@pytest.mark.parametrize("backend", ROPE_BACKENDS)
def test_every_candidate_config_matches_reference(backend):
    impl = interface.OPS["rope_qk"].implementation(backend)
    if impl.candidate_configs is None:
        pytest.skip(f"{backend} has no configs")
    q, k, positions = _inputs((2, 9, 5, 80), jnp.float32, seed=17, k_heads=3)
    spec = RopeSpec(rotary_dim=48)
    want = _qk_reference(q, k, positions, rotary_dim=48)
    for config in impl.candidate_configs(q, k, positions, spec=spec):
        got = jnp.concatenate(ops.rope_qk(q, k, positions, rotary_dim=48, backend=backend, config=config), axis=2)
        assert conformance.relative_error(got, want) < 5e-6, config


@pytest.mark.parametrize("backend", ROPE_BACKENDS)
def test_vmap_and_jit_match_reference(backend):
    x, _, positions = _inputs((2, 5, 3, 64), jnp.float32, seed=18)
    xs = jnp.stack([x, 2 * x, -x])
    ct = conformance.random_array(jax.random.key(19), xs.shape, jnp.float32)

    def loss(fn, x):
        return jnp.sum(fn(x, positions) * ct[0])

    ours = functools.partial(ops.rope, backend=backend, interleaved=True)
    ref = functools.partial(ops.rope, backend="xla", interleaved=True)
    got = jax.jit(jax.vmap(jax.grad(functools.partial(loss, ours))))(xs)
    want = jax.vmap(jax.grad(functools.partial(loss, ref)))(xs)
    assert conformance.relative_error(got, want) < 5e-6
    assert conformance.relative_error(jax.vmap(lambda x: ours(x, positions))(xs), jax.vmap(lambda x: ref(x, positions))(xs)) < 5e-6


def test_llama3_scaling_bands():
    spec = RopeSpec(rotary_dim=128, theta=500000.0, scaling=ops.Llama3Scaling())
    plain = inverse_frequencies(RopeSpec(rotary_dim=128, theta=500000.0))
    scaled = inverse_frequencies(spec)
    wavelength = 2 * np.pi / plain.astype(np.float64)
    high, low = wavelength < 8192 / 4, wavelength > 8192 / 1
    assert high.any() and low.any() and (~high & ~low).any()
    np.testing.assert_array_equal(scaled[high], plain[high])
    np.testing.assert_allclose(scaled[low], plain[low] / 8, rtol=1e-6)
    middle = ~high & ~low
    assert np.all(scaled[middle] < plain[middle]) and np.all(scaled[middle] > plain[middle] / 8)


# ---------------------------------------------------------------- bad input: each error names the argument


def test_bad_inputs_raise_errors_that_name_the_argument():
    x = jnp.ones((2, 3, 4, 8), jnp.float32)
    k = jnp.ones((2, 3, 2, 8), jnp.float32)
    pos = jnp.arange(3)
    cases = [
        (lambda: ops.rope(x, pos, rotary_dim=3), ValueError, "rotary_dim"),
        (lambda: ops.rope(x, pos, rotary_dim=10), ValueError, "rotary_dim"),
        (lambda: ops.rope(x, pos, rotary_dim=0), ValueError, "rotary_dim"),
        (lambda: ops.rope(x, pos, rotary_dim=4.0), TypeError, "rotary_dim"),
        (lambda: ops.rope(x, pos.astype(jnp.float32)), TypeError, "positions"),
        (lambda: ops.rope(x, jnp.arange(4)), ValueError, "positions"),
        (lambda: ops.rope(x, jnp.zeros((3, 3), jnp.int32)), ValueError, "positions"),
        (lambda: ops.rope(x, [0, 1, 2]), TypeError, "positions"),
        (lambda: ops.rope(x[0], pos), ValueError, "x"),
        (lambda: ops.rope(x.astype(jnp.int32), pos), TypeError, "x"),
        (lambda: ops.rope(x, pos, theta=0.0), ValueError, "theta"),
        (lambda: ops.rope(x, pos, interleaved=1), TypeError, "interleaved"),
        (lambda: ops.rope(x, pos, scaling={"factor": 8.0}), TypeError, "scaling"),
        (lambda: ops.Llama3Scaling(factor=-1.0), ValueError, "scaling.factor"),
        (lambda: ops.Llama3Scaling(low_freq_factor=4.0, high_freq_factor=1.0), ValueError, "scaling.high_freq_factor"),
        (lambda: ops.rope(x, pos, backend="cuda"), ValueError, "backend"),
        (lambda: ops.rope_qk(x, k[..., :4], pos), ValueError, "k"),
        (lambda: ops.rope_qk(x, k[:1], pos), ValueError, "k"),
        (lambda: ops.rope_qk(x, k.astype(jnp.bfloat16), pos), TypeError, "k"),
        (lambda: ops.rope_qk(x[0], k, pos), ValueError, "q"),
        (lambda: ops.rope_qk(x, k, jnp.arange(5)), ValueError, "positions"),
    ]
    for call, error, name in cases:
        with pytest.raises(error, match=rf"^{name}:"):
            call()
