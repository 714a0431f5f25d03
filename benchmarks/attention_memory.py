"""Temporary memory of attention's compiled forward+backward, per backend (compile only, no timing).

    python -m benchmarks.attention_memory [--shape 1,8192,32,8,128] [--no-causal] \
        [--variant plain --variant default --variant pallas_gpu:dz_chunk_bytes=4294967296 ...] [--out mem.json]

At Llama-3-8B's attention (B1 T8192, 32 query / 8 kv heads of 128, bf16, causal) by default:
jit(grad) of <attention(q, k, v), ct> with respect to q, k, v, compiled for the current device;
`memory_analysis()` gives the program's temporary bytes (what the backward's workspaces, saved
residuals and gradients in flight take beyond the arguments and outputs). A variant is `plain`
(jax.nn.dot_product_attention: cuDNN on a GPU, XLA elsewhere; what llama_block's plain variant
runs), `default` (forgeax's selection), a backend name, or `backend:field=value,...` (that
backend's config with fields replaced, e.g. pallas_gpu's dz_chunk_bytes or dz_tiles). A
variant the device cannot run is recorded with its reason. Default variants: plain, default and
every attention backend. Run it beside benchmarks/llama_block.py, whose temp_bytes are the
whole model's.
"""

from __future__ import annotations

import argparse
import ast
import math

import jax
import jax.numpy as jnp

from benchmarks.common import RESULTS_DIR, attention_inputs, parse_shape, result_name, write_json
from forgeax import core as interface
from forgeax import ops
from forgeax.kernels.common.attention import AttentionSpec

BACKENDS = ("cudnn", "pallas_gpu", "triton", "xla_chunked", "xla", "pallas_tpu")


def _config(backend: str, changes: dict, q, k, v, causal: bool):
    """The config `backend` resolves for this call on this device, with `changes` applied."""
    impl = interface.OPS["attention"].implementation(backend)
    spec = AttentionSpec(causal=causal, scale=1.0 / math.sqrt(q.shape[-1]), window_right=0 if causal else None)
    args = (q, k, v, None, None, None, None, None)
    reason = impl.supports(*args, spec=spec)
    if reason is not None:
        raise RuntimeError(reason)
    config, _ = impl.resolve_config(args, {"spec": spec}, None, jax.devices()[0].device_kind)
    return config.replace(**changes) if changes else config


def _attention(variant: str, q, k, v, causal: bool):
    """(attention fn of q, k, v, description of what runs)."""
    name, _, fields = variant.partition(":")
    if name == "plain":
        impl = "cudnn" if jax.default_backend() == "gpu" else None
        return (lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation=impl),
                f"jax.nn.dot_product_attention(implementation={impl!r})")
    backend = None if name == "default" else name
    config = None
    if fields:
        changes = {}
        for item in fields.split(","):
            key, _, value = item.partition("=")
            changes[key] = ast.literal_eval(value)
        config = _config(backend, changes, q, k, v, causal)
    fn = lambda q, k, v: ops.attention(q, k, v, causal=causal, backend=backend, config=config)  # noqa: E731
    return fn, f"ops.attention(backend={backend!r}, config={config})"


def measure(variant: str, q, k, v, ct, causal: bool) -> dict:
    try:
        attention, what = _attention(variant, q, k, v, causal)
        loss = lambda q, k, v: jnp.sum(attention(q, k, v).astype(jnp.float32) * ct.astype(jnp.float32))  # noqa: E731
        step = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
        compiled = step.lower(q, k, v).compile()
    except Exception as e:  # noqa: BLE001 - a variant this device cannot run: record why
        return {"error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]}
    mem = compiled.memory_analysis()
    get = lambda field: None if mem is None else getattr(mem, field, None)  # noqa: E731
    result = {"runs": what, "temp_bytes": get("temp_size_in_bytes"), "argument_bytes": get("argument_size_in_bytes"),
              "output_bytes": get("output_size_in_bytes"), "alias_bytes": get("alias_size_in_bytes")}
    if variant.partition(":")[0] != "plain":
        try:
            result["ran"] = sorted({f"{d.backend}" for d in ops.explain(step, q, k, v).decisions})
        except Exception as e:  # noqa: BLE001
            result["ran"] = [f"explain failed: {type(e).__name__}"]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="1,8192,32,8,128", help="B,T,N,K,H (S = T)")
    parser.add_argument("--no-causal", action="store_true")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--variant", action="append", help="default: plain, default and every backend")
    parser.add_argument("--out", help="JSON path (default: benchmarks/results/<name>.json on a GPU, '-' elsewhere)")
    args = parser.parse_args()
    B, T, N, K, H = parse_shape(args.shape)
    causal = not args.no_causal
    dtype = jnp.dtype(args.dtype)
    q, k, v, ct = attention_inputs(args.shape, dtype=dtype)
    variants = args.variant or ["plain", "default", *BACKENDS]
    results = {}
    gib = lambda n: "n/a" if n is None else f"{n / 2**30:7.3f} GiB"  # noqa: E731
    for variant in variants:
        r = results[variant] = measure(variant, q, k, v, ct, causal)
        line = f"refused/failed: {r['error']}" if "error" in r else (
            f"temp {gib(r['temp_bytes'])}  (arguments {gib(r['argument_bytes'])}, outputs {gib(r['output_bytes'])})"
            + (f"  ran {r['ran']}" if "ran" in r else ""))
        print(f"{variant:48s} {line}", flush=True)
    report = {"what": "attention fwd+bwd (jit(grad) w.r.t. q, k, v), compiled temporary memory",
              "device": jax.devices()[0].device_kind, "shape": {"B": B, "T": T, "N": N, "K": K, "H": H},
              "causal": causal, "dtype": dtype.name, "results": results, "jax": jax.__version__}
    out = args.out or (f"{RESULTS_DIR}/{result_name('attention', 'memory')}" if jax.default_backend() == "gpu" else "-")
    write_json(out, report)


if __name__ == "__main__":
    main()
