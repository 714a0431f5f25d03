"""Where an attention call's time goes, per backend and for cuDNN: kernels, gaps and dispatch.

    python -m benchmarks.attention_kernel_times --backend pallas_gpu --backend triton [--backend default] \
        [--shape B,T,N,K,H] [--causal 0] [--iterations 20] [--out times.json]

For the jitted forward and forward+backward of each backend it prints
  * the median GPU time of every kernel launched (CUPTI; names as the driver reports them) and
    their sum, the device time of one call;
  * wall ms: per call, over `--iterations` calls issued back to back (as tools/bench.py times);
  * dispatch ms: per call, the host time to issue those calls (before waiting for them).
wall - kernels is time the GPU spends idle between kernels; when dispatch ~ wall, the host, not
the GPU, sets the pace. Diagnostics only: the ratios against cuDNN come from tools/bench.py and
benchmarks/tune_attention.py (interleaved rounds).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jax

from benchmarks.common import attention_calls, attention_inputs, jitted_steps, kernel_times


def wall_and_dispatch(fn, args, calls: int) -> tuple[float, float]:
    """(wall ms, host dispatch ms) per call of `calls` calls issued back to back; medians of 5 rounds."""
    walls, dispatches = [], []
    for _ in range(5):
        start = time.perf_counter()
        outs = [fn(*args) for _ in range(calls)]
        issued = time.perf_counter()
        jax.block_until_ready(outs)
        walls.append((time.perf_counter() - start) / calls * 1e3)
        dispatches.append((issued - start) / calls * 1e3)
        del outs
    return statistics.median(walls), statistics.median(dispatches)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--backend", action="append", default=None)
    parser.add_argument("--shape", default="4,4096,32,32,128", help="B,T,N,K,H")
    parser.add_argument("--causal", type=int, default=1)
    parser.add_argument("--window", type=int, default=None, help="left window size (with causal)")
    parser.add_argument("--logit-soft-cap", type=float, default=None, help="soft cap (cuDNN has none: skipped)")
    parser.add_argument("--iterations", type=int, default=20)
    parser.add_argument("--out", default="-")
    args = parser.parse_args()
    q, k, v, do = attention_inputs(args.shape)
    causal = bool(args.causal)
    window = None if args.window is None else (args.window, 0)
    cap = args.logit_soft_cap
    results = {}
    for name, fn in attention_calls(args.backend or ["pallas_gpu"], causal=causal, window=window,
                                    logit_soft_cap=cap).items():
        fwd, fwd_bwd = jitted_steps(fn)
        for mode, step, step_args in (("fwd", fwd, (q, k, v)), ("fwd+bwd", fwd_bwd, (q, k, v, do))):
            try:
                jax.block_until_ready(step(*step_args))  # compile and warm up outside the measurements
            except NotImplementedError as e:  # cuDNN refuses some lengths (T4001): the others still run
                print(f"{name} {mode}: skipped, {str(e)[:120]}", flush=True)
                continue
            times = kernel_times(step, step_args, args.iterations)
            wall, dispatch = wall_and_dispatch(step, step_args, args.iterations)
            results[f"{name} {mode}"] = dict(kernels_ms=times, total_ms=sum(times.values()), wall_ms=wall,
                                             dispatch_ms=dispatch)
            print(f"{name} {mode}: kernels {sum(times.values()):.3f} ms ({len(times)}), wall {wall:.3f} ms, "
                  f"dispatch {dispatch:.3f} ms", flush=True)
            for kernel, ms in sorted(times.items(), key=lambda kv: -kv[1]):
                print(f"  {ms:8.3f} ms  {kernel[:110]}")
    if args.out != "-":
        with open(args.out, "w") as f:
            json.dump(dict(device=jax.devices()[0].device_kind, shape=args.shape, causal=causal, window=window,
                           logit_soft_cap=cap, iterations=args.iterations, results=results), f, indent=1)


if __name__ == "__main__":
    main()
