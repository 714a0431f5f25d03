"""Times every backend of an op, side by side with its anchors, on named shapes.

    bazel run //tools:bench -- --op rms_norm            # CPU: the small shapes
    python tools/bench.py --op rms_norm --op layer_norm # GPU, against the installed wheel

Method (docs/performance.md): compile first (excluded), warm up, then
`--reps` rounds of `--calls` back-to-back calls each closed by
`block_until_ready`; the per-call median of the rounds is the result. On an
accelerator the copy ceiling (a large read+write) is measured in the same run, and
each result is reported as bytes/s or FLOP/s, fraction of the floor, and ratio to
XLA. On the CPU there is no floor: caches make the measured copy rate no ceiling
for calls that fit in them, so the fraction is left out (see `checked_fractions`).
Each call's lower + compile time (the first in this process) is reported as `compile_s`
(with `--compile-workers N` > 1 a shape's candidates compile concurrently and the times include
that contention; the JSON's method records N).
Unless `--backend` says otherwise, the op's own selection (`default`) is timed beside every
backend; the JSON's `selection` list gives, per shape and mode, its time over the fastest
backend's and what it ran. The JSON is rewritten after every shape.
JSON goes to benchmarks/results/; `--plot DIR` also draws one PNG per op (tools/plot.py).
"""

from __future__ import annotations

import argparse
import ast
import concurrent.futures
import dataclasses
import datetime
import functools
import json
import os
import platform as host_platform
import re
import statistics
import sys
import time
from typing import Any, Callable, Sequence

import jax

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_specs  # noqa: E402  (a sibling module, also when run as a plain script)

import forgeax  # noqa: E402
from forgeax import core as interface  # noqa: E402
from forgeax.core.autotuning import SERIAL_COMPILE, compile_all  # noqa: E402
from forgeax.core.timing import copy_bandwidth, interleaved, paired_ratios, temp_bytes, time_call  # noqa: E402,F401

# The device nodes by which JAX decides that an NVIDIA GPU is visible (jax/_src/hardware_utils.py,
# has_visible_nvidia_gpu): without one of them JAX never starts its CUDA backend.
NVIDIA_DEVICE_NODES = ("/dev/nvidia0", "/dev/nvidiactl", "/dev/dxg")


def nvidia_gpu_visible() -> bool:
    return any(os.path.exists(node) for node in NVIDIA_DEVICE_NODES)


def quiet_cuda_plugin(environ: dict[str, str] = os.environ) -> bool:
    """Skips the CUDA plugin's library check on a machine where JAX will not use CUDA anyway.

    jax-cuda13-plugin checks its CUDA and cuDNN libraries when JAX first looks for backends, on
    every machine; where they are absent it raises, and JAX logs the exception as a 20-line
    `Jax plugin configuration error ... Unable to load cuDNN` traceback before falling back to
    the CPU. With no NVIDIA GPU visible JAX skips the CUDA backend whatever the check finds, so
    the check is turned off (JAX_SKIP_CUDA_CONSTRAINTS_CHECK): nothing else changes, the plugin
    still registers (cross-lowering for cuda keeps working) and the platform JAX picks is the
    same. Where a GPU is visible, JAX_SKIP_CUDA_CONSTRAINTS_CHECK is already set or cuda is asked
    for by JAX_PLATFORMS, nothing is touched. Call before JAX's first backend lookup (importing
    jax or forgeax does no lookup). Returns whether it turned the check off.
    """
    asked = [p.strip() for p in environ.get("JAX_PLATFORMS", "").split(",")]
    if nvidia_gpu_visible() or "JAX_SKIP_CUDA_CONSTRAINTS_CHECK" in environ or "cuda" in asked or "gpu" in asked:
        return False
    environ["JAX_SKIP_CUDA_CONSTRAINTS_CHECK"] = "1"
    return True


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
    # Bytes floor (each input read once, each output written once, over the copy ceiling) / time;
    # None where there is no ceiling (the CPU) or the measured one proved not to be one.
    fraction_of_floor: float | None
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
    # Seconds to lower and compile the jitted call (its first compile in this process: caches
    # warmed by earlier shapes or backends of the same run may help), None where not measured.
    compile_s: float | None = None


