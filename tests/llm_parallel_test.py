"""The LLM example sharded over a 2x4 ("data", "model") mesh of 8 CPU devices equals the
unsharded run: batch over "data", Megatron-style projections over "model"."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from forgeax.examples.llm import train

ARGS = ["--d-model", "64", "--n-layers", "2", "--n-heads", "8", "--n-kv-heads", "4", "--d-ff", "128",
        "--seq-len", "32", "--batch", "8", "--eval-batches", "1", "--quiet", "--warmup", "2", "--steps", "4",
        "--ops", "xla", "--no-report", "--no-plot", "--samples", "0"]


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 devices (XLA_FLAGS=--xla_force_host_platform_device_count=8)")
def test_2x4_sharded_run_equals_unsharded(tmp_path):
    one = train.run(ARGS + ["--out", str(tmp_path / "one")])
    mesh = train.run(ARGS + ["--out", str(tmp_path / "mesh"), "--mesh", "2x4"])
    assert "model" in mesh["sharding"]["wq"] and "model" in mesh["sharding"]["w_down"]
    np.testing.assert_allclose(mesh["losses"], one["losses"], rtol=2e-5)
    np.testing.assert_allclose(mesh["eval"][-1]["loss"], one["eval"][-1]["loss"], rtol=2e-5)
    a, b = mesh["final_params"]["layers"]["w_gate"][0], one["final_params"]["layers"]["w_gate"][0]
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)


def test_mesh_larger_than_the_devices_fails_clearly(tmp_path):
    with pytest.raises(SystemExit, match="--mesh"):
        train.run(ARGS + ["--out", str(tmp_path), "--mesh", f"{jax.device_count()}x2"])


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 devices (XLA_FLAGS=--xla_force_host_platform_device_count=8)")
def test_benchmark_counts_every_device_of_the_mesh_in_mfu(tmp_path):
    args = ARGS + ["--out", str(tmp_path), "--benchmark-steps", "1", "--peak-tflops", "1"]
    one, mesh = train.run(args), train.run(args + ["--mesh", "2x4"])
    assert one["devices"] == 1 and mesh["devices"] == 8
    for r in (one, mesh):  # MFU = model FLOP/s over the peak of every device the step ran on
        assert r["mfu"] == pytest.approx(6 * r["params"] * r["tokens_per_second"] / (1e12 * r["devices"]))
