"""Scratch checks for the Mosaic TPU attention (lead deletes). Run with FORGEAX_INTERPRET=1."""
import os, sys, time
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("FORGEAX_INTERPRET", "1")
import jax, jax.numpy as jnp, numpy as np
from forgeax import ops

def rel(a, b):
    a = np.asarray(a, np.float64); b = np.asarray(b, np.float64)
    assert not np.isnan(a).any(), "nan"
    d = np.linalg.norm(a - b); n = np.linalg.norm(b)
    return d / n if n > 0 else d

def case(B=1, T=17, S=17, N=4, K=2, H=64, Hv=None, dtype=jnp.float32, seg=False, bias=None, mask=None, drop=0.0, **kw):
    Hv = Hv or H
    r = np.random.default_rng(0)
    ks = jax.random.split(jax.random.PRNGKey(1), 8)
    q = jax.random.normal(ks[0], (B, T, N, H), dtype)
    k = jax.random.normal(ks[1], (B, S, K, H), dtype)
    v = jax.random.normal(ks[2], (B, S, K, Hv), dtype)
    extra = {}
    if seg:
        extra["segment_ids"] = (jnp.asarray(r.integers(0, 3, (B, T))), jnp.asarray(r.integers(0, 3, (B, S))))
    b_arr = None
    if bias is not None:
        b_arr = jax.random.normal(ks[3], bias + (T, S), jnp.float32).astype(dtype)
    if mask is not None:
        extra["mask"] = jnp.asarray(r.random(mask + (T, S)) > 0.3)
    if drop:
        extra.update(dropout_rate=drop, dropout_key=jax.random.PRNGKey(7))
    extra.update(kw)
    do = jax.random.normal(ks[4], (B, T, N, Hv), jnp.float32)
    dl = jax.random.normal(ks[5], (B, T, N), jnp.float32)

    def loss(q, k, v, b, backend):
        o, lse = ops.attention(q, k, v, bias=b, return_lse=True, backend=backend, **extra)
        lse_t = jnp.where(jnp.isfinite(lse), lse, 0.0)
        return jnp.sum(o.astype(jnp.float32) * do) + jnp.sum(lse_t * dl), (o, lse)

    argn = (0, 1, 2, 3) if b_arr is not None else (0, 1, 2)
    res = {}
    for be in ("pallas_tpu", "xla"):
        qq, kk, vv, bb = (q, k, v, b_arr) if be != "xla" else (q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32), None if b_arr is None else b_arr.astype(jnp.float32))
        (_, (o, lse)), g = jax.value_and_grad(loss, argnums=argn, has_aux=True)(qq, kk, vv, bb, be)
        res[be] = (o, lse, g)
    o1, l1, g1 = res["pallas_tpu"]; o2, l2, g2 = res["xla"]
    assert o1.dtype == dtype
    fin = np.isfinite(np.asarray(l2))
    assert (np.isfinite(np.asarray(l1)) == fin).all(), "lse finiteness"
    errs = dict(out=rel(o1, o2), lse=rel(np.where(fin, l1, 0), np.where(fin, l2, 0)))
    for name, a, b in zip("q k v bias".split(), g1, g2):
        assert a.dtype == dtype, (name, a.dtype)
        errs["d" + name] = rel(a, b)
    return errs

CASES = [
    dict(),
    dict(T=1, S=1), dict(T=17, S=200), dict(T=200, S=17), dict(T=128, S=128, K=4), dict(T=200, S=200, K=1, H=128),
    dict(causal=True, T=17, S=200), dict(causal=True, T=200, S=17), dict(causal=True, T=200, S=200, B=2),
    dict(window=(16, 8), T=200, S=200), dict(window=(0, 0), causal=True, T=200, S=17),
    dict(window=(None, 3), T=128, S=200),
    dict(logit_soft_cap=5.0, T=128, S=200),
    dict(seg=True, T=200, S=200, B=2), dict(bias=(1, 4), T=17, S=200), dict(bias=(2, 1), B=2, T=200, S=128),
    dict(bias=(1, 1), T=200, S=17), dict(mask=(1, 4), T=200, S=200), dict(mask=(2, 1), B=2, T=17, S=17),
    dict(drop=0.3, T=200, S=200, B=2), dict(Hv=128, H=64, T=17, S=200),
    dict(causal=True, seg=True, bias=(1, 4), mask=(1, 1), logit_soft_cap=10.0, drop=0.1, window=(50, None), T=200, S=200, B=2),
]
def main():
    dts = [jnp.dtype(d) for d in os.environ.get("DTYPES", "float32,bfloat16,float16").split(",")]
    sel = sys.argv[1:]
    if sel == ["extra"]:
        extra_checks(); sys.exit()
    for idx, c in enumerate(CASES):
        if sel and str(idx) not in sel: continue
        for dt in dts:
            t0 = time.time()
            e = case(dtype=dt, **c)
            tol = 1e-4 if dt == jnp.float32 else 2e-2
            bad = {k: v for k, v in e.items() if not v < tol}
            print(idx, c, jnp.dtype(dt).name, {k: f"{v:.1e}" for k, v in e.items()}, "FAIL" if bad else "ok", f"{time.time()-t0:.1f}s", flush=True)


