"""forgeax's calls work with JAX's persistent compilation cache: a second process compiles nothing.

Each check runs the same script twice in fresh processes sharing a cache directory and counts
XLA compiles (JAX's monitoring events). On CPU: ops on their XLA backends (forward and
gradient), and a Pallas kernel in the Mosaic TPU interpreter (a host callback, cached as well).
Triton: jax-triton compiles each kernel to PTX while JAX lowers, before JAX's cache is
consulted; forgeax's TTIR -> PTX disk cache (kernels/triton/compile_cache.py) makes a second
process compile no kernel: checked by cross-lowering for cuda here. `forgeax.export.cached` keeps
the lowered program too: a second process neither traces nor compiles. On a GPU,
`test_gpu_attention_is_ready_fast_from_a_warm_cache` times a causal attention forward+backward
(pallas_gpu and triton) in a cold and a warm process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

_RUNNER = textwrap.dedent("""
    import json, os, sys, time
    import jax
    from jax import monitoring
    # Per compile JAX records a request; then a hit (read from the cache) or, after compiling,
    # a miss (written to it).
    events = {"compile_requests_use_cache": "requests", "cache_hits": "cache_hits", "cache_misses": "compiled"}
    counts = dict.fromkeys(events.values(), 0)
    def on_event(name, **kw):
        key = events.get(name.rsplit("/", 1)[-1])
        if name.startswith("/jax/compilation_cache/") and key:
            counts[key] += 1
    monitoring.register_event_listener(on_event)
    jax.config.update("jax_compilation_cache_dir", sys.argv[1])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    import jax.numpy as jnp
    import forgeax
    from forgeax import ops
    start = time.perf_counter()
    {body}
    counts["seconds"] = time.perf_counter() - start
    print("RESULT", json.dumps(counts))
""")

_XLA_BODY = """
    x = jax.random.normal(jax.random.key(0), (64, 96), jnp.float32)
    s = jnp.ones((96,), jnp.float32)
    t = jax.random.randint(jax.random.key(1), (64,), 0, 96)
    loss = lambda x, s: ops.cross_entropy(ops.rms_norm(x, s, backend="xla") * 3.0, t, backend="xla")
    jax.block_until_ready(jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(x, s))
"""

_EXPORT_CACHED_BODY = """
    traced = []
    def step(x, s):
        traced.append(1)
        loss = lambda x, s: jnp.sum(ops.rms_norm(x, s, backend="xla") ** 2)
        return jax.grad(loss, argnums=(0, 1))(x, s)
    cached = forgeax.export.cached(step, key="step v1")
    x = jax.random.normal(jax.random.key(0), (64, 96), jnp.float32)
    out = jax.block_until_ready(cached(x, jnp.ones((96,), jnp.float32)))
    counts["traced"] = len(traced)
    counts["sum"] = float(sum(jnp.sum(o) for o in out))
"""

_PALLAS_INTERPRET_BODY = """
    with forgeax.interpret_mode():
        x = jax.random.normal(jax.random.key(0), (16, 128), jnp.float32)
        jax.block_until_ready(jax.jit(lambda x: ops.rms_norm(x, jnp.ones((128,)), backend="pallas_tpu"))(x))
"""

_TRITON_LOWER_BODY = """
    from forgeax.examples.custom_kernel import softcap_triton
    from forgeax.kernels.triton import compile_cache
    config = softcap_triton.SoftcapConfig(block=512)
    fn = lambda x: softcap_triton.softcap(x, cap=30.0, config=config)
    grad = jax.value_and_grad(lambda x: jnp.sum(fn(x).astype(jnp.float32)))
    x = jax.ShapeDtypeStruct((3, 1000), jnp.bfloat16)
    with forgeax.interpret_mode(False):
        text = jax.jit(grad).trace(x).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("triton_kernel_call") == 2
    counts.update(compile_cache.stats())
