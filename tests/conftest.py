"""Spreads pytest-xdist workers over the GPUs of one host (the GPU conformance runs).

With `FORGEAX_TEST_GPUS=n` and `pytest -n W`, worker `gwK` sees only the `K % n`-th GPU (of
those CUDA_VISIBLE_DEVICES lists, when set) and takes a 1/ceil(W/n) share of its memory (less a margin), so W processes compile kernels on the host's
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
    # Index into the GPUs this run was given (a job pinned to GPU 2 keeps its workers there).
    _visible = [d for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d] or [str(i) for i in range(_gpus)]
    os.environ["CUDA_VISIBLE_DEVICES"] = _visible[_index % len(_visible)]
    os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"] = f"{0.9 / math.ceil(_workers / len(_visible)):.3f}"
