"""Times the Triton norm kernels' candidate launch configs against XLA (GPU only).

    python -m benchmarks.tune_triton_norms --out tune.json

For each norm and shape: XLA, then every `named_candidates` entry, forward and
forward+backward, in one process, median of rounds (tools/bench.py's method).
The winner informs `default_config`; the run's JSON is the evidence.
"""

from __future__ import annotations

import argparse
import json
import statistics

import jax
import jax.numpy as jnp

from benchmarks import common
from forgeax.kernels.triton import norms as triton_norms
from forgeax.kernels.xla import norms as xla_norms

EPS = 1e-6


def variants(kind, rows, d, dtype):
    yield "xla", None
    for name, cfg in triton_norms.named_candidates(rows, d, dtype).items():
        yield name, cfg


def build(kind, name, cfg, mode):
    if name == "xla":
        fn = xla_norms.rms_norm if kind == "rms" else xla_norms.layer_norm
        fn_kw = {}
    else:
        fn = triton_norms.rms_norm if kind == "rms" else triton_norms.layer_norm
        fn_kw = {"config": cfg}
    call = (lambda x, s, o: fn(x, s, eps=EPS, **fn_kw)) if kind == "rms" else (lambda x, s, o: fn(x, s, o, eps=EPS, **fn_kw))
    if mode == "fwd":
        return jax.jit(lambda x, s, o, dy: call(x, s, o))

    def step(x, s, o, dy):
        y, pull = jax.vjp(call, x, s, o)
        return (y,) + pull(dy)

    return jax.jit(step)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="tune_triton_norms.json")
    ap.add_argument("--shape", action="append", default=None, help="ROWSxD (default 32768x4096)")
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args()
    shapes = [tuple(int(v) for v in s.split("x")) for s in (args.shape or ["32768x4096"])]
    ceiling = common.copy_bandwidth(args.calls, args.reps)
    print(f"{jax.devices()[0].device_kind}: copy {ceiling / 1e12:.2f} TB/s", flush=True)
    results = []
    for rows, d in shapes:
        key = jax.random.split(jax.random.key(0), 4)
        x = jax.random.normal(key[0], (rows, d), jnp.float32).astype(jnp.bfloat16)
        dy = jax.random.normal(key[1], (rows, d), jnp.float32).astype(jnp.bfloat16)
        s = 1 + 0.1 * jax.random.normal(key[2], (d,))
        o = 0.1 * jax.random.normal(key[3], (d,))
        for kind in ("rms", "layer_offset"):
            for mode in ("fwd", "fwd+bwd"):
                nbytes = (2 if mode == "fwd" else 5) * rows * d * 2
                base = None
                for name, cfg in variants(kind, rows, d, jnp.bfloat16):
                    try:
                        t = statistics.median(common.time_call(build(kind, name, cfg, mode), (x, s, o, dy), calls=args.calls, reps=args.reps))
                    except Exception as e:  # noqa: BLE001
                        print(f"{kind:12s} {mode:8s} {name:20s} FAILED {type(e).__name__}: {str(e)[:200]}", flush=True)
                        continue
                    base = base or t
                    r = {"shape": [rows, d], "kind": kind, "mode": mode, "variant": name, "config": None if cfg is None else cfg.__dict__,
                         "ms": t * 1e3, "tb_per_s": nbytes / t / 1e12, "fraction_of_copy": nbytes / t / ceiling, "speedup_vs_xla": base / t}
                    results.append(r)
                    print(f"{kind:12s} {mode:8s} {name:20s} {t * 1e3:8.4f} ms {r['tb_per_s']:5.2f} TB/s {r['fraction_of_copy']:4.0%} {r['speedup_vs_xla']:5.2f}x", flush=True)
    with open(args.out, "w") as f:
        json.dump({"device": jax.devices()[0].device_kind, "copy_tb_per_s": ceiling / 1e12, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
