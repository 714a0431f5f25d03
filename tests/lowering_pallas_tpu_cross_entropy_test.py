"""Cross-lowering of the Mosaic TPU cross-entropy kernels on CPU (no TPU needed).

`jax.jit(f).trace(...).lower(lowering_platforms=("tpu",))` runs Pallas' TPU
lowering: BlockSpec legality ((8, 128) rule), kernel tracing and the conversion
to the Mosaic dialect, ending in one `tpu_custom_call` per kernel launch. It
does not run Mosaic's layout passes (those live in libtpu), so it catches
compile errors on our side, not everything the TPU compiler might reject.
Numerics are checked in the TPU interpreter by tests/cross_entropy_test.py
(FORGEAX_INTERPRET=1); the one numerics test here runs the compiled-TPU block
width (4096 lanes) and several row blocks in the interpreter, which that suite's
small shapes and wide interpreter blocks do not reach.

Run: JAX_PLATFORMS=cpu pytest tests/lowering_pallas_tpu_cross_entropy_test.py
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import conformance
from forgeax import core as interface
from forgeax.kernels.common.losses import LossSpec
from forgeax.kernels.pallas.tpu import cross_entropy as tpu_ce
from forgeax.kernels.xla import cross_entropy as reference

CUSTOM_CALL = "@tpu_custom_call"

# (logits shape, dtype, options): the llama-3 training shape (8k tokens x 128k
# vocabulary, bf16) with and without every option, then odd shapes: vocabularies
# that are not multiples of 128 or of the vocab block (50257, 1000, 129, 7), row
# counts that are not multiples of the row block (300, 7, 1), leading axes, f16.
CASES = [
    ((8192, 128256), jnp.bfloat16, {}),
    ((8192, 128256), jnp.bfloat16, dict(label_smoothing=0.1, z_loss=1e-4, logit_soft_cap=30.0)),
    ((4, 1024, 50257), jnp.float32, dict(reduction="none")),
    ((300, 50257), jnp.bfloat16, dict(label_smoothing=0.1, ignore_index=0)),
    ((7, 1000), jnp.float16, dict(reduction="sum", label_smoothing=0.2)),
    ((1, 129), jnp.float32, dict(z_loss=1e-3)),
    ((3, 5, 7), jnp.bfloat16, dict(logit_soft_cap=5.0, reduction="none")),
]


def _lower_tpu(fn, *args) -> str:
    return conformance.lowered_text(fn, *args, platform="tpu")


def _kernel_names(text: str) -> list[str]:
    return sorted(re.findall(r'kernel_name = "(\w+)"', text))


def _loss(x, t, config=None, **options):
    return tpu_ce.cross_entropy(x, t, spec=LossSpec(**options), config=config)


def _specs(shape, dtype):
    return jax.ShapeDtypeStruct(shape, dtype), jax.ShapeDtypeStruct(shape[:-1], jnp.int32)


@pytest.mark.parametrize("shape,dtype,options", CASES, ids=str)
def test_forward_lowers_to_one_mosaic_kernel(shape, dtype, options):
    text = _lower_tpu(lambda x, t: _loss(x, t, **options), *_specs(shape, dtype))
    assert text.count(CUSTOM_CALL) == 1, text[:2000]
    assert _kernel_names(text) == ["_fwd_kernel"]


@pytest.mark.parametrize("shape,dtype,options", CASES, ids=str)
def test_backward_lowers_to_the_forward_and_backward_kernels(shape, dtype, options):
    def backward(x, t):
        out, pull = jax.vjp(lambda y: _loss(y, t, **options), x)
        return pull(jnp.ones_like(out))[0]

    text = _lower_tpu(backward, *_specs(shape, dtype))
    # The gradient is the backward kernel (custom_vjp), not autodiff through the forward.
    assert text.count(CUSTOM_CALL) == 2, text[:2000]
    assert _kernel_names(text) == ["_bwd_kernel", "_fwd_kernel"]


def test_vmapped_gradient_lowers_to_one_launch_per_kernel():
    """vmap folds the batch axis into the rows: still one forward and one backward launch."""
    x, t = _specs((3, 33, 1000), jnp.bfloat16)

    def loss(x, t):
        return jnp.sum(jax.vmap(lambda a, b: _loss(a, b, label_smoothing=0.1))(x, t))

    text = _lower_tpu(jax.grad(loss), x, t)
    assert text.count(CUSTOM_CALL) == 2
    assert _kernel_names(text) == ["_bwd_kernel", "_fwd_kernel"]


@pytest.mark.parametrize("rows", [1, 7, 8, 15, 16, 17, 127, 128, 129, 300, 8192, 100_003])
@pytest.mark.parametrize("vocab", [1, 7, 129, 1000, 4096, 4097, 50257, 128256])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_tiling_obeys_the_tpu_block_rule(rows, vocab, dtype):
    with interface.interpret_mode(False):
        t = tpu_ce.tiling(rows, vocab, dtype, tpu_ce.heuristic_config(None, None, spec=LossSpec()))
    align = 8 if jnp.dtype(dtype).itemsize == 4 else 16
    assert 1 <= t.block_rows <= rows and (t.block_rows == rows or t.block_rows % align == 0)
    assert 1 <= t.block_v <= vocab and (t.block_v == vocab or t.block_v % 128 == 0)
    assert t.ragged_v == (vocab % t.block_v != 0)


def test_supports_refuses_with_reasons():
    x, t = _specs((8, 1000), jnp.bfloat16)
    assert tpu_ce.CROSS_ENTROPY.supports(x, t, spec=LossSpec()) is None
    assert tpu_ce.CROSS_ENTROPY.supports(x, t, spec=LossSpec(axis_name="vocab")) is None  # vocabulary-parallel
    f64 = tpu_ce.CROSS_ENTROPY.supports(jax.ShapeDtypeStruct((8, 1000), jnp.float64), t, spec=LossSpec())
    assert f64 is not None and "float64" in f64


def test_explicit_config_sets_the_kernel_grids():
    """The config's tile reaches both kernels (their pallas_call grids), and off the interpreter
    the heuristic's is the default one."""
    x, t = _specs((300, 50257), jnp.bfloat16)

    def grids(config):
        def backward(x, t):
            out, pull = jax.vjp(lambda y: _loss(y, t, config=config, label_smoothing=0.1), x)
            return pull(jnp.ones_like(out))[0]

        with interface.interpret_mode(False):
            return re.findall(r"grid=\((\d+), (\d+)\)", str(jax.make_jaxpr(backward)(x, t)))

    assert grids(None) == [("3", "13")] * 2  # 128 rows x 4096 lanes, forward and backward
    assert grids(tpu_ce.CrossEntropyPallasTpuConfig(block_rows=32, block_v=1024)) == [("10", "50")] * 2


