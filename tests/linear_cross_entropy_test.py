"""linear_cross_entropy: every runnable backend against the XLA reference.

The reference materialises the logits (x @ W + b in f32) and calls the
cross-entropy reference; the chunked backends ("xla_chunked", and "triton" in
Triton's interpreter on CPU: its own process, see
linear_cross_entropy_triton_interpret_test.py) must match it in the loss and
in the gradients with respect to x, W and b, with chunk sizes that do not
divide the number of tokens (padding), several chunks (dW accumulated across
them) and one.

The loss is f32 whatever the inputs' dtype: cases declare output_dtype=f32.
The Triton backend stores a chunk's logits in the matmul dtype (bf16 for bf16
inputs), so its bf16 forward tolerance is looser than xla_chunked's.
"""

from __future__ import annotations


import jax
import jax.numpy as jnp
import numpy as np
import pytest

import conformance
from forgeax import core as interface
from forgeax import ops
from forgeax.kernels.common import linear_cross_entropy as chunked
from forgeax.kernels.common.losses import LossSpec
from forgeax.kernels.xla import linear_cross_entropy as reference

BACKENDS = conformance.runnable_backends("linear_cross_entropy")
DTYPES = {"f32": jnp.float32, "bf16": jnp.bfloat16}
IGNORE = -100
# Loss vs the f32 reference: f32 logits (xla_chunked) agree to rounding; the
# Triton backend rounds bf16/f16 logits to the matmul dtype (measured ~1e-4..1e-3).
FORWARD_TOLERANCE = {jnp.dtype(jnp.float32): 1e-5, jnp.dtype(jnp.bfloat16): 5e-3, jnp.dtype(jnp.float16): 1e-3}


@pytest.fixture(autouse=True)
def exact_f32_matmuls():
    """GPUs run f32 matmuls in TF32 by default. The reference scales d loss / d logits by
    1/count before its dx matmul, the chunked backends after it, so TF32 rounds different
    values (2e-4 apart on an H200): compare the algorithms with f32 matmuls."""
    with jax.default_matmul_precision("highest"):
        yield


def _public(x, w, t, b, *, backend=None, **kwargs):
    return ops.linear_cross_entropy(x, w, t, bias=b, backend=backend, **kwargs)


def _small_config(backend):
    """A non-default config of `backend` (narrower tiles than the heuristic's); skips the test
    for a backend that takes none."""
    if backend == "triton":
        from forgeax.kernels.triton import linear_cross_entropy as triton_lce

        return triton_lce.LinearCrossEntropyTritonConfig(block_v=256, num_warps=1)
    if backend == "pallas_gpu":
        from forgeax.kernels.pallas.gpu import linear_cross_entropy as gpu_lce

        return gpu_lce.LinearCrossEntropyPallasGpuConfig(block_n=64, stages=2)
    if backend == "pallas_tpu":
        from forgeax.kernels.pallas.tpu import cross_entropy as tpu_ce

        return tpu_ce.CrossEntropyPallasTpuConfig(block_rows=16, block_v=256)
    pytest.skip(f"{backend} takes no kernel config")


def _reference(x, w, t, b=None, *, chunk_size=None, **options):
    """The XLA reference with the op's keyword options (it takes them as one LossSpec)."""
    return reference.linear_cross_entropy(x, w, t, b, spec=LossSpec(**options), chunk_size=chunk_size)


def _inputs(tokens, hidden, vocab, dtype, seed, *, bias=True, ignore_every=0, w_dtype=None):
    # numpy's generator: no XLA compilation per shape. Logits come out ~N(0, 9).
    rng = np.random.default_rng(seed)
    shape = tokens if isinstance(tokens, tuple) else (tokens,)
    x = jnp.asarray(rng.standard_normal(shape + (hidden,), np.float32).astype(jnp.dtype(dtype)))
    w = jnp.asarray((3.0 / np.sqrt(hidden) * rng.standard_normal((hidden, vocab), np.float32)).astype(jnp.dtype(w_dtype or dtype)))
    b = jnp.asarray(rng.standard_normal((vocab,), np.float32).astype(jnp.dtype(dtype))) if bias else None
    t = rng.integers(0, vocab, shape, dtype=np.int32)
    if ignore_every:
        t.reshape(-1)[::ignore_every] = IGNORE
    return x, w, jnp.asarray(t), b