def extra_checks():
    from forgeax.kernels.common.attention import dropout_keep_numpy, dropout_seed_from_key
    ks = jax.random.split(jax.random.PRNGKey(3), 4)
    B, T, S, N, K, H = 2, 200, 200, 4, 2, 64
    q = jax.random.normal(ks[0], (B, T, N, H)); k = jax.random.normal(ks[1], (B, S, K, H)); v = jax.random.normal(ks[2], (B, S, K, H))
    # 1. dropout keep-mask equals the contract's numpy hash
    key = jax.random.PRNGKey(11); rate = 0.4
    out = ops.attention(q, k, v, dropout_rate=rate, dropout_key=key, backend="pallas_tpu")
    seed = int(dropout_seed_from_key(key))
    G = N // K
    qn, kn, vn = (np.asarray(a, np.float64) for a in (q, k, v))
    kn, vn = np.repeat(kn, G, 2), np.repeat(vn, G, 2)
    z = np.einsum("btnh,bsnh->bnts", qn, kn) / np.sqrt(H)
    p = np.exp(z - z.max(-1, keepdims=True)); p /= p.sum(-1, keepdims=True)
    I = np.arange
    keep = dropout_keep_numpy(seed, I(B)[:, None, None, None], I(N)[None, :, None, None], I(T)[None, None, :, None], I(S)[None, None, None, :], N, int(round(rate * (1 << 24))))
    want = np.einsum("bnts,bsnh->btnh", p * keep / (1 - rate), vn)
    print("dropout vs dropout_keep_numpy: rel", rel(out, want), "kept fraction", keep.mean())
    # 2. fully masked rows: segment ids that never match, and window (0,0) with T > S
    qs = jnp.zeros((B, T), jnp.int32).at[:, ::3].set(7); kvs = jnp.zeros((B, S), jnp.int32)
    def f(q, k, v):
        o, lse = ops.attention(q, k, v, segment_ids=(qs, kvs), return_lse=True, backend="pallas_tpu")
        return jnp.sum(o * 1.5) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0)), (o, lse)
    (_, (o, lse)), g = jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True)(q, k, v)
    dead = np.asarray(qs) == 7
    print("masked rows: out==0", bool(np.all(np.asarray(o)[dead] == 0)), "lse==-inf", bool(np.all(np.isneginf(np.asarray(lse)[dead]))),
          "lse finite elsewhere", bool(np.all(np.isfinite(np.asarray(lse)[~dead]))), "grads finite", all(bool(jnp.all(jnp.isfinite(x))) for x in g),
          "dq==0 on dead rows", bool(np.all(np.asarray(g[0])[dead] == 0)))
    # 3. jit + vmap + checkpoint + grad
    def loss(q, k, v, backend):
        return jnp.sum(jnp.sin(ops.attention(q, k, v, causal=True, window=(30, None), backend=backend)))
    gfn = lambda be: jax.jit(jax.grad(lambda q, k, v: jnp.sum(jax.vmap(jax.checkpoint(lambda a, b, c: loss(a, b, c, be)))(q, k, v)), argnums=(0, 1, 2)))
    qq, kk, vv = (jnp.stack([a, a * 0.5]) for a in (q, k, v))
    g1, g2 = gfn("pallas_tpu")(qq, kk, vv), gfn("xla")(qq, kk, vv)
    print("jit(grad(vmap(checkpoint))) rel:", [f"{rel(a, b):.1e}" for a, b in zip(g1, g2)])
    # 4. determinism
    o1 = ops.attention(q, k, v, causal=True, backend="pallas_tpu"); o2 = ops.attention(q, k, v, causal=True, backend="pallas_tpu")
    print("deterministic:", bool(jnp.all(o1 == o2)))


if __name__ == "__main__":
    main()
