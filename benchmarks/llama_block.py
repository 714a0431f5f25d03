"""The whole block: a jitted forward+backward of Llama decoder layers, forgeax against plain JAX.

    python -m benchmarks.llama_block [--layers 2] [--batch 1] [--seq 8192] [--variant plain --variant default] \
        [--calls 3 --reps 7] [--out block.json]

The layers are examples/llm's (pre-norm, RoPE, GQA causal attention, SwiGLU MLP, the residual add
fused into the next norm), at Llama-3-8B's sizes (d 4096, 32 query / 8 kv heads of 128, d_ff
14336, theta 500000), bf16 compute with f32 parameters, each layer checkpointed
(`jax.checkpoint`). The loss is <final normed hidden, a random cotangent>; gradients for every
parameter and the input. A variant names the backend of every op: `plain` is plain JAX code with
cuDNN attention (examples/llm/plain.py, what users write without forgeax), `default` is
forgeax's own selection (`backend=None`), `xla` forgeax's references, any other name a backend;
`op=backend,...` overrides single ops (e.g. `plain:attention=default` for forgeax attention only).
Variants are timed in interleaved rounds (docs/performance.md); the result is the median step
time, paired per-round ratios against the first variant, compile time and the compiled program's
temporary memory, and which backend each op call ran (forgeax.explain).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import jax
import jax.numpy as jnp

from benchmarks.common import interleaved, paired_ratios, result_name, write_json, RESULTS_DIR
from examples.llm import model as model_lib
from examples.llm.config import OPS, ModelConfig
from forgeax import ops

LLAMA3_8B = ModelConfig(vocab=128, d_model=4096, n_layers=2, n_heads=32, n_kv_heads=8, d_ff=14336, seq_len=8192,
                        rope_theta=500000.0, dtype="bfloat16", remat=True, tie_embeddings=True)


def parse_variant(text: str) -> dict[str, str | None]:
    """'plain' / 'default' / 'plain:attention=default,mlp=triton' -> OPS key -> backend (None: default)."""
    base, _, overrides = text.partition(":")
    backends = {name: base for name in OPS}
    for item in filter(None, overrides.split(",")):
        name, _, backend = item.partition("=")
        if name not in OPS:
            raise SystemExit(f"--variant: unknown op {name!r}; expected one of {list(OPS)}")
        backends[name] = backend
    return {name: None if b == "default" else b for name, b in backends.items()}


def _gib(nbytes: int | None) -> str:
    return "n/a" if nbytes is None else f"{nbytes / 2**30:.2f} GiB"


def block_step(cfg: ModelConfig, backends: dict[str, str | None]):
    """jit(value_and_grad) of <decoder_layers(h), ct> with respect to the layers' parameters and h."""
    def loss(layers, final_norm, h, ct):
        out = model_lib.decoder_layers(layers, final_norm, h, cfg, backends)
        return jnp.sum(out.astype(jnp.float32) * ct)

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 2)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--d-model", type=int, help="override Llama-3-8B's sizes (small CPU runs)")
    parser.add_argument("--d-ff", type=int)
    parser.add_argument("--heads", type=str, help="N,KV query and kv heads")
    parser.add_argument("--variant", action="append", help="default: plain and default (the first is the anchor)")
    parser.add_argument("--calls", type=int, default=3)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--out", help="JSON path (default: benchmarks/results/<name>.json on a GPU, '-' elsewhere)")
    args = parser.parse_args()
    sizes = {"n_layers": args.layers, "seq_len": args.seq}
    if args.d_model:
        sizes["d_model"] = args.d_model
    if args.d_ff:
        sizes["d_ff"] = args.d_ff
    if args.heads:
        sizes["n_heads"], sizes["n_kv_heads"] = (int(x) for x in args.heads.split(","))
    cfg = dataclasses.replace(LLAMA3_8B, **sizes)
    cfg.validate()
    params = model_lib.init_params(cfg, jax.random.PRNGKey(0))
    kh, kc = jax.random.split(jax.random.PRNGKey(1))
    shape = (args.batch, cfg.seq_len, cfg.d_model)
    h = jax.random.normal(kh, shape, jnp.float32).astype(jnp.bfloat16)
    ct = jax.random.normal(kc, shape, jnp.float32)
    step_args = (params["layers"], params["final_norm"], h, ct)

    names = args.variant or ["plain", "default"]
    steps, results = {}, {}
    for name in names:
        backends = parse_variant(name)
        step = block_step(cfg, backends)
        start = time.perf_counter()
        compiled = step.lower(*step_args).compile()
        compile_s = time.perf_counter() - start
        mem = compiled.memory_analysis()
        jax.block_until_ready(compiled(*step_args))
        steps[name] = (compiled, step_args)
        ran = {}
        if any(b != "plain" for b in backends.values()):
            for d in ops.explain(lambda *a, step=step: step(*a), *step_args).decisions:
                ran.setdefault(d.op, set()).add(d.backend)
        results[name] = {"backends": backends, "ran": {op: sorted(b) for op, b in ran.items()},
                         "compile_s": compile_s,
                         "temp_bytes": getattr(mem, "temp_size_in_bytes", None) if mem is not None else None}
        print(f"{name}: compiled in {compile_s:.1f} s, temp {_gib(results[name]['temp_bytes'])}, ran {results[name]['ran']}",
              flush=True)
    rounds = interleaved(steps, calls=args.calls, rounds=args.reps, warmup=1)
    anchor = names[0]
    for name in names:
        r = results[name]
        r["step_ms"] = statistics.median(rounds[name]) * 1e3
        r["rounds_ms"] = [t * 1e3 for t in rounds[name]]
        r[f"speedup_vs_{anchor}"] = statistics.median(paired_ratios(rounds[anchor], rounds[name]))
        print(f"{name:40s} {r['step_ms']:9.2f} ms  {r[f'speedup_vs_{anchor}']:.3f}x {anchor}  "
              f"temp {_gib(r['temp_bytes'])}  compile {r['compile_s']:.1f} s", flush=True)
    report = {"what": "Llama decoder layers, jitted fwd+bwd, each layer checkpointed", "device": jax.devices()[0].device_kind,
              "config": dataclasses.asdict(cfg), "batch": args.batch, "calls": args.calls, "reps": args.reps,
              "anchor": anchor, "results": results, "jax": jax.__version__}
    out = args.out or (f"{RESULTS_DIR}/{result_name('llama_block', 'bench')}" if jax.default_backend() == "gpu" else "-")
    write_json(out, report)


if __name__ == "__main__":
    main()
