"""A newcomer's first run: //tools:bench starts without a traceback and its table is honest.

- On a machine without an NVIDIA GPU, jax-cuda13-plugin's CUDA/cuDNN check used to fail and
  JAX logged it as a 20-line `Jax plugin configuration error` traceback at the first backend
  lookup of every program without JAX_PLATFORMS=cpu. tools/bench.py turns the check off where
  JAX skips CUDA anyway (no NVIDIA device node); the plugin must stay registered for the
  cross-lowering tests. (Test targets set JAX_PLATFORMS=cpu, tests/defs.bzl.)
- A fraction of the floor above 100% means the ceiling was no ceiling: the table leaves the
  column out then, and always on the CPU (no copy rate is a ceiling there).

Run: pytest tests/cpu_start_test.py (JAX_PLATFORMS may be set: the bench's subprocess drops it).
"""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys

import pytest

TOOLS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools")
sys.path.insert(0, TOOLS)
import bench  # noqa: E402  (tools/bench.py)

# What a newcomer's shell has: none of the settings the test targets get from tests/defs.bzl.
_DROPPED = ("JAX_PLATFORMS", "JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "FORGEAX_INTERPRET", "TRITON_INTERPRET")


def _fresh_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in _DROPPED}


def _run(args: list[str]) -> subprocess.CompletedProcess:
    res = subprocess.run([sys.executable, *args], env=_fresh_env(), capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, f"{args} failed (exit {res.returncode}):\n{res.stdout}\n{res.stderr}"
    return res


def test_bench_starts_without_a_traceback():
    res = _run([os.path.join(TOOLS, "bench.py"), "--op", "rms_norm", "--shape", "small f32", "--mode", "fwd",
                "--calls", "2", "--reps", "1", "--out", "-"])
    printed = res.stdout + res.stderr
    assert "Traceback" not in printed, printed
    assert not re.search(r"error|exception", printed, re.IGNORECASE), printed
    assert "rms_norm small f32 fwd xla" in printed, printed  # it did run
    # No table shows a call beating its floor; on the CPU there is no floor column at all.
    assert all(int(p) <= 100 for p in re.findall(r"(\d+)%", printed)), printed
    if "(platform cpu" in printed:
        assert "of floor" not in printed and "copy ceiling" not in printed.replace("no copy ceiling", ""), printed


_PLUGIN_CHECK = r"""
import sys
sys.path.insert(0, sys.argv[1])
import bench
turned_off = bench.quiet_cuda_plugin()
import jax, jax.numpy as jnp
from jax._src import xla_bridge
print("platform", jax.devices()[0].platform)
print("turned off", turned_off)
# The plugin registered its platform (private, but it is what cross-lowering to cuda rests on).
print("cuda registered", "cuda" in xla_bridge._backend_factories)
jax.jit(lambda x: jnp.sin(x) * 2).trace(jnp.ones(8)).lower(lowering_platforms=("cuda",))
print("lowered for cuda")
"""


def test_quiet_start_keeps_the_cuda_plugin():
    try:
        import jax_plugins.xla_cuda13  # noqa: F401
    except ImportError:
        pytest.skip("jax-cuda13-plugin is not installed")
    res = _run(["-c", _PLUGIN_CHECK, TOOLS])
    assert "Traceback" not in res.stdout + res.stderr, res.stderr
    assert "cuda registered True" in res.stdout and "lowered for cuda" in res.stdout, res.stdout
    if not bench.nvidia_gpu_visible():
        assert "platform cpu" in res.stdout and "turned off True" in res.stdout, res.stdout


@pytest.mark.parametrize("visible,environ,turned_off", [
    (False, {}, True),
    (False, {"JAX_PLATFORMS": "cpu"}, True),
    (True, {}, False),  # a GPU machine: JAX's platform choice and the plugin's check untouched
    (False, {"JAX_PLATFORMS": "cuda"}, False),  # CUDA asked for: its failure is the user's answer
    (False, {"JAX_PLATFORMS": "gpu,cpu"}, False),
    (False, {"JAX_SKIP_CUDA_CONSTRAINTS_CHECK": "0"}, False),  # the user's own setting stays
])
def test_quiet_cuda_plugin_only_without_a_gpu(monkeypatch, visible, environ, turned_off):
    monkeypatch.setattr(bench, "nvidia_gpu_visible", lambda: visible)
    before = dict(environ)
    assert bench.quiet_cuda_plugin(environ) is turned_off
    assert environ == ({**before, "JAX_SKIP_CUDA_CONSTRAINTS_CHECK": "1"} if turned_off else before)


def _timing(backend: str, median_ms: float, nbytes: float, ceiling: float | None) -> bench.Timing:
    return bench.Timing("rms_norm", "small f32", (4096, 1024), "float32", "fwd", backend, median_ms, (median_ms, median_ms),
                        nbytes, 0.0, nbytes / (median_ms / 1e3) / 1e12, 0.0,
                        (nbytes / ceiling) / (median_ms / 1e3) if ceiling else None, speedup_vs_xla=1.0)


def _report(results: list[bench.Timing], ceiling: float | None, device: str = "NVIDIA H100") -> dict:
    checked, note = bench.checked_fractions(results, ceiling)
    return {"device": device, "copy_ceiling_tb_per_s": ceiling / 1e12 if ceiling else None, "floor_note": note,
            "results": [dataclasses.asdict(t) for t in checked]}


def _percentages(report: dict) -> list[int]:
    title, columns, rows = bench.table(report)
    return [int(cell[:-1]) for row in rows for cell in row if re.fullmatch(r"\d+%", cell)]


def test_cpu_table_has_no_floor():
    # rms_norm's small forward at 459% of the copy rate measured on this 2-core CPU (the table).
    report = _report([_timing("xla", 1.6168, 2 * 4096 * 1024 * 4 + 4096, None)], None, device="cpu")
    title, columns, rows = bench.table(report)
    assert "of floor" not in columns and "ceiling" not in title
    assert all(len(row) == len(columns) for row in rows)
    assert report["results"][0]["fraction_of_floor"] is None and report["floor_note"] is None


def test_fractions_within_the_floor_are_shown():
    ceiling = 3.0e12
    nbytes = 2 * 32768 * 4096 * 2
    report = _report([_timing("xla", 0.6, nbytes, ceiling), _timing("triton", 0.3, nbytes, ceiling)], ceiling)
    title, columns, rows = bench.table(report)
    assert "of floor" in columns and "copy ceiling 3000 GB/s" in title
    assert all(len(row) == len(columns) for row in rows)
    assert sorted(_percentages(report)) == [30, 60] and report["floor_note"] is None


def test_a_fraction_above_the_floor_drops_them_all():
    ceiling = 3.0e9  # a "ceiling" that a call beat 4.6 times: it was none
    nbytes = 2 * 4096 * 1024 * 4
    report = _report([_timing("xla", 1.6168, nbytes, ceiling), _timing("other", 30.0, nbytes, ceiling)], ceiling)
    title, columns, rows = bench.table(report)
    assert "of floor" not in columns and "ceiling" not in title and _percentages(report) == []
    assert all(r["fraction_of_floor"] is None for r in report["results"])
    assert "xla" in report["floor_note"] and "not one" in report["floor_note"], report["floor_note"]


def test_an_old_report_with_a_fraction_above_the_floor_shows_none():
    # A report written before checked_fractions existed still holds the raw fractions.
    ceiling = 3.0e9
    results = [_timing("xla", 1.6168, 2 * 4096 * 1024 * 4, ceiling)]
    report = {"device": "cpu", "copy_ceiling_tb_per_s": ceiling / 1e12, "results": [dataclasses.asdict(t) for t in results]}
    assert report["results"][0]["fraction_of_floor"] > 1
    title, columns, rows = bench.table(report)
    assert "of floor" not in columns and _percentages(report) == []
