"""Cross-lowering of the Mosaic TPU norm kernels on CPU (no TPU needed).

`jax.jit(f).trace(...).lower(lowering_platforms=("tpu",))` runs Pallas' TPU
lowering: BlockSpec legality ((8, 128) rule), kernel tracing and the conversion
to the Mosaic dialect, ending in a `tpu_custom_call`. It does not run Mosaic's
layout passes (those live in libtpu), so this catches compile errors on our
side, not everything the TPU compiler might reject. Numerics are checked in
interpret mode by the conformance suite.

Run: JAX_PLATFORMS=cpu pytest tests/lowering_pallas_tpu_test.py
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import pytest

import conformance
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from forgeax.kernels.pallas.tpu import norms as tpu_norms

# (x shape, x dtype): the large training shape plus shapes whose rows are not a
# multiple of the row block and whose D is not a multiple of 128.
CASES = [
    ((32768, 4096), jnp.bfloat16),
    ((257, 4096), jnp.float32),
    ((257, 4096), jnp.bfloat16),
    ((3, 5, 1000), jnp.bfloat16),
    ((1, 7), jnp.float16),
    ((300, 7), jnp.float32),
    ((2, 3, 128), jnp.float16),
    ((4, 1000, 96), jnp.bfloat16),
]

NORMS = {
    "rms": lambda x, s, o: tpu_norms.RMS_NORM.fn(x, s, eps=1e-6),
    "layer": lambda x, s, o: tpu_norms.LAYER_NORM.fn(x, s, o, eps=1e-6),
    "layer_nobias": lambda x, s, o: tpu_norms.LAYER_NORM.fn(x, s, None, eps=1e-6),
}


def _lower_tpu(fn, *args) -> str:
    return conformance.lowered_text(fn, *args, platform='tpu')


def _specs(shape, dtype):
    d = shape[-1]
    return (
        jax.ShapeDtypeStruct(shape, dtype),
        jax.ShapeDtypeStruct((d,), jnp.float32),
        jax.ShapeDtypeStruct((d,), jnp.float32),
    )


@pytest.mark.parametrize("norm", sorted(NORMS))
@pytest.mark.parametrize("shape,dtype", CASES, ids=lambda c: str(c) if isinstance(c, tuple) else jnp.dtype(c).name)
def test_forward_lowers_to_one_mosaic_kernel(norm, shape, dtype):
    fn = NORMS[norm]
    text = _lower_tpu(fn, *_specs(shape, dtype))
    assert text.count("@tpu_custom_call") == 1
    assert 'kernel_name = "_fwd_kernel"' in text


@pytest.mark.parametrize("norm", sorted(NORMS))
@pytest.mark.parametrize("shape,dtype", CASES, ids=lambda c: str(c) if isinstance(c, tuple) else jnp.dtype(c).name)
def test_backward_lowers_to_mosaic_kernels(norm, shape, dtype):
    fn = NORMS[norm]
    with_offset = norm == "layer"

    def loss(x, s, o):
        return jnp.sum(fn(x, s, o).astype(jnp.float32) ** 2)

    argnums = (0, 1, 2) if with_offset else (0, 1)
    text = _lower_tpu(jax.grad(loss, argnums=argnums), *_specs(shape, dtype))
    # The gradient is the backward kernel (custom_vjp), not autodiff through the forward.
    assert text.count("@tpu_custom_call") == 2
    assert 'kernel_name = "_fwd_kernel"' in text
    assert 'kernel_name = "_bwd_kernel"' in text


def test_vmapped_gradient_lowers():
    x, s, o = _specs((3, 33, 1000), jnp.bfloat16)
    sb = jax.ShapeDtypeStruct((3, 1000), jnp.float32)

    def loss(x, s, o):  # batched scale: the backward runs once per batch element
        return jnp.sum(jax.vmap(NORMS["layer"])(x, s, jnp.broadcast_to(o, s.shape)).astype(jnp.float32))

    text = _lower_tpu(jax.grad(loss, argnums=(0, 1, 2)), x, sb, o)
    assert 'kernel_name = "_bwd_kernel"' in text


@pytest.mark.parametrize("rows", [1, 7, 8, 15, 16, 17, 257, 1000, 32768, 100_003])
@pytest.mark.parametrize("d", [7, 96, 1000, 4096, 8192, 16384])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_block_rows_obey_the_tpu_tiling_rule(rows, d, dtype):
    block = tpu_norms.block_rows(rows, d, dtype)
    align = 8 if jnp.dtype(dtype).itemsize == 4 else 16
    assert 1 <= block <= rows
    assert block == rows or block % align == 0


def test_supports_refuses_with_reasons():
    f32 = jnp.float32
    ok = tpu_norms.RMS_NORM.supports(jax.ShapeDtypeStruct((8, 4096), jnp.bfloat16), jax.ShapeDtypeStruct((4096,), f32), eps=1e-6)
    assert ok is None
    big = tpu_norms.LAYER_NORM.supports(jax.ShapeDtypeStruct((8, 1 << 20), f32), jax.ShapeDtypeStruct((1 << 20,), f32), None, eps=1e-6)
    assert big is not None and "VMEM" in big
    f64 = tpu_norms.RMS_NORM.supports(jax.ShapeDtypeStruct((8, 128), jnp.float64), jax.ShapeDtypeStruct((128,), f32), eps=1e-6)
    assert f64 is not None and "float64" in f64


def test_lowering_check_rejects_an_illegal_block():
    """The harness can fail: a (7, 1000) block of a (64, 1000) array breaks the (8, 128) rule."""

    def copy(x_ref, o_ref):
        o_ref[...] = x_ref[...]

    def bad(x):
        spec = pl.BlockSpec((7, 1000), lambda i: (i, 0))
        return pl.pallas_call(
            copy,
            grid=(10,),
            in_specs=[spec],
            out_specs=spec,
            out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
            compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",)),
        )(x)

    with pytest.raises(ValueError, match="divisible by 8 and 128"):
        _lower_tpu(bad, jax.ShapeDtypeStruct((64, 1000), jnp.float32))
