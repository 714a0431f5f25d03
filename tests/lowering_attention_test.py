"""Cross-lowering of the attention kernels on CPU: Triton -> PTX (sm_90), Mosaic GPU, Mosaic TPU.

Each backend's forward and forward+backward at the benchmark shapes must lower for its platform
and contain its kernel custom calls (and no fallback to XLA: the public op is called with an
implementation of that backend directly, never a fallback). A kernel that does not
compile (shared memory, layouts, unsupported ops) fails here without a GPU or TPU. Numerics are
proven by the interpret-mode suites and the GPU run.
"""

from __future__ import annotations

import math
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import pytest

import conformance

if os.environ.get("TRITON_INTERPRET", "").strip().lower() in ("1", "true", "yes", "on"):
    pytest.skip("cross-lowering needs compiled Triton kernels: unset TRITON_INTERPRET", allow_module_level=True)

import jax
import jax.numpy as jnp

from forgeax.kernels.common.attention import AttentionSpec
from forgeax import core as interface

MARKER = {
    "triton": ("cuda", "triton_kernel_call"),
    "pallas_gpu": ("cuda", "mosaic_gpu"),
    "pallas_tpu": ("tpu", "tpu_custom_call"),
}

# (B, T, S, N, K, H, options)
SHAPES = {
    "bench causal H128": (4, 4096, 4096, 32, 32, 128, dict(causal=True)),
    "gqa T8192": (1, 8192, 8192, 32, 8, 128, dict(causal=True)),
    "H64 full": (4, 4096, 4096, 32, 32, 64, {}),
    "H256 causal": (2, 4096, 4096, 16, 16, 256, dict(causal=True)),
    "window + soft cap": (1, 4096, 4096, 8, 8, 128, dict(causal=True, window=(1024, 0), logit_soft_cap=50.0)),
    "packed segments": (2, 4096, 4096, 16, 16, 128, dict(causal=True, segments=True)),
    "packed segments H64 GQA": (2, 4096, 4096, 16, 4, 64, dict(segments=True)),
    "packed segments H256": (1, 4096, 4096, 8, 8, 256, dict(causal=True, segments=True)),
    "unaligned T1000 S3000 soft cap": (2, 1000, 3000, 16, 4, 128, dict(causal=True, logit_soft_cap=50.0)),
    # Not causal: pallas_gpu masks the keys past S by a column limit (`Band.cols`); S not a
    # multiple of 8: its arrays are padded (a Mosaic GPU TMA array needs whole 8-row tiles).
    "unaligned full T1000 S1100 H64": (2, 1000, 1100, 8, 8, 64, {}),
    # jax.vmap over a leading axis of 3 (the kernels' batching rules, scalar prefetch included).
    "packed segments under vmap": (2, 1024, 1024, 8, 4, 128, dict(causal=True, segments=True, vmap=3)),
    # A bias of the full [B, N] extent, and one broadcast over both (pallas_tpu's dbias kernel).
    "bias": (2, 1024, 1024, 4, 2, 128, dict(causal=True, bias=(2, 4))),
    "broadcast bias + segments": (2, 2048, 2048, 8, 4, 128, dict(causal=True, segments=True, bias=(1, 1))),
    # MLA's unequal head dims (pallas_gpu computes v's at 128), and a v narrower than q/k at 128;
    # 96 (pallas_gpu's 64-byte-swizzled kernels; pallas_tpu pads it to 128); 80, which pallas_gpu
    # pads to 96.
    "MLA H192 v128": (2, 4096, 4096, 16, 16, 192, dict(causal=True, Hv=128)),
    "H128 v64 GQA": (2, 4096, 4096, 16, 4, 128, dict(causal=True, Hv=64)),
    "H96 packed segments": (2, 4096, 4096, 32, 32, 96, dict(causal=True, segments=True)),
    "H80 GQA window": (1, 4096, 4096, 16, 4, 80, dict(causal=True, window=(1024, 0))),
}


