"""`autotune(fn, *args)`: measure every backend and config for each forgeax op call in `fn`.

`fn` is traced abstractly (with `grad=True`, its vector-Jacobian product) while `Op.__call__`
records each call: op, argument shapes and dtypes, options, and whether it was differentiated
(`tuning.watch_gradient`).
For each distinct call, every backend that accepts it on this platform is timed with each of its
`candidate_configs` (plus the config it would use today: tuned data or heuristic) on random
inputs of the recorded shapes: forward, or forward and backward for a differentiated call.
Candidates are compiled in a thread pool and timed one after another with `core/timing.py`
(rounds interleaved); one that fails, or whose compile or first call runs past `timeout_s`, is
recorded in the report and skipped. The result is a `Tuning` with, per call and mode, each
backend's fastest config, fastest first.

Integer and boolean arguments take the value of an argument of `fn` with the same shape and dtype
when there is one (ragged_dot's group sizes, cross-entropy's targets passed to `fn`), else zeros
(valid indices, targets and segment ids); `inputs=` overrides both.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import contextvars
import dataclasses
import functools
import statistics
import threading
import time
import warnings
from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from forgeax.core import dispatch, runtime, timing, tuning
from forgeax.core.tuning import Call, Tuning, TuningEntry


def find_calls(fn: Callable[..., Any], *args: Any, grad: bool = False, **kwargs: Any) -> tuple[Call, ...]:
    """The distinct forgeax op calls in `fn(*args, **kwargs)` (and in its VJP when `grad`); a call
    seen both plain and differentiated is kept once of each (timed "fwd" and "fwd+bwd")."""
    calls: list[Call] = []
    token = dispatch._CALLS.set(calls)
    try:
        jax.clear_caches()  # functions jitted before are traced again, so their calls are seen
        if grad:
            jax.eval_shape(lambda *a: jax.vjp(lambda *p: fn(*p, **kwargs), *a)[0], *args)
        else:
            jax.eval_shape(functools.partial(fn, **kwargs), *args)
    finally:
        dispatch._CALLS.reset(token)
    unique: dict[tuple, Call] = {}
    for call in calls:
        call = dataclasses.replace(call, differentiated=call.differentiated or grad)
        unique.setdefault((call.op, call.key, call.backend, call.differentiated), call)
    return tuple(unique.values())


def random_inputs(call: Call, given: Sequence[Any] = (), seed: int = 0) -> tuple[jax.Array, ...]:
    """Arrays for the array arguments of `call`: normal floats; integers and booleans from the
    first of `given` with their shape and dtype, else zeros."""
    arrays = []
    for i, a in enumerate(x for x in call.args if isinstance(x, jax.ShapeDtypeStruct)):
        if jnp.issubdtype(a.dtype, jnp.inexact):
            arrays.append(jax.random.normal(jax.random.key(seed + i), a.shape, jnp.float32).astype(a.dtype))
        else:
            same = (g for g in given if tuple(g.shape) == tuple(a.shape) and g.dtype == a.dtype)
            arrays.append(jnp.asarray(next(same, jnp.zeros(a.shape, a.dtype))))
    return tuple(arrays)


def _build(op: dispatch.Op, call: Call, backend: str, config: Any) -> Callable[..., Any]:
    """The timed function of the call's arrays: the op, or, when the call was differentiated, its
    value and the gradient for the floating arguments of `sum(output * cotangent)` over the
    floating outputs, with the cotangents passed after the arrays (`cotangents`). A constant
    cotangent (the gradient of a plain sum) would let XLA fold it away and time the XLA backend
    without the read of the output gradient every backward pays in a model."""
    positions = [i for i, a in enumerate(call.args) if isinstance(a, jax.ShapeDtypeStruct)]

    def run(*arrays):
        full = list(call.args)
        for i, a in zip(positions, arrays):
            full[i] = a
        return op(*full, backend=backend, config=config, **call.kwargs)

    if not call.differentiated:
        return run
    wrt = [j for j, i in enumerate(positions) if jnp.issubdtype(call.args[i].dtype, jnp.inexact)]

    def fwd_bwd(*arrays_and_cotangents):
        arrays, cts = arrays_and_cotangents[:len(positions)], arrays_and_cotangents[len(positions):]

        def loss(*floats):
            full = list(arrays)
            for j, f in zip(wrt, floats):
                full[j] = f
            outs = [x for x in jax.tree.leaves(run(*full)) if jnp.issubdtype(x.dtype, jnp.inexact)]
            return sum(jnp.sum(x.astype(jnp.float32) * c.astype(jnp.float32)) for x, c in zip(outs, cts))

        return jax.value_and_grad(loss, argnums=tuple(range(len(wrt))))(*[arrays[j] for j in wrt])

    return fwd_bwd


def cotangents(op: dispatch.Op, call: Call, args: Sequence[jax.Array], seed: int = 1000) -> tuple[jax.Array, ...]:
    """Random output gradients for a differentiated call's timed function (`_build`), one per
    floating output; () for a call that is not differentiated."""
    if not call.differentiated:
        return ()
    outs = jax.eval_shape(_build(op, dataclasses.replace(call, differentiated=False), "xla", None), *args)
    floats = [o for o in jax.tree.leaves(outs) if jnp.issubdtype(o.dtype, jnp.inexact)]
    return tuple(jax.random.normal(jax.random.key(seed + i), o.shape, jnp.float32).astype(o.dtype) for i, o in enumerate(floats))


def candidates(op: dispatch.Op, call: Call, backends: Sequence[str] | None = None, max_configs: int | None = None
               ) -> tuple[list[tuple[str, Any]], list[dict[str, Any]]]:
    """([(backend, config)], [refusals]) for one call: the config the call would use today first,
    then the backend's `candidate_configs` (at most `max_configs` per backend)."""
    platform, device_kind = runtime.current_platform(), runtime.current_device_kind()
    names = [call.backend] if call.backend else [b for b in op.backends if backends is None or b in backends]
    found, refused = [], []
    for name in names:
        impl = op.implementation(name)
        reason = impl if isinstance(impl, str) else impl.why_not(platform, call.args, call.kwargs)
        if reason is not None:
            refused.append({"op": call.op, "key": call.key, "backend": name, "refused": reason})
            continue
        if impl.config_type is None:
            found.append((name, None))
            continue
        configs = [impl.resolve_config(call.args, call.kwargs, None, device_kind)[0]]
        if impl.candidate_configs is not None:
            configs += [c for c in impl.candidate_configs(*call.args, **call.kwargs) if c not in configs]
        found += [(name, c) for c in configs[:max_configs]]
    return found, refused


