"""Benchmark specs: named shapes from real models, how to call each op, and its floor.

A spec says, for an op and a mode ("fwd" or "fwd+bwd"), how to build inputs,
how to run one backend, and how many bytes / FLOPs the call must move at
minimum. `tools/bench.py` times every backend and anchor side by side.
"""

from __future__ import annotations

from . import attention, losses, matmul, norms, recurrent, serving
from .base import Shape, Spec

# op name -> Spec; every family module contributes its ops (examples add their own at import).
SPECS: dict[str, Spec] = {}
for _family in (norms, losses, matmul, attention, serving, recurrent):
    SPECS.update(_family.SPECS)



def default_shapes(spec: Spec, platform: str, names: list[str] | None = None) -> list[Shape]:
    """The shapes a run times: those named, else the model shapes on an accelerator and the small
    ones on the CPU. The small shapes are CPU demonstrations: on a GPU their calls take 0.03-0.1 ms,
    launch-bound, and two timings of one kernel differ by 5-15% between runs."""
    if names:
        return [s for s in spec.shapes if s.name in names]
    return [s for s in spec.shapes if s.small == (platform == "cpu")]


__all__ = ["SPECS", "Shape", "Spec", "default_shapes"]
