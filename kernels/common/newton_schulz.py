"""Newton-Schulz orthogonalisation (Muon's quintic): the reference iteration and the kernel driver.

For G of shape [..., M, N] (transposed first when M > N, so the Gram matrix is the small side):

    X_0 = G / (||G||_F + eps)                        (per matrix, in f32)
    A   = X X^T                                      ([M, M], symmetric)
    B   = b A + c A A                                (A A = A A^T: symmetric too)
    X  <- a X + B X                                  (`steps` times)

with (a, b, c) = (3.4445, -4.7750, 2.0315) by default (Keller Jordan's Muon). Each step maps
every singular value s of X to p(s) = a s + b s^3 + c s^5, which pumps small values up and keeps
the result inside a band around 1 rather than converging to exactly 1 (tests/newton_schulz_test.py
measures the band). As in Muon's reference, the iterations run in bf16: every product takes bf16
operands with f32 accumulation, and A, B and X are rounded to bf16 after each f32 epilogue. The
output is in G's dtype.

`newton_schulz_with(Kernels(gram=..., update=...))` builds a backend from two kernels on
[batch, M, K] arrays (M <= N already): `gram(x, c, alpha, beta)` = alpha x x^T + beta c
(c None: no term) and `update(b, x, a)` = a x + b x. The gradient of every kernel backend is
the reference's (recomputed in the backward, a custom_vjp): the autodiff of the iteration in f32.
Muon never differentiates this op, so its backward is the oracle itself rather than a kernel.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp

from forgeax.kernels.common.batching import fold_vmap_into_rows
from forgeax.kernels.common.partitioning import ROWS, rowwise

COEFFICIENTS = (3.4445, -4.7750, 2.0315)
ITERATION_DTYPE = jnp.bfloat16


@dataclasses.dataclass(frozen=True)
class NewtonSchulzSpec:
    """The static options of one call (hashable: a jit / custom_vjp static argument)."""

    steps: int = 5
    coefficients: tuple[float, float, float] = COEFFICIENTS
    eps: float = 1e-7


def _dot(x, y, contract_last: bool):
    """x @ y^T (contract_last) or x @ y over the last two axes, f32 result."""
    dims = ((x.ndim - 1,), (y.ndim - 1 if contract_last else y.ndim - 2,))
    batch = tuple(range(x.ndim - 2))
    precision = jax.lax.Precision.HIGHEST if x.dtype == jnp.float32 else None  # f32: no TF32 on GPUs
    return jax.lax.dot_general(x, y, (dims, (batch, batch)), precision=precision, preferred_element_type=jnp.float32)


def normalise(g: jax.Array, eps: float, dtype=ITERATION_DTYPE) -> jax.Array:
    """g / (||g||_F + eps) per matrix (last two axes), computed in f32, rounded to `dtype`."""
    g32 = g.astype(jnp.float32)
    norm = jnp.sqrt(jnp.sum(g32 * g32, axis=(-2, -1), keepdims=True))
    return (g32 / (norm + eps)).astype(dtype)


def _iteration(g: jax.Array, spec: NewtonSchulzSpec, dtype) -> jax.Array:
    """The iteration with operands (and A, B, X between steps) in `dtype`, f32 accumulation."""
    a, b, c = spec.coefficients
    transpose = g.shape[-2] > g.shape[-1]
    x = normalise(jnp.swapaxes(g, -1, -2) if transpose else g, spec.eps, dtype)
    for _ in range(spec.steps):
        gram = _dot(x, x, contract_last=True).astype(dtype)
        poly = (b * gram.astype(jnp.float32) + c * _dot(gram, gram, contract_last=True)).astype(dtype)
        x = (a * x.astype(jnp.float32) + _dot(poly, x, contract_last=False)).astype(dtype)
    out = jnp.swapaxes(x, -1, -2) if transpose else x
    return out.astype(g.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _reference(g: jax.Array, spec: NewtonSchulzSpec) -> jax.Array:
    return _iteration(g, spec, ITERATION_DTYPE)


def _reference_fwd(g, spec):
    return _reference(g, spec), g


def _reference_bwd(spec, g, cotangent):
    _, pullback = jax.vjp(lambda g: _iteration(g, spec, jnp.float32), g.astype(jnp.float32))
    (grad,) = pullback(cotangent.astype(jnp.float32))
    return (grad.astype(g.dtype),)


_reference.defvjp(_reference_fwd, _reference_bwd)


def reference(g: jax.Array, *, spec: NewtonSchulzSpec) -> jax.Array:
    """The plain iteration in jax.numpy (see the module docstring), in bf16. Its gradient is the
    autodiff of the same iteration in f32: the derivative of the polynomial map itself, since
    bf16 rounding has no useful derivative (autodiff through the bf16 casts gives a gradient
    that moves by percents when the cotangent moves by one bf16 rounding)."""
    return _reference(g, spec)


def xla_gram(x, c, alpha: float, beta: float, config=None):
    """alpha x x^T (+ beta c) in XLA: the fallback a kernel backend may use for a product."""
    del config
    out = alpha * _dot(x, x, contract_last=True)
    if c is not None:
        out = out + beta * c.astype(jnp.float32)
    return out.astype(ITERATION_DTYPE)


def xla_update(b, x, a: float, config=None):
    """a x + b x in XLA (cuBLAS / the MXU): the product without symmetry to exploit."""
    del config
    return (a * x.astype(jnp.float32) + _dot(b, x, contract_last=False)).astype(ITERATION_DTYPE)


@dataclasses.dataclass(frozen=True)
class Kernels:
    """A backend's two products on [batch, M, K] bf16 arrays (see the module docstring)."""

    gram: Callable[..., jax.Array]
    update: Callable[..., jax.Array]


