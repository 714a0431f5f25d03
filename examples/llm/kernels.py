"""`auto` backends by measurement, and the kernel report.

For each op the model calls, `op_case` builds its arguments at the model's real shapes and a
forward+backward. `choose` runs forgeax's autotuner (`forgeax.core.autotuning.tune_calls`) on
that call over the backends that run natively here (no interpreters), `max_configs` configs
each (1: each backend's default config, a backend choice), and keeps the fastest fwd+bwd. The
results are a `forgeax.Tuning` cached on disk (keyed by device kind, op and call signature), so
the next run with the same model skips the measurement; `resolve` returns it too, and the model
runs inside it, so a tuned config applies as well. On a CPU only the XLA backends run. `report`
compares each chosen backend with the XLA reference: time, speedup and compiled temporary
memory of the op, and of the whole train step.
"""

from __future__ import annotations

import os
import statistics
from pathlib import Path
from typing import Callable

import jax
import jax.numpy as jnp

import forgeax
from forgeax import ops
from forgeax.core import current_device_kind, current_platform
from forgeax.core.autotuning import find_calls, tune_calls
from forgeax.core.timing import interleaved

from .config import OPS, ModelConfig


def _rand(key, shape, dtype, scale=1.0):
    return (jax.random.normal(key, shape, jnp.float32) * scale).astype(dtype)


def op_case(name: str, cfg: ModelConfig, batch: int) -> tuple[Callable[[str | None], Callable], tuple]:
    """(make, args): make(backend) is a scalar function of args calling op `name` once (the OPS
    key) at the model's shapes; differentiate it for fwd+bwd."""
    dt = jnp.dtype(cfg.dtype)
    B, T, D, H = batch, cfg.seq_len, cfg.d_model, cfg.head_dim
    k = iter(jax.random.split(jax.random.PRNGKey(7), 4))
    f32 = lambda y: jnp.sum(y.astype(jnp.float32))  # noqa: E731
    if name == "norm":
        args = (_rand(next(k), (B, T, D), dt), _rand(next(k), (D,), dt))
        return (lambda b: lambda x, s: f32(ops.rms_norm(x, s, eps=cfg.norm_eps, backend=b))), args
    if name == "residual_norm":
        args = (_rand(next(k), (B, T, D), dt), _rand(next(k), (B, T, D), dt), _rand(next(k), (D,), dt))
        return (lambda b: lambda x, r, s: sum(map(f32, ops.add_rms_norm(x, r, s, eps=cfg.norm_eps, backend=b)))), args
    if name == "rope":
        args = (_rand(next(k), (B, T, cfg.n_heads, H), dt), _rand(next(k), (B, T, cfg.n_kv_heads, H), dt))
        pos = jnp.arange(T, dtype=jnp.int32)
        return (lambda b: lambda q, kk: sum(map(f32, ops.rope_qk(q, kk, pos, theta=cfg.rope_theta, backend=b)))), args
    if name == "attention":
        args = (_rand(next(k), (B, T, cfg.n_heads, H), dt), _rand(next(k), (B, T, cfg.n_kv_heads, H), dt),
                _rand(next(k), (B, T, cfg.n_kv_heads, H), dt))
        return (lambda b: lambda q, kk, v: f32(ops.attention(q, kk, v, causal=True, backend=b))), args
    if name == "mlp":
        s = D ** -0.5
        args = (_rand(next(k), (B * T, D), dt), _rand(next(k), (D, cfg.d_ff), dt, s), _rand(next(k), (D, cfg.d_ff), dt, s),
                _rand(next(k), (cfg.d_ff, D), dt, cfg.d_ff ** -0.5))
        return (lambda b: lambda x, g, u, d: f32(ops.gated_mlp(x, g, u, d, activation="silu", backend=b))), args
    if name == "loss":
        targets = jax.random.randint(next(k), (B * T,), 0, cfg.vocab)
        args = (_rand(next(k), (B * T, D), dt), _rand(next(k), (D, cfg.vocab), dt, D ** -0.5))
        return (lambda b: lambda x, w: ops.linear_cross_entropy(x, w, targets, backend=b)), args
    raise ValueError(f"op: unknown {name!r}; expected one of {list(OPS)}")


