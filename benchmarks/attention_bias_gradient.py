"""What a bias costs attention's forward+backward, per bias shape and backend.

    python benchmarks/attention_bias_gradient.py [--shape B,T,N,K,H] [--backend triton] \
        [--backend xla_chunked] [--rounds 10] [--out bias.json]

For each backend: causal bf16 fwd+bwd (gradients of q, k, v and the bias) without a bias, with a
full [B, N, T, S] bias (dbias is the backward's dz, written once), with a per-head [1, N, T, S] and
with a shared [1, 1, T, S] bias (dbias summed over the broadcast axes: Triton's `_dbias_kernel`,
which recomputes the scores and dO V^T). Timed in interleaved rounds (tools/bench.py); also the
compiled executable's temporary memory, which shows whether a B*N*T*S dz was materialised.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tools"))
from bench import interleaved, temp_bytes  # noqa: E402
from tune_attention import random_inputs  # noqa: E402  (this directory is on sys.path as a script)

from forgeax import ops  # noqa: E402

BIAS_SHAPES = {
    "none": None,
    "full": lambda B, N, T: (B, N, T, T),
    "per_head": lambda B, N, T: (1, N, T, T),
    "shared": lambda B, N, T: (1, 1, T, T),
}


def _training_step(backend: str, with_bias: bool):
    def loss(q, k, v, bias, dout):
        out = ops.attention(q, k, v, bias=bias if with_bias else None, causal=True, backend=backend)
        return jnp.sum(out.astype(jnp.float32) * dout.astype(jnp.float32))

    return jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3) if with_bias else (0, 1, 2)))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="2,4096,16,16,128", help="B,T,N,K,H (S = T)")
    parser.add_argument("--backend", action="append", default=None)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--calls", type=int, default=10)
    parser.add_argument("--out", default="-")
    args = parser.parse_args()
    B, T, N, _, _ = (int(d) for d in args.shape.split(","))
    q, k, v, dout = random_inputs(args.shape)
    bias_key = jax.random.key(1)

    candidates, memory = {}, {}
    for backend in args.backend or ["triton"]:
        for name, shape_of in BIAS_SHAPES.items():
            bias = None if shape_of is None else jax.random.normal(bias_key, shape_of(B, N, T), jnp.bfloat16)
            fn = _training_step(backend, bias is not None)
            call_args = (q, k, v, bias, dout)
            jax.block_until_ready(fn(*call_args))  # compile; a refusal surfaces here
            candidates[backend, name] = (fn, call_args)
            memory[backend, name] = temp_bytes(fn, call_args)
    times = interleaved(candidates, calls=args.calls, rounds=args.rounds, warmup=2)

    device = jax.devices()[0].device_kind
    results = []
    for (backend, name), seconds in times.items():
        ms = statistics.median(seconds) * 1e3
        base = statistics.median(times[backend, "none"]) * 1e3
        results.append(dict(backend=backend, bias=name, median_ms=ms, vs_no_bias=ms / base,
                            temp_bytes=memory[backend, name]))
        print(f"{backend:12s} {name:9s} fwd+bwd {ms:8.3f} ms  {ms / base:5.2f}x no bias  "
              f"temp {memory[backend, name] / 1e9 if memory[backend, name] else float('nan'):.2f} GB", flush=True)
    report = dict(device=device, shape=args.shape, causal=True, dtype="bfloat16", rounds=args.rounds,
                  calls=args.calls, results=results)
    if args.out != "-":
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
