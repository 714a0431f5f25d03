"""Energy per attention call, beside its time and the SM clock: is a backend power-bound?

    python benchmarks/attention_energy.py --backend pallas_gpu --backend triton \
        [--shape B,T,N,K,H] [--causal 0] [--calls 50] [--rounds 5] [--out energy.json]

Under sustained load an H100/H200 runs at its power cap (700 W) and lowers the SM clock until
it fits, so what a call costs in joules bounds its speed there: at the cap, time per call is at
least energy per call / 700 W. For cuDNN (always) and each backend this times the jitted
forward+backward in interleaved rounds (tools/bench.py's alternating order) of `--calls` calls
back to back, reading NVML's energy counter around each round and sampling the SM clock and
power every 10 ms during it; it prints per call the median ms, joules, mean watts and MHz, and
the time and energy ratios against cuDNN. Diagnostics: the ratios the issues gate on come from
tools/bench.py. Needs NVML (nvidia-ml-py, in the GPU image).
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time

import jax
from tune_attention import attention_calls, jitted_steps, random_inputs  # this directory is on sys.path

from bench import alternating  # noqa: E402 - tools/, put on sys.path by tune_attention


class _Sampler:
    """SM clock (MHz) and power (W) every `period` s while running."""

    def __init__(self, nvml, handle, period: float = 0.01):
        self.nvml, self.handle, self.period = nvml, handle, period
        self.clocks, self.watts, self._stop = [], [], threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.is_set():
            self.clocks.append(self.nvml.nvmlDeviceGetClockInfo(self.handle, self.nvml.NVML_CLOCK_SM))
            self.watts.append(self.nvml.nvmlDeviceGetPowerUsage(self.handle) / 1e3)
            time.sleep(self.period)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


def measure_round(nvml, handle, fn, args, calls: int) -> dict[str, float]:
    """One round of `calls` back-to-back calls: ms and joules per call, mean W and SM MHz."""
    with _Sampler(nvml, handle) as sampler:
        energy0 = nvml.nvmlDeviceGetTotalEnergyConsumption(handle)  # mJ since the driver loaded
        start = time.perf_counter()
        jax.block_until_ready([fn(*args) for _ in range(calls)])
        seconds = time.perf_counter() - start
        energy1 = nvml.nvmlDeviceGetTotalEnergyConsumption(handle)
    return dict(ms=seconds / calls * 1e3, joules=(energy1 - energy0) / 1e3 / calls,
                watts=statistics.fmean(sampler.watts), sm_mhz=statistics.fmean(sampler.clocks))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--backend", action="append", default=None)
    parser.add_argument("--shape", default="4,4096,32,32,128", help="B,T,N,K,H")
    parser.add_argument("--causal", type=int, default=1)
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", default="-")
    args = parser.parse_args()
    import pynvml as nvml  # lazily: only the GPU image has it

    nvml.nvmlInit()
    handle = nvml.nvmlDeviceGetHandleByIndex(0)
    q, k, v, do = random_inputs(args.shape)
    causal = bool(args.causal)
    steps = {}
    for name, fn in attention_calls(args.backend or ["pallas_gpu"], causal=causal).items():
        steps[name] = jitted_steps(fn)[1]  # fwd+bwd
        jax.block_until_ready(steps[name](q, k, v, do))  # compile and warm up
    rounds = {name: [] for name in steps}
    for name in alternating(list(steps), args.rounds):
        rounds[name].append(measure_round(nvml, handle, steps[name], (q, k, v, do), args.calls))
    results = {name: {key: statistics.median(r[key] for r in runs) for key in runs[0]} for name, runs in rounds.items()}
    base = results["cudnn"]
    print(f"{'fwd+bwd':12s} {'ms':>7s} {'J/call':>7s} {'W':>5s} {'MHz':>5s} {'speed':>6s} {'energy':>6s}")
    for name, r in results.items():
        r["speed_vs_cudnn"], r["energy_vs_cudnn"] = base["ms"] / r["ms"], r["joules"] / base["joules"]
        print(f"{name:12s} {r['ms']:7.3f} {r['joules']:7.3f} {r['watts']:5.0f} {r['sm_mhz']:5.0f} "
              f"{r['speed_vs_cudnn']:5.2f}x {r['energy_vs_cudnn']:5.2f}x", flush=True)
    nvml.nvmlShutdown()
    if args.out != "-":
        with open(args.out, "w") as f:
            json.dump(dict(device=jax.devices()[0].device_kind, shape=args.shape, causal=causal, calls=args.calls,
                           rounds=args.rounds, results=results, per_round=rounds), f, indent=1)


if __name__ == "__main__":
    main()