def _lower(backend, shape, backward, device_kind=None):
    """Lowers the backend's implementation itself (the public op would refuse it: this is a CPU),
    with the config `resolve_config` gives for `device_kind` (None: the heuristic's)."""
    B, T, S, N, K, H, options = shape
    platform, _ = MARKER[backend]
    left, right = options.get("window", (None, None))
    spec = AttentionSpec(
        causal=options.get("causal", False), scale=1.0 / math.sqrt(H), window_left=left,
        window_right=0 if options.get("causal") else right, logit_soft_cap=options.get("logit_soft_cap"),
    )
    q = jax.ShapeDtypeStruct((B, T, N, H), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((B, S, K, H), jnp.bfloat16)
    v = jax.ShapeDtypeStruct((B, S, K, options.get("Hv", H)), jnp.bfloat16)
    segments = (jax.ShapeDtypeStruct((B, T), jnp.int32), jax.ShapeDtypeStruct((B, S), jnp.int32))
    if not options.get("segments"):
        segments = (None, None)
    bias = jax.ShapeDtypeStruct((*options["bias"], T, S), jnp.bfloat16) if "bias" in options else None
    mask = jax.ShapeDtypeStruct((*options["mask"], T, S), jnp.bool_) if "mask" in options else None
    impl = interface.OPS["attention"].implementation(backend)
    assert not isinstance(impl, str), impl
    reason = impl.supports(q, k, v, bias, mask, *segments, None, spec=spec)
    if reason is not None:
        pytest.skip(f"{backend} refuses {shape}: {reason}")

    with interface.interpret_mode(False):  # the config of a compiled kernel, whatever the environment
        config, _ = impl.resolve_config((q, k, v, bias, mask, *segments, None), {"spec": spec}, None, device_kind)

    def forward(q, k, v, bias, mask, *segment_ids):
        return impl.call((q, k, v, bias, mask, *(segment_ids or (None, None)), None), {"spec": spec}, config)[0]

    def training(q, k, v, bias, mask, *segment_ids):
        out, pull = jax.vjp(lambda q, k, v, bias: forward(q, k, v, bias, mask, *segment_ids), q, k, v, bias)
        return pull(out)

    args = (q, k, v, bias, mask) + (segments if segments[0] is not None else ())
    fn = training if backward else forward
    if options.get("vmap"):
        fn = jax.vmap(fn)
        args = tuple(None if a is None else jax.ShapeDtypeStruct((options["vmap"], *a.shape), a.dtype) for a in args)
    return conformance.lowered_text(fn, *args, platform=platform)


@pytest.mark.parametrize("backward", [False, True], ids=["fwd", "fwd+bwd"])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("backend", MARKER)
def test_attention_lowers_to_its_kernels(backend, shape, backward):
    text = _lower(backend, SHAPES[shape], backward)
    marker = MARKER[backend][1]
    # Forward: one kernel at least; with the backward: at least two (the backward kernels).
    assert text.count(marker) >= (2 if backward else 1), f"{backend} {shape}: {text.count(marker)} kernel calls"


# Hopper's largest shared memory allocation per block (227 KB), what a launch is refused above.
HOPPER_SHARED_MEMORY = 232448

TILE_INPUTS = {
    "none": dict(causal=True),
    "bias": dict(causal=True, bias=(2, 4)),
    "mask": dict(causal=True, mask=(2, 1)),
    "segments + shared bias": dict(causal=True, segments=True, bias=(1, 1)),
    # Without segments the dbias kernel's (b, n) loop is software-pipelined: q, dO, K, V tiles per stage.
    "shared bias": dict(causal=True, bias=(1, 1)),
    "per-head bias": dict(causal=True, bias=(1, 4)),
}


@pytest.mark.parametrize("H", [128, 256])
@pytest.mark.parametrize("inputs", TILE_INPUTS)
@pytest.mark.parametrize("kind", ["NVIDIA H100 80GB HBM3", "NVIDIA H200"])
def test_triton_kernels_fit_hopper_shared_memory(kind, inputs, H, monkeypatch):
    """Every Triton kernel of a 16-bit forward+backward, with the config resolved for `kind` (a
    tuned entry of kernels/triton/tuned/attention.json or the heuristic), asks for no more shared
    memory than Hopper has: the pipeline buffers bias and mask tiles too, which a launch on the GPU
    refuses above 227 KB (an H100 run caught the forward's 128-key block with a bias asking for
    288 KB)."""
    from jax_triton import triton_lib

    monkeypatch.setattr(triton_lib, "_COMPILED_KERNEL_CACHE", {})  # compile here, not from cache
    compiled = []
    compile_ptx = triton_lib.compile_ttir_to_ptx_inplace

    def recording(*args, **kwargs):
        result = compile_ptx(*args, **kwargs)
        compiled.append((result.name, result.shared_mem_bytes))
        return result

    monkeypatch.setattr(triton_lib, "compile_ttir_to_ptx_inplace", recording)
    _lower("triton", (2, 512, 512, 4, 2, H, TILE_INPUTS[inputs]), backward=True, device_kind=kind)
    names = {name for name, _ in compiled}
    assert {"_fwd_kernel", "_bwd_kernel"} <= names, compiled
    too_big = [(name, size) for name, size in compiled if size > HOPPER_SHARED_MEMORY]
    assert not too_big, f"{kind} {inputs} H{H}: {too_big} bytes of shared memory > {HOPPER_SHARED_MEMORY}"


def test_triton_forward_key_block_follows_the_device_kind():
    """The 16-bit head_dim <= 128 forward takes its key block from the device kind (a tuned entry
    per device), except when it streams bias or mask tiles (shared memory, see above)."""
    from forgeax.kernels.triton.attention import ATTENTION

    def config(kind, H, scores=False):
        q = jax.ShapeDtypeStruct((1, 256, 4, H), jnp.bfloat16)
        bias = jax.ShapeDtypeStruct((1, 4, 256, 256), jnp.bfloat16) if scores else None
        return ATTENTION.resolve_config((q, q, q, bias, None, None, None, None), {"spec": AttentionSpec()}, None,
                                        kind)[0]

    for kind, block_n in (("NVIDIA H100 80GB HBM3", 128), ("NVIDIA H200", 64)):
        assert config(kind, 128).block_n == block_n
        assert config(kind, 64, scores=True).block_n == 64
        assert config(kind, 256) == config("NVIDIA H200", 256)
