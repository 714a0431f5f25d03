"""Several processes, one program: examples/multihost/step.py under jax.distributed on CPU.

Two processes of 2 CPU devices each (joined by `jax.distributed.initialize` over localhost,
XLA's CPU collectives across processes) run the sharded step (token-sharded rms_norm under jit,
vocabulary-parallel cross_entropy and ring attention in shard_map over all 4 devices); their
loss, gradient norms and checksums must equal one process with 4 devices. This is the
multi-host path simulated on one machine: the same code runs on GPU hosts.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import numpy as np

MODULE = "forgeax.examples.multihost.step"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _env(devices: int) -> dict[str, str]:
    # The children import what this process imports (Bazel puts the deps on sys.path, not PYTHONPATH).
    return dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=os.pathsep.join(p for p in sys.path if p),
                XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")


def _result(stdout: str) -> dict:
    return json.loads([line for line in stdout.splitlines() if line.startswith("{")][-1])


def test_two_processes_equal_one():
    port = _free_port()
    procs = [subprocess.Popen([sys.executable, "-m", MODULE, "--coordinator", f"localhost:{port}", "--num-processes", "2",
                               "--process-id", str(i)], env=_env(2), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(2)]
    outs = [p.communicate(timeout=540) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
    single = subprocess.run([sys.executable, "-m", MODULE], env=_env(4), capture_output=True, text=True, timeout=540)
    assert single.returncode == 0, single.stderr[-3000:]
    one = _result(single.stdout)
    many = [_result(out) for out, _ in outs]
    assert one["processes"] == 1 and one["devices"] == 4
    assert sorted(r["process"] for r in many) == [0, 1] and all(r["processes"] == 2 and r["devices"] == 4 for r in many)
    keys = [k for k in one if k not in ("process", "processes", "devices")]
    assert "loss" in keys and "grad_norm_q" in keys
    for r in many:
        np.testing.assert_allclose([r[k] for k in keys], [one[k] for k in keys], rtol=1e-5, atol=1e-6,
                                   err_msg=f"process {r['process']}: {keys}")
