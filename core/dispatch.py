"""Ops, the registry, dispatch, and `explain`: written once for every op.

An `Op` is one public function's contract: a name, its backends (`Implementation`s or
lazily imported "module:ATTR" references), a `Selection` (priority + rules, as data) and a
`features` function that describes a call to the rules. `backend=None` runs the backend of the
first tuning entry for the call that accepts it (`core/tuning.py`: the active `Tuning`, then
shipped ones; fwd+bwd-timed entries first, and the first fwd-timed one picks the forward of a
call that is not differentiated); else it takes, in this order, the backends of the first "all"
rule that fires, the platform priority, then `xla`, and runs the first whose `supports(...)`
accepts the call; a "forward_only" rule that fires picks the forward of a call that is not
differentiated (`_split`).
`backend="<name>"` runs that backend or raises `UnsupportedError`; "pallas" means the Pallas
variant of this platform.

The only mutable state is the registry (`OPS`), each op's cache of loaded implementations and
the recorders `explain` and `autotune` install for one trace.
"""

from __future__ import annotations

import contextvars
import dataclasses
import importlib
import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax

from forgeax.core.config import KernelConfig
from forgeax.core.registry import Implementation, ImplementationRef, UnsupportedError
from forgeax.core import runtime, tuning
from forgeax.core.runtime import PLATFORMS
from forgeax.core.selection import Features, Rule, Selection

# "pallas" names the Pallas variant that targets the current platform.
_PALLAS_ALIAS = {"gpu": ("pallas_gpu",), "tpu": ("pallas_tpu",), "cpu": ("pallas_gpu", "pallas_tpu")}


def _no_features(args: Sequence[Any], kwargs: Mapping[str, Any]) -> Mapping[str, Any]:
    del args, kwargs
    return {}


@dataclasses.dataclass(frozen=True)
class Choice:
    """What one call runs: `backend` with `config`, and under a gradient `gradient_backend`
    (with `gradient_config`) when a forward-only rule or a fwd-timed tuning entry picked another
    forward."""

    backend: str
    impl: Implementation
    config: KernelConfig | None
    config_source: str
    rule: Rule | None
    skipped: tuple[tuple[str, str], ...]
    gradient_backend: str | None = None
    gradient_impl: Implementation | None = None
    gradient_config: KernelConfig | None = None
    gradient_rule: Rule | None = None
    tuning: str | None = None  # the tuning entry that chose `backend`
    gradient_tuning: str | None = None  # the tuning entry that chose `gradient_backend`


@dataclasses.dataclass(frozen=True)
class Decision:
    """One op call as `explain` reports it: the call as written, the backend and config it runs,
    the rule that chose them, and why each better-ranked backend was skipped."""

    op: str
    call: str
    backend: str
    config: str
    rule: str
    skipped: tuple[tuple[str, str], ...]
    gradient: str | None = None  # "<backend> (<the rule that chose it>)" when it differs
    gradient_backend: str | None = None
    alternatives: tuple[tuple[str, str], ...] = ()  # the other backends: whether they could run it

    def __str__(self) -> str:
        lines = [f"{self.call} -> {self.backend}"]
        lines.append(f"    chosen by: {self.rule}")
        if self.config:
            lines.append(f"    config: {self.config}")
        if self.gradient is not None:
            lines.append(f"    under a gradient: {self.gradient}")
        lines += [f"    skipped {name}: {reason}" for name, reason in self.skipped]
        lines += [f"    alternative {name}: {text}" for name, text in self.alternatives]
        return "\n".join(lines)


_RECORDER: contextvars.ContextVar[list[Decision] | None] = contextvars.ContextVar("forgeax_recorder", default=None)
# The op calls `autotune` collects while it traces a function.
_CALLS: contextvars.ContextVar[list[tuning.Call] | None] = contextvars.ContextVar("forgeax_calls", default=None)


def _split(inference: Implementation, inference_config, training: Implementation, training_config,
           args: Sequence[Any], kwargs: Mapping[str, Any]) -> Any:
    """`inference` runs the call; under jax.grad / vjp the forward and backward are `training`'s
    (its forward recomputes the output, so a value and its gradient come from one backend).
    Both compute the op's contract and may differ by rounding. Keyword arguments are static."""

    @jax.custom_vjp
    def run(*args):
        return inference.call(args, kwargs, inference_config)

    def forward(*args):
        return jax.vjp(lambda *a: training.call(a, kwargs, training_config), *args)

    def backward(pull, cotangent):
        return pull(cotangent)

    run.defvjp(forward, backward)
    return run(*args)


