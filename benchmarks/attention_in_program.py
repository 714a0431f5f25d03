"""Attention inside a larger jitted program, per call, interleaved across backends.

    python -m benchmarks.attention_in_program [--layers 8] [--shape B,T,N,K,H] [--mode fwd+bwd] \
        [--backend pallas_gpu] [--backend default] [--out program.json]

tools/bench.py and benchmarks/tune_attention.py time one jitted attention call per executable, so each
backend's time around its kernel (launch, custom-call setup) is in every number. In a model one
executable runs many attention calls back to back. Here one jitted program runs `--layers` causal
attention forwards, each layer's output the next layer's query, and the time per attention call
is the program's time over `--layers` (median of interleaved rounds, tools/bench.py's method).
With `--mode fwd+bwd` the program also runs the backward through every layer (vjp, the output as
its own cotangent). Forward-only calls and differentiated calls are what the selection rules'
`forward_only` and `all` rules decide (docs/performance.md has the runs behind them).
"""

from __future__ import annotations

import argparse
import json
import statistics

import jax

from benchmarks.common import attention_inputs, interleaved, kernel_times
from forgeax import ops


def program(attend, layers: int, mode: str):
    def run(q, k, v):
        for _ in range(layers):
            q = attend(q, k, v)
        return q

    def train(q, k, v):
        out, pull = jax.vjp(run, q, k, v)
        return pull(out)

    return jax.jit(run if mode == "fwd" else train)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--backend", action="append", default=None)
    parser.add_argument("--shape", default="4,4096,32,32,128", help="B,T,N,K,H (H = value head dim too)")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--mode", choices=("fwd", "fwd+bwd"), default="fwd")
    parser.add_argument("--calls", type=int, default=5)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--kernel-times", type=int, default=0, metavar="ITERATIONS",
                        help="also print each program's CUPTI kernel times (median ms per kernel name)")
    parser.add_argument("--out", default="-")
    args = parser.parse_args()
    q, k, v, _ = attention_inputs(args.shape)
    attend = {"cudnn": lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")}
    for backend in args.backend or ["pallas_gpu", "default"]:
        attend["ops:cudnn" if backend == "cudnn" else backend] = lambda q, k, v, backend=None if backend == "default" else backend: ops.attention(
            q, k, v, causal=True, backend=backend)
    programs = {name: program(fn, args.layers, args.mode) for name, fn in attend.items()}
    for fn in programs.values():
        jax.block_until_ready(fn(q, k, v))  # compile outside the rounds
    rounds = interleaved({name: (fn, (q, k, v)) for name, fn in programs.items()},
                         calls=args.calls, rounds=args.reps, warmup=1)
    per_call = {name: statistics.median(times) * 1e3 / args.layers for name, times in rounds.items()}
    results = {name: dict(ms_per_attention=ms, vs_cudnn=per_call["cudnn"] / ms) for name, ms in per_call.items()}
    for name, r in results.items():
        print(f"{name:12s} {r['ms_per_attention']:.3f} ms per attention call  {r['vs_cudnn']:.3f}x cuDNN", flush=True)
    if args.kernel_times:
        for name, fn in programs.items():
            times = kernel_times(fn, (q, k, v), args.kernel_times)
            results[name]["kernels_ms"] = times
            print(f"{name}: kernels {sum(times.values()):.3f} ms per program", flush=True)
            for kernel, ms in sorted(times.items(), key=lambda kv: -kv[1]):
                print(f"  {ms:8.3f} ms  {kernel[:110]}")
    if args.out != "-":
        with open(args.out, "w") as f:
            json.dump(dict(device=jax.devices()[0].device_kind, shape=args.shape, causal=True, mode=args.mode,
                           layers=args.layers, calls=args.calls, reps=args.reps, results=results), f, indent=1)


if __name__ == "__main__":
    main()
