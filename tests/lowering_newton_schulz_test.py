"""Cross-lowering of the newton_schulz kernels on CPU: Triton for sm_90, Mosaic TPU for TPU.

`conformance.lowered_text` lowers for "cuda" (jax-triton compiles each @triton.jit kernel to PTX
for sm_90 and embeds it in a `triton_kernel_call`) or "tpu" (Pallas' Mosaic TPU lowering into a
`tpu_custom_call`). A kernel that does not compile fails here; numerics are checked by
tests/newton_schulz_test.py in the interpreters and on the GPU. At the benchmark shapes, 5
steps must lower to 10 Gram-kernel calls (two per step), plus 5 update-kernel calls when the
Triton update runs.

Run: JAX_PLATFORMS=cpu pytest tests/lowering_newton_schulz_test.py (WITHOUT TRITON_INTERPRET).
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import re

import pytest

import conformance

import jax
import jax.numpy as jnp

from forgeax.kernels.common.newton_schulz import NewtonSchulzSpec

SPEC = NewtonSchulzSpec()
TRITON_INTERPRET = os.environ.get("TRITON_INTERPRET", "").strip().lower() in ("1", "true", "yes", "on")


def _g(shape, dtype=jnp.bfloat16):
    return jax.ShapeDtypeStruct(shape, dtype)


@pytest.mark.skipif(TRITON_INTERPRET, reason="cross-lowering needs compiled Triton kernels: unset TRITON_INTERPRET")
@pytest.mark.parametrize("shape,triton_update", [((4096, 4096), False), ((4096, 14336), True), ((3, 33, 17), True)], ids=str)
def test_triton_kernels_lower_for_sm90(shape, triton_update):
    from forgeax.kernels.triton import newton_schulz as triton_ns  # noqa: PLC0415

    config = triton_ns.heuristic_config(_g(shape), spec=SPEC).replace(triton_update=triton_update)
    text = conformance.lowered_text(lambda g: triton_ns.NEWTON_SCHULZ.fn(g, spec=SPEC, config=config), _g(shape), platform="cuda")
    calls = text.count("triton_kernel_call")
    assert calls == 10 + (5 if triton_update else 0), calls


def test_pallas_tpu_gram_kernel_lowers_for_tpu():
    from forgeax.kernels.pallas.tpu import newton_schulz as tpu_ns  # noqa: PLC0415

    shape = (4096, 4096)
    config = tpu_ns.heuristic_config(_g(shape), spec=SPEC)
    text = conformance.lowered_text(lambda g: tpu_ns.NEWTON_SCHULZ.fn(g, spec=SPEC, config=config), _g(shape), platform="tpu")
    assert text.count("@tpu_custom_call") == 10
    assert sorted(set(re.findall(r'kernel_name = "(\w+)"', text))) == ["_gram_kernel"]
