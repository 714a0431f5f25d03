"""Cross-lowering of the ragged_paged_attention kernels on CPU: Triton for sm_90, Mosaic TPU.

`jax.jit(f).trace(...).lower(lowering_platforms=(...))` compiles each Triton kernel to PTX (a
`triton_kernel_call` custom call) and runs the Mosaic TPU lowering (a `tpu_custom_call`): a kernel
that does not compile fails here; numerics are the conformance suites' job.

Run: JAX_PLATFORMS=cpu pytest tests/lowering_ragged_paged_attention_test.py   (WITHOUT TRITON_INTERPRET)
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import pytest

import conformance
from forgeax.kernels.common.attention import AttentionSpec

_needs_triton = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET", "").strip().lower() in ("1", "true", "yes", "on"),
                                   reason="cross-lowering needs compiled Triton kernels: unset TRITON_INTERPRET")

# (T rows, S sequences, N, KV, H, num_pages, page, max_pages, dtype, spec): the benchmark's mixed
# batch (4 prefills of 2048 + 60 decodes at 8192, N32/KV8, H128, page 16), then f32 with a
# window and soft cap, MQA at page 64 with H 64, and f16 non-causal.
CASES = [
    (8252, 64, 32, 8, 128, 33280, 16, 512, jnp.bfloat16, AttentionSpec(causal=True, scale=128 ** -0.5)),
    (300, 5, 8, 2, 96, 40, 16, 8, jnp.float32,
     AttentionSpec(causal=True, scale=0.1, window_left=100, window_right=0, logit_soft_cap=30.0)),
    (77, 3, 8, 1, 64, 9, 64, 3, jnp.bfloat16, AttentionSpec(causal=True, scale=0.125)),
    (40, 3, 12, 4, 128, 12, 16, 4, jnp.float16, AttentionSpec(causal=False, scale=0.1, window_left=7, window_right=3)),
]


def _args(T, S, N, KV, H, P, page, maxp, dtype):
    return (jax.ShapeDtypeStruct((T, N, H), dtype), jax.ShapeDtypeStruct((P, page, KV, H), dtype),
            jax.ShapeDtypeStruct((P, page, KV, H), dtype), jax.ShapeDtypeStruct((S + 1,), jnp.int32),
            jax.ShapeDtypeStruct((S,), jnp.int32), jax.ShapeDtypeStruct((S, maxp), jnp.int32))


@_needs_triton
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"T{c[0]}-N{c[2]}-KV{c[3]}-H{c[4]}-{jnp.dtype(c[8]).name}")
def test_triton_lowers_for_sm90(case):
    from forgeax.kernels.triton import ragged_paged_attention as triton_rpa

    impl = triton_rpa.RAGGED_PAGED_ATTENTION
    spec = case[-1]
    args = _args(*case[:-1])
    configs = [impl.heuristic_config(*args, spec=spec)]
    if case is CASES[0]:
        # The candidates whose kernels differ in structure (tile rows, with or without the split
        # decode branch); the others change block sizes and stages of the same code (CPU time).
        configs = impl.candidate_configs(*args, spec=spec)
        configs = [c for i, c in enumerate(configs)
                   if (c.split_decodes, c.block_q) not in {(d.split_decodes, d.block_q) for d in configs[:i]}]
    for config in configs:
        text = conformance.lowered_text(lambda *a, config=config: impl.fn(*a, spec=spec, config=config), *args,
                                        platform="cuda")
        assert text.count("triton_kernel_call") == 1, config


@pytest.mark.parametrize("case", [c for c in CASES if c[8] != jnp.float16],
                         ids=lambda c: f"T{c[0]}-N{c[2]}-KV{c[3]}-H{c[4]}-{jnp.dtype(c[8]).name}")
def test_pallas_tpu_lowers_for_tpu(case):
    from forgeax.kernels.pallas.tpu import ragged_paged_attention as tpu_rpa

    impl = tpu_rpa.RAGGED_PAGED_ATTENTION
    spec = case[-1]
    args = _args(*case[:-1])
    config = impl.heuristic_config(*args, spec=spec)
    text = conformance.lowered_text(lambda *a: impl.fn(*a, spec=spec, config=config), *args, platform="tpu")
    assert text.count("tpu_custom_call") == 1
