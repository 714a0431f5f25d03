"""Measured choices as data: a `Tuning` maps op calls to the backend and config to run.

An entry says: on a device whose kind starts with `device`, a call of `op` whose signature is
`key` (its arrays' shapes and dtypes and its options, `signature`) runs `backend` with
`config` (a dict of the kernel config's fields, or None for the backend's default), as timed
`timed`: "fwd" (forward only) or "fwd+bwd" (forward and backward). A call signature may have
entries for several backends and both modes, fastest first per mode: `backend=None` takes the
first fwd+bwd entry whose backend accepts the call (fwd entries when none does) and, when the
first accepted fwd entry names another backend or config, runs that one where the call is not
differentiated (dispatch's split, as for a "forward_only" rule); entries of one mode serve
both. `backend="x"` takes x's entry (fwd+bwd first) for its config.

For one call, first found wins: explicit `backend=` / `config=` > the active tuning (`with
tuning:`; nested blocks merge, inner wins) > tunings made in this process by FORGEAX_AUTOTUNE=1
> the tunings shipped in the wheel (`forgeax/ops/tunings/*.json`) > selection rules, tuned
config files and heuristics. `a | b` merges (b wins per call signature and mode). `dumps()` /
`loads()` round-trip JSON stamped with the library version; entries of another version, for
another device kind, or whose config no longer fits the kernel's config class are ignored with
a warning. The active tuning is a context variable, so threads and tasks each see their own.
"""

from __future__ import annotations

import contextvars
import dataclasses
import enum
import functools
import importlib.resources
import json
import os
import threading
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

FORMAT = "forgeax-tuning/1"
SHIPPED = ("forgeax.ops", "tunings")  # package and folder of the tunings shipped in the wheel

_ACTIVE: contextvars.ContextVar[Tuning | None] = contextvars.ContextVar("forgeax_tuning", default=None)


class StaleTuningWarning(UserWarning):
    """A tuning entry was ignored: another library version, another device kind, or a config
    that no longer fits the kernel."""


def library_version() -> str:
    import forgeax  # noqa: PLC0415 - forgeax/__init__ imports core; read it when called

    return getattr(forgeax, "__version__", "unknown")


def _describe(value: Any) -> str:
    if hasattr(value, "shape") and hasattr(value, "dtype"):
        import numpy as np  # noqa: PLC0415

        return f"{np.dtype(value.dtype).name}[{','.join(str(int(d)) for d in value.shape)}]"
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = ",".join(f"{f.name}={_describe(getattr(value, f.name))}" for f in dataclasses.fields(value))
        return f"{type(value).__name__}({fields})"
    if isinstance(value, enum.Enum):
        return value.name
    if isinstance(value, (tuple, list)):
        return "(" + ",".join(_describe(v) for v in value) + ")"
    return repr(value)


def signature(args: Sequence[Any], kwargs: Mapping[str, Any]) -> str:
    """A call's key in a tuning: shapes and dtypes of the arrays, values of everything else,
    e.g. 'float32[4,16],float32[16];eps=1e-06'."""
    options = ",".join(f"{k}={_describe(v)}" for k, v in sorted(kwargs.items()))
    return ",".join(_describe(a) for a in args) + (f";{options}" if options else "")


@dataclasses.dataclass(frozen=True)
class Call:
    """One op call as a trace saw it: arrays as `jax.ShapeDtypeStruct`s, the options, the backend
    and config the caller passed, and whether the call was being differentiated (an argument is
    a JAX autodiff tracer, or `watch_gradient` saw its forward rule run)."""

    op: str
    args: tuple[Any, ...]
    kwargs: Mapping[str, Any]
    backend: str | None = None
    config: Any = None
    differentiated: bool = False

    @classmethod
    def of(cls, op: str, args: Sequence[Any], kwargs: Mapping[str, Any], backend: str | None = None, config: Any = None) -> Call:
        import jax  # noqa: PLC0415

        abstract = tuple(jax.ShapeDtypeStruct(a.shape, a.dtype) if hasattr(a, "shape") and hasattr(a, "dtype") else a for a in args)
        differentiated = any(type(leaf).__module__.endswith("interpreters.ad") for leaf in jax.tree.leaves(tuple(args)))
        return cls(op, abstract, dict(kwargs), backend, config, differentiated)

    @property
    def key(self) -> str:
        return signature(self.args, self.kwargs)


