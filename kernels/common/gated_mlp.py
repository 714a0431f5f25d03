"""Gated MLP: the shared shell of every kernel backend (shapes, weight forms, custom_vjp).

    gate = x @ w_gate,  up = x @ w_up,  h = act(gate) * up,  y = h (@ w_down)

x `[..., K]` is folded to `[M, K]`. The gate/up weights come either as two `[K, N]` arrays or
as one fused `[K, 2, N]` array (`w_up=None`; `w[:, 0]` is the gate, `w[:, 1]` the up
projection), which is the same memory as a `[K, 2N]` matrix whose first N columns are the
gate. A backend supplies two kernels:

  forward(x [M, K], w_gate, w_up, *, activation, config) -> h [M, N]
      the dual GEMM with the activation and product in its epilogue (no [M, 2N] write);
  backward(x, w_gate, w_up, dh [M, N], *, activation, config, want_h) -> (dpre [M, 2N], h | None)
      recomputes gate/up from x (the same dual GEMM) and forms, in its epilogue,
      dpre[:, :N] = dh * up * act'(gate), dpre[:, N:] = dh * act(gate), and h when asked.

Around them, XLA's dots (f32 accumulation) do the plain products of the backward:
dh = dy @ w_down^T, dw_down = h^T @ dy, and with W = [w_gate | w_up] as `[K, 2N]`,
dx = dpre @ W^T and dW = x^T @ dpre: one GEMM each over the concatenated gate/up axis.
By default nothing of width 2N is kept between forward and backward (the residuals are the
inputs), at the price of recomputing the two gate/up products: 8 matmul passes for fwd+bwd
where 6 are the minimum. A backend may offer the other trade, chosen by its config's
`save_preactivations`: a `forward_saving(...) -> (h, pre [M, 2N])` kernel whose epilogue also
writes [gate | up] under differentiation, and the backward forms dpre from `pre` in one XLA
elementwise fusion (no recompute; 2MN more elements of memory held for the backward).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp

from forgeax.kernels.common.batching import fold_vmap_into_rows
from forgeax.kernels.common.partitioning import split_launch, split_multiple_of

ACTIVATIONS = ("silu", "gelu", "gelu_tanh", "relu")
_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_GELU_TANH_C = 0.044715


@dataclasses.dataclass(frozen=True)
class GatedMLPSpec:
    """The options of one call, normalised once by ops.gated_mlp."""

    activation: str = "silu"

    def __post_init__(self) -> None:
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"activation: expected one of {ACTIVATIONS}, got {self.activation!r}")

    @property
    def activation_id(self) -> int:
        """The activation as the small int kernels switch on (index into ACTIVATIONS)."""
        return ACTIVATIONS.index(self.activation)


def activate(g: jax.Array, activation: str) -> jax.Array:
    """act(g) in g's dtype (callers pass f32): the reference's definitions."""
    if activation == "silu":
        return g * jax.nn.sigmoid(g)
    if activation == "gelu":
        return jax.nn.gelu(g, approximate=False)
    if activation == "gelu_tanh":
        return 0.5 * g * (1.0 + jnp.tanh(_SQRT_2_OVER_PI * (g + _GELU_TANH_C * g * g * g)))
    if activation == "relu":
        return jnp.maximum(g, 0.0)
    raise ValueError(f"activation: expected one of {ACTIVATIONS}, got {activation!r}")


def activate_and_derivative(g: jax.Array, activation: str) -> tuple[jax.Array, jax.Array]:
    """(act(g), act'(g)) in closed form, for kernels that write their epilogue in jnp."""
    if activation == "silu":
        s = jax.nn.sigmoid(g)
        return g * s, s * (1.0 + g * (1.0 - s))
    if activation == "gelu":
        cdf = 0.5 * (1.0 + jax.lax.erf(g * (1.0 / math.sqrt(2.0))))
        pdf = jnp.exp(-0.5 * g * g) * (1.0 / math.sqrt(2.0 * math.pi))
        return g * cdf, cdf + g * pdf
    if activation == "gelu_tanh":
        inner = _SQRT_2_OVER_PI * (g + _GELU_TANH_C * g * g * g)
        t = jnp.tanh(inner)
        d_inner = _SQRT_2_OVER_PI * (1.0 + 3.0 * _GELU_TANH_C * g * g)
        return 0.5 * g * (1.0 + t), 0.5 * (1.0 + t) + 0.5 * g * (1.0 - t * t) * d_inner
    if activation == "relu":
        return jnp.maximum(g, 0.0), (g > 0).astype(g.dtype)
    raise ValueError(f"activation: expected one of {ACTIVATIONS}, got {activation!r}")


def hidden_size(w_gate: jax.Array, w_up: jax.Array | None) -> int:
    """N: the gate/up output width of either weight form."""
    return int(w_gate.shape[-1])


def split_weights(w_gate: jax.Array, w_up: jax.Array | None) -> tuple[jax.Array, jax.Array]:
    """(w_gate [K, N], w_up [K, N]) from either form (slices of the fused one)."""
    if w_up is None:
        return w_gate[:, 0, :], w_gate[:, 1, :]
    return w_gate, w_up


def matmul_precision(dtype) -> jax.lax.Precision:
    # f32 inputs get true f32 products (no TF32 on GPUs); narrower inputs the MXU/tensor-core default.
    return jax.lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else jax.lax.Precision.DEFAULT


def contract(a: jax.Array, b: jax.Array, a_axes, b_axes, out_dtype=None) -> jax.Array:
    """a and b contracted over a_axes / b_axes (f32 accumulation), rounded to `out_dtype` (a's)."""
    dims = ((tuple(a_axes), tuple(b_axes)), ((), ()))
    out = jax.lax.dot_general(a, b, dims, precision=matmul_precision(a.dtype), preferred_element_type=jnp.float32)
    return out.astype(out_dtype or a.dtype)


Forward = Callable[..., jax.Array]
Backward = Callable[..., tuple[jax.Array, jax.Array | None]]


def _from_preactivations(pre, dh, activation, want_h):
    """(dpre [..., 2, N], h or None) from the saved [gate | up] `[..., 2, N]`: one XLA elementwise fusion."""
    gate, up = pre[..., 0, :].astype(jnp.float32), pre[..., 1, :].astype(jnp.float32)
    a, da = activate_and_derivative(gate, activation)
    d = dh.astype(jnp.float32)
    dpre = jnp.stack([d * up * da, d * a], axis=-2).astype(dh.dtype)
    return dpre, (a * up).astype(dh.dtype) if want_h else None


def _split_launch(kernel, outs: tuple[str, ...], n_multiple: int):
    """kernel(x2 [m, K], w_gate, w_up[, dh2 [m, N]]) over x's rows (all axes but the last),
    as a launch the SPMD partitioner splits (kernels/common/partitioning.py `split_launch`) over
    the rows (any leading axes, data parallelism) and the hidden axis N of the weights, dh and the
    outputs (tensor parallelism: each device's kernel on its own columns of w_gate / w_up, no
    communication); K stays whole. outs: per kernel output, "h" ([m, N]) or "pre" ([m, 2N] as
    [gate | up], returned as [..., 2, N] so that a split N stays a split of the last axis). N is
    split only into multiples of `n_multiple` (the kernel's column granule)."""

    def local(x, w_gate, w_up, dh, guard):
        del guard
        lead = x.shape[:-1]
        m = math.prod(lead)
        extra = () if dh is None else (dh.reshape(m, dh.shape[-1]),)
        results = kernel(x.reshape(m, x.shape[-1]), w_gate, w_up, *extra)
        results = results if isinstance(results, tuple) else (results,)
        return tuple(None if r is None else r.reshape(lead + ((2, r.shape[1] // 2) if kind == "pre" else (r.shape[1],)))
                     for r, kind in zip(results, outs))

    def launch(x, w_gate, w_up, dh=None):
        rows = tuple(f"r{i}" for i in range(x.ndim - 1))
        dims = ((*rows, None), (None, None, "n") if w_up is None else (None, "n"), (None, "n"), (*rows, "n"), ("n",))
        odims = tuple(((*rows, "n") if kind == "h" else (*rows, None, "n"), ()) for kind in outs)
        guard = split_multiple_of(hidden_size(w_gate, w_up), n_multiple)
        return split_launch(local, dims, odims)(x, w_gate, w_up, dh, guard)

    return launch


def differentiable_gated_mlp(forward: Forward, backward: Backward,
                             forward_saving: Callable[..., tuple[jax.Array, jax.Array]] | None = None,
                             *, n_multiple: int = 1) -> Callable[..., jax.Array]:
    """`fn(x, w_gate, w_up, w_down, *, spec, config)`: the op with a custom_vjp around a backend's
    kernels (module docstring). `w_up` None = fused `[K, 2, N]` w_gate; `w_down` may be None.
    `forward_saving` (optional) runs under differentiation when `config.save_preactivations`.

    Under jit with sharded arrays the kernels run on each device's rows of x and columns N of the
    weights (`_split_launch`, N split only into multiples of `n_multiple`); XLA partitions the
    plain products around them: with N split, y = h @ w_down and dx are partial sums over the
    N shards (one all-reduce each, Megatron's), weight gradients are summed over the row shards."""

    def rows_of(a):  # a row axis for a single token (the launch and vmap folding need one)
        return a if a.ndim > 1 else a[None]

    @functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
    def run(x, w_gate, w_up, w_down, spec, config):
        return _forward(x, w_gate, w_up, w_down, spec, config, save=False)[0]

    def _forward(x, w_gate, w_up, w_down, spec, config, save):
        xr = rows_of(x)
        # Kernel launches have no batching rule; rows of x are independent, so a vmap over x alone
        # folds into the rows (over the weights: one launch per batch element).
        if save:
            kernel = functools.partial(forward_saving, activation=spec.activation, config=config)
            h, pre = fold_vmap_into_rows(_split_launch(kernel, ("h", "pre"), n_multiple), (0,))(xr, w_gate, w_up)
        else:
            kernel = functools.partial(forward, activation=spec.activation, config=config)
            (h,), pre = fold_vmap_into_rows(_split_launch(kernel, ("h",), n_multiple), (0,))(xr, w_gate, w_up), None
        y = h if w_down is None else contract(h, w_down, (h.ndim - 1,), (0,))
        return y.reshape(*x.shape[:-1], y.shape[-1]), (x, w_gate, w_up, w_down, pre)

    def fwd(x, w_gate, w_up, w_down, spec, config):
        save = forward_saving is not None and bool(getattr(config, "save_preactivations", False))
        return _forward(x, w_gate, w_up, w_down, spec, config, save)

    def bwd(spec, config, residuals, dy):
        x, w_gate, w_up, w_down, pre = residuals
        xr = rows_of(x)
        last = xr.ndim - 1
        lead = tuple(range(last))
        dy = dy.reshape(*xr.shape[:-1], dy.shape[-1]).astype(x.dtype)
        dh = dy if w_down is None else contract(dy, w_down, (last,), (1,))
        if pre is None:
            kernel = functools.partial(backward, activation=spec.activation, config=config, want_h=w_down is not None)
            launch = _split_launch(kernel, ("pre", "h"), n_multiple)
            dpre, h = fold_vmap_into_rows(launch, (0, 3))(xr, w_gate, w_up, dh)
        else:
            dpre, h = _from_preactivations(pre, dh, spec.activation, w_down is not None)
        # dpre [..., 2, N] against W = [w_gate | w_up] as [K, 2, N] (the fused form as it is; one
        # weight-sized copy otherwise): one product each over the gate/up pair.
        dw_down = None if w_down is None else contract(h, dy, lead, lead, out_dtype=w_down.dtype)
        w3 = w_gate if w_up is None else jnp.stack([w_gate, w_up], axis=1)
        dx = contract(dpre, w3, (last, last + 1), (1, 2)).reshape(x.shape)
        # As [2, N, K], then transposed ([K, M] x [M, 2, N] has no bf16 kernel on XLA's CPU backend;
        # on GPUs XLA can fold the transpose into the product's output layout).
        dw = jnp.moveaxis(contract(dpre, xr, lead, lead, out_dtype=w_gate.dtype), -1, 0)
        if w_up is None:
            return dx, dw, None, dw_down
        return dx, dw[:, 0], dw[:, 1].astype(w_up.dtype), dw_down

    run.defvjp(fwd, bwd)
    return run


_FLOAT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def supports_float_rows(x, w_gate, w_up, w_down=None, *, spec) -> str | None:
    """The Triton and Mosaic TPU kernels' `supports`: f32/bf16/f16 and at least one row."""
    del w_gate, w_up, w_down, spec
    if jnp.dtype(x.dtype) not in _FLOAT_DTYPES:
        return f"x dtype {jnp.dtype(x.dtype).name} is not one of float32/bfloat16/float16"
    if math.prod(x.shape[:-1]) == 0:
        return "no rows (x has an empty leading axis)"
    return None
