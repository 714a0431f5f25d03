"""One launcher for every Triton kernel in forgeax.

`triton_call` has jax-triton 0.3.1's calling convention: the kernel receives
the positional `args` in call order (arrays as pointers, scalars as values),
then one output pointer per leaf of `out_shape`, then `**metaparams` as
constexprs by name. `grid` is a tuple or a callable taking one dict of the
metaparams.

  * On GPU (and when cross-lowering on a machine without one) it is
    `jax_triton.triton_call`, imported lazily so `import forgeax` needs no
    Triton.
  * When `interpret_enabled()`, the kernel runs in Triton's own interpreter on
    numpy copies of the inputs, inside `jax.pure_callback` (so it works under
    jit). Outputs start as NaN (floats) or -1 (ints): an element the kernel
    forgets to write shows up in the result. The interpreter needs
    TRITON_INTERPRET=1 in the environment before `import triton`.

Pitfalls the kernels must respect (jax-triton 0.3.1's calling convention): a Python float
positional scalar becomes fp64 (pass np.float32 or a constexpr); int scalars
carry no divisibility hint (pass sizes/strides as constexprs); in the
interpreter a loop bound must be a constexpr.
"""

from __future__ import annotations

import functools
import threading
from typing import Any

import jax
import numpy as np

from forgeax.core.runtime import interpret_enabled

__all__ = ["triton_call"]

# Without a GPU to ask, cross-lowering targets Hopper (sm_90), where we ship.
_DEFAULT_COMPUTE_CAPABILITY = 90


def triton_call(
    *args: Any,
    kernel: Any,
    out_shape: Any,
    grid: Any,
    num_warps: int = 4,
    num_stages: int = 3,
    **metaparams: Any,
) -> Any:
    """Launches `kernel` on `args`; returns arrays shaped like `out_shape` (a pytree)."""
    if interpret_enabled():
        return _interpret_call(*args, kernel=kernel, out_shape=out_shape, grid=grid, **metaparams)
    import jax_triton  # lazily: an optional dependency

    from forgeax.kernels.triton import compile_cache  # noqa: PLC0415

    compile_cache.install()  # TTIR -> PTX on disk when a cache directory is configured
    return jax_triton.triton_call(
        *args,
        kernel=kernel,
        out_shape=out_shape,
        grid=grid,
        num_warps=num_warps,
        num_stages=num_stages,
        compute_capability=None if _has_gpu() else _DEFAULT_COMPUTE_CAPABILITY,
        **metaparams,
    )


@functools.cache
def _has_gpu() -> bool:
    try:
        return bool(jax.devices("gpu"))
    except RuntimeError:  # no GPU backend in this process (e.g. JAX_PLATFORMS=cpu)
        return False


# ----------------------------------------------------------------------------- interpreter


class _NpTensor:
    """The slice of torch.Tensor that Triton's interpreter touches, over a numpy array.

    The interpreter copies "device" tensors to the host and back; here the
    numpy buffer is the host buffer, so those copies are no-ops and the kernel
    reads and writes the array in place.
    """

    def __init__(self, array: np.ndarray) -> None:
        self.a = array
        self.dtype = array.dtype  # str() gives 'float32', 'bfloat16' (ml_dtypes), ...

    def data_ptr(self) -> int:
        return self.a.ctypes.data

    def untyped_storage(self) -> _NpTensor:
        return self

    def cpu(self) -> _NpTensor:
        return self

    def new_empty(self, *args: Any, **kwargs: Any) -> _NpTensor:
        return self

    def set_(self, *args: Any, **kwargs: Any) -> _NpTensor:
        return self

    def copy_(self, other: Any) -> _NpTensor:
        return self

    def storage_offset(self) -> int:
        return 0

    def size(self) -> tuple[int, ...]:
        return self.a.shape

    def stride(self) -> tuple[int, ...]:
        return tuple(s // self.a.itemsize for s in self.a.strides)


@functools.cache
def _interpreter() -> Any:
    """Triton's InterpretedFunction class, after checking and patching the interpreter."""
    import ml_dtypes  # a jax dependency
    import triton
    from triton.runtime import interpreter

    if not triton.knobs.runtime.interpret:
        raise RuntimeError(
            "forgeax interpret mode runs Triton kernels in Triton's interpreter, which needs the "
            "environment variable TRITON_INTERPRET=1 set before triton is imported (set it when "
            "starting the process, e.g. `TRITON_INTERPRET=1 FORGEAX_INTERPRET=1 python ...`)."
        )
    # numpy >= 2.5 refuses int() of a shape-(1,) array, which is how the interpreter
    # turns a scalar tensor into an index; take the single element instead.
    original = interpreter._patch_lang_tensor

    def patch_lang_tensor(tensor: Any, scope: Any) -> None:
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(np.asarray(self.handle.data).reshape(-1)[0]))

    interpreter._patch_lang_tensor = patch_lang_tensor

    # The interpreter truncates f32 -> bf16; GPUs round to nearest even. Round
    # like the GPU (via ml_dtypes) so interpret-mode errors match the hardware's.
    tl = triton.language
    truncating_cast = interpreter.InterpreterBuilder.cast_impl

    def cast_impl(self: Any, src: Any, dst_type: Any) -> Any:
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            rounded = src.data.astype(ml_dtypes.bfloat16).view(np.uint16)  # bf16 is stored as uint16
            return interpreter.TensorHandle(rounded, dst_type.scalar)
        return truncating_cast(self, src, dst_type)

    interpreter.InterpreterBuilder.cast_impl = cast_impl
    return interpreter.InterpretedFunction


