"""forgeax.export: serialise functions that call forgeax ops with `jax.export`.

`jax.export` refuses custom calls whose target it does not know to be stable. forgeax's
kernels lower to these custom calls:

  * "triton_kernel_call": Triton kernels through jax-triton (the compiled kernel, PTX for one
    compute capability, is embedded in the call's backend config);
  * "mosaic_gpu_v2": Pallas Mosaic GPU kernels; "tpu_custom_call": Pallas Mosaic TPU kernels
    (both already on JAX's list of stable targets);
  * "__cudnn$fmhaSoftmax[Backward]": cuDNN attention (the "cudnn" backend, through jax.nn.dot_product_attention).

    exported = forgeax.export.export(jax.jit(loss), platforms=("cuda",))(params, batch)
    blob = exported.serialize()                     # bytes
    forgeax.export.load_runtimes()                  # in a new process, before the first call
    jax.export.deserialize(blob).call(params, batch)

or pass `disabled_checks=forgeax.export.disabled_checks()` to `jax.export.export` yourself.
`cached(fn, key=...)` keeps a function's exported program on disk so that a new process skips
tracing and lowering (where Triton and Mosaic GPU kernels are built).
What cannot be exported: calls traced in interpret mode (the Triton, Mosaic GPU and Mosaic TPU
interpreters run as host callbacks, which `jax.export` refuses); `export` below therefore traces
with interpret mode off. An exported Triton or Mosaic GPU kernel runs only on the GPU
generation it was compiled for (sm_90 when lowered without a GPU) and with a jaxlib whose
custom-call ABI matches (no cross-version guarantee: why JAX does not list them as stable).
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections.abc import Callable, Sequence
from typing import Any

import jax

from forgeax.core import runtime
from forgeax.core.runtime import interpret_mode

__all__ = ["CUSTOM_CALL_TARGETS", "cached", "disabled_checks", "export", "load_runtimes"]

# Every custom-call target a forgeax kernel emits (tests/export_test.py checks that lowering
# forgeax's kernels produces no other unstable target).
CUSTOM_CALL_TARGETS: tuple[str, ...] = (
    "triton_kernel_call",
    "mosaic_gpu_v2",
    "tpu_custom_call",
    # The "cudnn" attention backend refuses bias and dropout, so only these two (lowering them
    # needs cuDNN: checked on a GPU).
    "__cudnn$fmhaSoftmax",
    "__cudnn$fmhaSoftmaxBackward",
)


def disabled_checks() -> list[jax.export.DisabledSafetyCheck]:
    """`jax.export` safety checks to disable so that forgeax's custom calls may be serialised."""
    return [jax.export.DisabledSafetyCheck.custom_call(t) for t in CUSTOM_CALL_TARGETS]


def load_runtimes() -> None:
    """Makes a deserialised program's Mosaic GPU kernels runnable in this process.

    Their custom call finds its host runtime (libmosaic_gpu_runtime.so) through the environment
    variable MOSAIC_GPU_RUNTIME_LIB_PATH, which JAX sets when `jax.experimental.mosaic.gpu` is
    imported: tracing a Pallas GPU kernel imports it, deserialising and running a program does
    not, and the first call then fails with "Symbols not found: mosaic_gpu_launch_kernel". This
    sets the variable from jaxlib's CUDA plugin (a no-op without one). `cached` calls it."""
    if os.environ.get("MOSAIC_GPU_RUNTIME_LIB_PATH"):
        return
    try:
        from jax._src.lib import mosaic_gpu  # noqa: PLC0415 - the library's location only (ms), not the MLIR stack
        path = os.path.join(os.path.dirname(mosaic_gpu._mosaic_gpu_ext.__file__), "libmosaic_gpu_runtime.so")
    except (ImportError, AttributeError):
        path = None
    if path and os.path.exists(path):
        os.environ["MOSAIC_GPU_RUNTIME_LIB_PATH"] = path
        return
    try:
        import jax.experimental.mosaic.gpu  # noqa: F401,PLC0415 - sets the variable itself where it can
    except ImportError:
        pass


