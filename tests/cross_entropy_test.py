"""cross_entropy: every runnable backend against the XLA reference.

On CPU the Triton backend runs in Triton's interpreter (FORGEAX_INTERPRET=1 and
TRITON_INTERPRET=1, its own process); without TRITON_INTERPRET only xla runs.
On a GPU it runs the real kernels, including the 128k vocabulary.

Cross-entropy returns f32 whatever the logits' dtype and takes integer targets:
its cases declare `output_dtype=float32` and differentiate the logits only.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import conformance
from forgeax import core as interface
from forgeax import ops
from forgeax.kernels.common.losses import LossSpec
from forgeax.kernels.xla import cross_entropy as reference

BACKENDS = conformance.runnable_backends("cross_entropy")
DTYPES = {"f32": jnp.float32, "bf16": jnp.bfloat16}
IGNORE = -100
# The loss is f32 computed from the same (upcast) logits in every backend: tight for every dtype.
FORWARD_TOLERANCE = 1e-5


def _on_cpu() -> bool:
    return interface.current_platform() == "cpu"


def _normal(shape, seed):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape, np.float32))


def _inputs(tokens, vocab, dtype, seed, *, scale=3.0, ignore_every=0):
    # numpy's generator: no XLA compilation per shape (the CPU time goes to the kernels).
    rng = np.random.default_rng(seed)
    shape = tokens if isinstance(tokens, tuple) else (tokens,)
    logits = jnp.asarray((scale * rng.standard_normal(shape + (vocab,), np.float32)).astype(jnp.dtype(dtype)))
    targets = rng.integers(0, vocab, shape, dtype=np.int32)
    if ignore_every:
        targets.reshape(-1)[::ignore_every] = IGNORE
    return logits, jnp.asarray(targets)


def _reference(logits, targets, **options):
    """The XLA reference with the op's keyword options (it takes them as one LossSpec)."""
    return reference.cross_entropy(logits, targets, spec=LossSpec(**options))


def _assert_conforms(backend, logits, targets, *, seed=0, config=None, **kwargs):
    """conformance.assert_conforms for a loss: f32 output, gradient w.r.t. logits only."""
    public = functools.partial(ops.cross_entropy, config=config) if config is not None else ops.cross_entropy
    case = conformance.Case(
        f"cross_entropy{tuple(logits.shape)}", public, _reference, (logits, targets), kwargs,
        diff_argnums=(0,), output_dtype=jnp.float32, forward_tolerance=FORWARD_TOLERANCE,
    )
    out, (grad,) = conformance.assert_conforms(case, backend, seed=seed)
    return out, grad


# ---------------------------------------------------------------- forward and gradient against the reference


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("vocab", [1000, 32000, 50257, 128256])
@pytest.mark.parametrize("tokens", [1, 7, 64])
@pytest.mark.parametrize("backend", BACKENDS)
def test_matches_reference(backend, tokens, vocab, dtype):
    if vocab == 128256 and _on_cpu() and (backend != "xla" or tokens == 64):
        pytest.skip("128k vocabulary: xla only on CPU (the Triton interpreter is too slow); all backends on GPU")
    logits, targets = _inputs(tokens, vocab, DTYPES[dtype], seed=tokens * 7 + vocab % 97, ignore_every=5 if tokens > 1 else 0)
    # Per-token losses are the strictest comparison; the reductions are tested below.
    _assert_conforms(backend, logits, targets, reduction="none")