# Backends that store a chunk's logits in the matmul dtype (bf16 for bf16 inputs).
BF16_LOGITS = ("triton", "pallas_gpu")


def _semantics_dtype(backend):
    """Inputs for the semantic tests: f32, or bf16 for the wgmma kernel that refuses f32."""
    return jnp.bfloat16 if backend == "pallas_gpu" else jnp.float32


def _assert_conforms(backend, x, w, t, b, *, seed=0, tolerance=None, config=None, **kwargs):
    """conformance.assert_conforms: f32 loss, gradients w.r.t. x, W (and b)."""
    public = (lambda *a, **k: _public(*a, config=config, **k)) if config is not None else _public
    case = conformance.Case(
        f"linear_cross_entropy{tuple(x.shape)}x{tuple(w.shape)}", public, _reference, (x, w, t, b), kwargs,
        diff_argnums=(0, 1) if b is None else (0, 1, 3), output_dtype=jnp.float32,
        forward_tolerance=FORWARD_TOLERANCE[jnp.dtype(x.dtype)],
    )
    return conformance.assert_conforms(case, backend, seed=seed, tolerance=tolerance)


# ---------------------------------------------------------------- forward and gradients against the reference

# (tokens, H, V, chunk_size): one token; a chunk that does not divide the
# tokens (7 = 2 x 3 + 1) with V not a power of two; 65 tokens in 5 chunks;
# the default chunk (a single chunk here).
SHAPES = [(1, 64, 1000, None), (7, 96, 3001, 3), (65, 64, 1000, 16), (65, 96, 1000, None)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("backend", BACKENDS)
def test_matches_reference(backend, shape, dtype):
    tokens, hidden, vocab, chunk = shape
    x, w, t, b = _inputs(tokens, hidden, vocab, DTYPES[dtype], seed=tokens + vocab % 97, ignore_every=5 if tokens > 1 else 0)
    # Per-token losses are the strictest comparison; the reductions are tested below.
    _assert_conforms(backend, x, w, t, b, reduction="none", chunk_size=chunk)


OPTIONS = conformance.LOSS_OPTIONS


@pytest.mark.parametrize("option", OPTIONS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_options_match_reference(backend, option):
    kwargs = dict(OPTIONS[option])
    dtype = jnp.bfloat16 if len(option) % 2 else jnp.float32
    x, w, t, b = _inputs(13, 64, 1000, dtype, seed=len(option), ignore_every=4, bias=option != "z_loss")
    if "ignore_index" in kwargs:  # the custom index appears among the targets (-100 is then an out-of-range id)
        t = t.at[1].set(kwargs["ignore_index"])
    kwargs.setdefault("reduction", "none")
    tolerance = None
    if backend in BF16_LOGITS and dtype == jnp.bfloat16 and kwargs.get("label_smoothing") == 1.0:
        # g = p - 1/V cancels, and these backends' p comes from bf16-rounded logits: 1.1e-2 measured.
        tolerance = 2e-2
    _assert_conforms(backend, x, w, t, b, chunk_size=5, tolerance=tolerance, **kwargs)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_reductions_with_leading_axes_match_reference(backend, reduction):
    x, w, t, b = _inputs((2, 3, 5), 64, 1000, jnp.float32, seed=11, ignore_every=3)
    out, _ = _assert_conforms(backend, x, w, t, b, reduction=reduction, label_smoothing=0.1, chunk_size=8)
    assert out.shape == ((2, 3, 5) if reduction == "none" else ())


@pytest.mark.parametrize("backend", BACKENDS)
def test_f16_and_mixed_dtypes_match_reference(backend):
    x, w, t, b = _inputs(9, 64, 1000, jnp.float16, seed=12, ignore_every=3)
    _assert_conforms(backend, x, w, t, b, reduction="mean", z_loss=1e-4, chunk_size=4)
    # bf16 activations with an f32 weight: the matmuls run in f32 (promoted).
    x, w, t, b = _inputs(9, 64, 1000, jnp.bfloat16, seed=13, w_dtype=jnp.float32, bias=False)
    _assert_conforms(backend, x, w, t, b, reduction="sum", chunk_size=4)


# ---------------------------------------------------------------- edge semantics


@pytest.mark.parametrize("backend", BACKENDS)
def test_all_ignored_gives_zero_loss_and_zero_gradients(backend):
    x, w, _, b = _inputs(6, 64, 1000, _semantics_dtype(backend), seed=13)
    t = jnp.full((6,), IGNORE, jnp.int32)
    for reduction in ("mean", "sum", "none"):
        kwargs = dict(reduction=reduction, label_smoothing=0.1, z_loss=1e-3, chunk_size=4, backend=backend)
        loss_fn = lambda x, w, b: jnp.sum(ops.linear_cross_entropy(x, w, t, bias=b, **kwargs))  # noqa: E731
        loss, grads = jax.jit(jax.value_and_grad(loss_fn, argnums=(0, 1, 2)))(x, w, b)
        assert float(loss) == 0.0, reduction
        assert all(bool(jnp.all(g == 0)) for g in grads), reduction


@pytest.mark.parametrize("backend", BACKENDS)
def test_out_of_range_targets_behave_like_ignore_index(backend):
    vocab = 1000
    x, w, t, b = _inputs(8, 64, vocab, _semantics_dtype(backend), seed=14)
    bad = t.at[1].set(-1).at[4].set(vocab).at[6].set(vocab + 123)
    ignored = t.at[1].set(IGNORE).at[4].set(IGNORE).at[6].set(IGNORE)
    for reduction in ("mean", "none"):
        @jax.jit
        def loss_and_grads(x, w, b, t):
            fn = lambda *a: ops.linear_cross_entropy(a[0], a[1], t, bias=a[2], backend=backend, reduction=reduction, chunk_size=3)  # noqa: E731
            out, pull = jax.vjp(fn, x, w, b)
            return out, pull(jnp.ones_like(out) * jnp.arange(1.0, 1.0 + out.size).reshape(out.shape))

        out_bad, grads_bad = loss_and_grads(x, w, b, bad)
        out_ign, grads_ign = loss_and_grads(x, w, b, ignored)
        np.testing.assert_array_equal(np.asarray(out_bad), np.asarray(out_ign))
        for g_bad, g_ign in zip(grads_bad, grads_ign):
            np.testing.assert_array_equal(np.asarray(g_bad), np.asarray(g_ign))
        if reduction == "none":
            assert bool(jnp.all(out_bad[jnp.array([1, 4, 6])] == 0))
            assert bool(jnp.all(grads_bad[0][jnp.array([1, 4, 6])] == 0))


# ---------------------------------------------------------------- transformations


@pytest.mark.parametrize("backend", BACKENDS)
def test_jit_grad_vmap_checkpoint_match_reference(backend):
    dtype = _semantics_dtype(backend)
    tol = 1e-5 if dtype == jnp.float32 else 2e-2
    x, w, t, b = _inputs((3, 5), 64, 1000, dtype, seed=16, ignore_every=4)
    kwargs = dict(label_smoothing=0.1, z_loss=1e-3)
    ours = jax.checkpoint(lambda x, w, t: ops.linear_cross_entropy(x, w, t, bias=b, backend=backend, chunk_size=2, **kwargs))
    ref = lambda x, w, t: _reference(x, w, t, b, **kwargs)  # noqa: E731
    # vmap over x and targets (W shared, so each batch element has its own dW), then over x only.
    for t_axis, tt in ((0, t), (None, t[0])):
        got = jax.jit(jax.vmap(jax.value_and_grad(ours, argnums=(0, 1)), in_axes=(0, None, t_axis)))(x, w, tt)
        want = jax.jit(jax.vmap(jax.value_and_grad(ref, argnums=(0, 1)), in_axes=(0, None, t_axis)))(x, w, tt)
        for g, r in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            assert conformance.relative_error(g, r) < tol, t_axis
    # vmap of the per-token loss, and a gradient through a vmapped sum-reduced loss.
    per_token = jax.jit(jax.vmap(lambda x, t: ops.linear_cross_entropy(x, w, t, backend=backend, reduction="none", chunk_size=2)))(x, t)
    assert conformance.relative_error(per_token, _reference(x, w, t, reduction="none")) < tol
    g = jax.jit(jax.grad(lambda w: jnp.sum(jax.vmap(lambda a, c: ops.linear_cross_entropy(a, w, c, backend=backend, reduction="sum", chunk_size=4))(x, t))))(w)
    want_g = jax.jit(jax.grad(lambda w: _reference(x, w, t, reduction="sum")))(w)
    assert conformance.relative_error(g, want_g) < tol


def test_targets_get_no_gradient():
    for backend in BACKENDS:
        x, w, t, _ = _inputs(4, 64, 100, _semantics_dtype(backend), seed=18, bias=False)
        grads = jax.jit(lambda x, w, t: jax.vjp(lambda a, c, u: ops.linear_cross_entropy(a, c, u, backend=backend), x, w, t)[1](jnp.float32(1.0)))(x, w, t)
        assert grads[2].dtype == jax.dtypes.float0


# ---------------------------------------------------------------- chunking, selection and bad input


def test_default_chunk_size():
    # Llama-3: f32 logits (xla_chunked) 1024 tokens, bf16 logits (triton) 2048.
    assert chunked.default_chunk_size(8192, 128256, 4) == 1024
    assert chunked.default_chunk_size(8192, 128256, 2) == 2048
    assert chunked.default_chunk_size(65, 1000) == 65  # one chunk
    assert chunked.default_chunk_size(5000, 128256, 4) == 1000  # 5 even chunks, no padding
    assert chunked.default_chunk_size(4096, 1 << 20, 4) == 512  # never below 512 tokens
    assert chunked.default_chunk_size(100, 1 << 20, 4) == 100


@pytest.mark.parametrize("backend", BACKENDS)
def test_explicit_config_reaches_the_kernel_and_matches_reference(backend):
    config = _small_config(backend)
    x, w, t, b = _inputs(21, 64, 1000, jnp.bfloat16, seed=23, ignore_every=4)
    kwargs = dict(label_smoothing=0.1, z_loss=1e-3, logit_soft_cap=20.0, chunk_size=8)
    fn = lambda x, w, t: ops.linear_cross_entropy(x, w, t, bias=b, backend=backend, config=config, **kwargs)  # noqa: E731
    (decision,) = ops.explain(fn, x, w, t).decisions
    assert decision.config == f"{config} [explicit]"
    _assert_conforms(backend, x, w, t, b, config=config, reduction="none", **kwargs)


def test_config_for_another_backend_is_refused():
    from forgeax.kernels.pallas.tpu import cross_entropy as tpu_ce

    x, w, t, _ = _inputs(4, 8, 16, jnp.float32, seed=24, bias=False)
    for backend in ("xla", "xla_chunked"):
        with pytest.raises(interface.UnsupportedError, match="config"):
            ops.linear_cross_entropy(x, w, t, backend=backend, config=tpu_ce.CrossEntropyPallasTpuConfig())


def test_every_candidate_config_is_valid():
    from forgeax.kernels.pallas.gpu import linear_cross_entropy as gpu_lce
    from forgeax.kernels.pallas.tpu import linear_cross_entropy as tpu_lce

    x, w, t, _ = _inputs(4, 64, 100, jnp.bfloat16, seed=25, bias=False)
    for module in (gpu_lce, tpu_lce):
        candidates = module.candidate_configs(x, w, t, spec=LossSpec())
        assert candidates and all(isinstance(c, module.LINEAR_CROSS_ENTROPY.config_type) for c in candidates)


def test_vocab_parallel_is_supported_by_triton():
    # axis_name runs the Triton kernels on the local slice (tests/vocab_parallel_kernels_parallel_test.py).
    impl = interface.OPS["linear_cross_entropy"].implementation("triton")
    if isinstance(impl, str):
        pytest.skip(impl)
    x, w, t, _ = _inputs(2, 64, 100, jnp.float32, seed=19, bias=False)
    assert impl.supports(x, w, t, None, spec=LossSpec(axis_name="vocab"), chunk_size=None) is None
    assert impl.supports(x, w, t, None, spec=LossSpec(), chunk_size=None) is None


def test_bad_inputs_raise_errors_that_name_the_argument():
    x, w, t, b = _inputs(4, 8, 16, jnp.float32, seed=0)
    lce = ops.linear_cross_entropy
    cases = [
        (lambda: lce(x.astype(jnp.int32), w, t), TypeError, "x"),
        (lambda: lce(jnp.float32(1.0), w, t), ValueError, "x"),
        (lambda: lce(x, w.astype(jnp.int32), t), TypeError, "weight"),
        (lambda: lce(x, w[:7], t), ValueError, "weight"),
        (lambda: lce(x, w[None], t), ValueError, "weight"),
        (lambda: lce(x, w[:, :0], t), ValueError, "weight"),
        (lambda: lce(x, w, t, bias=b[:15]), ValueError, "bias"),
        (lambda: lce(x, w, t, bias=b.astype(jnp.int32)), TypeError, "bias"),
        (lambda: lce(x, w, t.astype(jnp.float32)), TypeError, "targets"),
        (lambda: lce(x, w, [0, 1, 2, 3]), TypeError, "targets"),
        (lambda: lce(x, w, t[:3]), ValueError, "targets"),
        (lambda: lce(x, w, t, reduction="avg"), ValueError, "reduction"),
        (lambda: lce(x, w, t, chunk_size=0), ValueError, "chunk_size"),
        (lambda: lce(x, w, t, chunk_size=-4), ValueError, "chunk_size"),
        (lambda: lce(x, w, t, chunk_size=2.5), TypeError, "chunk_size"),
        (lambda: lce(x, w, t, label_smoothing=1.5), ValueError, "label_smoothing"),
        (lambda: lce(x, w, t, z_loss=-1e-4), ValueError, "z_loss"),
        (lambda: lce(x, w, t, logit_soft_cap=0.0), ValueError, "logit_soft_cap"),
        (lambda: lce(x, w, t, ignore_index=1.5), TypeError, "ignore_index"),
        (lambda: lce(x, w, t, axis_name=["v"]), TypeError, "axis_name"),
        (lambda: lce(x, w, t, backend="cuda"), ValueError, "backend"),
    ]
    for call, error, name in cases:
        with pytest.raises(error, match=rf"^{name}:"):
            call()


def test_selection_on_this_platform():
    x, w, t, _ = _inputs(2, 8, 64, jnp.float32, seed=20, bias=False)
    chosen = ops.explain(lambda x, w, t: ops.linear_cross_entropy(x, w, t), x, w, t).backends()
    expected = {"gpu": "triton", "tpu": "pallas_tpu", "cpu": "xla"}[interface.current_platform()]
    assert chosen == (expected,)