def _describe_value(value: Any) -> str:
    if hasattr(value, "shape") and hasattr(value, "dtype"):
        return f"{jax.numpy.dtype(value.dtype).name}[{', '.join(str(d) for d in value.shape)}]"
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        changed = [f"{f.name}={getattr(value, f.name)!r}" for f in dataclasses.fields(value)
                   if f.default is not dataclasses.MISSING and getattr(value, f.name) != f.default]
        return ", ".join(changed)
    return repr(value)


class Op:
    """One op: its backends (lazily loaded), its selection, and dispatch."""

    def __init__(self, name: str, backends: Mapping[str, ImplementationRef], selection: Selection,
                 features: Features | None = None) -> None:
        if "xla" not in backends:
            raise ValueError(f"op {name!r}: backends must include the 'xla' reference")
        self.name = name
        self._refs: dict[str, ImplementationRef] = dict(backends)
        self._loaded: dict[str, Implementation | str] = {}  # cache: Implementation or import error
        self.selection = selection
        self.features: Features = features or _no_features

    # -- registry ---------------------------------------------------------------------------
    @property
    def backends(self) -> tuple[str, ...]:
        return tuple(self._refs)

    def priority(self, platform: str) -> tuple[str, ...]:
        """Backends tried by `backend=None` on `platform` when no rule fires, best first; `xla` last."""
        order = [b for b in self.selection.priority.get(platform, ()) if b in self._refs and b != "xla"]
        return tuple(order) + ("xla",)

    def add_backend(self, backend: str, impl: ImplementationRef, *, prefer_on: Sequence[str] = ()) -> None:
        """Registers (or replaces) `backend`; `prefer_on` puts it first in those platforms' priority."""
        self._refs[backend] = impl
        self._loaded.pop(backend, None)
        if prefer_on:
            self.selection = self.selection.with_first(backend, prefer_on)

    def implementation(self, backend: str) -> Implementation | str:
        """The loaded Implementation, or a string saying why it could not be loaded."""
        if backend not in self._loaded:
            ref = self._refs[backend]
            if isinstance(ref, Implementation):
                self._loaded[backend] = ref
            else:
                module_name, _, attr = ref.partition(":")
                try:
                    impl = getattr(importlib.import_module(module_name), attr)
                except Exception as e:  # noqa: BLE001 - any import failure is a reason to skip
                    impl = f"could not import {ref}: {type(e).__name__}: {e}"
                self._loaded[backend] = impl
        return self._loaded[backend]

    # -- selection --------------------------------------------------------------------------
    def _explicit(self, backend: str, platform: str) -> tuple[str, ...]:
        if backend == "pallas" and "pallas" not in self._refs:
            return tuple(b for b in _PALLAS_ALIAS[platform] if b in self._refs) or ("pallas_gpu",)
        if not isinstance(backend, str) or backend not in self._refs:
            known = sorted(set(self._refs) | ({"pallas"} if any(b.startswith("pallas_") for b in self._refs) else set()))
            raise ValueError(f"backend: unknown backend {backend!r} for {self.name}; expected None or one of {known}")
        return (backend,)

    def _first_runnable(self, candidates: Sequence[str], platform: str, args, kwargs,
                        config: KernelConfig | None) -> tuple[str, Implementation, tuple[tuple[str, str], ...]]:
        skipped: list[tuple[str, str]] = []
        seen: set[str] = set()
        for name in candidates:
            if name in seen:
                continue
            seen.add(name)
            impl = self.implementation(name) if name in self._refs else f"{name} is not registered for {self.name}"
            if isinstance(impl, str):
                reason = impl
            elif config is not None and not (impl.config_type and isinstance(config, impl.config_type)):
                reason = f"config: this backend takes {impl.config_type.__name__ if impl.config_type else 'no config'}, not the {type(config).__name__} passed"
            else:
                reason = impl.why_not(platform, args, kwargs)
            if reason is None:
                return name, impl, tuple(skipped)
            skipped.append((name, reason))
        detail = "; ".join(f"{n}: {r}" for n, r in skipped)
        raise UnsupportedError(f"{self.name}: no backend among {list(seen)} can run this call on {platform}: {detail}")

    def tuned(self, args: Sequence[Any], kwargs: Mapping[str, Any],
              device_kind: str) -> tuple[tuple[str, tuning.TuningEntry], ...]:
        """(source, entry) of every tuning entry for this call, in the order they are consulted
        (per source, fwd+bwd-timed entries first)."""
        sources = tuning.sources()
        if not sources:
            return ()
        key = tuning.signature(args, kwargs)
        return _timed_first("fwd+bwd", [(label, e) for label, t in sources for e in t.lookup(device_kind, self.name, key)])

    def _tuned_config(self, impl: Implementation, name: str, tuned, args, kwargs, explicit: KernelConfig | None,
                      device_kind: str) -> tuple[KernelConfig | None, str]:
        """A call's config: explicit, else the first usable tuning entry for backend `name`, else
        `impl.resolve_config` (tuned data file, heuristic)."""
        for label, entry in tuned if explicit is None else ():
            if entry.backend == name and entry.config is not None and (cfg := _entry_config(impl, entry)) is not None:
                return cfg, label
        return impl.resolve_config(args, kwargs, explicit, device_kind)

    def _choose_tuned(self, tuned, platform: str, args, kwargs, device_kind: str) -> tuple[Choice | None, list[tuple[str, str]]]:
        """The first fwd+bwd-timed tuning entry whose backend accepts the call (else the first
        fwd-timed one), split with the first accepted fwd-timed entry when that names another
        backend or config; or None and why each entry was refused."""
        training, refused = self._first_tuned(_timed_first("fwd+bwd", tuned), platform, args, kwargs, device_kind)
        if training is None or len({e.timed for _, e in tuned}) == 1:
            return training, refused
        forward, _ = self._first_tuned(_timed_first("fwd", tuned), platform, args, kwargs, device_kind)
        return _with_gradient(forward, training), refused

    def _first_tuned(self, tuned, platform: str, args, kwargs, device_kind: str) -> tuple[Choice | None, list[tuple[str, str]]]:
        """The first tuning entry whose backend accepts the call, or None and why each was refused."""
        skipped: list[tuple[str, str]] = []
        for label, entry in tuned:
            if entry.backend in (n for n, _ in skipped):
                continue
            impl = (self.implementation(entry.backend) if entry.backend in self._refs
                    else f"{entry.backend} is not registered for {self.name}")
            reason = impl if isinstance(impl, str) else impl.why_not(platform, args, kwargs)
            cfg = _entry_config(impl, entry) if reason is None and entry.config is not None else None
            if reason is None and (entry.config is None or cfg is not None):
                cfg, source = (cfg, label) if cfg is not None else impl.resolve_config(args, kwargs, None, device_kind)
                return Choice(entry.backend, impl, cfg, source, None, tuple(skipped), tuning=f"{label}: {entry}"), skipped
            skipped.append((entry.backend, f"{reason or 'its config no longer fits'} (refused the {label} entry)"))
        return None, skipped

    def choose(self, args: Sequence[Any], kwargs: Mapping[str, Any], backend: str | None = None,
               config: KernelConfig | None = None) -> Choice:
        """The backend(s) and config(s) this call runs; raises UnsupportedError when an explicit
        backend cannot run it."""
        platform = runtime.current_platform()
        device_kind = runtime.current_device_kind()
        tuned = self.tuned(args, kwargs, device_kind) if config is None else ()
        refused: list[tuple[str, str]] = []
        if backend is None and config is None:
            if not tuned and tuning.autotune_enabled():
                from forgeax.core.autotuning import tune_implicitly  # noqa: PLC0415 - it imports this module
                tune_implicitly(tuning.Call.of(self.name, args, kwargs))
                tuned = self.tuned(args, kwargs, device_kind)
            if tuned:
                choice, refused = self._choose_tuned(tuned, platform, args, kwargs, device_kind)
                if choice is not None:
                    return choice
        fired: dict[str, Rule] = {}
        if backend is None:
            fired = self.selection.fired(platform, device_kind, lambda: self.features(args, kwargs))
            training = fired.get("all")
            order = (training.prefer if training else ()) + self.priority(platform)
        else:
            training = None
            order = self._explicit(backend, platform)
        name, impl, skipped = self._first_runnable(order, platform, args, kwargs, config)
        cfg, source = self._tuned_config(impl, name, tuned, args, kwargs, config, device_kind)
        choice = Choice(name, impl, cfg, source, training, tuple(refused) + skipped)
        inference = fired.get("forward_only")
        if inference is not None and config is None:
            fwd_name, fwd_impl, fwd_skipped = self._first_runnable(inference.prefer + order, platform, args, kwargs, None)
            if fwd_name != name:
                fwd_cfg, fwd_source = self._tuned_config(fwd_impl, fwd_name, tuned, args, kwargs, None, device_kind)
                choice = _with_gradient(Choice(fwd_name, fwd_impl, fwd_cfg, fwd_source, inference, fwd_skipped), choice)
        return choice

    def describe_call(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> str:
        """The call as `explain` prints it: arguments named after the reference's parameters,
        absent (None) ones left out, options shown only where they differ from the default."""
        reference = self.implementation("xla")
        names: list[str] = []
        if isinstance(reference, Implementation):
            try:
                names = list(inspect.signature(reference.fn).parameters)
            except (TypeError, ValueError):
                names = []
        parts = []
        for i, value in enumerate(args):
            if value is None:
                continue
            label = names[i] if i < len(names) else f"arg{i}"
            parts.append(f"{label}={_describe_value(value)}")
        for key, value in kwargs.items():
            text = _describe_value(value)
            if dataclasses.is_dataclass(value):
                if text:
                    parts.append(text)
            else:
                parts.append(f"{key}={text}")
        return f"{self.name}({', '.join(parts)})"

    def select(self, args: Sequence[Any], kwargs: Mapping[str, Any], backend: str | None = None,
               config: KernelConfig | None = None) -> Choice:
        """`choose`, recorded for `explain` as a call: for ops that run this op's kernels
        themselves (ring attention runs attention's per block)."""
        choice = self.choose(args, kwargs, backend, config)
        recorder = _RECORDER.get()
        if recorder is not None:
            recorder.append(_decision(self, args, kwargs, backend, choice))
        return choice

    def __call__(self, *args: Any, backend: str | None = None, config: KernelConfig | None = None, **kwargs: Any) -> Any:
        calls = _CALLS.get()
        if calls is not None:
            calls.append(tuning.Call.of(self.name, args, kwargs, backend, config))
            index = len(calls) - 1

            def differentiated() -> None:
                calls[index] = dataclasses.replace(calls[index], differentiated=True)

            args = tuning.watch_gradient(args, differentiated)
        choice = self.select(args, kwargs, backend, config)
        if choice.gradient_impl is not None:
            return _split(choice.impl, choice.config, choice.gradient_impl, choice.gradient_config, args, kwargs)
        return choice.impl.call(args, kwargs, choice.config)


def _timed_first(timed: str, tuned):
    """`tuned` ((source, entry) pairs, grouped by source) with each source's entries timed `timed`
    before its others: a source consulted earlier still wins."""
    sources = list(dict.fromkeys(label for label, _ in tuned))
    return tuple(sorted(tuned, key=lambda pair: (sources.index(pair[0]), pair[1].timed != timed)))


def _with_gradient(forward: Choice, training: Choice) -> Choice:
    """`forward` runs the call and `training` its gradient (`_split`); `training` alone when
    they run the same backend and config."""
    if (forward.backend, forward.config) == (training.backend, training.config):
        return training
    return dataclasses.replace(forward, gradient_backend=training.backend, gradient_impl=training.impl,
                               gradient_config=training.config, gradient_rule=training.rule,
                               gradient_tuning=training.tuning)


def _entry_config(impl: Implementation, entry: tuning.TuningEntry) -> KernelConfig | None:
    """The config a tuning entry names, or None (with a warning) when it no longer fits."""
    if impl.config_type is None:
        tuning.stale(entry, "this backend takes no config")
        return None
    try:
        return impl.config_type.from_dict(entry.config)
    except (TypeError, ValueError) as e:
        tuning.stale(entry, str(e))
        return None


def _rule_text(rule: Rule | None, backend: str | None, chosen_by: str | None = None) -> str:
    if chosen_by is not None:
        return chosen_by
    if backend is not None:
        return f"backend={backend!r} (explicit)"
    if rule is None:
        return "the platform priority (no selection rule fired)"
    return f"rule {rule.id!r} ({rule.evidence['file']})"


def _decision(op: Op, args, kwargs, backend: str | None, choice: Choice) -> Decision:
    config = f"{choice.config} [{choice.config_source}]" if choice.config is not None else ""
    gradient = None
    if choice.gradient_backend is not None:
        trained = f" with {choice.gradient_config}" if choice.gradient_config is not None else ""
        gradient = f"{choice.gradient_backend}{trained} ({_rule_text(choice.gradient_rule, None, choice.gradient_tuning)})"
    return Decision(op.name, op.describe_call(args, kwargs), choice.backend, config,
                    _rule_text(choice.rule, backend, choice.tuning), choice.skipped, gradient, choice.gradient_backend,
                    _alternatives(op, args, kwargs, choice))


def _alternatives(op: Op, args, kwargs, choice: Choice) -> tuple[tuple[str, str], ...]:
    """For each backend neither chosen nor skipped: whether it could run the call, and its time
    in a tuning entry."""
    platform, device_kind = runtime.current_platform(), runtime.current_device_kind()
    measured: dict[str, dict[str, float]] = {}  # backend -> mode -> seconds of its first entry
    for _, e in op.tuned(args, kwargs, device_kind):
        if e.seconds is not None:
            measured.setdefault(e.backend, {}).setdefault(e.timed, e.seconds)
    taken = {choice.backend, choice.gradient_backend} | {name for name, _ in choice.skipped}
    found = []
    for name in op.backends:
        if name in taken:
            continue
        impl = op.implementation(name)
        reason = impl if isinstance(impl, str) else impl.why_not(platform, args, kwargs)
        times = ", ".join(f"{seconds * 1e3:.4g} ms {timed}" for timed, seconds in measured.get(name, {}).items())
        found.append((name, (reason or "could run this call") + (f" ({times} in the tuning)" if times else "")))
    return tuple(found)


# The registry: op name -> Op.
OPS: dict[str, Op] = {}


def define_op(name: str, backends: Mapping[str, ImplementationRef], priority: Mapping[str, Sequence[str]] | None = None,
              *, selection: Selection | None = None, features: Features | None = None) -> Op:
    """Creates and registers an op (forgeax's own ops are defined this way too).

    Give either `priority` (platform -> backends, best first: a selection without rules) or a
    full `selection` (usually `Selection.load(package, "rules/<op>.json")`) with the
    `features` its rules read."""
    if name in OPS:
        raise ValueError(f"name: op {name!r} is already defined")
    if (priority is None) == (selection is None):
        raise ValueError("priority, selection: give exactly one")
    if selection is None:
        selection = Selection({p: tuple(priority.get(p, ())) for p in PLATFORMS})
    op = Op(name, backends, selection, features)
    OPS[name] = op
    return op


def register_backend(op: str, backend: str, impl: ImplementationRef, *, prefer_on: Sequence[str] = ()) -> None:
    """Registers a user implementation `backend` for `op` (an existing op name).

    `prefer_on=("gpu",)` makes `backend=None` try it first on GPUs (after any rule that fires);
    otherwise it is used only when asked for by name.
    """
    if op not in OPS:
        raise ValueError(f"op: unknown op {op!r}; expected one of {sorted(OPS)}")
    OPS[op].add_backend(backend, impl, prefer_on=prefer_on)


@dataclasses.dataclass(frozen=True)
class Explanation:
    """The decisions of every forgeax op call in one traced function (its gradient included
    when `fn` computes one)."""

    decisions: tuple[Decision, ...]

    def __str__(self) -> str:
        if not self.decisions:
            return "no forgeax op calls"
        return "\n".join(str(d) for d in self.decisions)

    def backends(self) -> tuple[str, ...]:
        return tuple(d.backend for d in self.decisions)


def explain(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Explanation:
    """Traces `fn(*args, **kwargs)` abstractly and reports each op call's backend, config and
    the rule that chose them.

    Nothing runs on the device. JAX's trace caches are cleared first so that functions already
    jitted are traced again (their next call recompiles).
    """
    decisions: list[Decision] = []
    token = _RECORDER.set(decisions)
    try:
        jax.clear_caches()
        jax.eval_shape(fn, *args, **kwargs)
    finally:
        _RECORDER.reset(token)
    return Explanation(tuple(decisions))
