"""Experiment: does Triton 3.6's Hopper warp specialization make a faster attention forward?

    python benchmarks/triton_warp_specialized_forward.py --out ws.json     (GPU, sm_90)

A causal forward written for this test (B T N H layout, bf16, T a multiple of the tile), loading
Q/K/V through device-side tensor descriptors (TMA) and looping with
`tl.range(..., warp_specialize=True)`. With num_warps=4 Triton 3.6 turns the loop into one
producer warpgroup and two consumer warpgroups (12 warps, setmaxnreg); with num_warps=8 it
ignores the flag. Timed in interleaved rounds (tools/bench.py's method) against cuDNN, the
forgeax Triton and pallas_gpu backends, each output checked against cuDNN's.

jax-triton 0.3.1 launches with the requested num_warps and passes no global scratch buffer, so
neither warp-specialized nor descriptor kernels run through it as shipped (TRITON_JAX.md).
`patch_jax_triton` records each kernel's compile metadata and builds jaxlib's TritonKernel
with the metadata's num_warps and global scratch size. It lives here, not in
kernels/triton/launch.py, because the experiment did not pay off (see results/
attention_H200_triton_warp_specialized_forward.json).

Seen on CPU while writing it (cross-lowering for sm_90): the warp-specialization pass aborts on
a kernel with two warp-specialized loops, and on one loop followed by the diagonal tile as
straight-line code, so the causal mask is applied to every tile.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import types

import jax
import jax.numpy as jnp
import triton
import triton.language as tl

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tools"))
from bench import interleaved  # noqa: E402
from tune_attention import random_inputs, rel_err  # noqa: E402

_METADATA_BY_PTX: dict[str, dict] = {}


def patch_jax_triton() -> None:
    """Launch with the compiled kernel's num_warps and global scratch (see the module docstring)."""
    import jax_triton.triton_lib as jtl
    from triton.backends.nvidia.compiler import CUDABackend

    if getattr(jtl, "_metadata_launch", False):
        return
    make_ptx = CUDABackend.make_ptx

    def recording_make_ptx(self, src, metadata, options, capability):
        ptx = make_ptx(self, src, metadata, options, capability)
        _METADATA_BY_PTX[ptx] = dict(metadata)
        return ptx

    CUDABackend.make_ptx = recording_make_ptx
    lib = jtl.triton_kernel_call_lib

    def kernel(name, num_warps, num_ctas, shared, ptx, ttir, capability):
        metadata = _METADATA_BY_PTX.get(ptx, {})
        scratch = metadata.get("global_scratch_size") or None
        return lib.TritonKernel(name, metadata.get("num_warps", num_warps), num_ctas, shared, ptx, ttir, capability,
                                global_scratch_size=scratch,
                                global_scratch_align=metadata.get("global_scratch_align") if scratch else None)

    shim = types.SimpleNamespace(**{n: getattr(lib, n) for n in dir(lib) if not n.startswith("__")})
    shim.TritonKernel = kernel
    jtl.triton_kernel_call_lib = shim
    jtl._metadata_launch = True