def watch_gradient(args: Sequence[Any], on_gradient: Callable[[], None]) -> tuple[Any, ...]:
    """`args` passed through an identity whose `custom_jvp` rule calls `on_gradient`: it runs
    when the call is differentiated (jax.grad and vjp linearize through it), also inside a
    nested `jax.jit` or `jax.checkpoint`, where the arguments are no autodiff tracers. Used only
    while `autotune` traces."""
    import jax  # noqa: PLC0415
    import jax.numpy as jnp  # noqa: PLC0415

    positions = [i for i, a in enumerate(args) if hasattr(a, "dtype") and jnp.issubdtype(a.dtype, jnp.inexact)]
    if not positions:
        return tuple(args)

    @jax.custom_jvp
    def identity(*xs):
        return xs

    @identity.defjvp
    def _(primals, tangents):
        on_gradient()
        return primals, tangents

    watched = list(args)
    for i, a in zip(positions, identity(*(args[i] for i in positions))):
        watched[i] = a
    return tuple(watched)


@dataclasses.dataclass(frozen=True)
class TuningEntry:
    """One measured choice (see the module docstring). `seconds` is the median time measured
    for `timed` ("fwd" or "fwd+bwd")."""

    device: str
    op: str
    key: str
    backend: str
    config: Mapping[str, Any] | None = None
    seconds: float | None = None
    timed: str = "fwd"

    @property
    def identity(self) -> tuple[str, str, str, str, str]:
        """What a `Tuning` keys it by: one entry per device, op, call signature, backend and mode."""
        return (self.device, self.op, self.key, self.backend, self.timed)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self) | {"config": dict(self.config) if self.config is not None else None}

    def __str__(self) -> str:
        measured = f", {self.seconds * 1e3:.4g} ms {self.timed}" if self.seconds is not None else f", {self.timed}"
        return f"tuning entry {self.op}[{self.key}] on {self.device} -> {self.backend}{measured}"


