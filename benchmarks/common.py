"""What the benchmark tools share: inputs, jitted steps, timing, kernel times, result names.

Timing method (docs/performance.md): compile and warm up outside the measurement; then rounds of
`calls` back-to-back calls closed by `block_until_ready`, the candidates interleaved round by
round with the order reversed every other round; the per-call median over rounds is the result,
and a ratio is taken against an anchor timed in the same rounds.
"""

from __future__ import annotations

import collections
import datetime
import json
import os
import statistics
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp

from forgeax.core.timing import (  # noqa: E402,F401 - the shared timing method, re-exported for the scripts
    alternating,
    copy_bandwidth,
    interleaved,
    paired_ratios,
    temp_bytes,
    time_call,
)

RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


# --- Timing -----------------------------------------------------------------------------------

def kernel_times(fn, args, iterations: int) -> dict[str, float]:
    """Median GPU ms per kernel name of `fn(*args)` over `iterations` calls (CUPTI, through Mosaic
    GPU's profiler; kernels launched more than once per call are summed per call). Kernel times
    exclude launch gaps and host dispatch."""
    from jax.experimental.mosaic.gpu import profiler  # noqa: PLC0415 - GPU-only dependency

    _, runs = profiler.measure(fn, aggregate=False, iterations=iterations)(*args)
    per_name = collections.defaultdict(list)
    for run in runs:
        totals = collections.Counter()
        for name, ms in run:
            totals[name] += ms
        for name, ms in totals.items():
            per_name[name].append(ms)
    return {name: statistics.median(ms) for name, ms in per_name.items()}


# --- Inputs and steps -------------------------------------------------------------------------

def rel_err(a, b) -> float:
    """||a - b|| / ||b|| in f32."""
    a, b = jnp.asarray(a).astype(jnp.float32), jnp.asarray(b).astype(jnp.float32)
    return float(jnp.linalg.norm(a - b) / jnp.maximum(jnp.linalg.norm(b), 1e-30))


def parse_shape(shape: str) -> tuple[int, ...]:
    """'4,4096,32,32,128' -> (4, 4096, 32, 32, 128)."""
    return tuple(int(d) for d in shape.split(","))


def attention_inputs(shape: str, value_head_dim: int | None = None, dtype=jnp.bfloat16,
                     seed: int = 0) -> tuple[jax.Array, ...]:
    """q, k, v and an output cotangent do, standard normal, for shape 'B,T,N,K,H' (S = T; v's head
    dim `value_head_dim`, default H)."""
    B, T, N, K, H = parse_shape(shape)
    Hv = value_head_dim or H
    keys = jax.random.split(jax.random.key(seed), 4)
    return tuple(jax.random.normal(key, dims, jnp.float32).astype(dtype)
                 for key, dims in zip(keys, ((B, T, N, H), (B, T, K, H), (B, T, K, Hv), (B, T, N, Hv))))


def fwd_bwd(fn):
    """fn(*xs) -> step(*xs, dout) returning (out, *d xs): a forward and its backward for the cotangent dout."""
    def step(*args):
        *xs, dout = args
        out, pull = jax.vjp(fn, *xs)
        return (out,) + tuple(pull(dout))

    return step


def jitted_steps(fn):
    """(jit(fn), jit(fwd_bwd(fn))) of an attention fn(q, k, v); the second takes (q, k, v, do)
    and returns (out, dq, dk, dv)."""
    return jax.jit(fn), jax.jit(fwd_bwd(fn))


def attention_calls(backends: Sequence[str], *, causal: bool, window=None, logit_soft_cap=None,
                    segment_ids=None, equal_head_dims: bool = True) -> dict[str, Callable]:
    """name -> fn(q, k, v): the cuDNN anchor (jax.nn.dot_product_attention; left out with a soft
    cap, segment ids or v's head dim differing from q's, which it lacks), then each forgeax backend
    by name ('default': backend=None)."""
    from forgeax import ops  # noqa: PLC0415 - the tools import forgeax from the installed wheel

    calls = {}
    if logit_soft_cap is None and segment_ids is None and equal_head_dims:
        calls["cudnn"] = lambda q, k, v: jax.nn.dot_product_attention(
            q, k, v, is_causal=causal, local_window_size=window, implementation="cudnn")
    for backend in backends:
        calls[backend] = lambda q, k, v, backend=None if backend == "default" else backend: ops.attention(
            q, k, v, causal=causal, window=window, logit_soft_cap=logit_soft_cap, segment_ids=segment_ids,
            backend=backend)
    return calls


# --- Results ----------------------------------------------------------------------------------

def device_tag(kind: str | None = None) -> str:
    """'NVIDIA H100 80GB HBM3' -> 'H100': the device part of a result file's name."""
    kind = kind or jax.devices()[0].device_kind
    words = [w for w in kind.replace("NVIDIA", "").split() if w]
    return words[0] if words else kind.replace(" ", "_")


def result_name(op: str, what: str, device: str | None = None, date: str | None = None) -> str:
    """'<op>_<device>_<date>_<what>.json', the naming of benchmarks/results/ (INDEX.md)."""
    date = date or datetime.datetime.now(datetime.timezone.utc).date().isoformat()
    return f"{op}_{device or device_tag()}_{date}_{what}.json"


def write_json(path: str, report: dict[str, Any]) -> None:
    """Writes `report` to `path` ('-': nowhere), creating its directory."""
    if path == "-":
        return
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(report, f, indent=1)
    print(f"wrote {path}", flush=True)
