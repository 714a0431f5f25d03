"""The setup the *_parallel_test.py files share: 8 CPU devices, asked for before JAX starts.

Import this module before `import jax`: it adds --xla_force_host_platform_device_count=8 to
XLA_FLAGS (unless XLA_FLAGS already sets a count), which JAX reads only when it first starts, so it
takes effect when the test file is the first in its process to import jax (its own target).
FORGEAX_TEST_DEVICES=2 asks for 2 CPU devices instead, and tests then need only those: the mesh
shapes of a 2-GPU host (a size-1 mesh axis) reproduced on CPU. CI keeps the default 8.
"""

from __future__ import annotations

import math
import os
import re

CPU_DEVICES = int(os.environ.get("FORGEAX_TEST_DEVICES", "8"))

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={CPU_DEVICES}").strip()


def interpret_triton_on_cpu() -> None:
    """TRITON_INTERPRET=1 by default under JAX_PLATFORMS=cpu; call before triton is first imported."""
    if os.environ.get("JAX_PLATFORMS", "") == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")


def skip_unless_devices(cpu: int = 8, gpu: int | None = None) -> bool:
    """Skip the calling test module unless it has `cpu` devices (`gpu` on a GPU, where given).
    Returns whether JAX runs on a GPU."""
    import jax  # noqa: PLC0415  (after XLA_FLAGS is set above)
    import pytest  # noqa: PLC0415

    on_gpu = jax.default_backend() == "gpu"
    need = gpu if on_gpu and gpu is not None else min(cpu, CPU_DEVICES)
    if len(jax.devices()) < need:
        also = f" or {gpu} GPUs" if gpu is not None else ""
        pytest.skip(f"needs {cpu} CPU devices (XLA_FLAGS=--xla_force_host_platform_device_count=8 before jax starts){also}",
                    allow_module_level=True)
    return on_gpu


def same_sharding(got, want) -> bool:
    """Whether array `got` is laid out like `want` (an array or a sharding). Compares placements,
    not PartitionSpecs: XLA drops a mesh axis of size 1 from an output's spec (a 2-GPU mesh
    (1, 2) returns P(None, 'model') for an input placed as P('data', 'model'))."""
    sharding = getattr(want, "sharding", want)
    return got.sharding.is_equivalent_to(sharding, got.ndim)


# A collective in compiled HLO text: (its result shape, its kind); async forms count as theirs.
COLLECTIVE = re.compile(r"= (\(.*?\)|\S+) (all-gather|all-reduce|all-to-all|collective-permute|reduce-scatter)(?:-start)?\(")


def elements(shape_text: str) -> int:
    """Largest array (in elements) among an HLO shape or tuple of shapes."""
    dims = re.findall(r"\[([\d,]*)\]", shape_text)
    return max((math.prod(int(d) for d in ds.split(",") if d) for ds in dims), default=1)
