"""Vocabulary-parallel cross_entropy / linear_cross_entropy on every local GPU, against one device.

    python -m benchmarks.vocab_parallel --out results.json     # on a machine with >= 2 GPUs

Logits (8192, 128256) bf16 are split over the vocabulary across n devices (shard_map, axis "v");
the mean loss and its gradient must equal the single-device call (checked here, printed, and
recorded) for each backend of the parallel call (--backend; the Triton and Mosaic GPU kernels
compute per-row partials over their slice); all are timed with the method of tools/bench.py (median of interleaved rounds).
The same for linear_cross_entropy with the weight split over V (x replicated).
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from benchmarks.common import interleaved
from forgeax import ops


def _rel(a, b, device) -> float:
    """|a - b| / |b| (Frobenius), in f32 on `device` (a gradient of LCE's weight is 0.5 G elements:
    copying it to the host in f64 took longer than the timing)."""
    a, b = (jax.device_put(x, device).astype(jnp.float32) for x in (a, b))
    return float(jnp.linalg.norm(a - b) / jnp.maximum(jnp.linalg.norm(b), 1e-30))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="-")
    parser.add_argument("--calls", type=int, default=10)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--small", action="store_true", help="tiny shapes (a CPU check of the script)")
    parser.add_argument("--devices", type=int, help="use the first N devices (default all)")
    parser.add_argument("--backend", action="append",
                        help="backend of the vocabulary-parallel calls (repeatable; 'default' = the selection; default: "
                             "default, triton and the XLA one)")
    args = parser.parse_args()
    devices = jax.devices()[: args.devices] if args.devices else jax.devices()
    n = len(devices)
    mesh = jax.make_mesh((n,), ("v",), axis_types=(jax.sharding.AxisType.Auto,), devices=devices)
    key = jax.random.key(0)
    tokens, hidden, vocab = (64, 32, 1000) if args.small else (8192, 4096, 128256)
    k1, k2, k3, k4 = jax.random.split(key, 4)
    logits = (3 * jax.random.normal(k1, (tokens, vocab), jnp.float32)).astype(jnp.bfloat16)
    targets = jax.random.randint(k2, (tokens,), 0, vocab, jnp.int32).at[::7].set(-100)
    x = jax.random.normal(k3, (tokens, hidden), jnp.float32).astype(jnp.bfloat16)
    w = (jax.random.normal(k4, (hidden, vocab), jnp.float32) / hidden**0.5).astype(jnp.bfloat16)
    options = dict(label_smoothing=0.1, z_loss=1e-4)
    report = {"devices": [d.device_kind for d in devices], "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "method": {"calls_per_round": args.calls, "rounds": args.reps, "statistic": "median, interleaved"}, "results": []}

    def ce(backend, axis_name=None):
        return lambda lg, t: ops.cross_entropy(lg, t, backend=backend, axis_name=axis_name, **options)

    def lce(backend, axis_name=None):
        return lambda a, b, t: ops.linear_cross_entropy(a, b, t, backend=backend, axis_name=axis_name, **options)

    def sharded(loss, in_specs):
        body = jax.shard_map(lambda *a: jax.value_and_grad(loss, argnums=tuple(range(len(a) - 1)))(*a),
                             mesh=mesh, in_specs=in_specs, out_specs=(P(), tuple(s for s in in_specs[:-1])))
        return jax.jit(body)

    cases = {
        "cross_entropy": dict(
            single=jax.jit(jax.value_and_grad(ce(None), argnums=(0,))),
            parallel=lambda backend: sharded(ce(backend, "v"), (P(None, "v"), P())),
            backends=args.backend or ["default", "triton", "xla"],
            args=(logits, targets),
            shard=(NamedSharding(mesh, P(None, "v")), NamedSharding(mesh, P())),
        ),
        "linear_cross_entropy": dict(
            single=jax.jit(jax.value_and_grad(lce(None), argnums=(0, 1))),
            parallel=lambda backend: sharded(lce(backend, "v"), (P(), P(None, "v"), P())),
            backends=args.backend or ["default", "triton", "pallas_gpu", "xla_chunked"],
            args=(x, w, targets),
            shard=(NamedSharding(mesh, P()), NamedSharding(mesh, P(None, "v")), NamedSharding(mesh, P())),
        ),
    }
    for name, case in cases.items():
        one = jax.device_put(case["args"], devices[0])
        many = tuple(jax.device_put(a, s) for a, s in zip(case["args"], case["shard"]))
        loss1, grads1 = case["single"](*one)
        fns, rows = {"single": (case["single"], one)}, {}
        for backend in case["backends"]:
            try:
                parallel = case["parallel"](None if backend == "default" else backend)
                lossn, gradsn = parallel(*many)
            except Exception as e:  # noqa: BLE001 - a backend that cannot run here is reported, not fatal
                print(f"{name} {backend}: {type(e).__name__}: {str(e)[:200]}", flush=True)
                continue
            errors = {"loss_abs": float(abs(float(loss1) - float(lossn)))}
            for i, (g1, gn) in enumerate(zip(grads1, gradsn)):
                errors[f"grad{i}_rel"] = _rel(gn, g1, devices[0])
            fns[backend] = (parallel, many)
            rows[backend] = {"op": name, "devices": n, "options": options, "loss_single": float(loss1),
                             "loss_parallel": float(lossn), **errors, "single_backend": "default", "parallel_backend": backend}
        times = interleaved(fns, calls=args.calls, rounds=args.reps, warmup=1)
        for backend, row in rows.items():
            row.update(single_ms=statistics.median(times["single"]) * 1e3, parallel_ms=statistics.median(times[backend]) * 1e3)
            print(json.dumps(row), flush=True)
            report["results"].append(row)
        if args.out != "-":  # after each op: a run cut at its limit keeps what it measured
            with open(args.out, "w") as f:
                json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