@contextlib.contextmanager
def _unrecorded() -> Iterator[None]:
    """The op calls of timed candidates are not the user's: neither explain nor find_calls sees them."""
    tokens = dispatch._CALLS.set(None), dispatch._RECORDER.set(None)
    try:
        yield
    finally:
        dispatch._RECORDER.reset(tokens[1])
        dispatch._CALLS.reset(tokens[0])


def _progress(total: int, enabled: bool):
    """(advance(description), close) of a rich progress bar, or no-ops."""
    if not enabled or total == 0:
        return (lambda text: None), (lambda: None)
    try:
        from rich.progress import Progress  # noqa: PLC0415 - optional: the wheel does not require rich
    except ImportError:
        return (lambda text: None), (lambda: None)
    bar = Progress(transient=True)
    task = bar.add_task("autotune", total=total)
    bar.start()
    return (lambda text: bar.update(task, advance=1, description=text)), bar.stop


def tune_calls(calls: Sequence[Call], *, backends: Sequence[str] | None = None, max_configs: int | None = None,
               rounds: int = 5, calls_per_round: int = 10, timeout_s: float = 60.0, workers: int = 4,
               progress: bool = True, inputs: Callable[[Call], tuple] | None = None, given: Sequence[Any] = ()) -> Tuning:
    """A Tuning from timing each call's candidates (see the module docstring); `given`: concrete
    arrays integer arguments may take their values from."""
    device_kind = runtime.current_device_kind()
    plans = []
    report: list[dict[str, Any]] = []
    for call in calls:
        if call.backend is not None and call.config is not None:
            report.append({"op": call.op, "key": call.key, "backend": call.backend,
                           "refused": "backend and config given: nothing to tune"})
            continue
        op = dispatch.OPS[call.op]
        found, refused = candidates(op, call, backends, max_configs)
        report += refused
        plans.append((op, call, found))
    advance, close = _progress(sum(len(f) for _, _, f in plans), progress)
    entries: list[TuningEntry] = []
    pool = concurrent.futures.ThreadPoolExecutor(max(1, workers))
    with _unrecorded():
        try:
            for op, call, found in plans:
                try:
                    args = inputs(call) if inputs is not None else random_inputs(call, given)
                    args = tuple(args) + cotangents(op, call, args)
                    results = _time_call(op, call, found, args, pool, rounds, calls_per_round, timeout_s, advance, report)
                except Exception as e:  # noqa: BLE001 - one call's failure leaves the others' results
                    report.append({"op": call.op, "key": call.key, "error": f"{type(e).__name__}: {str(e)[:300]}"})
                    continue
                mode = "fwd+bwd" if call.differentiated else "fwd"
                entries += sorted((TuningEntry(device_kind, call.op, call.key, b, c.to_dict() if c is not None else None, s, mode)
                                   for (b, c), s in results.items()), key=lambda e: e.seconds)
        finally:
            close()
            pool.shutdown(wait=False, cancel_futures=True)  # a compile past its timeout is left behind
    return Tuning(entries, report=report)