def fwd_bwd(make, args, backend: str | None):
    f = make(backend)
    return jax.jit(jax.value_and_grad(f, argnums=tuple(range(len(args)))))


def compile_case(fn, args):
    """(compiled, temporary bytes) of jitted `fn` at `args`, run once (warm-up)."""
    compiled = fn.lower(*args).compile()
    mem = compiled.memory_analysis()
    temp = getattr(mem, "temp_size_in_bytes", None) if mem is not None else None
    jax.block_until_ready(compiled(*args))
    return compiled, temp


def time_rounds(compiled: dict, args, rounds: int = 5) -> dict:
    """Seconds per call of each compiled function: the median over `rounds` interleaved rounds
    (forgeax's timing method, core/timing.py: the order rotates and reverses between rounds)."""
    times = interleaved({name: (c, args) for name, c in compiled.items()}, calls=1, rounds=rounds, warmup=0)
    return {name: statistics.median(t) for name, t in times.items()}


def native_backends(name: str) -> list[str]:
    """Backends of the op that run natively here (xla first)."""
    op = ops.OPS[OPS[name]]
    platform = current_platform()
    out = []
    for b in op.backends:
        impl = op.implementation(b)
        if not isinstance(impl, str) and platform in impl.platforms:
            out.append(b)
    return sorted(out, key=lambda b: b != "xla")


