"""Scratch checks for kernels/pallas/gpu/linear_cross_entropy.py (the lead deletes this file).

Interpret mode on CPU vs backend="xla" (bf16 inputs, rel L2 < 2e-2), and cuda
cross-lowering at the benchmark shape. Run:
  cd /tmp && PYTHONPATH=/tmp/fxpath JAX_PLATFORMS=cpu /work/venv/bin/python /work/main/tests/linear_ce_pallas_gpu_scratch.py [lower]
"""
import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
import jax
import jax.numpy as jnp
import numpy as np

from forgeax import ops
from forgeax.kernels.common import linear_cross_entropy as chunked
from forgeax.kernels.pallas.gpu import linear_cross_entropy as gpu_lce
from forgeax.ops.interface import interpret_mode

# Until kernels/common has ChunkKernels.fused_matmul: the proposed `_logits` hook.
if "fused_matmul" not in {f.name for f in chunked.dataclasses.fields(chunked.ChunkKernels)}:
    _orig = chunked._logits

    def _logits(xc, w, b, opts):
        if opts.kernels is gpu_lce.CHUNK_KERNELS:
            return xc, w, b
        return _orig(xc, w, b, opts)

    chunked._logits = _logits


# LCE_CONFIG="warpgroups,block_n,stages" picks the kernel tiling.
if os.environ.get("LCE_CONFIG"):
    _w, _n, _s = map(int, os.environ["LCE_CONFIG"].split(","))
    gpu_lce.CONFIG = gpu_lce.Config(warpgroups=_w, block_n=_n, stages=_s)
print("config:", gpu_lce.CONFIG, flush=True)


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def check(name, n=64, h=128, v=1000, bias=False, dtype=jnp.bfloat16, **kw):
    k = jax.random.split(jax.random.key(hash(name) % 2**31), 5)
    x = jax.random.normal(k[0], (n, h), jnp.float32).astype(dtype)
    w = (jax.random.normal(k[1], (h, v), jnp.float32) * 0.3).astype(dtype)
    b = jax.random.normal(k[2], (v,), jnp.float32).astype(dtype) if bias else None
    t = jax.random.randint(k[3], (n,), 0, v)
    t = t.at[3].set(-100).at[5].set(v + 7).at[7].set(-3)  # ignored, out of range
    red = kw.get("reduction", "mean")
    ct = jax.random.normal(k[4], (n,), jnp.float32) if red == "none" else 1.0

    def run(fn):
        def f(x, w, b):
            out = fn(x, w, t, b)
            return jnp.sum(out * ct), out
        (_, out), grads = jax.value_and_grad(f, argnums=(0, 1, 2) if bias else (0, 1), has_aux=True)(x, w, b)
        return out, grads

    ref = run(lambda x, w, t, b: ops.linear_cross_entropy(x, w, t, bias=b, backend="xla", **kw))
    assert gpu_lce.LINEAR_CROSS_ENTROPY.supports(x, w, t, bias=b, **kw) is None
    t0 = time.time()
    with interpret_mode():
        got = run(lambda x, w, t, b: gpu_lce.LINEAR_CROSS_ENTROPY.fn(x, w, t, bias=b, **kw))
    errs = {"loss": rel(got[0], ref[0])}
    for nm, g1, g0 in zip(("dx", "dW", "db"), got[1], ref[1]):
        assert g1.dtype == g0.dtype, (nm, g1.dtype, g0.dtype)
        errs[nm] = rel(g1.astype(jnp.float32), g0.astype(jnp.float32))
    ok = all(e < 2e-2 for e in errs.values())
    print(f"{'OK ' if ok else 'BAD'} {name:34s} " + " ".join(f"{k}={e:.2e}" for k, e in errs.items()) + f"  ({time.time() - t0:.0f}s)", flush=True)
    return ok


CASES = {
    "mean": {},
    "sum_f16": dict(reduction="sum", dtype=jnp.float16),
    "none": dict(reduction="none"),
    "bias_mean": dict(bias=True),
    "smoothing": dict(label_smoothing=0.1),
    "zloss": dict(z_loss=1e-3),
    "softcap": dict(logit_soft_cap=3.0),
    "all_none_bias": dict(bias=True, reduction="none", label_smoothing=0.2, z_loss=1e-2, logit_soft_cap=5.0),
    "chunks_tail_v": dict(n=50, v=700, chunk_size=32, label_smoothing=0.1),
    "v_multiple": dict(n=40, v=1024, reduction="sum", bias=True),
    "h320_ring_wraps_tiles": dict(h=320, v=1000, logit_soft_cap=4.0),
    "h512_refills_bias": dict(h=512, v=2000, bias=True, label_smoothing=0.1, reduction="none"),
}


def lower():
    x = jax.ShapeDtypeStruct((8192, 4096), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((4096, 128256), jnp.bfloat16)
    t = jax.ShapeDtypeStruct((8192,), jnp.int32)
    fn = gpu_lce.LINEAR_CROSS_ENTROPY.fn
    for name, f in {
        "fwd+bwd mean": jax.grad(lambda x, w, t: fn(x, w, t), argnums=(0, 1)),
        "fwd none": lambda x, w, t: fn(x, w, t, reduction="none", logit_soft_cap=30.0),
        "fwd+bwd none": jax.grad(lambda x, w, t: jnp.sum(fn(x, w, t, reduction="none", label_smoothing=0.1)), argnums=(0, 1)),
    }.items():
        t0 = time.time()
        text = jax.jit(f).trace(x, w, t).lower(lowering_platforms=("cuda",)).as_text()
        print(f"lowered {name}: {text.count('mosaic_gpu')} mosaic_gpu mentions ({time.time() - t0:.0f}s)", flush=True)
    b = jax.ShapeDtypeStruct((128256,), jnp.float32)
    f = jax.grad(lambda x, w, b, t: fn(x, w, t, bias=b, z_loss=1e-4), argnums=(0, 1, 2))
    text = jax.jit(f).trace(x, w, b, t).lower(lowering_platforms=("cuda",)).as_text()
    print("lowered bias fwd+bwd:", text.count("mosaic_gpu"), flush=True)


def races():
    """One case under the interpreter's race detector; also checks the fused kernel is what runs."""
    from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call as ipc
    from jax.experimental.pallas import mosaic_gpu as plgpu
    gpu_lce._interpret = lambda: plgpu.InterpretGPUParams(detect_races=True)
    x = jnp.ones((64, 320), jnp.bfloat16); w = jnp.ones((320, 1000), jnp.bfloat16); t = jnp.arange(64)
    with interpret_mode():
        jaxpr = str(jax.make_jaxpr(jax.grad(lambda x, w: gpu_lce.LINEAR_CROSS_ENTROPY.fn(x, w, t, bias=jnp.ones(1000)), (0, 1)))(x, w))
    print("kernel in jaxpr:", "mosaic" in jaxpr or "pallas" in jaxpr or "interpret" in jaxpr)
    ok = check("h512_refills_bias", **CASES["h512_refills_bias"])
    print("races found:", ipc.get_races().races_found, "numerics ok:", ok)


if __name__ == "__main__":
    if sys.argv[1:] == ["races"]:
        races()
    elif sys.argv[1:] == ["lower"]:
        lower()
    else:
        names = sys.argv[1:] or list(CASES)
        res = [check(nm, **CASES[nm]) for nm in names]
        print("ALL OK" if all(res) else "FAILURES")
