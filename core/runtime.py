"""Where forgeax runs: platform, device kind, interpret mode, XLA's determinism flag.

Read at trace time by the selection (`forgeax.core.dispatch`) and by kernels that size
themselves to the device. The only state is the interpret-mode context variable.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
from collections.abc import Iterator

import jax

PLATFORMS = ("cpu", "gpu", "tpu")

_INTERPRET = contextvars.ContextVar("forgeax_interpret", default=None)


def interpret_enabled() -> bool:
    """Whether kernels run in their CPU interpreters.

    True inside `with interpret_mode():`, else when the environment variable
    FORGEAX_INTERPRET is set to a true value (1/true/yes/on).
    """
    forced = _INTERPRET.get()
    if forced is not None:
        return forced
    return os.environ.get("FORGEAX_INTERPRET", "").strip().lower() in ("1", "true", "yes", "on")


@contextlib.contextmanager
def interpret_mode(enabled: bool = True) -> Iterator[None]:
    """Run Pallas and Triton kernels in their interpreters (CPU) within this block.

    Kernels decide at trace time, so a function jitted outside the block keeps
    the mode it was traced with.
    """
    token = _INTERPRET.set(enabled)
    try:
        yield
    finally:
        _INTERPRET.reset(token)


def current_platform() -> str:
    """'cpu', 'gpu' or 'tpu': the platform of JAX's default backend."""
    backend = jax.default_backend()
    if backend in ("cuda", "rocm", "gpu"):
        return "gpu"
    return backend if backend in PLATFORMS else "cpu"


def current_device_kind() -> str:
    """The default device's kind, e.g. 'NVIDIA H200' (what selection rules and tuned configs match)."""
    return jax.devices()[0].device_kind


def current_compute_capability() -> str:
    """The default device's CUDA compute capability, e.g. '9.0'; '' when it reports none (CPU, TPU)."""
    return str(getattr(jax.devices()[0], "compute_capability", ""))


def current_compute_capability_major() -> int:
    """The major version of `current_compute_capability()` (9 on Hopper); 0 when there is none."""
    major = current_compute_capability().split(".")[0]
    return int(major) if major.isdigit() else 0


def gpu_sm_count() -> int:
    """Streaming multiprocessors of the first local GPU (what persistent grids size to); 132, an
    H100/H200 SXM's, when there is no GPU backend (interpret mode, cross-lowering on CPU)."""
    try:
        return int(getattr(jax.local_devices(backend="gpu")[0], "core_count", 0) or 132)
    except RuntimeError:
        return 132


def xla_gpu_deterministic_ops() -> bool:
    """Whether XLA_FLAGS turns on --xla_gpu_deterministic_ops (JAX's switch for reproducible GPU ops)."""
    value = None
    for flag in os.environ.get("XLA_FLAGS", "").split():
        name, _, setting = flag.partition("=")
        if name == "--xla_gpu_deterministic_ops":
            value = setting.lower() in ("", "true", "1")
    return bool(value)
