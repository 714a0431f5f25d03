"""The conformance harness for forgeax's own test suites: `forgeax.testing`, plus the test-run
settings and shared case tables of these suites.

The harness (assert_conforms, Case, runnable_backends, relative_error, random_array,
lowered_text, TOLERANCE) lives in forgeax.testing so that users can check their own ops and
backends with it; test files keep importing it from here (`import conformance`).
"""

from __future__ import annotations

import os

# XLA sizes its CPU thread pool from NPROC, else the cores. The Mosaic GPU interpreter runs a kernel
# as an XLA host callback that starts one program per warpgroup; a warpgroup's barrier wait is a
# callback that blocks the pool thread running it, and the kernel's own callback holds another.
# On a 2-core machine (CI) these two took the whole pool while the warpgroup they waited for had
# no thread left to run on: a hang (seen in a dQ + dK/dV backward under jit at T = S = 17; the
# same kernels ran when called one by one). Set before the first use of the CPU backend
# (`runnable_backends` below is the first in the test files); the Bazel targets set it too.
os.environ.setdefault("NPROC", "8")

from forgeax.testing import (  # noqa: E402,F401 - re-exported for the test files
    TOLERANCE,
    Case,
    _upcast,
    _vjp,
    assert_conforms,
    lowered_text,
    random_array,
    relative_error,
    runnable_backends,
)


def assert_pallas_tpu_unsupported(call) -> None:
    """`call()`, an op asked for backend="pallas_tpu" off a TPU and outside interpret mode, raises
    ops.UnsupportedError with the reason (a NotImplementedError). Skips where pallas_tpu can run."""
    import pytest  # noqa: PLC0415

    from forgeax import core, ops  # noqa: PLC0415

    if core.interpret_enabled() or core.current_platform() == "tpu":
        pytest.skip("pallas_tpu can run here")
    with pytest.raises(ops.UnsupportedError, match="pallas_tpu: runs on tpu"):
        call()
    assert issubclass(ops.UnsupportedError, NotImplementedError)

# The loss options every loss suite (cross_entropy, linear_cross_entropy) runs each backend with.
LOSS_OPTIONS = {
    "label_smoothing": dict(label_smoothing=0.1),
    "z_loss": dict(z_loss=1e-2),
    "soft_cap": dict(logit_soft_cap=5.0),
    "ignore_index": dict(ignore_index=3),
    "all_mean": dict(label_smoothing=0.2, z_loss=1e-3, logit_soft_cap=4.0, ignore_index=7, reduction="mean"),
    "all_sum": dict(label_smoothing=1.0, z_loss=1e-4, logit_soft_cap=30.0, reduction="sum"),
    "ls_zloss_none": dict(label_smoothing=0.05, z_loss=1e-4, reduction="none"),
}
