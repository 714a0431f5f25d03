"""forgeax.core: the bottom layer that kernels and ops both import.

`runtime` (platform, device kind, interpret mode), `registry` (`Implementation`,
`UnsupportedError`), `config` (kernel config dataclasses and tuned-config data),
`selection` (rules as data), `dispatch` (`Op`, the registry, `explain`), `tuning` (`Tuning`:
measured backend and config choices) and `autotune`. Nothing here imports a kernel or an op.
"""

from forgeax.core.autotuning import autotune
from forgeax.core.config import KernelConfig, TunedConfigs, TunedEntry, call_key
from forgeax.core.dispatch import OPS, Choice, Decision, Explanation, Op, define_op, explain, register_backend
from forgeax.core.registry import Implementation, ImplementationRef, UnsupportedError
from forgeax.core.runtime import (
    PLATFORMS,
    current_compute_capability,
    current_compute_capability_major,
    current_device_kind,
    current_platform,
    gpu_sm_count,
    interpret_enabled,
    interpret_mode,
    xla_gpu_deterministic_ops,
)
from forgeax.core.selection import Rule, Selection
from forgeax.core.tuning import StaleTuningWarning, Tuning, TuningEntry

__all__ = [
    "OPS", "PLATFORMS", "Choice", "Decision", "Explanation", "Implementation", "ImplementationRef",
    "KernelConfig", "Op", "Rule", "Selection", "StaleTuningWarning", "TunedConfigs", "TunedEntry", "Tuning",
    "TuningEntry", "UnsupportedError", "autotune", "call_key", "current_compute_capability", "current_compute_capability_major", "current_device_kind",
    "current_platform", "define_op", "explain", "gpu_sm_count", "interpret_enabled", "interpret_mode",
    "register_backend", "xla_gpu_deterministic_ops",
]