def test_compiled_tiling_matches_reference_in_the_interpreter():
    """The TPU block width (4096) and several row blocks (ragged rows and vocabulary), in the interpreter."""
    config = tpu_ce.CrossEntropyPallasTpuConfig()  # the compiled-TPU tile, not the interpreter's wider one
    rng = np.random.default_rng(0)
    rows, vocab = 300, 9000  # 3 row blocks of 128 (16-aligned for bf16), 3 vocab blocks of 4096
    logits = jnp.asarray((3.0 * rng.standard_normal((rows, vocab), np.float32)).astype(jnp.bfloat16))
    targets = rng.integers(0, vocab, (rows,), dtype=np.int32)
    targets[::7] = -100
    targets[1], targets[2] = vocab, vocab - 1  # out of range (ignored); the last id, in the ragged block
    targets = jnp.asarray(targets)
    cot = jnp.asarray(rng.standard_normal((rows,), np.float32))
    kwargs = dict(label_smoothing=0.1, z_loss=1e-3, logit_soft_cap=20.0, reduction="none")
    with interface.interpret_mode():
        t = tpu_ce.tiling(rows, vocab, logits.dtype, config)
        assert (t.block_rows, t.block_v, t.grid) == (128, 4096, (3, 3))
        out, pull = jax.vjp(lambda x: _loss(x, targets, config=config, **kwargs), logits)
        grad = pull(cot)[0]
    want, ref_pull = jax.vjp(lambda x: reference.cross_entropy(x, targets, spec=LossSpec(**kwargs)), logits.astype(jnp.float32))
    assert conformance.relative_error(out, want) < 1e-5
    assert grad.dtype == jnp.bfloat16 and conformance.relative_error(grad, ref_pull(cot)[0]) < 1e-2
    assert float(out[1]) == 0.0 and bool(jnp.all(grad[1] == 0))
