"""tools/plot.py (one PNG per op from bench JSON) and tools/bench.py's compile time and --plot."""

from __future__ import annotations

import json
import os
import sys

import pytest

pytest.importorskip("matplotlib")

# tools/ beside tests/ (in the checkout, and in the Bazel runfiles, which carry bench.py,
# bench_specs/ and plot.py as data).
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools"))

import plot  # noqa: E402

PNG = b"\x89PNG\r\n\x1a\n"


def _result(op, shape, mode, backend, ms, fraction=None):
    return {"op": op, "shape": shape, "dims": [4, 8], "dtype": "float32", "mode": mode, "backend": backend,
            "median_ms": ms, "fraction_of_floor": fraction, "speedup_vs_xla": None, "compile_s": 0.5}


def _report(results, device="NVIDIA H100 80GB HBM3"):
    return {"device": device, "platform": "gpu", "results": results}


def test_one_png_per_op_with_fraction_when_every_result_has_one(tmp_path):
    results = [_result("rms_norm", s, m, b, ms, f) for s in ("a 4k", "b 8k") for m in ("fwd", "fwd+bwd")
               for b, ms, f in (("xla", 2.0, 0.4), ("triton", 1.0, 0.8), ("anchor:jax", 1.5, 0.55))]
    results.append(_result("cross_entropy", "v 128k", "fwd", "xla", 3.0))
    report = tmp_path / "r.json"
    report.write_text(json.dumps(_report(results)))
    plot.main([str(report), "--out", str(tmp_path / "img")])
    assert sorted(os.listdir(tmp_path / "img")) == ["cross_entropy.png", "rms_norm.png"]
    for name in os.listdir(tmp_path / "img"):
        assert (tmp_path / "img" / name).read_bytes()[:8] == PNG
    rms = [r for r in plot.merged_results([_report(results)]) if r["op"] == "rms_norm"]
    assert plot.choose_metric(rms, "auto") == "fraction"
    assert plot.choose_metric(rms[:1] + [_result("rms_norm", "c", "fwd", "xla", 1.0)], "auto") == "ms"


def test_later_reports_replace_earlier_rows():
    old = _report([_result("rope", "s", "fwd", "xla", 9.0)])
    new = _report([_result("rope", "s", "fwd", "xla", 1.0), _result("rope", "s", "fwd", "triton", 0.5)])
    merged = plot.merged_results([old, new])
    assert sorted((r["backend"], r["median_ms"]) for r in merged) == [("triton", 0.5), ("xla", 1.0)]


def test_bench_reports_compile_time_and_plots(tmp_path):
    import bench  # noqa: PLC0415

    out = tmp_path / "bench.json"
    bench.main(["--op", "rms_norm", "--backend", "xla", "--mode", "fwd", "--calls", "1", "--reps", "1",
                "--out", str(out), "--plot", str(tmp_path / "img")])
    report = json.loads(out.read_text())
    rows = [r for r in report["results"] if r["backend"] == "xla"]
    assert rows and all(r["compile_s"] is not None and r["compile_s"] > 0 for r in rows)
    _, columns, table_rows = bench.table(report)
    assert columns[-1] == "compile s" and all(row[-1] != "-" for row in table_rows if row[4] == "xla")
    assert (tmp_path / "img" / "rms_norm.png").read_bytes()[:8] == PNG


def test_latest_picks_each_ops_newest_report(tmp_path):
    old = dict(_report([_result("rope", "s", "fwd", "xla", 9.0), _result("rms_norm", "s", "fwd", "xla", 2.0)]), date="2026-11-20")
    new = dict(_report([_result("rope", "s", "fwd", "xla", 1.0)]), date="2026-11-27")
    (tmp_path / "a_H100_2026-11-20_bench.json").write_text(json.dumps(old))
    (tmp_path / "b_H100_2026-11-27_bench.json").write_text(json.dumps(new))
    (tmp_path / "notes.json").write_text("{}")
    picked = {r["results"][0]["op"]: (os.path.basename(p), r["results"][0]["median_ms"]) for p, r in plot.latest_reports(str(tmp_path))}
    assert picked == {"rope": ("b_H100_2026-11-27_bench.json", 1.0), "rms_norm": ("a_H100_2026-11-20_bench.json", 2.0)}
    plot.main(["--latest", str(tmp_path), "--out", str(tmp_path / "img")])
    assert sorted(os.listdir(tmp_path / "img")) == ["rms_norm.png", "rope.png"]


