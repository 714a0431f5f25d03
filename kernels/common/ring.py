"""The ring loop of sequence-parallel attention, shared by `ops.ring_attention` (inside shard_map)
and the sequence-sharded attention launch under plain jit (kernels/common/attention.py).

The sequence axis is split over n devices along `axis_name` (a mesh axis name or a tuple of them);
device i holds query block i and, at the start, key/value block i. Forward: at step j device i
attends to the key/value block of device src = (i - j) mod n, then passes its key/value block on
to device i + 1 (`ppermute`), n - 1 hops. The partial results over disjoint key sets merge
exactly by their log-sum-exp:

    lse = log(exp(lse_a) + exp(lse_b))      out = exp(lse_a - lse) out_a + exp(lse_b - lse) out_b

(rows with no key so far keep lse = -inf and out = 0). Backward: a second ring; the key/value
blocks travel again together with their f32 dk / dv accumulators, each device adds its queries'
gradient contribution to the block it holds, and after n hops every dk / dv is back on its owner.
What a step computes (a kernel, or `ops.attention` under `jax.vjp`) is the caller's `block`.
Communication per ring (forward or backward): n - 1 (backward: n) ppermutes of the local blocks
that travel (k, v and kv segment ids; backward also dk, dv in f32).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from forgeax.kernels.common.batching import ManualAxes


def merge(out_acc, lse_acc, out_b, lse_b):
    """Two partial results over disjoint key sets -> their union's (f32; -inf rows stay 0).
    out [..., Hv], lse [...] (out's axes but the last)."""
    lse = jnp.logaddexp(lse_acc, lse_b)
    finite = jnp.isfinite(lse)
    safe = jnp.where(finite, lse, 0.0)
    w_acc = jnp.where(finite, jnp.exp(lse_acc - safe), 0.0)
    w_b = jnp.where(finite, jnp.exp(lse_b - safe), 0.0)
    return out_acc * w_acc[..., None] + out_b.astype(jnp.float32) * w_b[..., None], lse


def rotate(axis_name, n: int, *xs):
    """Every x passed one device on along the ring (device i -> i + 1 mod n)."""
    perm = [(d, (d + 1) % n) for d in range(n)]
    return tuple(None if x is None else jax.lax.ppermute(x, axis_name, perm) for x in xs)


def _steps(body: Callable, n: int, carry, loop: bool, peel_first: bool = False):
    """carry after body(step, carry, first, last) for step = 0 .. n-1. loop=False unrolls the
    steps in Python (each step's block may then be specialised to its static step); loop=True runs
    the middle steps as one `fori_loop` and the last one (and with peel_first the first) outside
    it, so the block is traced and its kernels lowered two or three times whatever n is. `first`
    is True only where step 0 runs alone (unrolled, or peeled): a body that reads it peels it."""
    if not loop:
        for step in range(n):
            carry = body(step, carry, step == 0, step + 1 == n)
        return carry
    begin = 0
    if peel_first:
        carry, begin = body(0, carry, True, n == 1), 1
        if n == 1:
            return carry
    if n - 1 > begin:
        carry = jax.lax.fori_loop(begin, n - 1, lambda step, c: body(step, c, False, False), carry)
    return body(n - 1, carry, n == 1, True)


def ring_forward(block: Callable, axis_name, n: int, out_shape, lse_shape, travel: tuple, *, loop: bool = False):
    """(out f32 [out_shape], lse f32 [lse_shape]) merged over the n steps of the ring.

    block(step, me, src, travel) -> (out_b, lse_b) of the local queries against the blocks in
    `travel` (e.g. (k, v, kv_segment_ids); None entries allowed), which belong to device src.
    With loop=True (inside shard_map) `step` and `src` are traced (see `_steps`). The next step's
    blocks are sent while this step computes (the two are independent)."""
    me = jax.lax.axis_index(axis_name)
    typed = ManualAxes.of(*travel)  # inside shard_map a loop's carry keeps the inputs' type
    out = typed.apply(jnp.zeros(out_shape, jnp.float32))
    lse = typed.apply(jnp.full(lse_shape, -jnp.inf, jnp.float32))

    def body(step, carry, first, last):
        out, lse, travel = carry
        following = travel if last else rotate(axis_name, n, *travel)
        out_b, lse_b = block(step, me, (me - step) % n, travel)
        out, lse = merge(out, lse, out_b, lse_b)
        return out, lse, following

    out, lse, _ = _steps(body, n, (out, lse, travel), loop)
    return out, lse


def ring_backward(block_grad: Callable, axis_name, n: int, dq_shape, travel: tuple, acc_shapes: tuple, *,
                  loop: bool = False):
    """(dq f32, accumulators f32) of the backward ring.

    block_grad(step, me, src, travel) -> (dq_b, *acc_b): the local queries' gradient and the
    gradients of the travelling blocks of device src (e.g. dk, dv; shapes `acc_shapes`). Each
    block's accumulator follows it one step behind: at step j the accumulator of the block held
    (the previous device's sum, finished at its step j - 1) arrives while this device computes
    its share, which is added after; so neither hop waits for a kernel. After the last step one
    more hop brings every accumulator home."""
    me = jax.lax.axis_index(axis_name)
    typed = ManualAxes.of(*travel)
    dq = typed.apply(jnp.zeros(dq_shape, jnp.float32))
    acc = tuple(typed.apply(jnp.zeros(s, jnp.float32)) for s in acc_shapes)

    def body(step, carry, first, last):
        dq, acc, travel = carry
        following = travel if last else rotate(axis_name, n, *travel)
        arrived = acc if first else rotate(axis_name, n, *acc)  # step 0: nothing to receive yet
        dq_b, *acc_b = block_grad(step, me, (me - step) % n, travel)
        acc = tuple(a + b.astype(jnp.float32) for a, b in zip(arrived, acc_b))
        return dq + dq_b.astype(jnp.float32), acc, following

    dq, acc, _ = _steps(body, n, (dq, acc, travel), loop, peel_first=True)
    return dq, rotate(axis_name, n, *acc)