def _iterate(kernels: Kernels, x3: jax.Array, spec: NewtonSchulzSpec, config) -> jax.Array:
    a, b, c = spec.coefficients
    for _ in range(spec.steps):
        gram = kernels.gram(x3, None, 1.0, 0.0, config)
        poly = kernels.gram(gram, gram, c, b, config)  # A A^T = A A, since A is symmetric
        x3 = kernels.update(poly, x3, a, config)
    return x3


def newton_schulz_with(kernels: Kernels) -> Callable[..., jax.Array]:
    """The backend function `fn(g, *, spec, config)` running `kernels`, with the reference's
    gradient (custom_vjp) and a vmap rule that folds a batch axis into the kernels' batch."""

    def run(x3: jax.Array, spec: NewtonSchulzSpec, config) -> jax.Array:
        return _iterate(kernels, x3, spec, config)

    @functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
    def forward(g, spec, config):
        transpose = g.shape[-2] > g.shape[-1]
        x = normalise(jnp.swapaxes(g, -1, -2) if transpose else g, spec.eps)
        lead, (m, n) = x.shape[:-2], x.shape[-2:]
        xb = x if lead else x[None]
        # The kernels see [batch, M, N]; the leading axes stay down to the launch, which the SPMD
        # partitioner splits over them (kernels/common/partitioning.py `rowwise`): a batch of
        # matrices sharded over any of its axes runs each device's whole matrices there.
        launch = rowwise(lambda x3: run(x3, spec, config), (ROWS,), ROWS, row_ndim=xb.ndim - 2)
        out = fold_vmap_into_rows(launch, row_args=(0,))(xb).reshape(lead + (m, n))
        out = jnp.swapaxes(out, -1, -2) if transpose else out
        return out.astype(g.dtype)

    def forward_fwd(g, spec, config):
        return forward(g, spec, config), g

    def forward_bwd(spec, config, g, cotangent):
        return _reference_bwd(spec, g, cotangent)

    forward.defvjp(forward_fwd, forward_bwd)

    # Jitted as a whole, so that an eager call does not dispatch the kernels op by op (the
    # Pallas TPU interpreter can deadlock XLA's CPU pool when its callbacks run eagerly).
    jitted = jax.jit(forward, static_argnums=(1, 2))

    def fn(g: jax.Array, *, spec: NewtonSchulzSpec, config=None) -> jax.Array:
        return jitted(g, spec, config)

    return fn


def upper_tiles(tiles: int):
    """(rows, cols) int32 numpy arrays of the tile pairs i <= j of a tiles x tiles grid, row by row."""
    import numpy as np  # noqa: PLC0415

    rows, cols = np.triu_indices(tiles)
    return rows.astype(np.int32), cols.astype(np.int32)
