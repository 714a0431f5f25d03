"""`forgeax.triton_call`: call your own @triton.jit kernel from JAX.

jax-triton's calling convention (the kernel gets the positional `args` in order, arrays as
pointers and scalars as values, then one output pointer per leaf of `out_shape`, then
`**metaparams` as constexprs by name; `grid` is a tuple or `grid(metaparams) -> tuple`), plus:

  * vmap. A kernel that declares a constexpr `<param>_batch_stride` for its pointer parameters
    (forgeax passes them on every launch) is batch-aware: under `jax.vmap` it is launched once, with the batch as one more
    grid axis after its own (`tl.program_id(len(grid))`, 0 when not vmapped), and forgeax passes
    each pointer's per-example stride in elements (0 for an operand that is not batched). The
    kernel adds `pid * <param>_batch_stride` to each pointer. Batched operands and outputs are
    row-major with the batch leading; nested vmaps fold into the same axis. A kernel without such
    parameters (or whose grid already has 3 axes) runs once per example (`lax.map`).
  * A CPU interpreter: under forgeax's interpret mode (`FORGEAX_INTERPRET=1` or
    `forgeax.interpret_mode()`) the kernel runs in Triton's interpreter inside a
    `jax.pure_callback` (needs `TRITON_INTERPRET=1` before `import triton`).
  * A persistent compile cache: with `FORGEAX_TRITON_CACHE_DIR` (or JAX's
    `jax_compilation_cache_dir`) set, Triton's TTIR -> PTX compile is stored on disk, keyed on
    the TTIR (kernel source, constexprs, dtypes, alignment), the compile options (num_warps,
    num_stages, ...), the compute capability and the Triton / jax-triton versions
    (`forgeax.kernels.triton.compile_cache`).

Differentiation: like any kernel, pair a forward and a backward launch in a `jax.custom_vjp`
(docs/extending.md and examples/custom_kernel/ show the pattern); vmap of the differentiated
function batches both launches.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from forgeax.kernels.triton import launch

__all__ = ["BATCH_STRIDE_SUFFIX", "triton_call"]

BATCH_STRIDE_SUFFIX = "_batch_stride"
_MAX_GRID_AXES = 3  # CUDA grids have x, y, z


def _parameter_names(kernel: Any) -> tuple[str, ...]:
    """The kernel's parameter names (a JITFunction, an Autotuner around one, or an interpreted one)."""
    names = getattr(kernel, "arg_names", None)
    if names:
        return tuple(names)
    fn = kernel
    while hasattr(fn, "fn"):
        fn = fn.fn
    return tuple(inspect.signature(fn).parameters)


@dataclasses.dataclass(frozen=True, eq=False)
class _Launch:
    """Everything about one launch but its array operands."""

    kernel: Any
    template: tuple[Any, ...]  # the positional args, with None where an array goes
    out_shapes: tuple[jax.ShapeDtypeStruct, ...]
    out_tree: Any
    grid: Any
    num_warps: int
    num_stages: int
    metaparams: tuple[tuple[str, Any], ...]

    @functools.cached_property
    def pointer_names(self) -> tuple[str, ...]:
        """Kernel parameter names of the array operands, then of the outputs."""
        names = _parameter_names(self.kernel)
        needed = len(self.template) + len(self.out_shapes)
        if len(names) < needed:
            raise TypeError(f"kernel: takes {len(names)} parameters, fewer than the {len(self.template)} args and "
                            f"{len(self.out_shapes)} outputs passed")
        arrays = [names[i] for i, a in enumerate(self.template) if a is None]
        return tuple(arrays) + names[len(self.template):needed]

    @functools.cached_property
    def batch_aware(self) -> bool:
        return any(n.endswith(BATCH_STRIDE_SUFFIX) for n in _parameter_names(self.kernel))

    def grid_for(self, metaparams: dict[str, Any]) -> tuple[int, ...]:
        grid = self.grid(dict(metaparams)) if callable(self.grid) else self.grid
        return tuple(grid) if isinstance(grid, (tuple, list)) else (grid,)


def triton_call(*args: Any, kernel: Any, out_shape: Any, grid: Any, num_warps: int = 4, num_stages: int = 3,
                **metaparams: Any) -> Any:
    """Launches `kernel` on `args`; returns arrays shaped like `out_shape` (a pytree of
    ShapeDtypeStructs or arrays). Traceable under jit, batchable under vmap (see the module
    docstring), runs in Triton's interpreter in forgeax's interpret mode. Not differentiable by
    itself: wrap forward and backward launches in a `jax.custom_vjp`.

    Python float scalars become fp64 in the kernel (pass `np.float32(x)` or a constexpr); pass
    sizes and strides as constexprs (jax-triton gives int scalars no divisibility hint).
    """
    out_leaves, out_tree = jax.tree.flatten(out_shape)
    out_shapes = tuple(jax.ShapeDtypeStruct(tuple(s.shape), s.dtype) for s in out_leaves)
    is_array = [isinstance(a, (jax.Array, np.ndarray)) for a in args]
    for name in metaparams:
        if name.endswith(BATCH_STRIDE_SUFFIX):
            raise ValueError(f"{name}: *{BATCH_STRIDE_SUFFIX} constexprs are set by vmap, not by the caller")
    spec = _Launch(kernel, tuple(None if flag else a for a, flag in zip(args, is_array)), out_shapes, out_tree, grid,
                   num_warps, num_stages, tuple(metaparams.items()))
    arrays = [jax.numpy.asarray(a) for a, flag in zip(args, is_array) if flag]
    outs = _no_derivative(_batchable(spec, None))(*arrays)
    return jax.tree.unflatten(out_tree, outs)


