"""Autotunes ops on their benchmark shapes and times the result against the default selection.

    python tools/autotune.py --op attention --op cross_entropy          # GPU, every named shape
    python tools/autotune.py --op rms_norm --write-tuning --device "NVIDIA H100"
    bazel run //tools:autotune -- --op rms_norm                         # CPU: the small shapes

For each op, named shape (tools/bench_specs/) and mode, `forgeax.autotune` runs on the
function the benchmark times with `backend=None` (its wall time is reported: the issue asks for
under a minute per op and shape); then that function compiled as users get it today (selection
rules, tuned data files, heuristic configs) and compiled inside `with tuning:` are timed in the
same interleaved rounds (core/timing.py). Results go to benchmarks/results/autotune_*.json;
`--write-tuning` merges the tunings into ops/tunings/<device>.json, which the wheel ships and
every call on that device kind consults (core/tuning.py). `--device` names the device-kind prefix
the entries match (default: this device's full kind).

    python tools/autotune.py --from-bench benchmarks/results/<bench>.json --write-tuning

makes the backend choice of each benchmarked call from committed `tools/bench.py` results
instead (no device needed): per op, named shape and mode, the backends by median time, fastest
first, for the call signature that shape traces to: fwd and fwd+bwd entries side by side, so a
call that is not differentiated runs the fwd winner and a differentiated one the fwd+bwd winner.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import re
import statistics
import sys
import time
from typing import Any

import jax

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench  # noqa: E402  (siblings, also when run as a plain script)
import bench_specs  # noqa: E402

import forgeax  # noqa: E402
from forgeax import core  # noqa: E402
from forgeax.core.timing import interleaved, paired_ratios  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _compiled(fn, inputs, tuning: forgeax.Tuning | None):
    """`fn` traced and compiled afresh, inside `with tuning:` when given (calls pick backends and
    configs at trace time)."""
    jax.clear_caches()
    if tuning is None:
        return jax.jit(fn).lower(*inputs).compile()
    with tuning:
        return jax.jit(fn).lower(*inputs).compile()


def _decisions(fn, inputs, tuning: forgeax.Tuning | None) -> list[str]:
    if tuning is None:
        return bench.explained(fn, inputs)
    with tuning:
        return bench.explained(fn, inputs)


def run(args: argparse.Namespace) -> tuple[dict[str, Any], forgeax.Tuning]:
    platform = core.current_platform()
    device = core.current_device_kind()
    rows, merged = [], forgeax.Tuning()
    for op_name in args.op:
        spec = bench_specs.SPECS[op_name]
        shapes = bench_specs.default_shapes(spec, platform, args.shape)
        for shape in shapes:
            inputs = spec.make_inputs(shape, jax.random.key(0))
            options = {**spec.options, **dict(shape.options)}
            for mode in args.mode:
                fn = spec.build(None, mode, options)
                start = time.perf_counter()
                tuning = forgeax.autotune(fn, *inputs, rounds=args.tune_rounds, calls=args.calls, timeout_s=args.timeout_s,
                                          max_configs=args.max_configs, workers=args.workers)
                tune_s = time.perf_counter() - start
                if args.device:
                    tuning = forgeax.Tuning([dataclasses.replace(e, device=args.device) for e in tuning.entries], report=tuning.report)
                merged = merged | tuning
                fns = {"default": (_compiled(fn, inputs, None), inputs), "tuned": (_compiled(fn, inputs, tuning), inputs)}
                times = interleaved(fns, calls=args.calls, rounds=args.reps, warmup=1)
                ratios = paired_ratios(times["default"], times["tuned"])
                row = {"op": op_name, "shape": shape.name, "dims": shape.dims, "dtype": shape.dtype, "mode": mode,
                       "autotune_seconds": tune_s, "default_ms": statistics.median(times["default"]) * 1e3,
                       "tuned_ms": statistics.median(times["tuned"]) * 1e3, "speedup_rounds": ratios,
                       "speedup": statistics.median(ratios), "default": _decisions(fn, inputs, None),
                       "tuned": _decisions(fn, inputs, tuning),
                       "failures": [r for r in tuning.report if "error" in r]}
                rows.append(row)
                print(f"{op_name} {shape.name} {mode}: autotune {tune_s:.1f} s; default {row['default_ms']:.4f} ms, "
                      f"tuned {row['tuned_ms']:.4f} ms (x{row['speedup']:.3f}); {len(row['failures'])} candidates failed", flush=True)
                for line in row["tuned"]:
                    print(f"    {line}", flush=True)
    report = {
        "device": device, "platform": platform,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "versions": {"jax": jax.__version__, "forgeax": forgeax.__version__},
        "method": {"autotune_rounds": args.tune_rounds, "rounds": args.reps, "calls_per_round": args.calls,
                   "statistic": "median per-call time; default (rules, tuned data, heuristics) and tuned timed in the same "
                                "interleaved rounds; speedup = median of per-round default/tuned ratios"},
        "results": rows,
        "tuning": json.loads(merged.dumps()),
    }
    return report, merged


def tuning_from_bench(paths: list[str], device: str | None = None) -> forgeax.Tuning:
    """The measured backend order of every (op, shape, mode) in `tools/bench.py` result files,
    as entries timed in that mode."""
    from forgeax.core.autotuning import find_calls  # noqa: PLC0415

    merged = forgeax.Tuning()
    for path in paths:
        with open(path) as f:
            data = json.load(f)
        groups: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
        for r in data["results"]:
            if bench.selectable(r["backend"]):
                groups.setdefault((r["op"], r["shape"], r["mode"]), []).append(r)
        for (op, shape_name, mode), rows in groups.items():
            spec = bench_specs.SPECS.get(op)
            shape = next((s for s in spec.shapes if s.name == shape_name), None) if spec else None
            if shape is None:
                print(f"  skip {op} {shape_name}: not a named shape of tools/bench_specs/", flush=True)
                continue
            inputs = jax.eval_shape(lambda key: spec.make_inputs(shape, key), jax.random.key(0))
            calls = [c for c in find_calls(spec.build(None, mode, {**spec.options, **dict(shape.options)}), *inputs) if c.op == op]
            rows = sorted(rows, key=lambda r: r["median_ms"])
            merged = merged | forgeax.Tuning([
                core.TuningEntry(device or data["device"], op, c.key, r["backend"], None, r["median_ms"] / 1e3, mode)
                for c in calls for r in rows])
    return merged


def main(argv: list[str] | None = None) -> None:
    bench.quiet_cuda_plugin()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--op", action="append", choices=sorted(bench_specs.SPECS))
    parser.add_argument("--from-bench", nargs="+", help="tools/bench.py result files to take the backend order from")
    parser.add_argument("--shape", action="append", help="named shapes (default: the model shapes on an accelerator, the small ones on CPU)")
    parser.add_argument("--mode", action="append", choices=("fwd", "fwd+bwd"))
    parser.add_argument("--tune-rounds", type=int, default=5)
    parser.add_argument("--reps", type=int, default=20, help="rounds timing default against tuned")
    parser.add_argument("--calls", type=int, default=10)
    parser.add_argument("--timeout-s", type=float, default=60.0)
    parser.add_argument("--max-configs", type=int, default=None)
    parser.add_argument("--workers", type=int, default=4, help="threads compiling candidates (1: one at a time)")
    parser.add_argument("--device", default=None, help="device-kind prefix for the entries, e.g. 'NVIDIA H100'")
    parser.add_argument("--write-tuning", action="store_true", help="merge into ops/tunings/<device>.json")
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results"))
    args = parser.parse_args(argv)
    args.mode = args.mode or ["fwd", "fwd+bwd"]
    if args.from_bench:
        tuning = tuning_from_bench(args.from_bench, args.device)
        device = args.device or tuning.entries[0].device
        print(f"{len(tuning)} entries from {len(args.from_bench)} result files")
    elif not args.op:
        parser.error("give --op (autotune) or --from-bench (result files)")
    else:
        report, tuning = run(args)
        device = args.device or report["device"]
    slug = re.sub(r"[^a-z0-9]+", "_", device.lower()).strip("_")
    if not args.from_bench:
        os.makedirs(args.out, exist_ok=True)
        path = os.path.join(args.out, f"autotune_{slug}_{report['date'][:10]}_{'_'.join(args.op)}.json")
        with open(path, "w") as f:
            json.dump(report, f, indent=1)
        print(f"wrote {path}")
    if args.write_tuning:
        target = os.path.join(ROOT, "ops", "tunings", f"{slug}.json")
        os.makedirs(os.path.dirname(target), exist_ok=True)
        if os.path.exists(target):
            with open(target) as f:
                tuning = forgeax.Tuning.loads(f.read(), source=target) | tuning
        with open(target, "w") as f:
            f.write(tuning.dumps() + "\n")
        print(f"wrote {target} ({len(tuning)} entries)")


if __name__ == "__main__":
    main()
