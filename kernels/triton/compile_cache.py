"""A persistent on-disk cache of Triton's TTIR -> PTX compiles, for jax-triton launches.

jax-triton compiles a @triton.jit kernel to PTX when JAX lowers the jitted function (0.4-3.8 s
per kernel), and keeps the result only in memory; JAX's persistent compilation cache does not
help there, since JAX lowers before it looks the compiled program up. With a cache directory
set, every jax-triton compile (forgeax's kernels and `forgeax.triton_call`) is looked up here
first.

The key is a SHA-256 of: the TTIR text (the kernel's source with its @triton.jit dependencies
inlined, its constexprs, argument dtypes and pointer alignment), the compile options (num_warps,
num_stages, num_ctas, fp fusion, ...), the target (platform, compute capability) and the Triton
and jax-triton versions. The grid is not part of a compile (it is a launch parameter of the
custom call). One JSON file per entry, written atomically; delete the directory to clear it.

Where: `FORGEAX_TRITON_CACHE_DIR`, else `<jax_compilation_cache_dir>/forgeax-triton` when JAX's
persistent cache is configured; otherwise nothing is cached on disk.
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import json
import os
import threading
from typing import Any

import jax

__all__ = ["cache_dir", "install", "stats"]

_LOCK = threading.Lock()
_STATS = {"hits": 0, "misses": 0}
_INSTALLED: list[str] = []  # the directory the patch writes to (at most one)


def cache_dir() -> str | None:
    """The directory in use, from the environment and JAX's config; None: no disk cache."""
    explicit = os.environ.get("FORGEAX_TRITON_CACHE_DIR", "").strip()
    if explicit:
        return explicit
    jax_dir = jax.config.jax_compilation_cache_dir
    return os.path.join(jax_dir, "forgeax-triton") if jax_dir else None


def stats() -> dict[str, int]:
    """Hits and misses of this process (compiles looked up on disk)."""
    return dict(_STATS)


def _key(ttir: str, backend: Any, options: Any, compute_capability: Any, platform: str) -> str:
    import jax_triton  # noqa: PLC0415 - optional dependency
    import triton  # noqa: PLC0415

    if dataclasses.is_dataclass(options):
        opts = sorted((k, repr(v)) for k, v in dataclasses.asdict(options).items())
    else:
        opts = repr(options)
    parts = [ttir, repr(opts), str(compute_capability), platform, type(backend).__name__,
             triton.__version__, jax_triton.__version__]
    return hashlib.sha256("\x00".join(parts).encode()).hexdigest()


def _encode(value: Any) -> Any:
    if isinstance(value, bytes):
        return {"bytes": base64.b64encode(value).decode()}
    return value


def _decode(value: Any) -> Any:
    if isinstance(value, dict) and set(value) == {"bytes"}:
        return base64.b64decode(value["bytes"])
    return value


def install() -> str | None:
    """Routes jax-triton's compiles through the disk cache in `cache_dir()` (idempotent);
    returns the directory, or None when no cache directory is configured."""
    directory = cache_dir()
    if directory is None:
        return None
    with _LOCK:
        if _INSTALLED:
            _INSTALLED[0] = directory
            return directory
        from jax_triton import triton_lib  # noqa: PLC0415

        compile_ttir = triton_lib.compile_ttir_inplace
        result_type = triton_lib.CompilationResult

        def cached_compile(ttir, backend, options, compute_capability, platform):
            folder = _INSTALLED[0]
            path = os.path.join(folder, _key(str(ttir), backend, options, compute_capability, platform) + ".json")
            try:
                with open(path) as f:
                    fields = {k: _decode(v) for k, v in json.load(f).items()}
                _STATS["hits"] += 1
                return result_type(**fields)
            except (OSError, ValueError, TypeError):
                pass  # absent or unreadable: compile
            result = compile_ttir(ttir, backend, options, compute_capability, platform)
            _STATS["misses"] += 1
            fields = {f: _encode(getattr(result, f)) for f in result._fields} if hasattr(result, "_fields") else \
                {f.name: _encode(getattr(result, f.name)) for f in dataclasses.fields(result)}
            os.makedirs(folder, exist_ok=True)
            tmp = f"{path}.{os.getpid()}.tmp"
            with open(tmp, "w") as f:
                json.dump(fields, f)
            os.replace(tmp, path)
            return result

        triton_lib.compile_ttir_inplace = cached_compile
        _INSTALLED.append(directory)
    return directory
