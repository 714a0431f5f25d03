"""Benchmarks the softcap op with forgeax's own bench tool (tools/bench.py): every backend, fwd
and fwd+bwd, against the floor, compile time included.

    python examples/custom_kernel/run_bench.py                      # CPU: the small shape
    python examples/custom_kernel/run_bench.py --plot /tmp/plots    # GPU: every shape, and a PNG

A user op joins the tool by adding a `bench_specs.Spec` (named shapes, inputs, how to call a
backend, the bytes/FLOPs floor) to `bench_specs.SPECS`; the arguments are tools/bench.py's.
"""

from __future__ import annotations

import functools
import os
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tools"))
import bench  # noqa: E402
import bench_specs  # noqa: E402
from bench_specs import Shape, Spec  # noqa: E402

from forgeax.examples.custom_kernel.softcap import softcap  # noqa: E402

CAP = 30.0
SHAPES = (
    Shape("gemma2 logits 8k tokens x 256k vocab", (8192, 256000), "bfloat16"),
    Shape("gemma2 attention scores 4x16x4k x 4k", (64, 4096, 4096), "bfloat16"),
    Shape("small f32", (512, 4096), "float32", small=True),
)


def make_inputs(shape: Shape, key: jax.Array):
    kx, kd = jax.random.split(key)
    x = (40.0 * jax.random.normal(kx, shape.dims, jnp.float32)).astype(shape.dtype)
    dy = jax.random.normal(kd, shape.dims, jnp.float32).astype(shape.dtype)
    return x, dy  # the last input is the cotangent of the fwd+bwd mode


def build(backend, mode, options):
    fn = functools.partial(softcap, backend=backend, **options)
    if mode == "fwd":
        return jax.jit(lambda x, dy: fn(x))

    def fwd_bwd(x, dy):
        y, pullback = jax.vjp(fn, x)
        return y, pullback(dy)[0]

    return jax.jit(fwd_bwd)


def floor(shape: Shape, mode: str) -> tuple[float, float]:
    """fwd reads x and writes y; fwd+bwd also reads x and dy and writes dx: 2 or 5 passes."""
    one_pass = jnp.dtype(shape.dtype).itemsize
    for d in shape.dims:
        one_pass *= d
    return (2 if mode == "fwd" else 5) * one_pass, 0.0


SPEC = Spec("softcap", SHAPES, make_inputs, build, floor, options={"cap": CAP})


def main(argv: list[str] | None = None) -> None:
    bench_specs.SPECS["softcap"] = SPEC
    bench.main(["--op", "softcap", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    main()
