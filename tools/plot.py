"""PNG plots of tools/bench.py reports: one per op, bars per backend and anchor, per shape and mode.

    python tools/plot.py benchmarks/results/attention_H100_2026-11-26_bench.json --out docs/img
    python tools/plot.py --latest benchmarks/results --out docs/img   # each op's newest bench JSON
    python tools/bench.py --op rms_norm --plot /tmp/plots      # while benchmarking

Each op's figure has one panel per mode (fwd, fwd+bwd); a group of bars per named shape, one
bar per backend or anchor. The metric is TFLOP/s for compute-bound ops (results that count
FLOPs), else the fraction of the bytes floor where the report has one for every result of the
op (1 is the floor), else the median time in ms (log scale); `--metric` forces one. Several reports may be given: their
results are plotted together (later files win for a repeated op/shape/mode/backend).
Writes <out>/<op>.png (matplotlib, Agg backend: no display needed).
"""

from __future__ import annotations

import argparse
import json
import os
import textwrap
from collections.abc import Iterable, Sequence
from typing import Any

METRICS = ("auto", "fraction", "tflops", "ms", "speedup_vs_xla", "compile_s")
_LABELS = {"fraction": "fraction of the floor (higher is better)", "ms": "median ms per call (lower is better)",
           "tflops": "TFLOP/s (higher is better)",
           "speedup_vs_xla": "speed-up over the XLA backend (higher is better)", "compile_s": "lower + compile, s"}


def _value(result: dict[str, Any], metric: str) -> float | None:
    key = {"fraction": "fraction_of_floor", "ms": "median_ms", "tflops": "tflop_per_s"}.get(metric, metric)
    value = result.get(key)
    return float(value) if value is not None else None


def merged_results(reports: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """The results of several reports; a later report replaces an earlier one's identical row."""
    rows: dict[tuple, dict[str, Any]] = {}
    for report in reports:
        for r in report["results"]:
            rows[(r["op"], r["shape"], r["mode"], r["backend"])] = dict(r, device=report.get("device", ""))
    return list(rows.values())


def choose_metric(results: Sequence[dict[str, Any]], metric: str) -> str:
    """`metric`, or for "auto": TFLOP/s for a compute-bound op (every result counts FLOPs), else
    the fraction of the (bytes) floor where every result has one, else ms."""
    if metric != "auto":
        return metric
    if results and all(r.get("flops") and r.get("tflop_per_s") for r in results):
        return "tflops"
    return "fraction" if results and all(r.get("fraction_of_floor") is not None for r in results) else "ms"


def plot_op(op: str, results: Sequence[dict[str, Any]], path: str, metric: str = "auto") -> str:
    """Writes one op's figure to `path`; returns the metric plotted."""
    import matplotlib  # noqa: PLC0415 - only the plotting needs it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    metric = choose_metric(results, metric)
    modes = [m for m in ("fwd", "fwd+bwd") if any(r["mode"] == m for r in results)] or sorted({r["mode"] for r in results})
    shapes = list(dict.fromkeys(r["shape"] for r in results))
    backends = list(dict.fromkeys(r["backend"] for r in results))
    width = 0.8 / max(len(backends), 1)
    fig, axes = plt.subplots(len(modes), 1, figsize=(max(6.5, 1.5 + 1.8 * len(shapes)), 0.6 + 3.0 * len(modes)),
                             squeeze=False)
    colors = plt.get_cmap("tab10")
    for ax, mode in zip(axes[:, 0], modes):
        for i, backend in enumerate(backends):
            xs, ys = [], []
            for j, shape in enumerate(shapes):
                row = next((r for r in results if r["mode"] == mode and r["shape"] == shape and r["backend"] == backend), None)
                value = _value(row, metric) if row else None
                if value is not None:
                    xs.append(j - 0.4 + width * (i + 0.5))
                    ys.append(value)
            if xs:
                ax.bar(xs, ys, width, label=backend, color=colors(i % 10),
                       hatch="//" if backend.startswith("anchor:") else None, edgecolor="black", linewidth=0.4)
        ax.set_xticks(range(len(shapes)))
        ax.set_xticklabels([textwrap.fill(s, 16) for s in shapes], fontsize=7)
        ax.set_title(f"{op}, {mode}", fontsize=10)
        ax.set_ylabel(_LABELS.get(metric, metric), fontsize=8)
        if metric == "ms":
            ax.set_yscale("log")
        if metric == "fraction":
            ax.set_ylim(0, 1.05)
            ax.axhline(1.0, color="gray", linewidth=0.6, linestyle="--")
        ax.grid(axis="y", linewidth=0.3)
    handles, labels = [], []
    for ax in axes[:, 0]:
        for h, label in zip(*ax.get_legend_handles_labels()):
            if label not in labels:
                handles.append(h)
                labels.append(label)
    fig.legend(handles, labels, fontsize=7, ncol=min(len(labels), 6), loc="lower center")
    devices = sorted({r.get("device", "") for r in results} - {""})
    if devices:
        fig.suptitle(", ".join(devices), fontsize=9)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return metric


def write_plots(reports: Sequence[dict[str, Any]], out_dir: str, metric: str = "auto") -> list[str]:
    """One PNG per op in `out_dir` (<op>.png); returns their paths."""
    results = merged_results(reports)
    paths = []
    for op in dict.fromkeys(r["op"] for r in results):
        path = os.path.join(out_dir, f"{op}.png")
        plot_op(op, [r for r in results if r["op"] == op], path, metric)
        paths.append(path)
    return paths


def latest_reports(directory: str) -> list[tuple[str, dict[str, Any]]]:
    """(path, report) of each op's newest bench report in `directory` (*_bench*.json holding
    tools/bench.py results; newest by the report's date, then file name), restricted to that op."""
    newest: dict[str, tuple[tuple[str, str], str, dict[str, Any]]] = {}
    for name in sorted(os.listdir(directory)):
        if "_bench" not in name or not name.endswith(".json"):
            continue
        path = os.path.join(directory, name)
        with open(path) as f:
            report = json.load(f)
        if not isinstance(report.get("results"), list):
            continue
        for op in {r["op"] for r in report["results"]}:
            rank = (str(report.get("date", "")), name)
            if op not in newest or rank > newest[op][0]:
                newest[op] = (rank, path, report)
    return [(path, dict(report, results=[r for r in report["results"] if r["op"] == op]))
            for op, (_, path, report) in sorted(newest.items())]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("reports", nargs="*", help="bench JSON files (benchmarks/results/*_bench.json)")
    parser.add_argument("--latest", metavar="DIR", help="plot each op from its newest bench JSON in DIR instead")
    parser.add_argument("--out", default="docs/img", help="directory for <op>.png (default docs/img)")
    parser.add_argument("--metric", default="auto", choices=METRICS)
    args = parser.parse_args(argv)
    if args.latest:
        for source, report in latest_reports(args.latest):
            for path in write_plots([report], args.out, args.metric):
                print(f"wrote {path} (from {os.path.basename(source)})")
        return
    if not args.reports:
        parser.error("give bench JSON files or --latest DIR")
    reports = []
    for name in args.reports:
        with open(name) as f:
            reports.append(json.load(f))
    for path in write_plots(reports, args.out, args.metric):
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