# Backends whose compiles must not overlap others (see `compile_all`).
SERIAL_COMPILE = frozenset({"cudnn"})


def compile_all(compiles: Mapping[Hashable, Callable[[], Any]], pool: concurrent.futures.Executor, *,
                serial: bool | Callable[[Hashable], bool], timeout_s: float | None = None,
                each: Callable[[Hashable], None] | None = None) -> dict[Hashable, Any]:
    """{key: its compile's result, or the exception it raised (a TimeoutError past `timeout_s`)},
    returned once every compile has ended, so that no candidate runs while another compiles: on
    an H200 a cuDNN call's first run (its graph captured on a stream) failed while other threads
    compiled ("capturing stream has unjoined work"), and so did every call after it. The compiles
    overlap in `pool`, except those `serial` names (True: all; a predicate: the keys it accepts,
    e.g. candidates of a backend in SERIAL_COMPILE), which run one at a time in this thread after
    the pooled ones have ended, so each compiles alone (a pooled compile past its timeout is left
    running). `each(key)` is called as each result is collected (a progress bar)."""
    def outcome(compile_: Callable[[], Any]) -> Any:
        try:
            return compile_()
        except Exception as e:  # noqa: BLE001 - the caller reports it
            return e

    alone = serial if callable(serial) else (lambda key: serial)
    futures = {key: pool.submit(contextvars.copy_context().run, compile_)
               for key, compile_ in compiles.items() if not alone(key)}
    results = {}
    for key in futures:
        if each is not None:
            each(key)
        results[key] = outcome(functools.partial(futures[key].result, timeout=timeout_s))
    for key, compile_ in compiles.items():
        if key not in futures:
            if each is not None:
                each(key)
            results[key] = outcome(compile_)
    return {key: results[key] for key in compiles}


