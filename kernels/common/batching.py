"""vmap for row-wise kernels: fold a vmapped batch axis into the rows.

Kernel launches (jax-triton calls, Pallas calls on some targets) have no batching
rule. A row-wise kernel does not need one: vmapping it over row-major arrays is
the same kernel over more rows.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp


def fold_vmap_into_rows(fn: Callable[..., Any], row_args: Sequence[int]) -> Callable[..., Any]:
    """Wraps `fn(*args)` so that `jax.vmap` folds the batch axis into rows.

    `fn`'s positional arguments listed in `row_args` have rows on axis 0 (one
    independent problem per row); every output leaf has rows on axis 0 too.
    Under vmap, when only row arguments are batched, the batch axis is merged
    into the rows and `fn` runs once; when any other argument (weights) is
    batched, `fn` runs once per batch element with `lax.map`.
    Outputs that reduce over rows (weight gradients) cannot be folded: give
    such a function `row_args=()`, which always takes the `lax.map` path.
    Arguments may be None (e.g. no offset) or pytrees.
    """
    row_args = frozenset(row_args)

    @jax.custom_batching.custom_vmap
    def wrapped(*args):
        return fn(*args)

    @wrapped.def_vmap
    def _rule(axis_size, in_batched, *args):
        others_batched = any(any(jax.tree.leaves(b)) for i, b in enumerate(in_batched) if i not in row_args)
        if others_batched:
            def one(i):
                return wrapped(*[
                    jax.tree.map(lambda a, b: a[i] if b else a, arg, flag) for arg, flag in zip(args, in_batched)
                ])
            out = jax.lax.map(one, jnp.arange(axis_size))
        else:
            def merge(a, flag):
                if not flag:
                    a = jnp.broadcast_to(a, (axis_size,) + a.shape)
                return a.reshape((axis_size * a.shape[1],) + a.shape[2:])

            merged = [
                jax.tree.map(merge, arg, flag) if i in row_args and arg is not None else arg
                for i, (arg, flag) in enumerate(zip(args, in_batched))
            ]
            out = wrapped(*merged)  # the wrapper again: an outer vmap folds too
            out = jax.tree.map(lambda o: o.reshape((axis_size, o.shape[0] // axis_size) + o.shape[1:]), out)
        return out, jax.tree.map(lambda _: True, out)

    return functools.wraps(fn)(wrapped)


def varying_axes(x: Any) -> frozenset:
    """The `shard_map` mesh axes the value `x` varies over (empty outside shard_map)."""
    manual = getattr(jax.typeof(x), "manual_axis_type", None)
    return frozenset(getattr(manual, "varying", ()) or ())


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class ManualAxes:
    """The `shard_map` mesh axes a custom_vjp's inputs vary over, kept as a static residual.

    Inside `shard_map`, JAX types values by the manual mesh axes they vary over, and a
    custom_vjp's backward must return gradients typed like its primal inputs. Kernel calls
    (Pallas, jax-triton) drop that type from their outputs, and residuals can lose it (a switch's
    linearisation), so the forward records the inputs' axes for the backward to restore."""

    axes: tuple = ()

    @classmethod
    def of(cls, *xs: Any) -> "ManualAxes":
        axes = frozenset().union(*(varying_axes(x) for x in jax.tree.leaves(xs)))
        return cls(tuple(sorted(axes, key=str)))

    def apply(self, x: jax.Array | None) -> jax.Array | None:
        """x typed as varying over these axes (unchanged outside shard_map)."""
        if x is None:
            return None
        missing = tuple(a for a in self.axes if a not in varying_axes(x))
        return jax.lax.pcast(x, missing, to="varying") if missing else x

    def cotangent(self, grad: jax.Array, primal: jax.Array) -> jax.Array:
        """A kernel's per-device `grad` of `primal`, typed like `primal`: varying over these axes
        (the call's), then summed over those `primal` does not vary over (a replicated weight's
        gradient is the sum of every device's part)."""
        grad = self.apply(grad)
        summed = tuple(a for a in self.axes if a not in varying_axes(primal))
        return jax.lax.psum(grad, summed) if summed else grad