class Tuning(Mapping):
    """Immutable mapping (device, op, key, backend, timed) -> `TuningEntry`; a context manager.

    Entries of one (device, op, key) keep their order: per mode, the first is what `backend=None`
    runs. A file whose entries have one mode (or no `timed`: "fwd") serves both modes.
    `report` holds what the autotuner measured and what failed (kept through dumps/loads)."""

    def __init__(self, entries: Sequence[TuningEntry] = (), *, report: Sequence[Mapping[str, Any]] = ()) -> None:
        self._entries: dict[tuple[str, str, str, str, str], TuningEntry] = {}
        for e in entries:
            self._entries[e.identity] = e
        self.report = tuple(report)
        self._tokens: dict[int, list[contextvars.Token]] = {}

    def __getitem__(self, key: tuple[str, str, str, str, str]) -> TuningEntry:
        return self._entries[key]

    def __iter__(self) -> Iterator[tuple[str, str, str, str, str]]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f"Tuning({len(self)} entries)"

    @property
    def entries(self) -> tuple[TuningEntry, ...]:
        return tuple(self._entries.values())

    def __or__(self, other: Tuning) -> Tuning:
        """Merged; for a call signature and mode `other` has entries for, its order comes first
        (an entry of one mode never replaces one of the other)."""
        if not isinstance(other, Tuning):
            return NotImplemented
        kept = [e for e in self.entries if e.identity not in other]
        return Tuning(other.entries + tuple(kept), report=self.report + other.report)

    def lookup(self, device_kind: str, op: str, key: str) -> tuple[TuningEntry, ...]:
        """The entries for this call on this device kind, best first per mode."""
        return tuple(e for e in self._entries.values() if e.op == op and e.key == key and device_kind.startswith(e.device))

    # -- JSON -------------------------------------------------------------------------------
    def dumps(self, *, indent: int | None = 1) -> str:
        return json.dumps({"format": FORMAT, "forgeax": library_version(),
                           "entries": [e.to_dict() for e in self.entries], "report": list(self.report)}, indent=indent)

    @classmethod
    def loads(cls, text: str, *, source: str = "a tuning") -> Tuning:
        """The tuning in `text`; one written by another forgeax version loads empty, with a warning."""
        data = json.loads(text)
        if data.get("format") != FORMAT:
            raise ValueError(f"{source}: not a forgeax tuning (format {data.get('format')!r}, expected {FORMAT!r})")
        version = library_version()
        if data.get("forgeax") != version:
            warnings.warn(f"{source}: written by forgeax {data.get('forgeax')}, this is {version}: its "
                          f"{len(data.get('entries', ()))} entries are ignored (tune again)", StaleTuningWarning, stacklevel=2)
            return cls()
        return cls([TuningEntry(**e) for e in data.get("entries", ())], report=data.get("report", ()))

    # -- context ----------------------------------------------------------------------------
    def __enter__(self) -> Tuning:
        from forgeax.core import runtime  # noqa: PLC0415

        device = runtime.current_device_kind()
        foreign = sorted({e.device for e in self.entries if not device.startswith(e.device)})
        if foreign:
            warnings.warn(f"tuning: entries for {foreign} are ignored on this {device!r}", StaleTuningWarning, stacklevel=2)
        outer = _ACTIVE.get()
        token = _ACTIVE.set(self if outer is None else outer | self)
        self._tokens.setdefault(threading.get_ident(), []).append(token)
        return self

    def __exit__(self, *exc: Any) -> None:
        _ACTIVE.reset(self._tokens[threading.get_ident()].pop())


def active() -> Tuning | None:
    """The tuning of the innermost `with tuning:` block, or None."""
    return _ACTIVE.get()


@functools.cache
def shipped() -> Tuning:
    """The tunings in the wheel (`forgeax/ops/tunings/*.json`), merged; empty when there are none."""
    package, folder = SHIPPED
    merged = Tuning()
    try:
        files = sorted(importlib.resources.files(package).joinpath(folder).iterdir(), key=lambda f: f.name)
    except (FileNotFoundError, ModuleNotFoundError, NotADirectoryError):
        return merged
    for f in files:
        if f.name.endswith(".json"):
            merged = merged | Tuning.loads(f.read_text(), source=f"{package}/{folder}/{f.name}")
    return merged


# Tunings made at trace time under FORGEAX_AUTOTUNE=1, one per call signature, for this process.
_IMPLICIT_LOCK = threading.Lock()
_implicit = Tuning()


def implicit() -> Tuning:
    return _implicit


def add_implicit(tuning: Tuning) -> None:
    global _implicit
    with _IMPLICIT_LOCK:
        _implicit = _implicit | tuning


def autotune_enabled() -> bool:
    """Whether FORGEAX_AUTOTUNE asks for tuning each new call signature at trace time (off by default)."""
    return os.environ.get("FORGEAX_AUTOTUNE", "").strip().lower() in ("1", "true", "yes", "on")


def sources() -> tuple[tuple[str, Tuning], ...]:
    """(label, tuning) in the order a call consults them."""
    found = []
    if (current := _ACTIVE.get()) is not None:
        found.append(("active tuning", current))
    if len(_implicit):
        found.append(("FORGEAX_AUTOTUNE tuning", _implicit))
    if len(shipped_tuning := shipped()):
        found.append(("shipped tuning", shipped_tuning))
    return tuple(found)


def stale(entry: TuningEntry, reason: str) -> None:
    warnings.warn(f"{entry} is ignored: {reason}", StaleTuningWarning, stacklevel=3)
