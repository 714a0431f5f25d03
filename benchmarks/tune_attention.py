"""Times variants of an attention backend's kernel config (or module constants) against cuDNN, interleaved in one process.

    python -m benchmarks.tune_attention --backend pallas_gpu \
        --variant default --variant dz_tiles=0 --variant overlap=0,flat_forward=0 --out tune.json
    python -m benchmarks.tune_attention --backend pallas_gpu --variant candidates
    python -m benchmarks.tune_attention --backend triton --variant default --variant source=old.py

For a backend with a kernel config (pallas_gpu: `AttentionConfig`) a variant names fields that
change the call's heuristic config ('candidates': every config of `candidate_configs`), passed as
`ops.attention(..., config=...)`. For the others a variant sets module-level constants of
forgeax.kernels.<backend path>.attention before tracing (kernels read them at trace time).
Each variant builds fwd and fwd+bwd at the benchmark shape
(B4 T=S=4096 N32 H128 bf16 causal unless --shape says otherwise) and is timed in interleaved
rounds with cuDNN (tools/bench.py's method); the output and the gradients are checked against
cuDNN's (a variant off by more than 2e-2 relative is reported and dropped). With
--logit-soft-cap, --documents (packed sequences) or --value-head-dim, which cuDNN lacks, the first variant takes
cuDNN's place as anchor and check.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import importlib.util
import json
import math
import statistics
import sys

import jax
import jax.numpy as jnp

from benchmarks.common import alternating, attention_calls, interleaved, jitted_steps, kernel_times, rel_err
from benchmarks.common import attention_inputs as random_inputs
from forgeax import core, ops
from forgeax.kernels.common.attention import AttentionSpec

MODULES = {"pallas_gpu": "forgeax.kernels.pallas.gpu.attention", "triton": "forgeax.kernels.triton.attention"}


def _parse(variant: str, module) -> dict[str, object]:
    """'NAME=1,OTHER=240:24,ONE=256:,NONE=()' -> {NAME: 1, OTHER: (240, 24), ONE: (256,), NONE: ()}; 'source=PATH':
    every function of the backend module replaced by its namesake in the Python file PATH (an
    earlier revision of the module, say `git show REV:kernels/triton/attention.py > old.py`;
    its functions keep reading PATH's globals, so the variant is that revision's kernels)."""
    if variant == "default":
        return {}
    if variant.startswith("source="):
        spec = importlib.util.spec_from_file_location(f"{module.__name__}_variant", variant[len("source="):])
        other = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = other  # dataclasses look their module up there
        spec.loader.exec_module(other)
        return {name: value for name, value in vars(other).items()
                if callable(value) and not isinstance(value, type) and name in vars(module)}
    value = lambda v: () if v == "()" else tuple(int(x) for x in v.split(":") if x) if ":" in v else int(v)
    return {name: value(v) for name, v in (item.split("=") for item in variant.split(","))}


def _configs(variants: list[str], impl, call: tuple, spec) -> dict[str, object]:
    """variant name -> kernel config: 'default' the call's heuristic config, 'candidates' every
    config of `candidate_configs` (named by the fields that differ), 'a=1,b=0' the heuristic
    config with those fields (ints; 0/1 for switches)."""
    base = impl.heuristic_config(*call, spec=spec)
    configs = {}
    for variant in variants:
        if variant == "candidates":
            for config in impl.candidate_configs(*call, spec=spec):
                changed = {k: v for k, v in config.to_dict().items() if v != base.to_dict()[k]}
                configs[",".join(f"{k}={int(v)}" for k, v in changed.items()) or "default"] = config
        elif variant == "default":
            configs[variant] = base
        else:
            fields = {f.name: f for f in dataclasses.fields(base)}
            changes = {}
            for name, text in (item.split("=") for item in variant.split(",")):
                if name not in fields:
                    raise SystemExit(f"--variant {variant}: {type(base).__name__} has no field {name!r}")
                changes[name] = bool(int(text)) if isinstance(getattr(base, name), bool) else int(text)
            configs[variant] = base.replace(**changes)
    return configs


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--backend", default="pallas_gpu", choices=sorted(MODULES))
    parser.add_argument("--variant", action="append", default=None)
    parser.add_argument("--shape", default="4,4096,32,32,128", help="B,T,N,K,H")
    parser.add_argument("--causal", type=int, default=1)
    parser.add_argument("--window", type=int, default=None, help="left window size (with causal)")
    parser.add_argument("--logit-soft-cap", type=float, default=None,
                        help="soft cap (cuDNN has none: the first variant is the anchor)")
    parser.add_argument("--documents", type=int, default=None, metavar="L",
                        help="pack documents of L tokens into each row (segment ids; cuDNN has none: "
                             "the first variant is the anchor)")
    parser.add_argument("--value-head-dim", type=int, default=None, metavar="HV",
                        help="v's head dim, if not H (MLA; cuDNN has none: the first variant is the anchor)")
    parser.add_argument("--calls", type=int, default=10)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--out", default="-")
    parser.add_argument("--kernel-times", type=int, default=0, metavar="ITERATIONS",
                        help="also CUPTI kernel times of every fwd+bwd, in 3 rounds of this many calls "
                             "(alternating order), medians per kernel")
    parser.add_argument("--no-check", action="store_true",
                        help="time variants even when their results are wrong (bottleneck diagnostics)")
    args = parser.parse_args()
    module = importlib.import_module(MODULES[args.backend])
    B, T, N, K, H = (int(d) for d in args.shape.split(","))
    Hv = args.value_head_dim or H
    q, k, v, do = random_inputs(args.shape, Hv)
    causal = bool(args.causal)
    window = None if args.window is None else (args.window, 0)
    # Visible (query, key) pairs: causal T(T+1)/2, less those beyond a window of w keys to the left.
    pairs = T * (T + 1) / 2 if causal else T * T
    if window is not None:
        far = max(T - args.window - 1, 0)
        pairs -= far * (far + 1) / 2
    segment_ids = None
    if args.documents is not None:  # (window and documents together: not counted here)
        L = args.documents
        ids = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32) // L, (B, T))
        segment_ids = (ids, ids)
        docs = [min(L, T - s) for s in range(0, T, L)]
        pairs = sum(n * (n + 1) / 2 if causal else n * n for n in docs)
    flops = 2.0 * B * N * (H + Hv) * pairs

    cap = args.logit_soft_cap
    candidates = {name: jitted_steps(fn) for name, fn in
                  attention_calls([], causal=causal, window=window, logit_soft_cap=cap, segment_ids=segment_ids,
                                  equal_head_dims=Hv == H).items()}
    impl = core.OPS["attention"].implementation(args.backend)
    configs = {}
    if getattr(impl, "config_type", None) is not None:
        spec = AttentionSpec(causal=causal, scale=1.0 / math.sqrt(H), window_left=None if window is None else window[0],
                             window_right=0 if causal else None, logit_soft_cap=cap)
        seg = segment_ids or (None, None)
        configs = _configs(args.variant or ["default"], impl, (q, k, v, None, None, *seg, None), spec)
    defaults = {}
    for variant in configs or args.variant or ["default"]:
        if not configs:
            settings = _parse(variant, module)
            for name in settings:
                defaults.setdefault(name, getattr(module, name))
            for name, value in {**defaults, **settings}.items():
                if dataclasses.is_dataclass(defaults[name]) and isinstance(value, tuple):
                    value = type(defaults[name])(*value)  # a config dataclass from its fields in order
                setattr(module, name, value)
        fns = jitted_steps(lambda q, k, v, config=configs.get(variant): ops.attention(
            q, k, v, causal=causal, window=window, logit_soft_cap=cap, segment_ids=segment_ids, backend=args.backend,
            config=config))
        # Trace + compile now, while the constants hold this variant's values.
        try:
            jax.block_until_ready(fns[0](q, k, v))
            got = fns[1](q, k, v, do)
            anchor = next(iter(candidates), variant)
            ref = candidates[anchor][1](q, k, v, do) if candidates else got
            errs = [rel_err(a, b) for a, b in zip(got, ref)]
            print(f"{variant}: compiled, rel err vs {anchor} out/dq/dk/dv " + " ".join(f"{e:.2e}" for e in errs),
                  flush=True)
            if max(errs) > 2e-2 and not args.no_check:
                raise ValueError(f"wrong results: rel err {max(errs):.2e}")
            candidates[variant] = fns
        except Exception as e:  # noqa: BLE001 - a variant that does not compile is reported and dropped
            print(f"{variant}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
    timed = {}
    for name, (fwd, fwd_bwd) in candidates.items():
        timed[(name, "fwd")] = (fwd, (q, k, v))
        timed[(name, "fwd+bwd")] = (fwd_bwd, (q, k, v, do))
    rounds = interleaved(timed, calls=args.calls, rounds=args.reps, warmup=1)
    results = []
    anchor = next(iter(candidates))  # cuDNN, or with a soft cap the first variant that compiled
    for (name, mode), times in rounds.items():
        ms = statistics.median(times) * 1e3
        base = statistics.median(rounds[(anchor, mode)]) * 1e3
        tflops = flops * (1 if mode == "fwd" else 3.5) / (ms * 1e-3) / 1e12
        results.append(dict(variant=name, mode=mode, median_ms=ms, tflop_per_s=tflops, anchor=anchor,
                            vs_anchor=base / ms))
        print(f"{name:40s} {mode:8s} {ms:8.3f} ms {tflops:6.0f} TFLOP/s {base / ms:5.2f}x {anchor}", flush=True)
    kernels = _kernel_times(candidates, (q, k, v, do), args.kernel_times) if args.kernel_times else {}
    if args.out != "-":
        with open(args.out, "w") as f:
            json.dump(dict(device=jax.devices()[0].device_kind, backend=args.backend, shape=args.shape, causal=causal,
                           window=window, logit_soft_cap=cap, documents=args.documents, value_head_dim=Hv,
                           results=results, fwd_bwd_kernel_ms=kernels), f,
                          indent=1)


def _kernel_times(candidates, args, iterations: int) -> dict[str, dict[str, float]]:
    """Per candidate, median CUPTI ms of each kernel of its fwd+bwd over 3 rounds (the order
    reversed in the middle one); kernel times do not include launch gaps or host dispatch."""
    per_round = {name: [] for name in candidates}
    for name in alternating(list(candidates), 3):
        per_round[name].append(kernel_times(candidates[name][1], args, iterations))
    out = {}
    for name, rounds in per_round.items():
        out[name] = {kernel: statistics.median(r[kernel] for r in rounds) for kernel in rounds[0]}
        total = sum(out[name].values())
        print(f"{name:40s} fwd+bwd kernels {total:8.3f} ms: "
              + ", ".join(f"{kernel[:24]} {ms:.3f}" for kernel, ms in sorted(out[name].items(), key=lambda kv: -kv[1])),
              flush=True)
    return out


if __name__ == "__main__":
    main()
