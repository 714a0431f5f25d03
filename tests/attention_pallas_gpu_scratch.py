"""Scratch checks for kernels/pallas/gpu/attention.py (the lead deletes this file).

python attention_pallas_gpu_scratch.py lower [H ...]      cross-lower fwd+bwd for cuda at B4 T=S=4096 N32
python attention_pallas_gpu_scratch.py interp CASE ...    interpret-mode numerics vs backend="xla"
"""
import os, sys, time
os.environ.setdefault("JAX_PLATFORMS", "cpu")
import jax, jax.numpy as jnp, numpy as np
from forgeax.kernels.common.attention import AttentionSpec
from forgeax.kernels.pallas.gpu import attention as A
from forgeax.kernels.xla import attention as X
from forgeax.ops.interface import interpret_mode


def loss_fn(impl, spec, ct, wl):
    def f(q, k, v):
        out, lse = impl(q, k, v, None, None, None, None, None, spec=spec)
        fin = jnp.isfinite(lse)
        return jnp.sum(out.astype(jnp.float32) * ct) + jnp.sum(jnp.where(fin, lse * wl, 0.0))
    return f


def lower(H, causal=True, T=4096, S=4096, N=32, K=32, B=4, window=None, cap=None):
    spec = AttentionSpec(causal=causal, scale=H ** -0.5, window_left=window, window_right=0 if causal else None,
                         logit_soft_cap=cap)
    q = jax.ShapeDtypeStruct((B, T, N, H), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((B, S, K, H), jnp.bfloat16)
    ct = jnp.zeros((B, T, N, H), jnp.float32); wl = jnp.zeros((B, N, T), jnp.float32)
    assert A._supports(q, k, k, None, None, None, None, None, spec=spec) is None
    t0 = time.time()
    fwd = jax.jit(lambda q, k, v: A.ATTENTION.fn(q, k, v, None, None, None, None, None, spec=spec))
    txt = fwd.trace(q, k, k).lower(lowering_platforms=("cuda",)).as_text()
    n_f = txt.count("mosaic_gpu_v2")
    g = jax.jit(jax.grad(loss_fn(A.ATTENTION.fn, spec, ct, wl), argnums=(0, 1, 2)))
    txt = g.trace(q, k, k).lower(lowering_platforms=("cuda",)).as_text()
    print(f"lower H={H} causal={causal} T={T} S={S} N={N} K={K} win={window} cap={cap}: fwd calls {n_f}, "
          f"grad calls {txt.count('mosaic_gpu_v2')}  ({time.time()-t0:.1f}s)", flush=True)


def rel(a, b):
    a = np.asarray(a, np.float64); b = np.asarray(b, np.float64)
    fa, fb = np.isfinite(a), np.isfinite(b)
    assert (fa == fb).all(), "finite pattern differs"
    a, b = np.where(fa, a, 0), np.where(fb, b, 0)
    return np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)


def interp(T=128, S=128, N=2, K=2, H=64, causal=False, window=None, cap=None, B=1, dtype=jnp.bfloat16, seed=0):
    spec = AttentionSpec(causal=causal, scale=H ** -0.5, window_left=window,
                         window_right=0 if causal else (None if window is None else window), logit_soft_cap=cap)
    ks = jax.random.split(jax.random.key(seed), 5)
    q = jax.random.normal(ks[0], (B, T, N, H), jnp.float32).astype(dtype)
    k = jax.random.normal(ks[1], (B, S, K, H), jnp.float32).astype(dtype)
    v = jax.random.normal(ks[2], (B, S, K, H), jnp.float32).astype(dtype)
    ct = jax.random.normal(ks[3], (B, T, N, H), jnp.float32)
    wl = jax.random.normal(ks[4], (B, N, T), jnp.float32)
    assert A._supports(q, k, v, None, None, None, None, None, spec=spec) is None
    t0 = time.time()
    with interpret_mode():
        out, lse = jax.jit(lambda q, k, v: A.ATTENTION.fn(q, k, v, None, None, None, None, None, spec=spec))(q, k, v)
        g = jax.jit(jax.grad(loss_fn(A.ATTENTION.fn, spec, ct, wl), argnums=(0, 1, 2)))(q, k, v)
    ro, rl = X.reference(q, k, v, None, None, None, None, None, spec=spec)
    rg = jax.grad(loss_fn(X.ATTENTION.fn, spec, ct, wl), argnums=(0, 1, 2))(q, k, v)
    errs = dict(out=rel(out, ro), lse=rel(lse, rl), dq=rel(g[0], rg[0]), dk=rel(g[1], rg[1]), dv=rel(g[2], rg[2]))
    ok = all(e < 2e-2 for e in errs.values())
    print(f"interp T={T} S={S} N={N} K={K} H={H} causal={causal} win={window} cap={cap}: "
          + " ".join(f"{n}={e:.2e}" for n, e in errs.items()) + f" {'OK' if ok else 'FAIL'} ({time.time()-t0:.0f}s)",
          flush=True)
    return ok


if __name__ == "__main__":
    mode = sys.argv[1]
    if os.environ.get("RACES"):
        import functools
        from jax.experimental.pallas import mosaic_gpu as plgpu
        from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call as ipc
        orig = plgpu.InterpretGPUParams
        A.plgpu.InterpretGPUParams = functools.partial(orig, detect_races=True)
    if mode == "lower":
        for a in sys.argv[2:]:
            exec(f"lower({a})")
    else:
        for a in sys.argv[2:]:
            exec(f"interp({a})")
            if os.environ.get("RACES"):
                print("races found:", ipc.get_races().races_found, flush=True)