def _time_call(op, call: Call, found, args, pool, rounds, calls_per_round, timeout_s, advance,
               report) -> dict[tuple[str, Any], float]:
    """{(backend, config): median seconds} of each backend's fastest config for one call."""
    mode = "fwd+bwd" if call.differentiated else "fwd"

    def fail(backend, config, error):
        report.append({"op": call.op, "key": call.key, "backend": backend, "config": config.to_dict() if config else None,
                       "timed": mode, "error": error})

    def compile_one(candidate):
        return jax.jit(_build(op, call, *candidate)).lower(*args).compile()

    compiled = compile_all({cand: functools.partial(compile_one, cand) for cand in found}, pool,
                           serial=lambda candidate: candidate[0] in SERIAL_COMPILE, timeout_s=timeout_s,
                           each=lambda cand: advance(f"{call.op} {cand[0]}"))
    ready = {}
    for (backend, config), fn in compiled.items():
        try:
            if isinstance(fn, concurrent.futures.TimeoutError):
                raise TimeoutError(f"not compiled within {timeout_s} s")
            if isinstance(fn, Exception):
                raise fn
            start = time.perf_counter()
            jax.block_until_ready(fn(*args))
            if time.perf_counter() - start > timeout_s:
                raise TimeoutError(f"one call took more than {timeout_s} s")
            ready[(backend, config)] = fn
        except Exception as e:  # noqa: BLE001 - a failing candidate is recorded and skipped
            fail(backend, config, f"{type(e).__name__}: {str(e)[:300]}")
    times = timing.interleaved({cand: (fn, args) for cand, fn in ready.items()}, calls=calls_per_round, rounds=rounds, warmup=1)
    best: dict[str, tuple[tuple[str, Any], float]] = {}
    for (backend, config), rounds_s in times.items():
        seconds = statistics.median(rounds_s)
        report.append({"op": call.op, "key": call.key, "backend": backend, "config": config.to_dict() if config else None,
                       "timed": mode, "seconds": seconds})
        if backend not in best or seconds < best[backend][1]:
            best[backend] = ((backend, config), seconds)
    return dict(best.values())


def autotune(fn: Callable[..., Any], *args: Any, grad: bool = False, backends: Sequence[str] | None = None,
             max_configs: int | None = None, rounds: int = 5, calls: int = 10, timeout_s: float = 60.0,
             workers: int = 4, progress: bool = True, inputs: Callable[[Call], tuple] | None = None,
             **kwargs: Any) -> Tuning:
    """Times every backend and config of each forgeax op call in `fn(*args, **kwargs)` and returns
    the `Tuning` of the fastest (use it with `with tuning:`, save it with `tuning.dumps()`).

    Args:
      grad: trace `jax.vjp(fn)`: every call is timed forward and backward (calls that `fn`
        itself differentiates are timed so anyway).
      backends: only these backends (default: every registered one that accepts the call).
      max_configs: at most this many configs per backend (the current default first).
      rounds, calls: timing rounds, and back-to-back calls per round (`core/timing.py`).
      timeout_s: a candidate whose compile or first call takes longer is recorded and skipped.
      workers: threads compiling candidates.
      inputs: `(Call) -> arrays` for the call's array arguments (default `random_inputs`).
    """
    found = find_calls(fn, *args, grad=grad, **kwargs)
    given = [a for a in jax.tree.leaves((args, kwargs)) if isinstance(a, (jax.Array, np.ndarray))]
    return tune_calls(found, backends=backends, max_configs=max_configs, rounds=rounds, calls_per_round=calls,
                      timeout_s=timeout_s, workers=workers, progress=progress, inputs=inputs, given=given)


_TRIED_LOCK = threading.Lock()
_TRIED: set[tuple[str, str]] = set()  # call signatures FORGEAX_AUTOTUNE tuned (or tried to) in this process


def tune_implicitly(call: Call) -> None:
    """FORGEAX_AUTOTUNE=1: tunes one new call signature at trace time and keeps the result for
    this process. Runs in its own thread, outside the trace in progress (JAX's tracing state is
    per thread), with few rounds; a failure is a warning and the call falls back to the rules."""
    with _TRIED_LOCK:
        if (call.op, call.key) in _TRIED:
            return
        _TRIED.add((call.op, call.key))
    done: dict[str, Any] = {}

    def work():
        try:
            done["tuning"] = tune_calls([call], rounds=3, calls_per_round=5, progress=False)
        except Exception as e:  # noqa: BLE001
            done["error"] = e

    thread = threading.Thread(target=contextvars.copy_context().run, args=(work,))
    thread.start()
    thread.join()
    if "error" in done:
        warnings.warn(f"FORGEAX_AUTOTUNE: tuning {call.op}[{call.key}] failed ({done['error']!r}); using the selection rules")
        return
    tuning.add_implicit(done["tuning"])
