"""forgeax.export: functions that call forgeax ops serialise with jax.export.

On CPU: a function of several ops (their XLA backends) and its gradient round-trip through
export -> serialize -> deserialize -> call with bit-identical results; functions calling
forgeax's Triton, Mosaic GPU and Mosaic TPU kernels export for cuda / tpu (lowering only)
with `forgeax.export`'s allow-list, and the Triton one fails without it; an interpreted
kernel (a host callback) cannot be exported. Round trips of the real kernels need a GPU:
the `gpu` tests below run there.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import conformance
import forgeax
import forgeax.export
from forgeax import core, ops

TRITON_INTERPRET = os.environ.get("TRITON_INTERPRET", "").strip().lower() in ("1", "true", "yes", "on")
needs_compiled_triton = pytest.mark.skipif(TRITON_INTERPRET, reason="cross-lowering needs TRITON_INTERPRET unset")
on_gpu = pytest.mark.skipif(core.current_platform() != "gpu", reason="needs a GPU")


def _model(x, scale, w, targets, positions):
    """A few ops chained: norm, rope, gated MLP-like matmul, loss."""
    h = ops.rms_norm(x, scale)
    h = ops.rope(h.reshape(2, 8, 3, 32), positions).reshape(16, 96)
    logits = h @ w
    return ops.cross_entropy(logits, targets)


def _inputs():
    k = jax.random.split(jax.random.key(0), 4)
    x = conformance.random_array(k[0], (16, 96), jnp.float32)
    scale = 1.0 + conformance.random_array(k[1], (96,), jnp.float32, scale=0.1)
    w = conformance.random_array(k[2], (96, 50), jnp.float32, scale=0.1)
    targets = jax.random.randint(k[3], (16,), 0, 50)
    positions = jnp.arange(8, dtype=jnp.int32)
    return x, scale, w, targets, positions


def _round_trip(fn, args, platforms=None):
    exported = forgeax.export.export(jax.jit(fn), platforms=platforms)(*args)
    blob = exported.serialize()
    assert isinstance(blob, (bytes, bytearray)) and len(blob) > 0
    return jax.export.deserialize(blob)


def _assert_same(expected, got, where):
    for e, g in zip(jax.tree.leaves(expected), jax.tree.leaves(got), strict=True):
        if core.current_platform() == "cpu":
            assert np.array_equal(np.asarray(e), np.asarray(g)), where
        else:  # a GPU backward may sum in any order (atomics)
            np.testing.assert_allclose(np.asarray(e, np.float32), np.asarray(g, np.float32), rtol=1e-5, atol=1e-6,
                                       err_msg=str(where))


def test_op_chain_and_its_gradient_round_trip():
    """On CPU the ops' XLA backends; on a GPU whatever the selection picks there."""
    args = _inputs()
    grad_fn = jax.grad(_model, argnums=(0, 1, 2))
    for fn in (_model, grad_fn):
        restored = _round_trip(fn, args)
        with core.interpret_mode(False):
            expected = jax.jit(fn)(*args)
        _assert_same(expected, restored.call(*args), fn)
    if core.current_platform() == "cpu":
        assert forgeax.explain(_model, *args).backends() == ("xla",) * 3


def test_every_target_is_a_disabled_check():
    targets = [c.is_custom_call() for c in forgeax.export.disabled_checks()]
    assert targets == list(forgeax.export.CUSTOM_CALL_TARGETS)
    assert "triton_kernel_call" in targets


def _softcap_triton():
    from forgeax.examples.custom_kernel import softcap_triton

    config = softcap_triton.SoftcapConfig(block=256)
    return lambda x: softcap_triton.softcap(x, cap=30.0, config=config)


@needs_compiled_triton
def test_triton_kernel_exports_for_cuda_only_with_the_allow_list():
    fn = _softcap_triton()
    x = jax.ShapeDtypeStruct((4, 1000), jnp.bfloat16)
    loss_grad = jax.grad(lambda x: jnp.sum(fn(x).astype(jnp.float32)))
    for f in (fn, loss_grad):
        with pytest.raises(ValueError, match="triton_kernel_call"):
            with core.interpret_mode(False):
                jax.export.export(jax.jit(f), platforms=("cuda",))(x)
        exported = forgeax.export.export(jax.jit(f), platforms=("cuda",))(x)
        assert exported.platforms == ("cuda",)
        assert "triton_kernel_call" in exported.mlir_module()
        restored = jax.export.deserialize(exported.serialize())
        assert restored.out_avals == exported.out_avals