OPTIONS = conformance.LOSS_OPTIONS


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("vocab", [1000, 50257])
@pytest.mark.parametrize("option", OPTIONS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_options_match_reference(backend, option, vocab, dtype):
    kwargs = dict(OPTIONS[option])
    logits, targets = _inputs(7, vocab, DTYPES[dtype], seed=len(option) + vocab % 13, ignore_every=4)
    if "ignore_index" in kwargs:  # the custom index appears among the targets (and -100 is then a normal, out-of-range id)
        targets = targets.at[1].set(kwargs["ignore_index"])
    kwargs.setdefault("reduction", "none")
    _assert_conforms(backend, logits, targets, **kwargs)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_reductions_with_leading_axes_match_reference(backend, reduction):
    logits, targets = _inputs((2, 3, 5), 1000, jnp.float32, seed=11, ignore_every=3)
    out, _ = _assert_conforms(backend, logits, targets, reduction=reduction, label_smoothing=0.1)
    assert out.shape == ((2, 3, 5) if reduction == "none" else ())


@pytest.mark.parametrize("backend", BACKENDS)
def test_f16_logits_match_reference(backend):
    logits, targets = _inputs(7, 32000, jnp.float16, seed=12, ignore_every=3)
    _assert_conforms(backend, logits, targets, reduction="mean", z_loss=1e-4)


# ---------------------------------------------------------------- edge semantics


@pytest.mark.parametrize("backend", BACKENDS)
def test_all_ignored_gives_zero_loss_and_zero_gradient(backend):
    logits, _ = _inputs(6, 1000, jnp.float32, seed=13)
    targets = jnp.full((6,), IGNORE, jnp.int32)
    for reduction in ("mean", "sum", "none"):
        kwargs = dict(reduction=reduction, label_smoothing=0.1, z_loss=1e-3)
        loss, grad = jax.jit(jax.value_and_grad(lambda x: jnp.sum(ops.cross_entropy(x, targets, backend=backend, **kwargs))))(logits)
        assert float(loss) == 0.0, reduction
        assert bool(jnp.all(grad == 0)), reduction


@pytest.mark.parametrize("backend", BACKENDS)
def test_out_of_range_targets_behave_like_ignore_index(backend):
    vocab = 1000
    logits, targets = _inputs(8, vocab, jnp.float32, seed=14)
    bad = targets.at[1].set(-1).at[4].set(vocab).at[6].set(vocab + 123)
    ignored = targets.at[1].set(IGNORE).at[4].set(IGNORE).at[6].set(IGNORE)
    cot = _normal((8,), 2)
    for reduction in ("mean", "sum", "none"):
        c = cot if reduction == "none" else cot[0]

        @jax.jit
        def loss_and_grad(x, t):
            out, pull = jax.vjp(lambda y: ops.cross_entropy(y, t, backend=backend, reduction=reduction, label_smoothing=0.1), x)
            return out, pull(c)[0]

        out_bad, grad_bad = loss_and_grad(logits, bad)
        out_ign, grad_ign = loss_and_grad(logits, ignored)
        np.testing.assert_array_equal(np.asarray(out_bad), np.asarray(out_ign))
        np.testing.assert_array_equal(np.asarray(grad_bad), np.asarray(grad_ign))
        if reduction == "none":
            assert bool(jnp.all(out_bad[jnp.array([1, 4, 6])] == 0))
            assert bool(jnp.all(grad_bad[jnp.array([1, 4, 6])] == 0))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("backend", BACKENDS)
def test_large_logits_stay_finite(backend, dtype):
    logits, targets = _inputs(7, 1000, DTYPES[dtype], seed=15, scale=1e4)
    out, grad = _assert_conforms(backend, logits, targets, reduction="none", z_loss=1e-4, label_smoothing=0.1)
    assert float(jnp.max(jnp.abs(logits.astype(jnp.float32)))) > 1e4
    capped = ops.cross_entropy(logits, targets, backend=backend, logit_soft_cap=30.0)
    assert bool(jnp.isfinite(capped))


# ---------------------------------------------------------------- transformations


@pytest.mark.parametrize("backend", BACKENDS)
def test_jit_grad_vmap_checkpoint_match_reference(backend):
    logits, targets = _inputs((3, 5), 1000, jnp.float32, seed=16, ignore_every=4)
    kwargs = dict(label_smoothing=0.1, z_loss=1e-3)
    ours = jax.checkpoint(functools.partial(ops.cross_entropy, backend=backend, **kwargs))
    ref = functools.partial(_reference, **kwargs)
    # Both arguments batched, then only the logits (the targets broadcast over the batch).
    for t_axis, t in ((0, targets), (None, targets[0])):
        got = jax.jit(jax.vmap(jax.value_and_grad(ours), in_axes=(0, t_axis)))(logits, t)
        want = jax.jit(jax.vmap(jax.value_and_grad(ref), in_axes=(0, t_axis)))(logits, t)
        for g, w in zip(got, want):
            assert conformance.relative_error(g, w) < 1e-5, t_axis
    # vmap of the per-token loss, and a gradient through a vmapped sum-reduced loss.
    per_token = jax.jit(jax.vmap(lambda x, t: ops.cross_entropy(x, t, backend=backend, reduction="none")))(logits, targets)
    assert conformance.relative_error(per_token, _reference(logits, targets, reduction="none")) < 1e-5
    g = jax.jit(jax.grad(lambda x: jnp.sum(jax.vmap(lambda a, b: ops.cross_entropy(a, b, backend=backend, reduction="sum"))(x, targets))))(logits)
    want_g = jax.jit(jax.grad(lambda x: _reference(x, targets, reduction="sum")))(logits)
    assert conformance.relative_error(g, want_g) < 1e-5


def test_triton_gradient_in_forward_variant_matches_reference():
    if "triton" not in BACKENDS:
        pytest.skip("the Triton backend does not run here")
    from forgeax.kernels.triton import cross_entropy as triton_ce

    config = triton_ce.CrossEntropyTritonConfig(block_v=1024, grad_in_forward=True)
    logits, targets = _inputs(7, 3000, jnp.bfloat16, seed=17, ignore_every=3)
    kwargs = dict(label_smoothing=0.1, z_loss=1e-3, logit_soft_cap=20.0, reduction="mean")
    loss, grad = jax.jit(jax.value_and_grad(lambda x: ops.cross_entropy(x, targets, backend="triton", config=config, **kwargs)))(logits)
    want, want_grad = jax.value_and_grad(lambda x: _reference(x, targets, **kwargs))(logits.astype(jnp.float32))
    assert conformance.relative_error(loss, want) < 1e-5
    assert grad.dtype == jnp.bfloat16 and conformance.relative_error(grad, want_grad) < 1e-2


def _small_config(backend):
    """A non-default config of `backend` (skips the test for one that takes none): blocks much
    narrower than the heuristic's, so V=1000 runs several vocabulary blocks (and the TPU kernel
    several row blocks)."""
    if backend == "triton":
        from forgeax.kernels.triton import cross_entropy as triton_ce

        return triton_ce.CrossEntropyTritonConfig(block_v=256, num_warps=1)
    if backend == "pallas_tpu":
        from forgeax.kernels.pallas.tpu import cross_entropy as tpu_ce

        return tpu_ce.CrossEntropyPallasTpuConfig(block_rows=16, block_v=256)
    pytest.skip(f"{backend} takes no kernel config")


@pytest.mark.parametrize("backend", BACKENDS)
def test_explicit_config_reaches_the_kernel_and_matches_reference(backend):
    config = _small_config(backend)
    logits, targets = _inputs(37, 1000, jnp.bfloat16, seed=21, ignore_every=4)
    kwargs = dict(label_smoothing=0.1, z_loss=1e-3, logit_soft_cap=20.0)
    (decision,) = ops.explain(lambda x, t: ops.cross_entropy(x, t, backend=backend, config=config, **kwargs), logits, targets).decisions
    assert decision.config == f"{config} [explicit]"
    _assert_conforms(backend, logits, targets, config=config, reduction="none", **kwargs)


def test_triton_config_reaches_the_kernels_through_the_op():
    """grad_in_forward changes which kernels run: one launch for forward+backward instead of two."""
    if "triton" not in BACKENDS:
        pytest.skip("the Triton backend does not run here")
    from forgeax.kernels.triton import cross_entropy as triton_ce

    logits, targets = _inputs(4, 100, jnp.float32, seed=25)

    def launches(config):
        fn = jax.value_and_grad(lambda x: ops.cross_entropy(x, targets, backend="triton", config=config))
        # One equation per launch: a Triton custom call, or in the interpreter a host callback.
        return len(re.findall(r"\b(?:triton_kernel_call|pure_callback)\[", str(jax.make_jaxpr(fn)(logits))))

    assert launches(None) == 2
    assert launches(triton_ce.CrossEntropyTritonConfig(grad_in_forward=True)) == 1


def test_config_for_another_backend_is_refused():
    from forgeax.kernels.pallas.tpu import cross_entropy as tpu_ce

    logits, targets = _inputs(4, 100, jnp.float32, seed=22)
    with pytest.raises(interface.UnsupportedError, match="config"):
        ops.cross_entropy(logits, targets, backend="xla", config=tpu_ce.CrossEntropyPallasTpuConfig())


# Every config of the loss backends (linear_cross_entropy's too: the test is the same).
@pytest.mark.parametrize("module, name, values, field", [
    ("forgeax.kernels.pallas.tpu.cross_entropy", "CrossEntropyPallasTpuConfig", dict(block_rows=20), "block_rows"),
    ("forgeax.kernels.pallas.tpu.cross_entropy", "CrossEntropyPallasTpuConfig", dict(block_v=1000), "block_v"),
    ("forgeax.kernels.pallas.tpu.cross_entropy", "CrossEntropyPallasTpuConfig", dict(block_v=0), "block_v"),
    ("forgeax.kernels.triton.cross_entropy", "CrossEntropyTritonConfig", dict(block_v=3000), "block_v"),
    ("forgeax.kernels.triton.cross_entropy", "CrossEntropyTritonConfig", dict(num_warps=3), "num_warps"),
    ("forgeax.kernels.triton.linear_cross_entropy", "LinearCrossEntropyTritonConfig", dict(block_v=100), "block_v"),
    ("forgeax.kernels.triton.linear_cross_entropy", "LinearCrossEntropyTritonConfig", dict(num_warps=0), "num_warps"),
    ("forgeax.kernels.pallas.gpu.linear_cross_entropy", "LinearCrossEntropyPallasGpuConfig", dict(block_n=96), "block_n"),
    ("forgeax.kernels.pallas.gpu.linear_cross_entropy", "LinearCrossEntropyPallasGpuConfig", dict(warpgroups=3), "warpgroups"),
    ("forgeax.kernels.pallas.gpu.linear_cross_entropy", "LinearCrossEntropyPallasGpuConfig", dict(stages=1), "stages"),
    # 2 warpgroups x 8 stages: over the shared memory of a CTA.
    ("forgeax.kernels.pallas.gpu.linear_cross_entropy", "LinearCrossEntropyPallasGpuConfig", dict(warpgroups=2, stages=8), "stages"),
], ids=str)
def test_bad_config_values_raise_errors_that_name_the_field(module, name, values, field):
    config_type = getattr(pytest.importorskip(module), name)
    with pytest.raises(ValueError, match=rf"^{name}\.{field}:"):
        config_type(**values)


def test_targets_get_no_gradient():
    logits, targets = _inputs(4, 100, jnp.float32, seed=18)
    for backend in BACKENDS:
        _, dt = jax.jit(lambda x, t: jax.vjp(lambda y, u: ops.cross_entropy(y, u, backend=backend), x, t)[1](jnp.float32(1.0)))(logits, targets)
        assert dt.dtype == jax.dtypes.float0


# ---------------------------------------------------------------- selection and bad input


def test_triton_supports_vocab_parallel():
    # axis_name runs the Triton kernels on the local slice (tests/vocab_parallel_kernels_parallel_test.py).
    impl = interface.OPS["cross_entropy"].implementation("triton")
    if isinstance(impl, str):
        pytest.skip(impl)
    logits, targets = _inputs(2, 64, jnp.float32, seed=19)
    assert impl.supports(logits, targets, spec=LossSpec(axis_name="vocab")) is None
    assert impl.supports(logits, targets, spec=LossSpec()) is None


def test_bad_inputs_raise_errors_that_name_the_argument():
    x = _normal((4, 8), 0)
    t = jnp.arange(4, dtype=jnp.int32)
    ce = ops.cross_entropy
    cases = [
        (lambda: ce(x.astype(jnp.int32), t), TypeError, "logits"),
        (lambda: ce([[1.0]], t), TypeError, "logits"),
        (lambda: ce(jnp.float32(1.0), t), ValueError, "logits"),
        (lambda: ce(jnp.ones((4, 0)), t), ValueError, "logits"),
        (lambda: ce(x, t.astype(jnp.float32)), TypeError, "targets"),
        (lambda: ce(x, [0, 1, 2, 3]), TypeError, "targets"),
        (lambda: ce(x, t[:3]), ValueError, "targets"),
        (lambda: ce(x, t[:, None]), ValueError, "targets"),
        (lambda: ce(x, t, reduction="avg"), ValueError, "reduction"),
        (lambda: ce(x, t, reduction=None), ValueError, "reduction"),
        (lambda: ce(x, t, label_smoothing=-0.1), ValueError, "label_smoothing"),
        (lambda: ce(x, t, label_smoothing=1.5), ValueError, "label_smoothing"),
        (lambda: ce(x, t, label_smoothing="a"), TypeError, "label_smoothing"),
        (lambda: ce(x, t, z_loss=-1e-4), ValueError, "z_loss"),
        (lambda: ce(x, t, z_loss=float("nan")), ValueError, "z_loss"),
        (lambda: ce(x, t, logit_soft_cap=0.0), ValueError, "logit_soft_cap"),
        (lambda: ce(x, t, logit_soft_cap=-30.0), ValueError, "logit_soft_cap"),
        (lambda: ce(x, t, ignore_index=1.5), TypeError, "ignore_index"),
        (lambda: ce(x, t, axis_name=["v"]), TypeError, "axis_name"),
        (lambda: ce(x, t, backend="cuda"), ValueError, "backend"),
    ]
    for call, error, name in cases:
        with pytest.raises(error, match=rf"^{name}:"):
            call()


def test_selection_on_this_platform():
    logits, targets = _inputs(2, 64, jnp.float32, seed=20)
    chosen = ops.explain(lambda x, t: ops.cross_entropy(x, t), logits, targets).backends()
    expected = "triton" if interface.current_platform() == "gpu" else "xla"
    assert chosen == (expected,)