def checked_fractions(results: list[Timing], ceiling: float | None) -> tuple[list[Timing], str | None]:
    """`results` with their fractions of the floor kept only where the ceiling held, and a note.

    No call can beat the floor: a fraction above 1 means the measured ceiling was not one (a cache,
    a copy that ran slow), and then no fraction computed from it means anything. All of them are
    dropped and the note says which call outran the ceiling and by how much."""
    if ceiling is None:
        return [dataclasses.replace(t, fraction_of_floor=None) for t in results], None
    over = [t for t in results if t.fraction_of_floor is not None and t.fraction_of_floor > 1]
    if not over:
        return results, None
    worst = max(over, key=lambda t: t.fraction_of_floor)
    note = (f"{worst.op} {worst.shape} {worst.mode} {worst.backend} moved {worst.tb_per_s * 1e3:.0f} GB/s, "
            f"{worst.fraction_of_floor:.1f}x the copy ceiling measured in this run ({ceiling / 1e9:.0f} GB/s): "
            "that ceiling is not one, so no fraction of the floor is reported")
    return [dataclasses.replace(t, fraction_of_floor=None) for t in results], note


def parse_backend(name: str) -> tuple[str, dict[str, Any]]:
    """'pallas_gpu:deterministic=True' -> ('pallas_gpu', {'deterministic': True}); 'default' = backend=None."""
    backend, *settings = name.split(":")
    extra = {}
    for setting in settings:
        key, _, value = setting.partition("=")
        extra[key] = ast.literal_eval(value)
    return backend, extra


def lower_and_compile(fn: Any, inputs: Sequence[Any]) -> tuple[float | None, float | None]:
    """(seconds to lower + compile `fn` on `inputs`, temporary bytes of the executable)."""
    if not hasattr(fn, "lower"):
        return None, temp_bytes(fn, inputs)
    start = time.perf_counter()
    compiled = fn.lower(*inputs).compile()
    seconds = time.perf_counter() - start
    try:
        return seconds, float(compiled.memory_analysis().temp_size_in_bytes)
    except Exception:  # noqa: BLE001 - not every backend/runtime reports it
        return seconds, None


def selection_check(results: list[Timing], runs: dict[tuple[str, str, str, str], list[str]] | None = None) -> list[dict[str, Any]]:
    """Per op, shape and mode: the default selection's time against the fastest backend timed in
    the same rounds (anchors and option variants such as 'pallas_gpu:deterministic=True' are not
    candidates the selection could pick, so they are left out), also as the median of per-round
    ratios. `same_program_as_fastest`: the default runs exactly the fastest row's backends and
    configs (`runs`, what `explain` reports, without where each config came from), so any gap
    between the two rows is run-to-run noise of one program, not a choice."""
    groups: dict[tuple[str, str, str], list[Timing]] = {}
    for t in results:
        groups.setdefault((t.op, t.shape, t.mode), []).append(t)
    runs = runs or {}
    rows = []
    for (op, shape, mode), timings in groups.items():
        default = next((t for t in timings if t.backend == "default"), None)
        named = [t for t in timings if selectable(t.backend)]
        if default is None or not named:
            continue
        fastest = min(named, key=lambda t: t.median_ms)
        program = [_program(runs.get((op, shape, mode, name)), mode) for name in ("default", fastest.backend)]
        paired = paired_ratios(default.rounds_ms, fastest.rounds_ms)
        rows.append({"op": op, "shape": shape, "mode": mode, "default_ms": default.median_ms, "fastest": fastest.backend,
                     "fastest_ms": fastest.median_ms, "default_over_fastest": default.median_ms / fastest.median_ms,
                     "default_over_fastest_rounds": statistics.median(paired) if paired else None,
                     "same_program_as_fastest": None if None in program else program[0] == program[1]})
    return rows


def _program(decisions: list[str] | None, mode: str = "fwd") -> tuple[str, ...] | None:
    """`explained` lines without the '[source]' labels (heuristic, tuned file, ...): two calls
    with equal programs run the same kernels with the same configs. Timed fwd+bwd, a call whose
    gradient runs another backend ('op: A ...; under a gradient: B with ...') runs B for its
    forward too (the split of core/dispatch.py), so its program is B's."""
    if not decisions or any(d.startswith("explain failed") for d in decisions):
        return None
    lines = []
    for d in decisions:
        op, _, rest = d.partition(": ")
        if mode == "fwd+bwd" and "; under a gradient: " in rest:
            rest = rest.split("; under a gradient: ", 1)[1].replace(" with ", " ", 1)
        lines.append(re.sub(r" \[[^\]]*\]", "", f"{op}: {rest}").strip())
    return tuple(lines)


def selectable(backend: str) -> bool:
    """Whether a result row's backend is one the selection could pick: not the default itself,
    an anchor, or a named backend with options ('pallas_gpu:deterministic=True')."""
    return backend != "default" and not backend.startswith("anchor:") and ":" not in backend