@triton.jit
def _causal_forward(Q, K, V, O, LSE, B: tl.constexpr, T: tl.constexpr, N: tl.constexpr, H: tl.constexpr,
                    BM: tl.constexpr, BN: tl.constexpr, QK_SCALE: tl.constexpr, WS: tl.constexpr):
    m0 = (tl.num_programs(0) - 1 - tl.program_id(0)) * BM
    bn = tl.program_id(1)
    b = bn // N
    n = bn % N
    rows = tl.make_tensor_descriptor(Q, shape=[B * T, N * H], strides=[N * H, 1], block_shape=[BM, H])
    k_desc = tl.make_tensor_descriptor(K, shape=[B * T, N * H], strides=[N * H, 1], block_shape=[BN, H])
    v_desc = tl.make_tensor_descriptor(V, shape=[B * T, N * H], strides=[N * H, 1], block_shape=[BN, H])
    q = rows.load([b * T + m0, n * H])
    acc = tl.zeros([BM, H], tl.float32)
    m_i = tl.full([BM], float("-inf"), tl.float32)
    l_i = tl.zeros([BM], tl.float32)
    t = m0 + tl.arange(0, BM)
    for start in tl.range(0, m0 + BM, BN, warp_specialize=WS):
        s = start + tl.arange(0, BN)
        z = tl.where(s[None, :] <= t[:, None], tl.dot(q, k_desc.load([b * T + start, n * H]).T) * QK_SCALE, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(z, 1))
        p = tl.math.exp2(z - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = v_desc.load([b * T + start, n * H])
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
        m_i = m_new
    out = tl.make_tensor_descriptor(O, shape=[B * T, N * H], strides=[N * H, 1], block_shape=[BM, H])
    out.store([b * T + m0, n * H], (acc / l_i[:, None]).to(O.dtype.element_ty))
    tl.store(LSE + bn * T + t, (m_i + tl.math.log2(l_i)) * 0.6931471805599453)


def causal_forward(q, k, v, *, warp_specialize, block_m, block_n, warps, stages):
    import jax_triton

    B, T, N, H = q.shape
    return jax_triton.triton_call(
        q, k, v, kernel=_causal_forward,
        out_shape=(jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((B * N, T), jnp.float32)),
        grid=(T // block_m, B * N), num_warps=warps, num_stages=stages,
        B=B, T=T, N=N, H=H, BM=block_m, BN=block_n, QK_SCALE=math.log2(math.e) / math.sqrt(H), WS=warp_specialize,
    )[0]


# (warp_specialize, block_m, block_n, num_warps, num_stages)
VARIANTS = [(True, 128, 128, 4, 2), (True, 128, 64, 4, 2), (True, 128, 128, 4, 3), (False, 128, 128, 8, 2), (True, 128, 64, 4, 3)]


def main() -> None:
    from forgeax import ops

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="4,4096,32,32,128", help="B,T,N,K,H with K == N (no GQA here)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=10)
    parser.add_argument("--out", default="-")
    args = parser.parse_args()
    patch_jax_triton()
    q, k, v, _ = random_inputs(args.shape)
    B, T, N, H = q.shape
    if k.shape[2] != N:
        parser.error("--shape: this kernel needs K == N")
    candidates = {
        "cudnn": lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn"),
        "triton": lambda q, k, v: ops.attention(q, k, v, causal=True, backend="triton"),
        "pallas_gpu": lambda q, k, v: ops.attention(q, k, v, causal=True, backend="pallas_gpu"),
    }
    for ws, bm, bn, warps, stages in VARIANTS:
        candidates[f"ws{ws}_{bm}x{bn}_w{warps}_s{stages}"] = lambda q, k, v, c=(ws, bm, bn, warps, stages): causal_forward(
            q, k, v, warp_specialize=c[0], block_m=c[1], block_n=c[2], warps=c[3], stages=c[4])
    reference = jax.jit(candidates["cudnn"])(q, k, v)
    report = {"device": jax.devices()[0].device_kind, "shape": [B, T, N, H], "results": {}, "errors": {}}
    timed = {}
    for name, fn in candidates.items():
        fn = jax.jit(fn)
        try:
            out = jax.block_until_ready(fn(q, k, v))
        except Exception as e:  # a variant that cannot run is reported, the others go on
            report["errors"][name] = f"{type(e).__name__}: {str(e)[:800]}"
            continue
        report["results"][name] = {"rel_err_vs_cudnn": rel_err(out, reference)}
        timed[name] = fn
    seconds = interleaved({name: (fn, (q, k, v)) for name, fn in timed.items()},
                          calls=args.calls, rounds=args.rounds, warmup=1)
    rounds = {name: [t * 1e3 for t in ts] for name, ts in seconds.items()}
    flops = 4 * B * T * T * N * H / 2
    for name, ms in rounds.items():
        median = statistics.median(ms)
        report["results"][name].update(median_ms=median, tflop_per_s=flops / median / 1e9, rounds_ms=ms)
    for name in rounds:
        report["results"][name]["vs_cudnn"] = report["results"]["cudnn"]["median_ms"] / report["results"][name]["median_ms"]
    text = json.dumps(report, indent=1)
    print(text) if args.out == "-" else open(args.out, "w").write(text)


if __name__ == "__main__":
    main()
