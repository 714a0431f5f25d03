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


# ----------------------------------------------------------------------------- attention configs


def _attention_call(T=1000, S=1000, H=128, dtype=jnp.bfloat16, mask=False):
    from forgeax.kernels.common.attention import AttentionSpec

    q = jax.ShapeDtypeStruct((2, T, 4, H), dtype)
    k = jax.ShapeDtypeStruct((2, S, 2, H), dtype)
    m = jax.ShapeDtypeStruct((1, 1, T, S), jnp.bool_) if mask else None
    return (q, k, k, None, m, None, None, None), {"spec": AttentionSpec(causal=True, scale=H**-0.5)}


def _lower_attention(config, args, kwargs):
    from forgeax.kernels.pallas.tpu.attention import ATTENTION

    def training(q, k, v, bias, mask):
        return jax.vjp(lambda *a: ATTENTION.call((*a, bias, mask, *args[5:]), kwargs, config)[0], q, k, v)[1](
            jnp.ones(q.shape[:3] + (v.shape[3],), q.dtype))

    return _lower_tpu(training, *args[:5])


def test_attention_config_errors_name_the_field():
    from forgeax.kernels.pallas.tpu.attention import PallasTpuAttentionConfig, heuristic_config

    base = heuristic_config(*_attention_call()[0], **_attention_call()[1])
    for field, value in (("block_q", 100), ("block_k", 64), ("bwd_block_q", 0), ("bwd_block_k", 130),
                         ("block_q", True)):
        with pytest.raises(ValueError, match=rf"PallasTpuAttentionConfig\.{field}:"):
            base.replace(**{field: value})
    with pytest.raises(TypeError):
        PallasTpuAttentionConfig(512, 512, 256, 512)  # keyword-only
    assert PallasTpuAttentionConfig.from_dict(base.to_dict()) == base


def test_attention_heuristic_takes_small_blocks_in_the_interpreter():
    from forgeax import core
    from forgeax.kernels.pallas.tpu.attention import ATTENTION, PallasTpuAttentionConfig

    args, kwargs = _attention_call()
    compiled = PallasTpuAttentionConfig(block_q=512, block_k=512, bwd_block_q=256, bwd_block_k=512)
    assert ATTENTION.resolve_config(args, kwargs, None, "TPU v5 lite") == (compiled, "heuristic")
    with core.interpret_mode():
        interpreted = PallasTpuAttentionConfig(block_q=64, block_k=128, bwd_block_q=64, bwd_block_k=128)
        assert ATTENTION.resolve_config(args, kwargs, None, "cpu") == (interpreted, "heuristic")


def test_attention_explicit_config_sets_the_blocks():
    """The blocks of the config passed are the caps of the call's layout (each block as small as
    covers the sequence, query blocks aligned to the dtypes' rows) and change the lowered kernels."""
    from forgeax.kernels.pallas.tpu import attention as tpu_attention

    args, kwargs = _attention_call()
    heuristic = tpu_attention.heuristic_config(*args, **kwargs)
    config = heuristic.replace(block_q=128, block_k=256, bwd_block_q=8, bwd_block_k=128)
    layout = lambda backward, a=args: tpu_attention._layout(*a[:6], config, backward=backward)  # noqa: E731
    assert (layout(False).bq, layout(False).bk) == (128, 256)  # T = 1000: 8 blocks of 125 -> 128
    assert (layout(True).bq, layout(True).bk) == (16, 128)  # bf16 rows align to 16
    masked = _attention_call(mask=True)[0]
    assert layout(True, masked).bq == 32  # int8 mask rows align to 32
    text = _lower_attention(config, args, kwargs)
    assert text.count("tpu_custom_call") == 3
    assert text != _lower_attention(heuristic, args, kwargs)


@pytest.mark.parametrize("call", ["bf16 causal", "f32 H64 mask T300"])
def test_attention_candidate_configs_are_valid_and_lower(call):
    from forgeax.kernels.pallas.tpu.attention import candidate_configs, heuristic_config

    args, kwargs = {"bf16 causal": _attention_call(),
                    "f32 H64 mask T300": _attention_call(T=300, S=700, H=64, dtype=jnp.float32, mask=True)}[call]
    configs = candidate_configs(*args, **kwargs)
    assert configs[0] == heuristic_config(*args, **kwargs)
    assert len(set(configs)) == len(configs) > 8
    for config in configs:
        assert _lower_attention(config, args, kwargs).count("tpu_custom_call") == 3, config
