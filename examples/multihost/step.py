"""One sharded forgeax program that runs unchanged on one process or on several hosts.

    # every host (process_id 0..n-1), same command otherwise:
    python -m forgeax.examples.multihost.step --coordinator host0:12355 --num-processes 2 --process-id 0
    # one process, all local devices:
    python -m forgeax.examples.multihost.step

With `--coordinator`, `jax.distributed.initialize` joins the processes into one runtime whose
`jax.devices()` lists every process's devices; the mesh below spans all of them. Each process
builds only its own shards of the global arrays (`jax.make_array_from_callback`: no host holds
the whole batch), and the jitted step is the same code as on one process:

  * `ops.rms_norm` on a token-sharded `[tokens, D]` activation (plain jit: the kernels run per
    shard, no communication),
  * vocabulary-parallel `ops.cross_entropy` inside `shard_map` (`axis_name`: per-row statistics
    are all-reduced over the vocabulary axis, never the logits),
  * `ops.ring_attention` over the sequence axis (K/V blocks rotate between devices; on several
    hosts some hops cross the network).

It prints one JSON line of scalars (loss, gradient norms, output checksums) that do not depend
on how many processes ran it: tests/multi_process_parallel_test.py compares 2 processes x 2
CPU devices with 1 process x 4. On GPU hosts the coordinator is any reachable host:port, one
process per host (or per GPU), e.g. from SLURM's variables; nothing else changes.
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

TOKENS, D, VOCAB = 64, 32, 96
T, N, H = 128, 2, 16


def global_array(mesh: jax.sharding.Mesh, spec: P, key: int, shape: tuple[int, ...], dtype=jnp.float32) -> jax.Array:
    """A global array every process builds only its own shards of (the same values on any mesh)."""
    full = np.asarray(jax.random.normal(jax.random.key(key), shape, jnp.float32)).astype(dtype)
    return jax.make_array_from_callback(shape, NamedSharding(mesh, spec), lambda index: full[index])


def step(mesh: jax.sharding.Mesh) -> dict[str, float]:
    from forgeax import ops  # noqa: PLC0415 - after jax.distributed.initialize

    axis = mesh.axis_names[0]
    x = global_array(mesh, P(axis), 1, (TOKENS, D))
    scale = global_array(mesh, P(), 2, (D,))
    w = global_array(mesh, P(None, axis), 3, (D, VOCAB))
    targets = jax.make_array_from_callback((TOKENS,), NamedSharding(mesh, P()),
                                           lambda index: (np.arange(TOKENS, dtype=np.int32) * 7 % VOCAB)[index])
    q, k, v = (global_array(mesh, P(None, axis), 10 + i, (1, T, N, H)) for i in range(3))

    def loss_fn(x, scale, w, q, k, v):
        h = ops.rms_norm(x, scale)

        def vocab_parallel(h, w, t):
            return ops.cross_entropy(h @ w, t, axis_name=axis)

        ce = jax.shard_map(vocab_parallel, mesh=mesh, in_specs=(P(), P(None, axis), P()), out_specs=P())(h, w, targets)
        attn = jax.shard_map(lambda q, k, v: ops.ring_attention(q, k, v, axis_name=axis, causal=True), mesh=mesh,
                             in_specs=(P(None, axis),) * 3, out_specs=P(None, axis))(q, k, v)
        return ce + jnp.mean(attn**2), (h, attn)

    (loss, (h, attn)), grads = jax.jit(jax.value_and_grad(loss_fn, argnums=(0, 1, 2, 3, 4, 5), has_aux=True))(x, scale, w, q, k, v)
    # Scalars reduced inside the program: every process gets the same replicated values.
    norms = jax.jit(lambda gs: [jnp.sqrt(jnp.sum(g.astype(jnp.float32) ** 2)) for g in gs])(grads)
    sums = jax.jit(lambda a, b: (jnp.sum(a), jnp.sum(jnp.abs(b))))(h, attn)
    return {"loss": float(loss), **{f"grad_norm_{n}": float(g) for n, g in zip(("x", "scale", "w", "q", "k", "v"), norms)},
            "rms_norm_sum": float(sums[0]), "attention_abs_sum": float(sums[1])}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--coordinator", help="host:port of process 0 (omit for one process)")
    parser.add_argument("--num-processes", type=int, default=1)
    parser.add_argument("--process-id", type=int, default=0)
    args = parser.parse_args(argv)
    if args.coordinator:
        jax.distributed.initialize(args.coordinator, num_processes=args.num_processes, process_id=args.process_id)
    mesh = jax.make_mesh((jax.device_count(),), ("shards",), axis_types=(jax.sharding.AxisType.Auto,))
    result = step(mesh)
    print(json.dumps({"process": jax.process_index(), "processes": jax.process_count(), "devices": jax.device_count(),
                      **result}), flush=True)


if __name__ == "__main__":
    main()
