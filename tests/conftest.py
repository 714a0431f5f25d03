"""Spreads pytest-xdist workers over the GPUs of one host (the GPU conformance runs).

With `FORGEAX_TEST_GPUS=n` and `pytest -n W`, worker `gwK` sees only GPU `K % n` and takes a
1/ceil(W/n) share of its memory (less a margin), so W processes compile kernels on the host's
cores in parallel while each GPU runs the tests of a few workers. It must run before any test
module imports jax, which is why it lives in a conftest. Without the variable it does nothing
(CPU runs, Bazel, single-GPU runs).
"""

import math
import os

_gpus = int(os.environ.get("FORGEAX_TEST_GPUS", "0") or 0)
_worker = os.environ.get("PYTEST_XDIST_WORKER", "")
if _gpus > 0 and _worker.startswith("gw"):
    _index = int(_worker[2:])
    _workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", str(_gpus)))
    os.environ["CUDA_VISIBLE_DEVICES"] = str(_index % _gpus)
    os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"] = f"{0.9 / math.ceil(_workers / _gpus):.3f}"
