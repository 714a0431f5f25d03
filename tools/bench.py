"""Times every backend of an op, side by side with its anchors, on named shapes.

    bazel run //tools:bench -- --op rms_norm            # CPU: the small shapes
    python tools/bench.py --op rms_norm --op layer_norm # GPU, against the installed wheel

Method (DESIGN.md, Performance): compile first (excluded), warm up, then
`--reps` rounds of `--calls` back-to-back calls each closed by
`block_until_ready`; the per-call median of the rounds is the result. The copy
ceiling (a large read+write) is measured in the same run, and each result is
reported as bytes/s or FLOP/s, fraction of the floor, and ratio to XLA. JSON
goes to benchmarks/results/.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import datetime
import json
import os
import platform as host_platform
import statistics
import sys
import time
from typing import Any, Callable, Hashable, Iterator, Sequence

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_specs  # noqa: E402  (a sibling module, also when run as a plain script)

from forgeax import core as interface  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Timing:
    op: str
    shape: str
    dims: tuple[int, ...]
    dtype: str
    mode: str
    backend: str
    median_ms: float
    spread_ms: tuple[float, float]
    bytes: float
    flops: float
    tb_per_s: float
    tflop_per_s: float
    fraction_of_floor: float
    speedup_vs_xla: float | None = None
    note: str = ""
    # Temporary bytes of the compiled call (XLA's memory analysis), None where unavailable.
    temp_bytes: float | None = None
    # Ratio to the spec's main anchor (e.g. cuDNN for attention) timed in the same rounds.
    speedup_vs_anchor: float | None = None
    # Per-call ms of each round, in round order, and the ratio to the anchor round by round (a
    # paired statistic: both were timed within one round, so clock drift between rounds cancels).
    rounds_ms: tuple[float, ...] = ()
    speedup_vs_anchor_rounds: tuple[float, ...] = ()


def time_call(fn, args, *, calls: int, reps: int, warmup: int = 2) -> list[float]:
    """Per-call seconds of `reps` rounds of `calls` back-to-back calls."""
    jax.block_until_ready(fn(*args))  # compile
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    rounds = []
    for _ in range(reps):
        start = time.perf_counter()
        for _ in range(calls):
            out = fn(*args)
        jax.block_until_ready(out)
        rounds.append((time.perf_counter() - start) / calls)
    return rounds


def alternating(names: Sequence[Hashable], rounds: int) -> Iterator[Hashable]:
    """`names` in order on even rounds and reversed on odd ones, `rounds` times (see `interleaved`)."""
    for r in range(rounds):
        yield from (names if r % 2 == 0 else names[::-1])


def interleaved(candidates: dict[Hashable, tuple[Callable, tuple]], *, calls: int, rounds: int,
                warmup: int) -> dict[Hashable, list[float]]:
    """Per-call seconds of each candidate `fn(*args)` over `rounds` rounds; a round times every
    candidate once (`time_call`, `calls` calls after `warmup`), in the given order on even rounds
    and reversed on odd ones. Interleaving spreads clock and thermal drift over every candidate;
    reversing makes each one follow each neighbour, because a candidate timed right after another
    runs in the state the other left: in one program, cuDNN's forward measured 1.084-1.097 ms right
    after pallas_gpu's and 1.042-1.050 otherwise (H200, benchmarks/results/attention_in_program.json)."""
    times = {name: [] for name in candidates}
    for name in alternating(list(candidates), rounds):
        fn, args = candidates[name]
        times[name] += time_call(fn, args, calls=calls, reps=1, warmup=warmup)
    return times


def temp_bytes(fn, args) -> float | None:
    """Temporary memory of `fn`'s compiled executable (excludes arguments and outputs)."""
    try:
        return float(fn.lower(*args).compile().memory_analysis().temp_size_in_bytes)
    except Exception:  # noqa: BLE001 - not every backend/runtime reports it
        return None


