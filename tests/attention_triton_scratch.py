"""Scratch checks of the Triton attention backend in Triton's interpreter (the lead deletes this).

Run: cd /tmp && TRITON_INTERPRET=1 FORGEAX_INTERPRET=1 PYTHONPATH=/tmp/fxpath JAX_PLATFORMS=cpu \
     /work/venv/bin/python /work/main/tests/attention_triton_scratch.py [filter]
"""
import os, sys, time
import numpy as np
import jax, jax.numpy as jnp
from forgeax import ops

def rel(a, b):
    a = np.asarray(a, np.float64); b = np.asarray(b, np.float64)
    assert np.all(np.isfinite(a)) == np.all(np.isfinite(b)) or True
    fa = np.isfinite(b)
    if not np.array_equal(np.isfinite(a), fa):
        return float("nan")
    a, b = np.where(fa, a, 0), np.where(fa, b, 0)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))

def run(name, B=1, T=17, S=17, N=4, K=2, H=16, Hv=None, dtype=jnp.float32, **kw):
    Hv = Hv or H
    ks = jax.random.split(jax.random.PRNGKey(hash(name) % 2**31), 10)
    q = jax.random.normal(ks[0], (B, T, N, H), dtype)
    k = jax.random.normal(ks[1], (B, S, K, H), dtype)
    v = jax.random.normal(ks[2], (B, S, K, Hv), dtype)
    ct = jax.random.normal(ks[3], (B, T, N, Hv), jnp.float32)
    ctl = jax.random.normal(ks[4], (B, T, N), jnp.float32)
    extra = {}
    bias = kw.pop("bias", None)
    if bias is not None:
        extra["bias"] = jax.random.normal(ks[5], bias, dtype)
    mshape = kw.pop("mask", None)
    if mshape is not None:
        extra["mask"] = jax.random.bernoulli(ks[6], 0.7, mshape)
    if kw.pop("segments", False):
        extra["segment_ids"] = (jax.random.randint(ks[7], (B, T), 0, 3), jax.random.randint(ks[8], (B, S), 0, 3))
    if kw.pop("seg_never", False):
        extra["segment_ids"] = (jnp.zeros((B, T), jnp.int32), jnp.ones((B, S), jnp.int32))
    if kw.get("dropout_rate"):
        extra["dropout_key"] = ks[9]
    kw.update(extra)
    def loss(q, k, v, b, backend):
        kk = dict(kw)
        if b is not None: kk["bias"] = b
        o, lse = ops.attention(q, k, v, return_lse=True, backend=backend, **kk)
        return jnp.sum(o.astype(jnp.float32) * ct) + jnp.sum(jnp.where(jnp.isfinite(lse), lse * ctl, 0.0)), (o, lse)
    b0 = kw.pop("bias", None)
    res = {}
    for be in ("triton", "xla"):
        argn = (0, 1, 2, 3) if b0 is not None else (0, 1, 2)
        g, (o, lse) = jax.grad(loss, argnums=argn, has_aux=True)(q, k, v, b0, be)
        res[be] = dict(o=o, lse=lse, dq=g[0], dk=g[1], dv=g[2], **({"db": g[3]} if b0 is not None else {}))
    tol = 1e-4 if dtype == jnp.float32 else 2e-2
    errs = {key: rel(res["triton"][key], res["xla"][key]) for key in res["xla"]}
    finite = all(np.all(np.isfinite(np.asarray(res["triton"][x], np.float64))) for x in res["triton"] if x != "lse")
    ok = all(e < tol for e in errs.values()) and finite
    print(f"{'OK ' if ok else 'BAD'} {name:38s} " + " ".join(f"{k_}={e:.1e}" for k_, e in errs.items()) + ("" if finite else " NONFINITE"), flush=True)
    return ok

CASES = {
    "plain_f32": dict(),
    "tails_T130_S64_H64": dict(T=130, S=64, H=64, K=1),
    "T1_S130": dict(T=1, S=130, K=4),
    "T64_S17_causal": dict(T=64, S=17, causal=True),
    "T17_S130_causal": dict(T=17, S=130, causal=True),
    "T130_causal_B2": dict(B=2, T=130, S=130, causal=True, K=1),
    "window_3_5": dict(T=64, S=64, window=(3, 5)),
    "window_left_only": dict(T=64, S=130, window=(7, None)),
    "window_right_only": dict(T=130, S=64, window=(None, 2)),
    "causal_window_00_T_gt_S": dict(T=64, S=17, causal=True, window=(0, 0)),
    "softcap": dict(T=64, S=64, logit_soft_cap=2.0),
    "segments": dict(T=64, S=64, segments=True),
    "segments_never": dict(T=17, S=17, seg_never=True),
    "bias_full": dict(B=2, T=17, S=64, bias=(2, 4, 17, 64)),
    "bias_bcast": dict(B=2, T=64, S=17, bias=(1, 1, 64, 17)),
    "bias_heads": dict(B=2, T=17, S=17, bias=(1, 4, 17, 17)),
    "mask_bcast": dict(B=2, T=64, S=64, mask=(2, 1, 64, 64)),
    "mask_full": dict(B=1, T=17, S=64, mask=(1, 4, 17, 64)),
    "dropout": dict(B=2, T=64, S=64, dropout_rate=0.3),
    "hv_differs": dict(T=17, S=64, H=16, Hv=64),
    "hv_pad": dict(T=17, S=17, H=24, Hv=40),
    "bf16_causal_H64": dict(T=130, S=130, H=64, dtype=jnp.bfloat16, causal=True),
    "f16_window": dict(T=64, S=64, dtype=jnp.float16, window=(10, 0)),
    "combo_all": dict(B=2, T=64, S=130, causal=True, window=(40, None), logit_soft_cap=3.0, segments=True,
                      bias=(1, 4, 64, 130), mask=(2, 1, 64, 130), dropout_rate=0.2),
    "combo_bf16": dict(B=1, T=130, S=64, window=(5, 9), logit_soft_cap=5.0, bias=(1, 1, 130, 64), dtype=jnp.bfloat16, K=1),
}

if __name__ == "__main__":
    flt = sys.argv[1] if len(sys.argv) > 1 else ""
    bad = []
    for name, kw in CASES.items():
        if flt in name:
            t0 = time.time()
            if not run(name, **kw):
                bad.append(name)
    print("FAILED:", bad)