def export(fn: Callable[..., Any], *, platforms: Sequence[str] | None = None,
           disabled_checks: Sequence[jax.export.DisabledSafetyCheck] = ()) -> Callable[..., jax.export.Exported]:
    """`jax.export.export(fn, ...)` with forgeax's custom calls allowed and its kernels traced
    natively (never their interpreters). `fn` should be jitted; returns a function of the
    arguments (arrays or ShapeDtypeStructs) that gives the `jax.export.Exported`."""
    checks = [*globals()["disabled_checks"](), *disabled_checks]
    exporter = jax.export.export(fn if hasattr(fn, "trace") else jax.jit(fn), platforms=platforms,
                                 disabled_checks=checks)

    def run(*args: Any, **kwargs: Any) -> jax.export.Exported:
        with interpret_mode(False):
            return exporter(*args, **kwargs)

    return run


def _cache_directory(directory: str | None) -> str:
    directory = directory or os.environ.get("FORGEAX_EXPORT_CACHE_DIR", "").strip() or None
    if directory is None and jax.config.jax_compilation_cache_dir:
        directory = os.path.join(jax.config.jax_compilation_cache_dir, "forgeax-export")
    if directory is None:
        raise ValueError("directory: give one, or set FORGEAX_EXPORT_CACHE_DIR or jax_compilation_cache_dir")
    return directory


def _signature(key: str, args: Any, kwargs: Any) -> str:
    """What decides the traced program besides `fn`'s code: the arguments' structure, shapes and
    dtypes, where it runs, the versions, interpret mode and the active tuning."""
    from forgeax import __version__  # noqa: PLC0415 - the package imports this module
    from forgeax.core import tuning  # noqa: PLC0415

    leaves, tree = jax.tree.flatten((args, kwargs))
    avals = [(tuple(a.shape), str(a.dtype), bool(getattr(a, "weak_type", False))) if hasattr(a, "shape") else repr(a)
             for a in leaves]
    sources = [(label, t.dumps()) for label, t in tuning.sources()]
    parts = [key, str(tree), repr(avals), runtime.current_platform(), runtime.current_device_kind(),
             str(runtime.interpret_enabled()), jax.__version__, __version__, repr(sources)]
    return hashlib.sha256("\x00".join(parts).encode()).hexdigest()[:32]


def cached(fn: Callable[..., Any], *, key: str, directory: str | None = None) -> Callable[..., Any]:
    """`jax.jit(fn)` whose traced and lowered program is kept on disk (`jax.export`), so that a
    new process skips tracing and lowering, where Triton and Mosaic GPU kernels compile (seconds
    per kernel; JAX's persistent compilation cache starts after lowering). With JAX's cache also
    set, the warm process compiles nothing either.

    `key` names `fn`'s code: change it whenever `fn` or anything it calls changes (Python code is
    not hashed; a stale key runs the old program). Entries are also keyed by the arguments'
    structure, shapes and dtypes, the platform and device kind, the JAX and forgeax versions,
    interpret mode and the active tunings. The directory is `directory`, else
    FORGEAX_EXPORT_CACHE_DIR, else `<jax_compilation_cache_dir>/forgeax-export`. The result is
    not differentiable (export the whole training step, gradient included); keyword arguments
    must be arrays (pytrees), like the positional ones.
    """
    jitted = fn if hasattr(fn, "trace") else jax.jit(fn)
    loaded: dict[str, Callable[..., Any]] = {}  # signature -> jitted call of the exported program
    lock = threading.Lock()

    def call(*args: Any, **kwargs: Any) -> Any:
        signature = _signature(key, args, kwargs)
        with lock:
            run = loaded.get(signature)
            if run is None:
                folder = _cache_directory(directory)
                path = os.path.join(folder, f"{signature}.jax_export")
                try:
                    with open(path, "rb") as f:
                        exported = jax.export.deserialize(bytearray(f.read()))
                    load_runtimes()
                except (OSError, ValueError):
                    exported = export(jitted)(*args, **kwargs)
                    os.makedirs(folder, exist_ok=True)
                    tmp = f"{path}.{os.getpid()}.tmp"
                    with open(tmp, "wb") as f:
                        f.write(exported.serialize())
                    os.replace(tmp, path)
                run = loaded[signature] = jax.jit(exported.call)  # jit: one dispatch per call
        return run(*args, **kwargs)

    return call
