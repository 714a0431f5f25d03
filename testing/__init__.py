"""forgeax.testing: the conformance harness, every backend of an op against its XLA reference.

forgeax tests its own ops with it (tests/conformance.py re-exports it); a user-defined op or
backend gets the same checks (docs/extending.md).

One call, `assert_conforms(case, backend)`, checks a backend on one set of
arguments:
  * forward: finite, same shape/dtype as the reference, not all zeros, and
    ||out - ref|| / ||ref|| under the dtype's tolerance, where `ref` is the
    XLA reference evaluated in f32 on the same (upcast) inputs;
  * gradients with respect to every differentiable argument, pulled back from
    a random cotangent (never ones), compared the same way;
  * determinism: a second call is bitwise identical (a second backward too, unless
    the case allows an order-free backward: `Case.reproducible_backward`; then, off
    CPU, the second backward must agree within the tolerance).
A backend that refuses the case (UnsupportedError from its supports()) makes the
test skip with that reason: it never compares numbers it would not produce.

Which backends run here is decided once, by `runnable_backends(op)`: those that
load and can run on this platform (natively, or in their interpreter under
FORGEAX_INTERPRET=1). `FORGEAX_TEST_BACKENDS=a,b` narrows the set; the Triton
interpreter needs TRITON_INTERPRET=1 before `import triton`, so it runs in its
own test target.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from forgeax import core as interface

__all__ = ["TOLERANCE", "Case", "assert_conforms", "lowered_text", "random_array", "relative_error", "runnable_backends"]

# ||out - ref|| / ||ref|| allowed per dtype of the inputs: f32 arithmetic lands far under 1e-5,
# bf16 operands between 1e-3 and 1e-2 (docs/development.md, testing).
TOLERANCE = {
    jnp.dtype(jnp.float32): 1e-5,
    jnp.dtype(jnp.float16): 2e-3,
    jnp.dtype(jnp.bfloat16): 1e-2,
}


def runnable_backends(op_name: str) -> list[str]:
    """Backends of `op_name` that can run on this machine, for parametrising tests."""
    op = interface.OPS[op_name]
    platform = interface.current_platform()
    wanted = os.environ.get("FORGEAX_TEST_BACKENDS")
    names = [b.strip() for b in wanted.split(",")] if wanted else list(op.backends)
    runnable = []
    for name in names:
        impl = op.implementation(name)
        if isinstance(impl, str):
            continue
        if platform not in impl.platforms:
            if not (platform == "cpu" and impl.interpretable and interface.interpret_enabled()):
                continue
            # Triton's interpreter exists only when TRITON_INTERPRET=1 was set before import.
            if name == "triton" and os.environ.get("TRITON_INTERPRET") != "1":
                continue
        runnable.append(name)
    return runnable


def relative_error(out: Any, ref: Any) -> float:
    # numpy, not jnp: each jnp conversion of a new shape would be one more XLA compile per test.
    out = np.asarray(out).astype(np.float64)
    ref = np.asarray(ref).astype(np.float64)
    # A reference that is exactly zero (e.g. dq of attention over a single key, whose softmax is
    # constant) has no scale: compare absolutely there, relative to an O(1) quantity.
    denominator = np.linalg.norm(ref)
    return float(np.linalg.norm(out - ref) / (denominator if denominator > 0 else np.sqrt(max(ref.size, 1))))


def random_array(key: jax.Array, shape: Sequence[int], dtype: Any, *, scale: float = 1.0, mean: float = 0.0) -> jax.Array:
    """Normal(mean, scale) values in `dtype`; never all zeros."""
    return (mean + scale * jax.random.normal(key, tuple(shape), jnp.float32)).astype(dtype)


@dataclasses.dataclass(frozen=True)
class Case:
    """One call of an op: positional args (arrays or None), static kwargs, and
    which positional args are differentiable."""

    name: str
    public: Callable[..., Any]  # the forgeax.ops function (takes backend=)
    reference: Callable[..., Any]  # the XLA reference (no backend=)
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    diff_argnums: tuple[int, ...]
    # Ops whose output dtype is fixed (a loss is f32 whatever the logits) say so;
    # None: the output is in the first argument's dtype. Such outputs are
    # compared with `forward_tolerance` instead of the input dtype's tolerance.
    output_dtype: Any = None
    forward_tolerance: float | None = None
    # False where the call allows a backward that sums with float atomics in any order
    # (attention with deterministic=False): the second backward is then compared within
    # tolerance instead of bit for bit. Forwards are always checked bit for bit.
    reproducible_backward: bool = True

    @property
    def dtype(self) -> Any:
        return jnp.dtype(self.args[0].dtype)


def _upcast(args: tuple[Any, ...]) -> tuple[Any, ...]:
    return tuple(a.astype(jnp.float32) if hasattr(a, "dtype") and jnp.issubdtype(a.dtype, jnp.floating) else a for a in args)


def _vjp(fn: Callable[..., Any], args: tuple[Any, ...], diff_argnums: tuple[int, ...], cotangent: Any):
    def partial_fn(*diff):
        full = list(args)
        for i, d in zip(diff_argnums, diff):
            full[i] = d
        return fn(*full)

    out, pullback = jax.vjp(partial_fn, *[args[i] for i in diff_argnums])
    return out, pullback(cotangent.astype(out.dtype))


def assert_conforms(case: Case, backend: str, *, tolerance: float | None = None, seed: int = 0) -> tuple[Any, Any]:
    """Forward, gradients and determinism of `backend` against the reference; returns (out, grads)."""
    tol = tolerance if tolerance is not None else TOLERANCE[case.dtype]
    out_dtype = jnp.dtype(case.output_dtype or case.dtype)
    forward_tol = case.forward_tolerance if case.forward_tolerance is not None else tol
    run = jax.jit(lambda *a: case.public(*a, backend=backend, **case.kwargs))
    ref_fn = lambda *a: case.reference(*a, **case.kwargs)  # noqa: E731
    # The reference is jitted too: one compile each for its forward and its gradient instead of
    # one per primitive (op-by-op dispatch), which dominated the cheaper tests on CPU.
    ref_forward = jax.jit(ref_fn)

    try:
        out = run(*case.args)
    except interface.UnsupportedError as e:
        # The backend refused this case through supports(): visible as a skip with its reason.
        import pytest  # noqa: PLC0415 - only test runs get here

        pytest.skip(f"{backend} refuses: {e}")
    ref = ref_forward(*_upcast(case.args))
    where = f"{case.name} {case.dtype.name} {case.kwargs} [{backend}]"
    assert out.shape == ref.shape, f"{where}: shape {out.shape} != reference {ref.shape}"
    assert out.dtype == out_dtype, f"{where}: dtype {out.dtype} != expected {out_dtype}"
    out_np, ref_np = np.asarray(out), np.asarray(ref)
    assert np.isfinite(out_np.astype(np.float32)).all(), f"{where}: non-finite output"
    assert np.abs(ref_np).max() > 0, f"{where}: degenerate case, the reference is all zeros"
    err = relative_error(out_np, ref_np)
    assert err < forward_tol, f"{where}: forward relative error {err:.3g} >= {forward_tol:g}"

    again = run(*case.args)
    assert np.array_equal(np.asarray(again), out_np, equal_nan=True), f"{where}: a second call gave different bits"

    if not case.diff_argnums:
        return out, ()
    cotangent = random_array(jax.random.key(seed + 1), out.shape, jnp.float32)
    grad_fn = jax.jit(lambda *a: _vjp(lambda *b: case.public(*b, backend=backend, **case.kwargs), a, case.diff_argnums, cotangent)[1])
    grads = grad_fn(*case.args)
    ref_grads = jax.jit(lambda *a: _vjp(ref_fn, a, case.diff_argnums, cotangent)[1])(*_upcast(case.args))
    for i, g, rg in zip(case.diff_argnums, grads, ref_grads):
        arg = case.args[i]
        assert g.shape == arg.shape and g.dtype == arg.dtype, f"{where}: grad of arg {i} is {g.dtype}{g.shape}, expected {arg.dtype}{arg.shape}"
        assert np.isfinite(np.asarray(g).astype(np.float32)).all(), f"{where}: non-finite gradient of arg {i}"
        gerr = relative_error(g, rg)
        assert gerr < tol, f"{where}: gradient of arg {i} relative error {gerr:.3g} >= {tol:g}"
    if not case.reproducible_backward and interface.current_platform() == "cpu":
        # On CPU every backend runs in one order (XLA's CPU backend, the interpreters), so a
        # rerun of an order-free backward checks nothing that the reproducible cases and the GPU
        # run of the same tests do not; it would cost a second interpreted backward per test.
        return out, grads
    grads_again = grad_fn(*case.args)
    for g, g2 in zip(grads, grads_again):
        if case.reproducible_backward:
            assert np.array_equal(np.asarray(g), np.asarray(g2), equal_nan=True), f"{where}: a second backward gave different bits"
        else:
            assert relative_error(g2, g) < tol, f"{where}: a second backward differs beyond rounding"
    return out, grads


def lowered_text(fn: Callable[..., Any], *args: Any, platform: str) -> str:
    """StableHLO text of `jax.jit(fn)` lowered for `platform` ("cuda", "tpu") on this machine.

    Cross-lowering runs the whole Python side of a kernel's compilation (Triton
    to PTX, Mosaic GPU / TPU dialect lowering) without the hardware. Kernels
    must not pick their interpreters here, even under FORGEAX_INTERPRET=1.
    """
    with interface.interpret_mode(False):
        return jax.jit(fn).trace(*args).lower(lowering_platforms=(platform,)).as_text()
