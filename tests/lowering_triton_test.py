"""Cross-lowering of the Triton norm kernels for cuda on CPU (no GPU needed).

`jax.jit(f).trace(...).lower(lowering_platforms=("cuda",))` makes jax-triton
compile each @triton.jit kernel to PTX for sm_90 (launch.py passes
compute_capability=90 when there is no GPU) and embed it in a
`triton_kernel_call` custom call. A kernel that does not compile fails here.
It proves nothing about numerics: interpret mode and the GPU conformance run do.

Run: JAX_PLATFORMS=cpu pytest tests/lowering_triton_test.py   (WITHOUT TRITON_INTERPRET:
with it, @triton.jit builds interpreter objects that jax-triton cannot compile).
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import pytest

import conformance

if os.environ.get("TRITON_INTERPRET", "").strip().lower() in ("1", "true", "yes", "on"):
    pytest.skip("cross-lowering needs compiled Triton kernels: unset TRITON_INTERPRET", allow_module_level=True)

import jax
import jax.numpy as jnp

from forgeax.kernels.triton import norms as triton_norms

CUSTOM_CALL = "triton_kernel_call"

# (norm, x shape, x dtype): the large training shape for all three variants,
# then rows that are not a multiple of any tile, D not a power of two (and not
# a multiple of 8 elements), tiny inputs, the largest supported D.
CASES = [
    ("rms", (32768, 4096), jnp.bfloat16),
    ("layer", (32768, 4096), jnp.bfloat16),
    ("layer_offset", (32768, 4096), jnp.bfloat16),
    ("layer_offset", (257, 1000), jnp.float32),
    ("rms", (3, 5, 7), jnp.float16),
    ("layer", (2, 3, 128), jnp.bfloat16),
    ("rms", (4097, 96), jnp.float32),
    ("layer_offset", (64, 16384), jnp.bfloat16),
]


def _norm(kind):
    if kind == "rms":
        return lambda x, s, o: triton_norms.rms_norm(x, s, eps=1e-6)
    if kind == "layer":
        return lambda x, s, o: triton_norms.layer_norm(x, s, None, eps=1e-5)
    return lambda x, s, o: triton_norms.layer_norm(x, s, o, eps=1e-5)


def _lower_cuda(fn, *args) -> str:
    return conformance.lowered_text(fn, *args, platform='cuda')


@pytest.mark.parametrize("kind,shape,dtype", CASES, ids=lambda v: str(v))
def test_forward_and_backward_lower_to_triton_kernels_for_cuda(kind, shape, dtype):
    d = shape[-1]
    x = jax.ShapeDtypeStruct(shape, dtype)
    p = jax.ShapeDtypeStruct((d,), dtype)
    norm = _norm(kind)

    forward = _lower_cuda(norm, x, p, p)
    assert forward.count(CUSTOM_CALL) == 1, forward[:2000]

    def backward(x, s, o, ct):
        return jax.vjp(norm, x, s, o)[1](ct)

    module = _lower_cuda(backward, x, p, p, x)
    # The forward kernel (residuals) and the backward kernel.
    assert module.count(CUSTOM_CALL) == 2, module[:2000]


def test_explicit_configs_lower():
    x = jax.ShapeDtypeStruct((32768, 4096), jnp.bfloat16)
    p = jax.ShapeDtypeStruct((4096,), jnp.bfloat16)
    for name, config in triton_norms.named_candidates(32768, 4096, jnp.bfloat16).items():
        def loss(x, s, o, config=config):
            return jnp.sum(triton_norms.layer_norm(x, s, o, eps=1e-5, config=config).astype(jnp.float32))

        module = _lower_cuda(jax.grad(loss, argnums=(0, 1, 2)), x, p, p)
        assert module.count(CUSTOM_CALL) == 2, name


def test_supports_refuses_what_the_kernels_cannot_do():
    ok = jax.ShapeDtypeStruct((8, 4096), jnp.bfloat16)
    p = jax.ShapeDtypeStruct((4096,), jnp.bfloat16)
    assert triton_norms.RMS_NORM.supports(ok, p, eps=1e-6) is None
    assert triton_norms.LAYER_NORM.supports(ok, p, p, eps=1e-6) is None
    too_wide = jax.ShapeDtypeStruct((8, triton_norms.MAX_D + 1), jnp.float32)
    wide_p = jax.ShapeDtypeStruct((triton_norms.MAX_D + 1,), jnp.float32)
    reason = triton_norms.LAYER_NORM.supports(too_wide, wide_p, None, eps=1e-6)
    assert reason is not None and str(triton_norms.MAX_D + 1) in reason
    f64 = jax.ShapeDtypeStruct((8, 128), jnp.float64)
    assert triton_norms.RMS_NORM.supports(f64, jax.ShapeDtypeStruct((128,), jnp.float32), eps=1e-6) is not None


# ----------------------------------------------------------------------------- launch configs


def _launches(monkeypatch):
    """Records the kernel name and launch parameters of every jax-triton call (a spy: the call
    goes through unchanged)."""
    import jax_triton

    launches = []
    call = jax_triton.triton_call

    def recording(*args, kernel, grid, num_warps, num_stages, **metaparams):
        launches.append(dict(kernel=kernel.__name__, grid=tuple(grid), num_warps=num_warps, num_stages=num_stages,
                             **{k: v for k, v in metaparams.items() if k != "out_shape"}))
        return call(*args, kernel=kernel, grid=grid, num_warps=num_warps, num_stages=num_stages, **metaparams)

    monkeypatch.setattr(jax_triton, "triton_call", recording)
    return launches


def test_norm_explicit_config_changes_the_launch(monkeypatch):
    x = jax.ShapeDtypeStruct((1000, 1024), jnp.bfloat16)
    p = jax.ShapeDtypeStruct((1024,), jnp.bfloat16)
    config = triton_norms.heuristic_config(x, p, eps=1e-6).replace(fwd_block_rows=1, fwd_num_warps=2, bwd_num_stages=2)
    launches = _launches(monkeypatch)
    loss = lambda x, s: jnp.sum(triton_norms.rms_norm(x, s, eps=1e-6, config=config).astype(jnp.float32))  # noqa: E731
    _lower_cuda(jax.grad(loss, argnums=(0, 1)), x, p)
    forward, backward = launches
    assert (forward["BLOCK_ROWS"], forward["num_warps"], forward["grid"]) == (1, 2, (1000,))
    assert backward["num_stages"] == 2


def _attention_call(H=128, T=256, S=256, N=4, K=2, dtype=jnp.bfloat16, bias=False, **options):
    from forgeax.kernels.common.attention import AttentionSpec

    q = jax.ShapeDtypeStruct((2, T, N, H), dtype)
    k = jax.ShapeDtypeStruct((2, S, K, H), dtype)
    b = jax.ShapeDtypeStruct((2, N, T, S), dtype) if bias else None
    return (q, k, k, b, None, None, None, None), {"spec": AttentionSpec(scale=H**-0.5, **options)}


def _lower_attention(config, args, kwargs):
    from forgeax.kernels.triton.attention import ATTENTION

    def training(q, k, v, bias):
        return jax.vjp(lambda *a: ATTENTION.call((*a, *args[4:]), kwargs, config)[0], q, k, v, bias)[1](
            jnp.ones(q.shape[:3] + (v.shape[3],), q.dtype))

    return _lower_cuda(training, *args[:4])


def test_attention_explicit_config_changes_the_launch(monkeypatch):
    """The config passed is the one the kernels launch with: tiles, warps, stages, the delta
    block and the dq schedule (no `_dq_kernel` without dq_from_dz_tiles)."""
    from forgeax.kernels.triton.attention import ATTENTION

    args, kwargs = _attention_call(causal=True)
    heuristic = ATTENTION.resolve_config(args, kwargs, None, "NVIDIA H200")[0]
    assert heuristic.dq_from_dz_tiles
    config = heuristic.replace(block_m=64, block_n=32, fwd_warps=4, fwd_stages=2, block_n1=64, block_m2=64,
                               delta_block_m=128, dq_from_dz_tiles=False)
    assert ATTENTION.resolve_config(args, kwargs, config, "NVIDIA H200") == (config, "explicit")
    launches = _launches(monkeypatch)
    text = _lower_attention(config, args, kwargs)
    assert text.count(CUSTOM_CALL) == 3
    by_kernel = {launch["kernel"]: launch for launch in launches}
    assert set(by_kernel) == {"_fwd_kernel", "_delta_kernel", "_bwd_kernel"}
    fwd, delta, bwd = by_kernel["_fwd_kernel"], by_kernel["_delta_kernel"], by_kernel["_bwd_kernel"]
    assert (fwd["BM"], fwd["BN"], fwd["num_warps"], fwd["num_stages"], fwd["grid"]) == (64, 32, 4, 2, (4, 8))
    assert (delta["BM"], delta["grid"]) == (128, (2, 8))
    assert (bwd["BM1"], bwd["BN1"], bwd["BM2"], bwd["BN2"], bwd["DZT_OUT"]) == (64, 64, 64, 64, False)
    assert bwd["grid"] == (256 // 64 + 256 // 64, 8)  # dK/dV programs, then dQ programs


def test_attention_tuned_entry_only_for_its_device_kind():
    """tuned/attention.json's H100 entries (128-key forward blocks) apply on an H100 to 16-bit
    calls up to head dim 128 without bias or mask tiles; other devices, other calls and the
    interpreter take the heuristic."""
    from forgeax import core
    from forgeax.kernels.triton.attention import ATTENTION, heuristic_config

    h100, h200 = "NVIDIA H100 80GB HBM3", "NVIDIA H200"
    args, kwargs = _attention_call(causal=True)
    config, source = ATTENTION.resolve_config(args, kwargs, None, h100)
    assert source.startswith("tuned for NVIDIA H100") and "attention_H100" in source
    assert config == heuristic_config(*args, **kwargs).replace(block_n=128)
    assert ATTENTION.resolve_config(args, kwargs, None, h200) == (heuristic_config(*args, **kwargs), "heuristic")
    h64 = _attention_call(H=64)
    config, source = ATTENTION.resolve_config(*h64, None, h100)
    assert source.startswith("tuned") and config.block_n == 128 and not config.dq_from_dz_tiles
    assert config == heuristic_config(*h64[0], **h64[1]).replace(block_n=128)
    for other in (_attention_call(bias=True), _attention_call(H=256), _attention_call(dtype=jnp.float32)):
        assert ATTENTION.resolve_config(*other, None, h100)[1] == "heuristic"
    with core.interpret_mode():
        config, source = ATTENTION.resolve_config(args, kwargs, None, h100)
        assert source == "heuristic" and config == heuristic_config(*args, **kwargs) and config.block_n == 16


def test_attention_tuned_entries_are_valid_and_cite_committed_results():
    import pathlib

    from forgeax.kernels.triton.attention import ATTENTION, TritonAttentionConfig

    results = pathlib.Path(__file__).resolve().parent.parent / "benchmarks" / "results"
    for entry in ATTENTION.tuned.entries:
        TritonAttentionConfig.from_dict(entry.config)
        assert entry.evidence.startswith("benchmarks/results/"), entry
        if results.is_dir():  # absent in a Bazel sandbox
            assert (results.parent.parent / entry.evidence).is_file(), entry.evidence


def test_attention_config_errors_name_the_field():
    from forgeax.kernels.triton.attention import TritonAttentionConfig, heuristic_config

    base = heuristic_config(*_attention_call()[0], **_attention_call()[1])
    for field, value in (("block_m", 48), ("block_n", 8), ("block_n2", 0), ("fwd_warps", 3), ("bwd_warps", True),
                         ("fwd_stages", 0), ("bwd_stages", 1.5), ("delta_block_m", 24), ("dq_from_dz_tiles", 1)):
        with pytest.raises(ValueError, match=rf"TritonAttentionConfig\.{field}:"):
            base.replace(**{field: value})
    with pytest.raises(TypeError):
        TritonAttentionConfig(32, 16, 4, 1, 16, 32, 32, 16, 4, 1, 32, False)  # keyword-only
    with pytest.raises(ValueError, match="unknown fields"):
        TritonAttentionConfig.from_dict({**base.to_dict(), "block_k": 64})
    assert TritonAttentionConfig.from_dict(base.to_dict()) == base


@pytest.mark.parametrize("call", ["bf16 H128 causal", "bf16 H64 bias", "f16 H256", "f32 H128"])
def test_attention_candidate_configs_are_valid_and_compile(call):
    """The search space starts with the heuristic, holds no duplicates, keeps forward key blocks
    <= 64 with streamed bias tiles, and every config of it compiles (fwd+bwd; a sample of them
    for the 16-bit H128 space, which was timed on an H100)."""
    from forgeax.kernels.triton.attention import candidate_configs, heuristic_config

    args, kwargs = {
        "bf16 H128 causal": _attention_call(causal=True),
        "bf16 H64 bias": _attention_call(H=64, bias=True),
        "f16 H256": _attention_call(H=256, dtype=jnp.float16, causal=True),
        "f32 H128": _attention_call(dtype=jnp.float32),
    }[call]
    configs = candidate_configs(*args, **kwargs)
    assert configs[0] == heuristic_config(*args, **kwargs)
    assert len(set(configs)) == len(configs) > 8
    if args[3] is not None:
        assert all(c.block_n <= 64 for c in configs)
    sample = configs if call != "bf16 H128 causal" else configs[::4]
    for config in sample[:4]:
        assert _lower_attention(config, args, kwargs).count(CUSTOM_CALL) >= 3, config