def cache_path() -> Path:
    root = os.environ.get("FORGEAX_LLM_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "forgeax")
    return Path(root) / "llm_auto_tuning.json"


def load_cache(cache: Path) -> forgeax.Tuning:
    """The cached tuning (empty when missing; a cache of another forgeax version loads empty)."""
    return forgeax.Tuning.loads(cache.read_text(), source=str(cache)) if cache.exists() else forgeax.Tuning()


def choose(name: str, cfg: ModelConfig, batch: int, *, cache: Path | None = None, max_configs: int = 1,
           log=print) -> tuple[str, forgeax.Tuning]:
    """The fastest native backend for op `name` at the model's shapes, fwd+bwd, and the tuning
    entries of that call (measured now, or read from `cache`)."""
    cache = cache or cache_path()
    make, args = op_case(name, cfg, batch)
    (call,) = [c for c in find_calls(fwd_bwd(make, args, None), *args) if c.op == OPS[name]]
    device = current_device_kind()

    def measured(tuning: forgeax.Tuning) -> list:  # the call's fwd+bwd timings in `tuning`
        return [e for e in tuning.lookup(device, call.op, call.key) if e.timed == "fwd+bwd" and e.seconds is not None]

    stored = load_cache(cache)
    timed = measured(stored)
    if not timed:
        tuning = tune_calls([call], backends=native_backends(name), max_configs=max_configs, progress=False)
        for failure in (r for r in tuning.report if "error" in r):
            log(f"  auto {name}: {failure.get('backend', '')} skipped ({str(failure['error']).splitlines()[0][:120]})")
        stored = stored | tuning
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_suffix(".tmp")
        tmp.write_text(stored.dumps())
        tmp.replace(cache)
        timed = measured(stored)
        if not timed:
            raise RuntimeError(f"auto {name}: no backend ran {call.op} at the model's shapes: {tuning.report}")
        if len(timed) > 1:
            log(f"  auto {name}: " + ", ".join(f"{e.backend} {e.seconds * 1e3:.2f} ms" for e in sorted(timed, key=lambda e: e.seconds)))
    best = min(timed, key=lambda e: e.seconds)
    return best.backend, forgeax.Tuning([best])


def resolve(settings: dict[str, str], cfg: ModelConfig, batch: int, *, cache: Path | None = None, max_configs: int = 1,
            log=print) -> tuple[dict[str, str | None], forgeax.Tuning]:
    """(OPS key -> backend for the model, the tuning to run it in): "auto" measured (and
    cached), "default" forgeax's own selection (None), any other name passed on."""
    out, tuning = {}, forgeax.Tuning()
    for name, setting in settings.items():
        if setting == "auto":
            out[name], chosen = choose(name, cfg, batch, cache=cache, max_configs=max_configs, log=log)
            tuning = tuning | chosen
        elif setting in (None, "default"):
            out[name] = None  # forgeax's own selection (rules + priority)
        else:
            out[name] = setting
    return out, tuning


def report(loss_fn, params, batch_arrays, backends: dict[str, str | None], cfg: ModelConfig, batch: int) -> list[dict]:
    """Per op: the backend that ran (forgeax.explain on the step's gradient), its fwd+bwd time and
    temp bytes against backend="xla" at the model's shapes; then the whole step's temp bytes."""
    grad = jax.grad(loss_fn)
    explanation = ops.explain(lambda p: grad(p, *batch_arrays, cfg, backends), params)
    ran: dict[str, set] = {}
    for d in explanation.decisions:
        ran.setdefault(d.op, set()).add(d.backend)
    rows = []
    for name, op_name in OPS.items():
        if backends[name] == "plain":  # plain JAX code, not a forgeax op: nothing to compare
            rows.append({"op": name, "forgeax_op": op_name, "backend": "plain", "calls": 0, "seconds": None,
                         "xla_seconds": None, "speedup": None, "temp_bytes": None, "xla_temp_bytes": None})
            continue
        make, args = op_case(name, cfg, batch)
        chosen = sorted(ran.get(op_name, {backends[name] or "xla"}))
        c_x, m_x = compile_case(fwd_bwd(make, args, "xla"), args)
        if chosen == ["xla"]:
            t_x = time_rounds({"xla": c_x}, args)["xla"]
            t_c, m_c = t_x, m_x
        else:
            c_c, m_c = compile_case(fwd_bwd(make, args, chosen[0]), args)
            t = time_rounds({"xla": c_x, "chosen": c_c}, args)
            t_x, t_c = t["xla"], t["chosen"]
        rows.append({"op": name, "forgeax_op": op_name, "backend": "+".join(chosen), "calls": sum(
            1 for d in explanation.decisions if d.op == op_name), "seconds": t_c, "xla_seconds": t_x,
            "speedup": t_x / t_c if t_c else None, "temp_bytes": m_c, "xla_temp_bytes": m_x})
    step = jax.jit(jax.value_and_grad(loss_fn), static_argnums=(3, 4))
    xla_all = {k: "xla" for k in backends}

    def temp(b):
        mem = step.lower(params, *batch_arrays, cfg, _Frozen(b)).compile().memory_analysis()
        return getattr(mem, "temp_size_in_bytes", None) if mem is not None else None

    m_step, m_step_x = temp(backends), temp(xla_all)
    rows.append({"op": "train step", "forgeax_op": "", "backend": "as chosen", "calls": len(explanation.decisions),
                 "seconds": None, "xla_seconds": None, "speedup": None, "temp_bytes": m_step, "xla_temp_bytes": m_step_x})
    return rows


class _Frozen(dict):
    """A hashable dict (a static jit argument)."""

    def __hash__(self):
        return hash(tuple(sorted(self.items())))


def frozen(d: dict) -> _Frozen:
    return _Frozen(d)


def print_report(rows: list[dict], console=None) -> None:
    from rich.console import Console  # noqa: PLC0415
    from rich.table import Table  # noqa: PLC0415

    console = console or Console()
    t = Table(title=f"forgeax kernel report ({current_device_kind()}, fwd+bwd at the model's shapes)")
    for col in ("op", "backend", "calls", "ms", "xla ms", "speedup", "temp MiB", "xla MiB", "saved MiB"):
        t.add_column(col, justify="left" if col in ("op", "backend") else "right", no_wrap=col in ("op", "backend"))
    ms = lambda s: "" if s is None else f"{s * 1e3:.2f}"  # noqa: E731
    mb = lambda b: "" if b is None else f"{b / 2**20:.1f}"  # noqa: E731
    for r in rows:
        saved = "" if None in (r["temp_bytes"], r["xla_temp_bytes"]) else mb(r["xla_temp_bytes"] - r["temp_bytes"])
        t.add_row(r["op"], r["backend"], str(r["calls"]), ms(r["seconds"]), ms(r["xla_seconds"]),
                  "" if r["speedup"] is None else f"{r['speedup']:.2f}x", mb(r["temp_bytes"]), mb(r["xla_temp_bytes"]), saved)
    console.width = max(console.width, 112)  # a pipe defaults to 80 columns
    console.print(t)
