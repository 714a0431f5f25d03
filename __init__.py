"""forgeax: fast, differentiable accelerator kernels for JAX.

    import forgeax
    from forgeax import ops
    y = ops.rms_norm(x, scale)
    print(forgeax.explain(lambda x: ops.rms_norm(x, scale), x))
"""

from forgeax import export, ops
from forgeax.core import (
    Implementation,
    KernelConfig,
    Selection,
    Tuning,
    UnsupportedError,
    autotune,
    define_op,
    explain,
    interpret_mode,
    register_backend,
)
from forgeax.kernels.triton.user import triton_call

__version__ = "0.1.0"

__all__ = [
    "Implementation",
    "KernelConfig",
    "Selection",
    "Tuning",
    "UnsupportedError",
    "autotune",
    "define_op",
    "explain",
    "export",
    "interpret_mode",
    "ops",
    "register_backend",
    "triton_call",
]