def _poisoned(shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    fill = np.nan if jax.numpy.issubdtype(dtype, jax.numpy.inexact) else -1  # jnp knows bf16 is a float
    return np.full(shape, fill, dtype=dtype)


# Triton's interpreter patches triton.language module-wide for the duration of a launch: it is
# not thread-safe. Several devices' callbacks (shard_map over CPU devices) run concurrently and
# deadlock without this.
_INTERPRETER_LOCK = threading.Lock()


def _interpret_call(*args: Any, kernel: Any, out_shape: Any, grid: Any, **metaparams: Any) -> Any:
    interpreted = _interpreter()(getattr(kernel, "fn", kernel))  # JITFunction -> its Python source
    out_leaves, out_tree = jax.tree.flatten(out_shape)
    is_array = [isinstance(a, (jax.Array, np.ndarray)) for a in args]  # tracers are jax.Arrays
    launch_grid = grid(dict(metaparams)) if callable(grid) else grid
    launch_grid = tuple(launch_grid) if isinstance(launch_grid, (tuple, list)) else (launch_grid,)

    def host(*arrays: np.ndarray) -> list[np.ndarray]:
        inputs = iter(arrays)
        # Fresh C-contiguous copies: the kernel must not see (or write) jax's buffers.
        call_args = [_NpTensor(np.array(next(inputs), order="C")) if flag else a for a, flag in zip(args, is_array)]
        outs = [_poisoned(s.shape, s.dtype) for s in out_leaves]
        with _INTERPRETER_LOCK:  # one launch at a time (see _INTERPRETER_LOCK)
            interpreted[launch_grid](*call_args, *[_NpTensor(o) for o in outs], **metaparams)
        return outs

    result_shapes = [jax.ShapeDtypeStruct(s.shape, s.dtype) for s in out_leaves]
    outs = jax.pure_callback(host, result_shapes, *[a for a, flag in zip(args, is_array) if flag])
    return jax.tree.unflatten(out_tree, outs)


def check_matmul_tiles(config: Any) -> None:
    """A matmul kernel config's tiles (block_m/n/k powers of two >= 16; num_warps 1..16): the
    ValueError names the config class and field."""
    for name in ("block_m", "block_n", "block_k"):
        value = getattr(config, name)
        if value < 16 or value & (value - 1):
            raise ValueError(f"{type(config).__name__}.{name}: expected a power of two >= 16, got {value}")
    if config.num_warps not in (1, 2, 4, 8, 16):
        raise ValueError(f"{type(config).__name__}.num_warps: expected 1, 2, 4, 8 or 16, got {config.num_warps}")


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def fit_matmul_tiles(config: Any, m: int, n: int, k: int) -> Any:
    """`config` with blocks no larger than the (power-of-two-rounded) problem, and at least 16."""
    return config.replace(block_m=max(16, min(config.block_m, _pow2_at_least(m))),
                          block_n=max(16, min(config.block_n, _pow2_at_least(n))),
                          block_k=max(16, min(config.block_k, _pow2_at_least(k))))
