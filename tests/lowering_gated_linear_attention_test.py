"""Cross-lowering of the gated linear attention kernels on CPU (no accelerator needed).

`jax.jit(f).trace(...).lower(lowering_platforms=(...))` runs the whole Python side of each
kernel's compilation: Triton to PTX for sm_90 (`triton_kernel_call` custom calls). A kernel that
does not compile fails here; numerics are the conformance suites' job.

Run: JAX_PLATFORMS=cpu pytest tests/lowering_gated_linear_attention_test.py   (WITHOUT TRITON_INTERPRET)
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import pytest

import conformance
from forgeax.kernels.common.gated_linear_attention import GLASpec

_TRITON_INTERPRET = os.environ.get("TRITON_INTERPRET", "").strip().lower() in ("1", "true", "yes", "on")

# (B, T, N, K, V, chunk, dtype, packed sequences): the benchmark head dims, an odd length with
# K != V in f32, and packed sequences.
CASES = [
    (1, 256, 2, 128, 128, 64, jnp.bfloat16, 0),
    (2, 65, 3, 48, 80, 16, jnp.float32, 0),
    (1, 100, 2, 64, 64, 32, jnp.float16, 3),
]
_IDS = lambda c: f"B{c[0]}-T{c[1]}-N{c[2]}-K{c[3]}-V{c[4]}-C{c[5]}-{jnp.dtype(c[6]).name}-seqs{c[7]}"  # noqa: E731


def _args(b, t, n, kd, vd, chunk, dtype, seqs):
    seqs_or_b = seqs or b
    arrays = (jax.ShapeDtypeStruct((b, t, n, kd), dtype), jax.ShapeDtypeStruct((b, t, n, kd), dtype),
              jax.ShapeDtypeStruct((b, t, n, vd), dtype), jax.ShapeDtypeStruct((b, t, n, kd), jnp.float32),
              jax.ShapeDtypeStruct((seqs_or_b, n, kd, vd), jnp.float32))
    cu = jax.ShapeDtypeStruct((seqs + 1,), jnp.int32) if seqs else None
    return arrays, cu, GLASpec(scale=kd ** -0.5, chunk_size=chunk)


def _check(impl, platform, custom_call, case, forward_calls, backward_calls):
    arrays, cu, spec = _args(*case)
    config = impl.heuristic_config(*arrays, None, cu, spec=spec) if impl.config_type else None
    kwargs = {"spec": spec} | ({"config": config} if config is not None else {})

    def forward(q, k, v, g, init, *maybe_cu):
        return impl.fn(q, k, v, g, init, maybe_cu[0] if maybe_cu else None, **kwargs)

    def fwd_bwd(q, k, v, g, init, do, dfinal, *maybe_cu):
        out, pullback = jax.vjp(lambda *a: forward(*a, *maybe_cu), q, k, v, g, init)
        return out, pullback((do, dfinal))

    extra = (cu,) if cu is not None else ()
    text = conformance.lowered_text(forward, *arrays, *extra, platform=platform)
    assert text.count(custom_call) == forward_calls, text[:2000]
    do = jax.ShapeDtypeStruct(arrays[2].shape, arrays[0].dtype)
    text = conformance.lowered_text(fwd_bwd, *arrays, do, arrays[4], *extra, platform=platform)
    assert text.count(custom_call) == forward_calls + backward_calls, text[:2000]


@pytest.mark.skipif(_TRITON_INTERPRET, reason="cross-lowering needs compiled Triton kernels: unset TRITON_INTERPRET")
@pytest.mark.parametrize("case", CASES, ids=_IDS)
def test_triton_forward_and_backward_lower_for_sm90(case):
    from forgeax.kernels.triton import gated_linear_attention as triton_gla

    # Forward: states + output; backward: dH, dq/dk, dv.
    _check(triton_gla.GATED_LINEAR_ATTENTION, "cuda", "triton_kernel_call", case, 2, 3)


@pytest.mark.skipif(_TRITON_INTERPRET, reason="cross-lowering needs compiled Triton kernels: unset TRITON_INTERPRET")
def test_triton_candidate_configs_are_valid_and_lower():
    """The autotune search space starts with the heuristic, holds no duplicates, rejects bad
    fields by name, and its most different members (4 warps, the widest K block) compile."""
    from forgeax.kernels.triton import gated_linear_attention as triton_gla

    impl = triton_gla.GATED_LINEAR_ATTENTION
    arrays, cu, spec = _args(*CASES[0])
    configs = impl.candidate_configs(*arrays, None, cu, spec=spec)
    assert configs[0] == impl.heuristic_config(*arrays, None, cu, spec=spec)
    assert len(set(configs)) == len(configs) >= 6
    for field, value in (("block_k", 48), ("num_warps", 3), ("num_stages", 0)):
        with pytest.raises(ValueError, match=field):
            configs[0].replace(**{field: value})
    for config in (configs[1], max(configs, key=lambda c: c.block_k)):
        def forward(q, k, v, g, init, config=config):
            return impl.fn(q, k, v, g, init, None, spec=spec, config=config)

        assert conformance.lowered_text(forward, *arrays, platform="cuda").count("triton_kernel_call") == 2


@pytest.mark.parametrize("case", CASES, ids=_IDS)
def test_pallas_tpu_forward_and_backward_lower_for_tpu(case):
    from forgeax.kernels.pallas.tpu import gated_linear_attention as tpu_gla

    # Forward: one sequential kernel; backward: one reverse kernel.
    _check(tpu_gla.GATED_LINEAR_ATTENTION, "tpu", "tpu_custom_call", case, 1, 1)
