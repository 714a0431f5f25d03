"""Is a backward bitwise reproducible? Runs each attention implementation's gradient twice.

    python -m benchmarks.backward_determinism [--out FILE]     (on a GPU)

For each candidate (jax.nn's cuDNN path, and forgeax's GPU backends) it reports whether six runs
of the same jitted gradient give identical bits, and the largest relative difference between
them: the evidence behind ops.attention's `deterministic` option (cudnn refuses
deterministic=True without XLA's --xla_gpu_deterministic_ops).
"""

from __future__ import annotations

import argparse
import functools

import jax
import jax.numpy as jnp

from benchmarks.common import attention_inputs, rel_err, write_json
from forgeax import ops


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="-")
    args = parser.parse_args()
    B, T, N, H = 2, 4096, 16, 128
    q, k, v, do = attention_inputs(f"{B},{T},{N},{N},{H}")
    candidates = {
        "cudnn (jax.nn)": functools.partial(jax.nn.dot_product_attention, is_causal=True, implementation="cudnn"),
        "pallas_gpu": functools.partial(ops.attention, causal=True, backend="pallas_gpu"),
        "triton": functools.partial(ops.attention, causal=True, backend="triton"),
    }
    rows = []
    for name, fn in candidates.items():
        grad = jax.jit(lambda q, k, v, fn=fn: jax.vjp(fn, q, k, v)[1](do))
        first = [a.astype(jnp.float32) for a in grad(q, k, v)]
        same, worst = True, 0.0
        for _ in range(5):
            again = [a.astype(jnp.float32) for a in grad(q, k, v)]
            same &= all(bool(jnp.all(a == b)) for a, b in zip(first, again))
            worst = max(worst, max(rel_err(a, b) for a, b in zip(again, first)))
        rows.append({"candidate": name, "bitwise_equal_over_6_runs": same, "max_relative_difference": worst})
        print(rows[-1], flush=True)
    result = {"device": jax.devices()[0].device_kind, "shape": {"B": B, "T": T, "N": N, "H": H, "causal": True}, "rows": rows}
    write_json(args.out, result)


if __name__ == "__main__":
    main()