def _no_derivative(run):
    """`run` with a JVP rule that says what to do instead (the same error on GPU and in the
    interpreter, whose own messages differ)."""

    @jax.custom_jvp
    def launch(*arrays):
        return run(*arrays)

    @launch.defjvp
    def _jvp(primals, tangents):
        del primals, tangents
        raise TypeError("forgeax.triton_call: a kernel launch has no derivative; pair a forward and a backward "
                        "triton_call in a jax.custom_vjp (docs/extending.md, examples/custom_kernel/)")

    return launch


# (batch size, which array operands carry it) of a folded launch; None when not vmapped.
_Batch = tuple[int, tuple[bool, ...]] | None


def _launch(spec: _Launch, batch: _Batch, arrays: Sequence[jax.Array]) -> list[jax.Array]:
    it = iter(arrays)
    call_args = [next(it) if a is None else a for a in spec.template]
    metaparams = dict(spec.metaparams)
    grid = spec.grid_for(metaparams)
    out_shapes = spec.out_shapes
    # Every declared batch stride is passed (0 when not vmapped): jax-triton's compile does not
    # apply a constexpr's default value.
    metaparams.update({n: 0 for n in _parameter_names(spec.kernel) if n.endswith(BATCH_STRIDE_SUFFIX)})
    if batch is not None:
        size, flags = batch
        # Per-example strides in elements: the operands' leading axis is the batch.
        strides = [int(np.prod(a.shape[1:])) if f else 0 for a, f in zip(arrays, flags)]
        strides += [int(np.prod(s.shape)) for s in out_shapes]
        declared = set(_parameter_names(spec.kernel))
        for name, stride in zip(spec.pointer_names, strides):
            key = name + BATCH_STRIDE_SUFFIX
            if key in declared:
                metaparams[key] = stride
            elif stride:
                raise ValueError(f"kernel: vmap batches {name!r} but the kernel declares no {key!r} constexpr; "
                                 f"declare one for every pointer parameter (default 0)")
        grid = grid + (size,)
        out_shapes = tuple(jax.ShapeDtypeStruct((size,) + s.shape, s.dtype) for s in out_shapes)
    outs = launch.triton_call(*call_args, kernel=spec.kernel, out_shape=out_shapes, grid=grid,
                              num_warps=spec.num_warps, num_stages=spec.num_stages, **metaparams)
    return list(outs)


def _batchable(spec: _Launch, batch: _Batch):
    """The launch as a function of its array operands, with a vmap rule that folds the batch
    into one more grid axis (or maps over it where the kernel cannot take it)."""

    @jax.custom_batching.custom_vmap
    def run(*arrays):
        return _launch(spec, batch, arrays)

    @run.def_vmap
    def rule(axis_size, in_batched, *arrays):
        in_batched = [bool(b) for b in in_batched]
        axes = len(spec.grid_for(dict(spec.metaparams))) + (batch is not None)
        if not spec.batch_aware or (batch is None and axes >= _MAX_GRID_AXES):
            return _map_over_batch(run, axis_size, in_batched, arrays)
        if batch is None:
            out = _batchable(spec, (axis_size, tuple(in_batched)))(*arrays)
            return out, [True] * len(out)
        # Nested vmap: fold the new axis (leading) and the folded one into one batch axis of
        # size axis_size * inner; an operand batched by only one of them is broadcast.
        inner, inner_flags = batch
        merged, flags = [], []
        for a, outer_b, inner_b in zip(arrays, in_batched, inner_flags):
            if not (outer_b or inner_b):
                merged.append(a)
                flags.append(False)
                continue
            if not outer_b:
                a = jax.numpy.broadcast_to(a, (axis_size,) + a.shape)
            if not inner_b:
                a = jax.numpy.broadcast_to(a[:, None], (axis_size, inner) + a.shape[1:])
            merged.append(a.reshape((axis_size * inner,) + a.shape[2:]))
            flags.append(True)
        out = _batchable(spec, (axis_size * inner, tuple(flags)))(*merged)
        out = [o.reshape((axis_size, inner) + o.shape[1:]) for o in out]
        return out, [True] * len(out)

    return run


def _map_over_batch(run, axis_size: int, in_batched: list[bool], arrays):
    """One launch per example (a kernel that declares no batch strides)."""
    batched = [a for a, b in zip(arrays, in_batched) if b]

    def one(slices):
        it = iter(slices)
        return run(*[next(it) if b else a for a, b in zip(arrays, in_batched)])

    out = jax.lax.map(one, batched)
    return out, [True] * len(out)