def explained(fn: Any, inputs: Sequence[Any]) -> list[str]:
    """What the selection runs for `fn` on `inputs`, 'op: backend config' per call (and what runs
    under a gradient when that differs)."""
    return [f"{d.op}: {d.backend} {d.config}" + (f"; under a gradient: {d.gradient}" if d.gradient else "")
            for d in forgeax.explain(fn, *inputs).decisions]


def decisions(fn: Any, inputs: Sequence[Any]) -> list[str]:
    """`explained`, or the error (a report, never a reason to stop the benchmark)."""
    try:
        return explained(fn, inputs)
    except Exception as e:  # noqa: BLE001
        return [f"explain failed: {type(e).__name__}: {str(e)[:200]}"]


def run(args: argparse.Namespace, checkpoint: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Times every backend and anchor; `checkpoint(report)` is called after each shape with the
    results so far (a run cut by a time limit keeps what it measured)."""
    platform = interface.current_platform()
    device = jax.devices()[0]
    ceiling = copy_bandwidth(args.calls, args.reps)
    gpu = "; no NVIDIA GPU visible" if platform == "cpu" and not nvidia_gpu_visible() else ""
    print(f"device: {device.device_kind} (platform {platform}{gpu}); "
          + (f"copy ceiling {ceiling / 1e9:.0f} GB/s" if ceiling else "no copy ceiling on the CPU, so no fraction of the floor"),
          flush=True)
    results: list[Timing] = []
    chosen: dict[tuple[str, str, str, str], list[str]] = {}
    pool = concurrent.futures.ThreadPoolExecutor(max(1, args.compile_workers))
    for op_name in args.op:
        spec = bench_specs.SPECS[op_name]
        registered = interface.OPS[op_name].backends
        wanted = args.backend or ["default", *registered]
        backends = [b for b in wanted if parse_backend(b)[0] in registered + ("default",) and b not in (args.skip_backend or ())]
        shapes = bench_specs.default_shapes(spec, platform, args.shape)
        for shape in shapes:
            inputs = spec.make_inputs(shape, jax.random.key(0))
            options = {**spec.options, **dict(shape.options)}
            for mode in args.mode:
                nbytes, flops = spec.floor(shape, mode)
                floor_s = nbytes / ceiling if ceiling else None
                anchors = {a: build for a, build in spec.anchors.items() if not args.anchor or a in args.anchor}
                candidates = [(b, None) for b in backends] + [(f"anchor:{a}", build) for a, build in anchors.items()]
                built = {}
                for name, anchor_build in candidates:
                    backend, extra = parse_backend(name) if anchor_build is None else (name, {})
                    if anchor_build is None and spec.precheck and backend != "default":
                        impl = interface.OPS[op_name].implementation(backend)
                        why = impl if isinstance(impl, str) else impl.why_not(platform, inputs[:-1], {**options, **extra})
                        if why is not None:
                            print(f"  skip {op_name} {shape.name} {mode} {name}: {why}", flush=True)
                            continue
                    try:
                        built[name] = (anchor_build(mode, options) if anchor_build else
                                       spec.build(None if backend == "default" else backend, mode, {**options, **extra}))
                    except Exception as e:  # noqa: BLE001 - report and go on with the other backends
                        _report_failure(op_name, shape.name, mode, name, e)
                # Compiles may overlap (--compile-workers), except for ops with a cuDNN backend, and
                # all of them end before any call runs (core.autotuning.compile_all says why).
                compiled = compile_all({name: functools.partial(lower_and_compile, fn, inputs) for name, fn in built.items()}, pool,
                                       serial=args.compile_workers <= 1 or bool(set(registered) & SERIAL_COMPILE))
                fns = {}
                for name, result in compiled.items():
                    try:
                        if isinstance(result, Exception):
                            raise result
                        compile_s, temp = result
                        time_call(built[name], inputs, calls=1, reps=1)  # warm up (jit reuses the compile above)
                        fns[name] = (built[name], temp, compile_s)
                        if name == "default" or selectable(name):
                            chosen[(op_name, shape.name, mode, name)] = decisions(built[name], inputs)
                    except Exception as e:  # noqa: BLE001 - report and go on with the other backends
                        _report_failure(op_name, shape.name, mode, name, e)
                rounds = interleaved({name: (fn, inputs) for name, (fn, _, _) in fns.items()},
                                     calls=args.calls, rounds=args.reps, warmup=0)
                row: list[Timing] = []
                for name, (fn, temp, compile_s) in fns.items():
                    med = statistics.median(rounds[name])
                    row.append(Timing(op_name, shape.name, shape.dims, shape.dtype, mode, name, med * 1e3,
                                      (min(rounds[name]) * 1e3, max(rounds[name]) * 1e3), nbytes, flops, nbytes / med / 1e12,
                                      flops / med / 1e12, floor_s / med if floor_s else None, temp_bytes=temp,
                                      rounds_ms=tuple(t * 1e3 for t in rounds[name]), compile_s=compile_s))
                    print(f"  {op_name} {shape.name} {mode} {name}: {med * 1e3:.4f} ms"
                          + (f" {flops / med / 1e12:.0f} TFLOP/s" if flops else f" {nbytes / med / 1e9:.0f} GB/s"), flush=True)
                xla = next((t for t in row if t.backend == "xla"), None)
                anchor = next((t for t in row if t.backend == f"anchor:{spec.main_anchor}"), None)
                results += [dataclasses.replace(
                    t, speedup_vs_xla=(xla.median_ms / t.median_ms) if xla else None,
                    speedup_vs_anchor=(anchor.median_ms / t.median_ms) if anchor else None,
                    speedup_vs_anchor_rounds=tuple(paired_ratios(anchor.rounds_ms, t.rounds_ms)) if anchor else ())
                    for t in row]
                del fns  # free the executables' buffers before the next shape
                if checkpoint is not None:
                    checkpoint(_report(results, ceiling, device, platform, args, chosen))
    return _report(results, ceiling, device, platform, args, chosen)


def _report_failure(op_name: str, shape: str, mode: str, name: str, error: Exception) -> None:
    if isinstance(error, interface.UnsupportedError):
        print(f"  skip {op_name} {shape} {mode} {name}: {error}", flush=True)
    else:
        print(f"  FAIL {op_name} {shape} {mode} {name}: {type(error).__name__}: {str(error)[:300]}", flush=True)


def _report(results: list[Timing], ceiling: float | None, device: Any, platform: str, args: argparse.Namespace,
            chosen: dict[tuple[str, str, str, str], list[str]]) -> dict[str, Any]:
    results, floor_note = checked_fractions(results, ceiling)
    selection = selection_check(results, chosen)
    for row in selection:
        row["default_runs"] = chosen.get((row["op"], row["shape"], row["mode"], "default"), [])
    return {
        "device": device.device_kind,
        "platform": platform,
        "host": host_platform.node(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "versions": {"jax": jax.__version__, "jaxlib": jax.lib.__version__ if hasattr(jax.lib, "__version__") else None, **_optional_versions()},
        "method": {"calls_per_round": args.calls, "rounds": args.reps, "compile_workers": args.compile_workers, "statistic": "median per-call time over rounds; rounds interleaved across backends and anchors, round r rotated by r and reversed on odd rounds (core/timing.alternating)"},
        "copy_ceiling_tb_per_s": ceiling / 1e12 if ceiling else None,
        "floor_note": floor_note,
        "results": [dataclasses.asdict(t) for t in results],
        "selection": selection,
    }


def _optional_versions() -> dict[str, str]:
    versions = {}
    for name in ("jaxlib", "triton", "jax_triton"):
        try:
            versions[name] = __import__(name).__version__
        except Exception:  # noqa: BLE001
            versions[name] = "absent"
    return versions


def table(report: dict[str, Any]) -> tuple[str, list[str], list[list[str]]]:
    """Title, column names and rows of the printed table of a `run` report.

    The "of floor" column is there only where the report has a copy ceiling and every fraction
    is at most 100% (`checked_fractions` drops them otherwise; a report written before it existed
    may still hold them): a table never shows a call beating its floor."""
    results = report["results"]
    fractions = [r.get("fraction_of_floor") for r in results]
    ceiling = report.get("copy_ceiling_tb_per_s")
    floor = bool(ceiling) and any(f is not None for f in fractions) and all(f is None or f <= 1 for f in fractions)
    title = report["device"] + (f": copy ceiling {ceiling * 1e3:.0f} GB/s" if floor else "")
    columns = ["op", "shape", "dtype", "mode", "backend", "ms", "GB/s", "TFLOP/s"] + (["of floor"] if floor else []) + [
        "vs xla", "vs anchor", "temp GB", "compile s"]
    rows = []
    for r, fraction in zip(results, fractions):
        rows.append([r["op"], f"{r['shape']} {list(r['dims'])}", r["dtype"], r["mode"], r["backend"], f"{r['median_ms']:.4f}",
                     f"{r['tb_per_s'] * 1e3:.0f}", f"{r['tflop_per_s']:.1f}" if r["flops"] else "-"]
                    + ([f"{fraction:.0%}" if fraction is not None else "-"] if floor else [])
                    + [f"{r['speedup_vs_xla']:.2f}x" if r["speedup_vs_xla"] else "-",
                       f"{r['speedup_vs_anchor']:.2f}x" if r.get("speedup_vs_anchor") else "-",
                       f"{r['temp_bytes'] / 1e9:.3f}" if r.get("temp_bytes") is not None else "-",
                       f"{r['compile_s']:.2f}" if r.get("compile_s") is not None else "-"])
    return title, columns, rows


def print_table(report: dict[str, Any]) -> None:
    title, columns, rows = table(report)
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:  # plain text where rich is absent
        print(title)
        for row in [columns] + rows:
            print(" | ".join(row))
    else:
        printed = Table(title=title)
        for col in columns:
            printed.add_column(col, justify="right" if col not in ("op", "shape", "backend", "mode", "dtype") else "left")
        for row in rows:
            printed.add_row(*row)
        Console(width=200).print(printed)
    if report.get("floor_note"):
        print(f"note: {report['floor_note']}")


def print_selection(report: dict[str, Any]) -> None:
    """The default selection against the fastest backend, one line per op, shape and mode."""
    for row in report.get("selection", []):
        print(f"selection {row['op']} {row['shape']} {row['mode']}: default {row['default_ms']:.4f} ms, fastest "
              f"{row['fastest']} {row['fastest_ms']:.4f} ms, default/fastest {row['default_over_fastest']:.3f}"
              + (" (the same program)" if row.get("same_program_as_fastest") else "")
              + f" ({'; '.join(row['default_runs'])})")


def result_name(report: dict[str, Any], ops: Sequence[str]) -> str:
    """benchmarks/results/INDEX.md's naming, <ops>_<device>_<date>_bench.json ('NVIDIA H100 80GB
    HBM3' -> H100); CPU runs (demonstrations, not committed) are <ops>_cpu.json."""
    if report["platform"] == "cpu":
        return f"{'+'.join(ops)}_cpu.json"
    words = report["device"].replace("NVIDIA", "").split()
    device = words[0] if words else report["device"].replace(" ", "_")
    return f"{'+'.join(ops)}_{device}_{report['date'][:10]}_bench.json"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--op", action="append", choices=sorted(bench_specs.SPECS), help="op to time (repeatable; default all)")
    parser.add_argument("--shape", action="append", help="named shape (repeatable; default: the model shapes on an accelerator, the small ones on CPU)")
    parser.add_argument("--anchor", action="append", help="anchor to time (repeatable; default: all of the spec's)")
    parser.add_argument("--backend", action="append", help="backend (repeatable; default: every backend that runs here); 'default' = the op's "
                        "own selection; 'name:option=value' adds a call option, e.g. pallas_gpu:deterministic=True")
    parser.add_argument("--skip-backend", action="append", help="backend left out of the default list (repeatable)")
    parser.add_argument("--mode", action="append", choices=("fwd", "fwd+bwd"), help="default both")
    parser.add_argument("--compile-workers", type=int, default=1, help="threads compiling a shape's candidates at once "
                        "(compile_s then includes the contention: 1 for compile times alone)")
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--plot", default=None, metavar="DIR", help="also write one PNG per op to DIR (tools/plot.py)")
    parser.add_argument("--out", default=None, help="JSON path (default benchmarks/results/<ops>_<device>_<date>_bench.json, "
                        "on the CPU <ops>_cpu.json; '-' for none)")
    args = parser.parse_args(argv)
    quiet_cuda_plugin()
    args.op = args.op or sorted(bench_specs.SPECS)
    args.mode = args.mode or ["fwd", "fwd+bwd"]
    root = os.environ.get("BUILD_WORKSPACE_DIRECTORY", os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

    def write(report: dict[str, Any]) -> str | None:
        if args.out == "-":
            return None
        path = args.out or os.path.join(root, "benchmarks", "results", result_name(report, args.op))
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path + ".tmp", "w") as f:
            json.dump(report, f, indent=1)
        os.replace(path + ".tmp", path)  # a reader (or a kill) never sees half a file
        return path

    report = run(args, checkpoint=write)
    print_table(report)
    print_selection(report)
    path = write(report)
    if path:
        print(f"wrote {path}")
    if args.plot:
        import plot  # noqa: PLC0415 - a sibling module; matplotlib only when plotting

        for path in plot.write_plots([report], args.plot):
            print(f"wrote {path}")


if __name__ == "__main__":
    main()
