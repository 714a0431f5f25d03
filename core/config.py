"""Kernel configs: frozen, validated, keyword-only dataclasses, and where their values come from.

A kernel's config (block sizes, warps, stages, schedule switches) is a subclass of
`KernelConfig`. Its backend's `Implementation` names the class and two functions:
`heuristic_config(*args, **kwargs)`, the default for a call, and `candidate_configs(...)`,
the search space an autotuner walks. For one call the config is, first found wins:

  1. the one the caller passed (`ops.attention(..., backend="triton", config=...)`);
  2. a tuned entry for this device kind and call key, from the data file the implementation
     names (`TunedConfigs`, shipped in the wheel);
  3. `heuristic_config(...)`.

Module constants in kernel files hold hardware limits only; nothing is tuned by patching
globals.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.resources
import json
import typing
from collections.abc import Mapping
from typing import Any, Self


@dataclasses.dataclass(frozen=True, kw_only=True)
class KernelConfig:
    """Base of every kernel config. Subclasses add fields and may extend `validate`.

    Hashable (a config is a static argument of a jitted kernel) and JSON-serialisable through
    `to_dict` / `from_dict` (tuples become lists and back).
    """

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raises ValueError naming the field when a value is out of range. The base class checks
        that int fields are ints (not bools) and > 0 unless their name says it may be zero."""
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if isinstance(value, int) and not isinstance(value, bool) and value <= 0 and not field.name.startswith("min_"):
                raise ValueError(f"{type(self).__name__}.{field.name}: expected an int > 0, got {value}")

    def replace(self, **changes: Any) -> Self:
        """A copy with `changes` applied (validated again)."""
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return {f.name: _jsonable(getattr(self, f.name)) for f in dataclasses.fields(self)}

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> Self:
        """The config with these field values; unknown fields are an error naming them."""
        names = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - set(names))
        if unknown:
            raise ValueError(f"{cls.__name__}: unknown fields {unknown}; expected some of {sorted(names)}")
        hints = typing.get_type_hints(cls)
        return cls(**{k: _from_json(v, hints.get(k)) for k, v in values.items()})


def _jsonable(value: Any) -> Any:
    if isinstance(value, tuple):
        return [_jsonable(v) for v in value]
    return value


def _from_json(value: Any, hint: Any) -> Any:
    if isinstance(value, list):
        return tuple(_from_json(v, None) for v in value)
    del hint
    return value


def call_key(args: Any, kwargs: Mapping[str, Any] | None = None) -> str:
    """A stable description of a call's array shapes and dtypes, e.g. 'bfloat16[4,4096,32,128],...'.

    The default key of a tuned-config entry. Options (kwargs) that change the kernel belong in
    an implementation's own `tuning_key`."""
    del kwargs
    parts = []
    for a in args:
        if hasattr(a, "shape") and hasattr(a, "dtype"):
            import numpy as np  # noqa: PLC0415 - keeps this module light to import

            parts.append(f"{np.dtype(a.dtype).name}[{','.join(str(int(d)) for d in a.shape)}]")
        elif a is None:
            parts.append("None")
    return ",".join(parts)


@dataclasses.dataclass(frozen=True)
class TunedEntry:
    """One measured config: on devices whose kind starts with `device`, for calls whose key is
    `key` (or every call, `key="*"`), use `config`. `evidence` names the committed result."""

    device: str
    key: str
    config: Mapping[str, Any]
    evidence: str = ""


@dataclasses.dataclass(frozen=True)
class TunedConfigs:
    """A data file of tuned configs for one kernel: `{"entries": [{"device", "key", "config",
    "evidence"}, ...]}`, shipped beside the kernel as package data."""

    package: str
    filename: str

    @functools.cached_property
    def entries(self) -> tuple[TunedEntry, ...]:
        text = importlib.resources.files(self.package).joinpath(self.filename).read_text()
        data = json.loads(text)
        return tuple(TunedEntry(**entry) for entry in data.get("entries", ()))

    def lookup(self, device_kind: str, key: str) -> TunedEntry | None:
        """The first entry for this device kind and key (an exact key before a '*' one)."""
        matching = [e for e in self.entries if device_kind.startswith(e.device)]
        exact = next((e for e in matching if e.key == key), None)
        return exact or next((e for e in matching if e.key == "*"), None)
