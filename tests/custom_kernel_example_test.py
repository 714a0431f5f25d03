"""The user-kernel example (examples/custom_kernel: softcap) and `forgeax.triton_call`.

The op goes through the same conformance harness as forgeax's own ops (forward, gradient,
determinism against its XLA reference). `forgeax.triton_call` is checked under jit, grad and
vmap (folded into the grid, nested, and the per-example fallback) where Triton runs: on a GPU,
or in Triton's interpreter (custom_kernel_example_triton_interpret_test.py).
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import conformance
import forgeax
from forgeax import core as interface
from forgeax.examples.custom_kernel import reference
from forgeax.examples.custom_kernel.softcap import softcap

BACKENDS = conformance.runnable_backends("softcap")
TRITON_RUNS = "triton" in BACKENDS or (interface.current_platform() == "gpu")
needs_triton = pytest.mark.skipif(not TRITON_RUNS, reason="Triton runs on a GPU or in its interpreter (TRITON_INTERPRET=1)")

# Awkward sizes: one element, a prime, not a multiple of any block, above one block.
CASES = [((1,), "f32", 30.0), ((3, 5, 7), "bf16", 5.0), ((2, 1031), "f16", 50.0), ((4, 300), "f32", 1.0)]
DTYPES = {"f32": jnp.float32, "bf16": jnp.bfloat16, "f16": jnp.float16}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shape,dtype,cap", CASES, ids=str)
def test_softcap_conforms_to_reference(backend, shape, dtype, cap):
    x = conformance.random_array(jax.random.key(len(shape) + int(cap)), shape, DTYPES[dtype], scale=2 * cap)
    case = conformance.Case("softcap", softcap, reference.softcap, (x,), {"cap": cap}, diff_argnums=(0,))
    conformance.assert_conforms(case, backend)


def test_softcap_bad_arguments_name_the_argument():
    with pytest.raises(ValueError, match="cap"):
        softcap(jnp.ones(3), cap=-1.0)
    with pytest.raises(TypeError, match="x"):
        softcap([1.0, 2.0])
    with pytest.raises(ValueError, match="backend"):
        softcap(jnp.ones(3), backend="cuda")


def test_softcap_is_registered_and_explained():
    assert forgeax.core.OPS["softcap"].backends == ("xla", "triton")
    text = str(forgeax.explain(lambda a: softcap(a, 3.0), jnp.ones((4,), jnp.float32)))
    assert text.startswith("softcap(") and "->" in text


# ------------------------------------------------------------------ forgeax.triton_call itself


def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def scale_add(x_ptr, b_ptr, y_ptr, N: tl.constexpr, ALPHA: tl.constexpr, BLOCK: tl.constexpr,
                  x_ptr_batch_stride: tl.constexpr = 0, b_ptr_batch_stride: tl.constexpr = 0,
                  y_ptr_batch_stride: tl.constexpr = 0):
        """y = ALPHA * x + b on N elements; batch-aware (grid axis 1)."""
        batch = tl.program_id(1)
        offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offsets < N
        x = tl.load(x_ptr + batch * x_ptr_batch_stride + offsets, mask=mask)
        b = tl.load(b_ptr + batch * b_ptr_batch_stride + offsets, mask=mask)
        tl.store(y_ptr + batch * y_ptr_batch_stride + offsets, ALPHA * x + b, mask=mask)

    @triton.jit
    def plain_scale_add(x_ptr, b_ptr, y_ptr, N: tl.constexpr, ALPHA: tl.constexpr, BLOCK: tl.constexpr):
        """The same without batch strides: vmap runs it once per example."""
        offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offsets < N
        x = tl.load(x_ptr + offsets, mask=mask)
        b = tl.load(b_ptr + offsets, mask=mask)
        tl.store(y_ptr + offsets, ALPHA * x + b, mask=mask)

    return scale_add, plain_scale_add


def _scale_add(kernel, x, b, alpha=3.0):
    n = x.shape[0]
    return forgeax.triton_call(x, b, kernel=kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                               grid=lambda meta: (pl_cdiv(n, meta["BLOCK"]),), N=n, ALPHA=alpha, BLOCK=16)


def pl_cdiv(a, b):
    return -(-a // b)


@needs_triton
@pytest.mark.parametrize("batch_aware", [True, False], ids=["folded", "per_example"])
def test_triton_call_under_jit_and_vmap(batch_aware):
    scale_add, plain = _kernels()
    kernel = scale_add if batch_aware else plain
    key = jax.random.split(jax.random.key(0), 2)
    x = jax.random.normal(key[0], (3, 4, 37), jnp.float32)
    b = jax.random.normal(key[1], (37,), jnp.float32)
    call = lambda x, b: _scale_add(kernel, x, b)  # noqa: E731
    expected = np.asarray(3.0 * x + b)
    # atol: the GPU may fuse 3x + b into one FMA (one rounding) where XLA's reference rounds twice.
    tol = dict(rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(jax.jit(call)(x[0, 0], b), expected[0, 0], **tol)
    # Batched x, shared b (stride 0); then both batched; then a vmap of a vmap (one folded axis).
    np.testing.assert_allclose(jax.jit(jax.vmap(call, (0, None)))(x[0], b), expected[0], **tol)
    bb = jnp.broadcast_to(b, (4, 37)) + jnp.arange(4.0)[:, None]
    np.testing.assert_allclose(jax.vmap(call)(x[0], bb), np.asarray(3.0 * x[0] + bb), **tol)
    nested = jax.jit(jax.vmap(jax.vmap(call, (0, None)), (1, None), out_axes=1))(x, b)
    np.testing.assert_allclose(nested, expected, **tol)
    text = str(jax.make_jaxpr(jax.vmap(jax.vmap(call, (0, None)), (1, None)))(x, b))
    assert ("scan" in text) != batch_aware, text  # folded: no loop; per example: lax.map (a scan)


@needs_triton
def test_triton_call_with_custom_vjp_under_grad_and_vmap():
    x = conformance.random_array(jax.random.key(3), (5, 67), jnp.float32, scale=20.0)
    loss = lambda f: (lambda a: jnp.sum(jnp.sin(f(a))))  # noqa: E731
    ours = loss(lambda a: softcap(a, 10.0, backend="triton"))
    ref = loss(lambda a: reference.softcap(a, cap=10.0))
    np.testing.assert_allclose(jax.jit(jax.grad(ours))(x), jax.grad(ref)(x), rtol=2e-5, atol=1e-6)
    per_row = jax.jit(jax.vmap(jax.grad(ours)))(x)
    np.testing.assert_allclose(per_row, jax.vmap(jax.grad(ref))(x), rtol=2e-5, atol=1e-6)


@needs_triton
def test_triton_call_refuses_a_vmap_its_kernel_cannot_take():
    import triton
    import triton.language as tl

    @triton.jit
    def half_aware(x_ptr, y_ptr, N: tl.constexpr, y_ptr_batch_stride: tl.constexpr = 0):
        offsets = tl.arange(0, N)
        tl.store(y_ptr + tl.program_id(1) * y_ptr_batch_stride + offsets, tl.load(x_ptr + offsets))

    call = lambda x: forgeax.triton_call(x, kernel=half_aware, out_shape=x, grid=(1,), N=8)  # noqa: E731
    with pytest.raises(ValueError, match="x_ptr_batch_stride"):
        jax.vmap(call)(jnp.ones((2, 8)))
    with pytest.raises(ValueError, match="set by vmap"):
        forgeax.triton_call(jnp.ones(8), kernel=half_aware, out_shape=jnp.ones(8), grid=(1,), N=8, y_ptr_batch_stride=1)


@needs_triton
def test_softcap_autotunes_with_the_library_machinery():
    """forgeax.autotune times the user op's candidate_configs; the tuning then selects them."""
    x = conformance.random_array(jax.random.key(5), (4, 300), jnp.float32, scale=10.0)
    fn = lambda a: softcap(a, 5.0)  # noqa: E731
    tuning = forgeax.autotune(fn, x, backends=["triton"], max_configs=2, rounds=1, calls=1, workers=1, progress=False)
    with tuning:
        text = str(forgeax.explain(fn, x))
        np.testing.assert_allclose(jax.jit(fn)(x), reference.softcap(x, cap=5.0), rtol=1e-5, atol=1e-6)
    assert "-> triton" in text and "tuning" in text, text


@pytest.mark.skipif("xla" not in BACKENDS, reason="times the XLA backend (runs in the XLA suite)")
def test_softcap_benchmarks_with_the_bench_tool(tmp_path):
    """examples/custom_kernel/run_bench.py: the user op in tools/bench.py (small shape, few rounds)."""
    import json
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools"))
    from forgeax.examples.custom_kernel import run_bench

    out = tmp_path / "softcap.json"
    run_bench.main(["--backend", "xla", "--mode", "fwd", "--shape", "small f32", "--calls", "1", "--reps", "1", "--out", str(out)])
    rows = json.loads(out.read_text())["results"]
    assert [(r["op"], r["backend"], r["mode"]) for r in rows] == [("softcap", "xla", "fwd")]
    assert rows[0]["median_ms"] > 0 and rows[0]["compile_s"] > 0


@needs_triton
def test_triton_call_alone_says_how_to_differentiate():
    scale_add, _ = _kernels()
    b = jnp.ones(37)
    with pytest.raises(TypeError, match="custom_vjp"):
        jax.grad(lambda x: jnp.sum(_scale_add(scale_add, x, b)))(jnp.ones(37))
