"""Expert-parallel moe_mlp over 2-4 local GPUs, against the same layer on one GPU.

    python -m benchmarks.moe_expert_parallel --out results.json             # >= 2 GPUs
    python -m benchmarks.moe_expert_parallel --backend default --backend pallas_gpu --devices 2,4
    python -m benchmarks.moe_expert_parallel --small --out -                # CPU check of the script

A Mixtral-8x7B-like layer (T 8192 tokens, D 4096, F 14336, 8 experts, top-2, bf16): on one
device, `ops.moe_mlp`; on n devices, the expert-parallel form (`expert_axis="ep"` inside
`shard_map`: tokens split over the devices, experts too; assignments travel by all-to-all).
Per device count and ragged_dot backend: the forward and forward+backward (the gradients of x,
the router logits and the three expert weights) are timed with the method of tools/bench.py
(median of interleaved rounds, single and parallel in the same rounds), and the parallel results
are checked against the single-device ones (relative errors recorded). Speedup = single /
parallel; efficiency = speedup / n.
"""

from __future__ import annotations

import os
import sys

if "--small" in sys.argv and "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4").strip()

import argparse  # noqa: E402
import datetime  # noqa: E402
import statistics  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from benchmarks.common import interleaved, rel_err, write_json  # noqa: E402
from forgeax import ops  # noqa: E402

AXIS = "ep"


def _inputs(tokens, hidden, ffn, experts, dtype, seed=0):
    ks = jax.random.split(jax.random.key(seed), 6)
    normal = lambda k, s, scale=1.0: (scale * jax.random.normal(k, s, jnp.float32)).astype(dtype)  # noqa: E731
    args = (normal(ks[0], (tokens, hidden)), jax.random.normal(ks[1], (tokens, experts), jnp.float32),
            normal(ks[2], (experts, hidden, ffn), hidden ** -0.5), normal(ks[3], (experts, hidden, ffn), hidden ** -0.5),
            normal(ks[4], (experts, ffn, hidden), ffn ** -0.5))
    return args, normal(ks[5], (tokens, hidden))


def _steps(backend, top_k, mesh):
    """(single fwd, single fwd+bwd, parallel fwd, parallel fwd+bwd): jitted fns of (*args, ct)."""
    kw = dict(top_k=top_k, backend=backend)

    def single(x, logits, wg, wu, wd, ct):
        return ops.moe_mlp(x, logits, wg, wu, wd, **kw)

    def local(x, logits, wg, wu, wd, ct):
        return ops.moe_mlp(x, logits, wg, wu, wd, expert_axis=AXIS, **kw)

    parallel = jax.shard_map(local, mesh=mesh, in_specs=(P(AXIS),) * 6, out_specs=P(AXIS))

    def with_grads(fn):
        def step(x, logits, wg, wu, wd, ct):
            out, pull = jax.vjp(lambda *a: fn(*a, ct), x, logits, wg, wu, wd)
            return (out,) + pull(ct)

        return jax.jit(step)

    return jax.jit(single), with_grads(single), jax.jit(parallel), with_grads(parallel)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="-", help="JSON report path ('-': print only)")
    parser.add_argument("--devices", default=None, help="device counts, e.g. '2,4' (default: 2 and 4, those available)")
    parser.add_argument("--backend", action="append", help="ragged_dot backend (repeatable; 'default' = best; default: default)")
    parser.add_argument("--mode", action="append", choices=("fwd", "fwd+bwd"), help="default: both")
    parser.add_argument("--calls", type=int, default=5)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--small", action="store_true", help="tiny shapes on 4 host devices (a CPU check of the script)")
    args = parser.parse_args()
    devices = jax.devices()
    tokens, hidden, ffn, experts, top_k = (64, 64, 128, 8, 2) if args.small else (8192, 4096, 14336, 8, 2)
    dtype = jnp.bfloat16
    counts = [int(c) for c in args.devices.split(",")] if args.devices else [c for c in (2, 4) if c <= len(devices)]
    counts = [c for c in counts if 2 <= c <= len(devices) and experts % c == 0 and tokens % c == 0]
    if not counts:
        raise SystemExit(f"needs >= 2 devices dividing {experts} experts; this machine has {len(devices)}")
    backends = args.backend or ["default"]
    modes = args.mode or ["fwd", "fwd+bwd"]
    inputs, ct = _inputs(tokens, hidden, ffn, experts, dtype)
    one = jax.device_put((*inputs, ct), devices[0])
    report = {"devices": [d.device_kind for d in devices], "platform": jax.default_backend(), "jax": jax.__version__,
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "shape": {"tokens": tokens, "hidden": hidden, "ffn": ffn, "experts": experts, "top_k": top_k,
                        "dtype": jnp.dtype(dtype).name, "model": "tiny (--small)" if args.small else "Mixtral-8x7B-like layer"},
              "method": {"calls_per_round": args.calls, "rounds": args.reps,
                         "statistic": "median per-call time over rounds; single and parallel interleaved in the same rounds"},
              "results": []}
    for n in counts:
        mesh = jax.make_mesh((n,), (AXIS,), axis_types=(jax.sharding.AxisType.Auto,), devices=devices[:n])
        many = tuple(jax.device_put(a, NamedSharding(mesh, P(AXIS))) for a in (*inputs, ct))
        for name in backends:
            backend = None if name == "default" else name
            single_fwd, single_bwd, par_fwd, par_bwd = _steps(backend, top_k, mesh)
            for mode in modes:
                single, par = (single_fwd, par_fwd) if mode == "fwd" else (single_bwd, par_bwd)
                try:
                    ref = jax.block_until_ready(single(*one))
                    got = jax.block_until_ready(par(*many))
                except Exception as e:  # noqa: BLE001 - a backend that cannot run this is reported, not fatal
                    row = {"devices": n, "backend": name, "mode": mode, "error": f"{type(e).__name__}: {str(e)[:300]}"}
                    print(row, flush=True)
                    report["results"].append(row)
                    continue
                if mode == "fwd":
                    ref, got = (ref,), (got,)
                names = ["out"] + ([] if mode == "fwd" else ["d_x", "d_logits", "d_w_gate", "d_w_up", "d_w_down"])
                errors = {f"{k}_rel_err": rel_err(jax.device_get(g), jax.device_get(r)) for k, g, r in zip(names, got, ref)}
                times = interleaved({"single": (single, one), "parallel": (par, many)}, calls=args.calls, rounds=args.reps,
                                    warmup=1)
                single_ms = statistics.median(times["single"]) * 1e3
                parallel_ms = statistics.median(times["parallel"]) * 1e3
                row = {"devices": n, "backend": name, "mode": mode, "single_ms": single_ms, "parallel_ms": parallel_ms,
                       "speedup": single_ms / parallel_ms, "efficiency": single_ms / parallel_ms / n,
                       "tokens_per_s_parallel": tokens / (parallel_ms * 1e-3), **errors}
                print(row, flush=True)
                report["results"].append(row)
    write_json(args.out, report)


if __name__ == "__main__":
    main()