def test_compute_bound_ops_plot_tflops():
    rows = [dict(_result("attention", "s", "fwd", b, 1.0, 0.1), flops=1e12, tflop_per_s=t) for b, t in (("xla", 100.0), ("triton", 400.0))]
    assert plot.choose_metric(rows, "auto") == "tflops"


def test_accelerator_runs_time_the_model_shapes_and_cpu_runs_the_small_ones():
    import bench_specs  # noqa: PLC0415

    spec = bench_specs.SPECS["rms_norm"]
    gpu, cpu = bench_specs.default_shapes(spec, "gpu"), bench_specs.default_shapes(spec, "cpu")
    assert gpu and cpu and not any(s.small for s in gpu) and all(s.small for s in cpu)
    assert len(gpu) + len(cpu) == len(spec.shapes)
    assert [s.name for s in bench_specs.default_shapes(spec, "gpu", ["small f32"])] == ["small f32"]


def test_selection_check_marks_a_default_that_runs_the_fastest_program():
    import bench  # noqa: PLC0415 - tools/ is on sys.path above

    def row(backend, rounds):
        return bench.Timing("attention", "s", (1,), "bfloat16", "fwd+bwd", backend, sorted(rounds)[len(rounds) // 2],
                            (min(rounds), max(rounds)), 1.0, 1.0, 1.0, 1.0, None, rounds_ms=tuple(rounds))

    results = [row("default", [3.2, 3.5, 3.4]), row("pallas_gpu", [3.2, 3.3, 3.25]), row("cudnn", [4.0, 4.1, 4.2])]
    same = {("attention", "s", "fwd+bwd", "default"): ["attention: pallas_gpu Config(a=1) [heuristic]"],
            ("attention", "s", "fwd+bwd", "pallas_gpu"): ["attention: pallas_gpu Config(a=1) [tuned data]"]}
    (check,) = bench.selection_check(results, same)
    assert check["fastest"] == "pallas_gpu" and check["default_over_fastest"] == pytest.approx(3.4 / 3.25)
    assert check["default_over_fastest_rounds"] == pytest.approx(3.4 / 3.25)  # rounds 1.0, 1.061, 1.046
    assert check["same_program_as_fastest"] is True
    other = dict(same)
    other[("attention", "s", "fwd+bwd", "default")] = ["attention: pallas_gpu Config(a=2) [heuristic]"]
    assert bench.selection_check(results, other)[0]["same_program_as_fastest"] is False
    assert bench.selection_check(results)[0]["same_program_as_fastest"] is None  # nothing explained: unknown


def test_selection_check_reads_a_split_default_as_its_gradient_program_under_fwd_bwd():
    import bench  # noqa: PLC0415

    def row(mode, backend, ms):
        return bench.Timing("rms_norm", "s", (1,), "bfloat16", mode, backend, ms, (ms, ms), 1.0, 1.0, 1.0, 1.0, None,
                            rounds_ms=(ms,))

    split = ["rms_norm: xla ; under a gradient: triton with Cfg(rows=4) [tuned data]"]
    triton = ["rms_norm: triton Cfg(rows=4) [heuristic]"]
    for mode, same in (("fwd+bwd", True), ("fwd", False)):  # forward alone: the xla kernel runs
        results = [row(mode, "default", 0.082), row(mode, "triton", 0.081), row(mode, "xla", 0.09)]
        runs = {("rms_norm", "s", mode, "default"): split, ("rms_norm", "s", mode, "triton"): triton}
        assert bench.selection_check(results, runs)[0]["same_program_as_fastest"] is same, mode


def test_selection_check_on_real_explain_lines(tmp_path):
    """On a CPU the default runs the XLA reference: the same program as the `xla` row, from the
    explain lines the bench records for both."""
    import bench  # noqa: PLC0415

    out = tmp_path / "bench.json"
    bench.main(["--op", "rms_norm", "--backend", "default", "--backend", "xla", "--mode", "fwd", "--mode", "fwd+bwd",
                "--calls", "1", "--reps", "2", "--out", str(out)])
    checks = json.loads(out.read_text())["selection"]
    assert checks and all(c["fastest"] == "xla" and c["same_program_as_fastest"] is True for c in checks), checks
    assert all(c["default_over_fastest_rounds"] > 0 for c in checks)