"""


def _run(body: str, cache: str, **env: str) -> dict:
    script = _RUNNER.replace("{body}", textwrap.dedent(body).strip())
    environ = {**os.environ, "JAX_PLATFORMS": "cpu", **env}
    environ.pop("TRITON_INTERPRET", None)  # compiled Triton kernels (cross-lowering), not the interpreter
    done = subprocess.run([sys.executable, "-c", script, cache], env=environ, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    line = next(l for l in done.stdout.splitlines() if l.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


def test_xla_backends_second_process_compiles_nothing(tmp_path):
    first = _run(_XLA_BODY, str(tmp_path))
    assert first["compiled"] >= 1 and first["cache_hits"] == 0, first
    entries = sorted(os.listdir(tmp_path))
    second = _run(_XLA_BODY, str(tmp_path))
    assert second["compiled"] == 0 and second["cache_hits"] == second["requests"] >= 1, second
    assert sorted(os.listdir(tmp_path)) == entries  # nothing new written


def test_export_cached_second_process_neither_traces_nor_compiles(tmp_path):
    """forgeax.export.cached keeps the lowered program (jax.export) beside JAX's cache: a new
    process skips tracing and lowering (where Triton and Mosaic GPU kernels compile) too."""
    first = _run(_EXPORT_CACHED_BODY, str(tmp_path))
    assert first["traced"] == 1 and first["compiled"] >= 1, first
    assert len(os.listdir(tmp_path / "forgeax-export")) == 1
    second = _run(_EXPORT_CACHED_BODY, str(tmp_path))
    assert second["traced"] == 0 and second["compiled"] == 0 and second["cache_hits"] >= 1, second
    assert second["sum"] == first["sum"]


def test_pallas_tpu_interpreter_second_process_compiles_nothing(tmp_path):
    """The interpreter runs behind a pure_callback; JAX persists such executables too."""
    first = _run(_PALLAS_INTERPRET_BODY, str(tmp_path), FORGEAX_INTERPRET="1")
    assert first["compiled"] >= 1, first
    second = _run(_PALLAS_INTERPRET_BODY, str(tmp_path), FORGEAX_INTERPRET="1")
    assert second["compiled"] == 0 and second["cache_hits"] == second["requests"] >= 1, second


def test_triton_kernels_second_process_compiles_no_kernel(tmp_path):
    pytest.importorskip("jax_triton")
    triton_dir = tmp_path / "triton"
    first = _run(_TRITON_LOWER_BODY, str(tmp_path / "jax"), FORGEAX_TRITON_CACHE_DIR=str(triton_dir))
    assert first["misses"] == 2 and first["hits"] == 0, first  # the forward and backward kernels
    assert len(os.listdir(triton_dir)) == 2
    second = _run(_TRITON_LOWER_BODY, str(tmp_path / "jax"), FORGEAX_TRITON_CACHE_DIR=str(triton_dir))
    assert second["misses"] == 0 and second["hits"] == 2, second
    # Without FORGEAX_TRITON_CACHE_DIR, JAX's cache directory is used (<dir>/forgeax-triton).
    third = _run(_TRITON_LOWER_BODY, str(tmp_path / "jax"))
    assert third["misses"] == 2 and os.path.isdir(tmp_path / "jax" / "forgeax-triton"), third


_GPU_ATTENTION_BODY = """
    import os
    os.environ.setdefault("FORGEAX_TRITON_CACHE_DIR", os.path.join(sys.argv[1], "forgeax-triton"))
    backend = os.environ["BENCH_BACKEND"]
    q = jax.random.normal(jax.random.key(0), (1, 2048, 8, 128), jnp.bfloat16)
    loss = lambda q, k, v: jnp.sum(ops.attention(q, k, v, causal=True, backend=backend).astype(jnp.float32))
    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
    t0 = time.perf_counter()
    if os.environ["CACHE_MODE"] == "export":  # the lowered program on disk too
        jax.block_until_ready(forgeax.export.cached(step, key="attention step")(q, q, q))
        t3 = time.perf_counter()
    else:
        lowered = step.trace(q, q, q).lower()
        t1 = time.perf_counter()
        compiled = lowered.compile()
        t2 = time.perf_counter()
        jax.block_until_ready(compiled(q, q, q))
        t3 = time.perf_counter()
        counts.update(lower_s=t1 - t0, compile_s=t2 - t1, first_call_s=t3 - t2)
    counts.update(ready_s=t3 - t0)
"""


@pytest.mark.skipif(os.environ.get("JAX_PLATFORMS", "") == "cpu" or not os.path.exists("/dev/nvidiactl"),
                    reason="needs a GPU")
@pytest.mark.parametrize("mode", ["jit", "export"])
@pytest.mark.parametrize("backend", ["pallas_gpu", "triton"])
def test_gpu_attention_is_ready_fast_from_a_warm_cache(tmp_path, backend, mode):
    """jit: JAX's cache (and forgeax's Triton cache); export: forgeax.export.cached on top, the
    configuration that should be ready in under a second (the timings are printed either way)."""
    env = {"JAX_PLATFORMS": "cuda", "BENCH_BACKEND": backend, "CACHE_MODE": mode, "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
    cold = _run(_GPU_ATTENTION_BODY, str(tmp_path), **env)
    warm = _run(_GPU_ATTENTION_BODY, str(tmp_path), **env)
    print(f"{backend} {mode}: cold {cold}\n{backend} {mode}: warm {warm}")
    # The cache must hit (nothing compiled again); how long a warm start takes is a measurement,
    # printed here and recorded in docs/performance.md, not a pass/fail threshold.
    assert cold["compiled"] >= 1 and warm["compiled"] == 0, (cold, warm)