def copy_bandwidth(calls: int, reps: int) -> float:
    """Bytes/s of a large device copy (read + write), the memory ceiling."""
    n = (1 << 28) if interface.current_platform() != "cpu" else (1 << 24)
    x = jnp.arange(n, dtype=jnp.float32)
    rounds = time_call(jax.jit(lambda a: a * 1.0001), (x,), calls=calls, reps=reps)
    return 2 * 4 * n / statistics.median(rounds)


def parse_backend(name: str) -> tuple[str, dict[str, Any]]:
    """'pallas_gpu:deterministic=True' -> ('pallas_gpu', {'deterministic': True}); 'default' = backend=None."""
    backend, *settings = name.split(":")
    extra = {}
    for setting in settings:
        key, _, value = setting.partition("=")
        extra[key] = ast.literal_eval(value)
    return backend, extra


def run(args: argparse.Namespace) -> dict[str, Any]:
    platform = interface.current_platform()
    device = jax.devices()[0]
    ceiling = copy_bandwidth(args.calls, args.reps)
    print(f"device: {device.device_kind} ({platform}); copy ceiling {ceiling / 1e9:.0f} GB/s", flush=True)
    results: list[Timing] = []
    for op_name in args.op:
        spec = bench_specs.SPECS[op_name]
        registered = interface.OPS[op_name].backends
        wanted = args.backend or list(registered)
        backends = [b for b in wanted if parse_backend(b)[0] in registered + ("default",)]
        shapes = [s for s in spec.shapes if (args.shape and s.name in args.shape) or (not args.shape and (platform != "cpu" or s.small))]
        for shape in shapes:
            inputs = spec.make_inputs(shape, jax.random.key(0))
            options = {**spec.options, **dict(shape.options)}
            for mode in args.mode:
                nbytes, flops = spec.floor(shape, mode)
                floor_s = nbytes / ceiling
                anchors = {a: build for a, build in spec.anchors.items() if not args.anchor or a in args.anchor}
                candidates = [(b, None) for b in backends] + [(f"anchor:{a}", build) for a, build in anchors.items()]
                fns = {}
                for name, anchor_build in candidates:
                    backend, extra = parse_backend(name) if anchor_build is None else (name, {})
                    if anchor_build is None and spec.precheck and backend != "default":
                        impl = interface.OPS[op_name].implementation(backend)
                        why = impl if isinstance(impl, str) else impl.why_not(platform, inputs[:-1], {**options, **extra})
                        if why is not None:
                            print(f"  skip {op_name} {shape.name} {mode} {name}: {why}", flush=True)
                            continue
                    try:
                        fn = (anchor_build(mode, options) if anchor_build else
                              spec.build(None if backend == "default" else backend, mode, {**options, **extra}))
                        temp = temp_bytes(fn, inputs)
                        time_call(fn, inputs, calls=1, reps=1)  # compile + warm up
                        fns[name] = (fn, temp)
                    except interface.UnsupportedError as e:
                        print(f"  skip {op_name} {shape.name} {mode} {name}: {e}", flush=True)
                    except Exception as e:  # noqa: BLE001 - report and go on with the other backends
                        print(f"  FAIL {op_name} {shape.name} {mode} {name}: {type(e).__name__}: {str(e)[:300]}", flush=True)
                rounds = interleaved({name: (fn, inputs) for name, (fn, _) in fns.items()},
                                     calls=args.calls, rounds=args.reps, warmup=0)
                row: list[Timing] = []
                for name, (fn, temp) in fns.items():
                    med = statistics.median(rounds[name])
                    row.append(Timing(op_name, shape.name, shape.dims, shape.dtype, mode, name, med * 1e3,
                                      (min(rounds[name]) * 1e3, max(rounds[name]) * 1e3), nbytes, flops, nbytes / med / 1e12,
                                      flops / med / 1e12, floor_s / med, temp_bytes=temp,
                                      rounds_ms=tuple(t * 1e3 for t in rounds[name])))
                    print(f"  {op_name} {shape.name} {mode} {name}: {med * 1e3:.4f} ms"
                          + (f" {flops / med / 1e12:.0f} TFLOP/s" if flops else f" {nbytes / med / 1e9:.0f} GB/s"), flush=True)
                xla = next((t for t in row if t.backend == "xla"), None)
                anchor = next((t for t in row if t.backend == f"anchor:{spec.main_anchor}"), None)
                results += [dataclasses.replace(
                    t, speedup_vs_xla=(xla.median_ms / t.median_ms) if xla else None,
                    speedup_vs_anchor=(anchor.median_ms / t.median_ms) if anchor else None,
                    speedup_vs_anchor_rounds=tuple(a / b for a, b in zip(anchor.rounds_ms, t.rounds_ms)) if anchor else ())
                    for t in row]
                del fns  # free the executables' buffers before the next shape
    return {
        "device": device.device_kind,
        "platform": platform,
        "host": host_platform.node(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "versions": {"jax": jax.__version__, "jaxlib": jax.lib.__version__ if hasattr(jax.lib, "__version__") else None, **_optional_versions()},
        "method": {"calls_per_round": args.calls, "rounds": args.reps, "statistic": "median per-call time over rounds; rounds interleaved across backends and anchors, order reversed every other round"},
        "copy_ceiling_tb_per_s": ceiling / 1e12,
        "results": [dataclasses.asdict(t) for t in results],
    }


def _optional_versions() -> dict[str, str]:
    versions = {}
    for name in ("jaxlib", "triton", "jax_triton"):
        try:
            versions[name] = __import__(name).__version__
        except Exception:  # noqa: BLE001
            versions[name] = "absent"
    return versions


def print_table(report: dict[str, Any]) -> None:
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:  # plain text where rich is absent
        for r in report["results"]:
            print(r)
        return
    table = Table(title=f"{report['device']}: copy ceiling {report['copy_ceiling_tb_per_s'] * 1e3:.0f} GB/s")
    for col in ("op", "shape", "dtype", "mode", "backend", "ms", "GB/s", "TFLOP/s", "of floor", "vs xla", "vs anchor", "temp GB"):
        table.add_column(col, justify="right" if col not in ("op", "shape", "backend", "mode", "dtype") else "left")
    for r in report["results"]:
        table.add_row(r["op"], f"{r['shape']} {list(r['dims'])}", r["dtype"], r["mode"], r["backend"], f"{r['median_ms']:.4f}",
                      f"{r['tb_per_s'] * 1e3:.0f}", f"{r['tflop_per_s']:.1f}" if r["flops"] else "-", f"{r['fraction_of_floor']:.0%}",
                      f"{r['speedup_vs_xla']:.2f}x" if r["speedup_vs_xla"] else "-",
                      f"{r['speedup_vs_anchor']:.2f}x" if r.get("speedup_vs_anchor") else "-",
                      f"{r['temp_bytes'] / 1e9:.3f}" if r.get("temp_bytes") is not None else "-")
    Console(width=200).print(table)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--op", action="append", choices=sorted(bench_specs.SPECS), help="op to time (repeatable; default all)")
    parser.add_argument("--shape", action="append", help="named shape (repeatable; default: all on GPU, the small ones on CPU)")
    parser.add_argument("--anchor", action="append", help="anchor to time (repeatable; default: all of the spec's)")
    parser.add_argument("--backend", action="append", help="backend (repeatable; default: every backend that runs here); 'default' = the op's "
                        "own selection; 'name:option=value' adds a call option, e.g. pallas_gpu:deterministic=True")
    parser.add_argument("--mode", action="append", choices=("fwd", "fwd+bwd"), help="default both")
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--out", default=None, help="JSON path (default benchmarks/results/<ops>_<device>.json; '-' for none)")
    args = parser.parse_args(argv)
    args.op = args.op or sorted(bench_specs.SPECS)
    args.mode = args.mode or ["fwd", "fwd+bwd"]
    report = run(args)
    print_table(report)
    if args.out != "-":
        root = os.environ.get("BUILD_WORKSPACE_DIRECTORY", os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
        device = report["device"].replace(" ", "_")
        path = args.out or os.path.join(root, "benchmarks", "results", f"{'+'.join(args.op)}_{device}.json")
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            json.dump(report, f, indent=1)
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