def test_pallas_kernels_export_for_their_platforms():
    from forgeax.kernels.pallas.gpu import norms as gpu_norms
    from forgeax.kernels.pallas.tpu import norms as tpu_norms

    x = jax.ShapeDtypeStruct((257, 512), jnp.bfloat16)
    s = jax.ShapeDtypeStruct((512,), jnp.float32)
    for impl, platform, target in ((gpu_norms.RMS_NORM, "cuda", "mosaic_gpu_v2"), (tpu_norms.RMS_NORM, "tpu", "tpu_custom_call")):
        fn = lambda x, s, impl=impl: impl.fn(x, s, eps=1e-6)  # noqa: E731
        exported = forgeax.export.export(jax.jit(fn), platforms=(platform,))(x, s)
        assert target in exported.mlir_module()
        jax.export.deserialize(exported.serialize())


def test_interpreted_kernels_cannot_be_exported():
    """Interpret mode runs kernels as host callbacks, which jax.export refuses (forgeax.export's
    own `export` traces with interpret mode off for that reason)."""
    from forgeax.kernels.pallas.gpu import norms as gpu_norms

    x = jnp.ones((8, 128), jnp.float32)
    s = jnp.ones((128,), jnp.float32)
    fn = jax.jit(lambda x, s: gpu_norms.RMS_NORM.fn(x, s, eps=1e-6))
    with core.interpret_mode(True), pytest.raises(Exception, match="(?i)callback|custom call"):
        jax.export.export(fn, disabled_checks=forgeax.export.disabled_checks())(x, s)


@on_gpu
def test_kernels_round_trip_on_gpu():
    """The real kernels: export, serialize, deserialize, call; bit-identical to the jitted call."""
    x = conformance.random_array(jax.random.key(2), (257, 512), jnp.bfloat16)
    scale = 1.0 + conformance.random_array(jax.random.key(3), (512,), jnp.float32, scale=0.1)
    for backend in ("triton", "pallas_gpu"):
        fn = lambda x, scale, backend=backend: ops.rms_norm(x, scale, backend=backend)  # noqa: E731
        loss = lambda x, s, fn=fn: jnp.sum(fn(x, s).astype(jnp.float32) ** 2)  # noqa: E731
        for f in (fn, jax.grad(loss, argnums=(0, 1))):
            restored = _round_trip(f, (x, scale))
            assert any(t in restored.mlir_module() for t in ("triton_kernel_call", "mosaic_gpu_v2")), backend
            _assert_same(jax.jit(f)(x, scale), restored.call(x, scale), backend)
    x = conformance.random_array(jax.random.key(1), (4, 1000), jnp.bfloat16, scale=40.0)
    fn = _softcap_triton()
    restored = _round_trip(fn, (x,))
    assert np.array_equal(np.asarray(jax.jit(fn)(x)), np.asarray(restored.call(x)))


@needs_compiled_triton
def test_vmapped_triton_kernel_lowers_to_one_launch_for_cuda():
    """The batch folded into the grid compiles (nonzero batch-stride constexprs) as one launch."""
    fn = jax.vmap(_softcap_triton())
    x = jax.ShapeDtypeStruct((3, 4, 1000), jnp.float32)
    text = forgeax.export.export(jax.jit(fn), platforms=("cuda",))(x).mlir_module()
    assert text.count("stablehlo.custom_call @triton_kernel_call") == 1, text[:3000]


def test_load_runtimes_points_mosaic_gpu_kernels_at_the_runtime_jax_would():
    """A fresh process that only deserialises a program must find the Mosaic GPU runtime where
    importing jax.experimental.mosaic.gpu (what tracing a kernel does) would point it."""
    import subprocess  # noqa: PLC0415
    import sys  # noqa: PLC0415

    pytest.importorskip("jax.experimental.mosaic.gpu")
    body = ("import os, forgeax.export; forgeax.export.load_runtimes(); a = os.environ.get('MOSAIC_GPU_RUNTIME_LIB_PATH'); "
            "import jax.experimental.mosaic.gpu; print(repr(a)); print(repr(os.environ.get('MOSAIC_GPU_RUNTIME_LIB_PATH')))")
    env = {k: v for k, v in os.environ.items() if k != "MOSAIC_GPU_RUNTIME_LIB_PATH"}
    done = subprocess.run([sys.executable, "-c", body], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    ours, jaxs = done.stdout.split()[-2:]
    if jaxs == "None":
        pytest.skip("this jaxlib has no Mosaic GPU runtime library")
    assert ours == jaxs and os.path.exists(eval(ours))  # noqa: S307 - a repr printed just above
