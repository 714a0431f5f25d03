"""What a backend gives the library for one op: an `Implementation`."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from forgeax.core.config import KernelConfig, TunedConfigs, call_key
from forgeax.core.runtime import PLATFORMS, interpret_enabled


class UnsupportedError(NotImplementedError):
    """An explicitly requested backend cannot handle this call (the message says why)."""


def _supports_everything(*args: Any, **kwargs: Any) -> str | None:
    del args, kwargs
    return None


@dataclasses.dataclass(frozen=True)
class Implementation:
    """One backend's implementation of one op.

    Attributes:
      fn: the implementation; same positional and keyword arguments as the op, without
        `backend`, plus `config=` when `config_type` is set. Differentiable (a `custom_vjp`
        for kernels) and traceable under `jax.jit`.
      platforms: platforms where it runs natively.
      interpretable: whether it also runs on CPU when `interpret_enabled()`.
      supports: `supports(*args, **kwargs) -> None | str`: None if the call is handled, else
        the reason it is not. Sees the op's arguments (arrays may be tracers: shapes and dtypes
        only).
      config_type: the kernel's `KernelConfig` subclass, or None for a kernel without knobs.
      heuristic_config: `(*args, **kwargs) -> config`, the default for a call.
      candidate_configs: `(*args, **kwargs) -> sequence of configs`, the search space.
      tuned: measured configs per device kind (a data file shipped with the kernel).
      tuning_key: `(*args, **kwargs) -> str`, the key of a call in `tuned` (default: shapes and
        dtypes of the array arguments).
      kernels: `(config) -> kernels`, the backend's raw launches for ops composed of this op's
        kernels (attention: its forward and its backward given the statistics, which ring
        attention runs per block), or None.
    """

    fn: Callable[..., Any]
    platforms: frozenset[str] = frozenset(PLATFORMS)
    interpretable: bool = False
    supports: Callable[..., str | None] = _supports_everything
    config_type: type[KernelConfig] | None = None
    heuristic_config: Callable[..., KernelConfig] | None = None
    candidate_configs: Callable[..., Sequence[KernelConfig]] | None = None
    tuned: TunedConfigs | None = None
    tuning_key: Callable[..., str] = call_key
    kernels: Callable[[KernelConfig | None], Any] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "platforms", frozenset(self.platforms))
        unknown = self.platforms - set(PLATFORMS)
        if unknown:
            raise ValueError(f"platforms: unknown {sorted(unknown)}; expected a subset of {PLATFORMS}")
        if self.config_type is not None and self.heuristic_config is None:
            raise ValueError("heuristic_config: required when config_type is set")

    def why_not(self, platform: str, args: Sequence[Any], kwargs: Mapping[str, Any]) -> str | None:
        """None if this implementation can run the call on `platform`, else why not."""
        if platform not in self.platforms:
            if not (platform == "cpu" and self.interpretable and interpret_enabled()):
                hint = " (set FORGEAX_INTERPRET=1 to run its interpreter on CPU)" if self.interpretable else ""
                return f"runs on {'/'.join(sorted(self.platforms))}, this is {platform}{hint}"
        return self.supports(*args, **kwargs)

    def resolve_config(self, args: Sequence[Any], kwargs: Mapping[str, Any], explicit: KernelConfig | None,
                       device_kind: str | None) -> tuple[KernelConfig | None, str]:
        """(config, where it came from: 'explicit', 'tuned: <evidence>' or 'heuristic') for a call."""
        if self.config_type is None:
            if explicit is not None:
                raise TypeError(f"config: this backend takes no config, got {type(explicit).__name__}")
            return None, ""
        if explicit is not None:
            if not isinstance(explicit, self.config_type):
                raise TypeError(f"config: expected a {self.config_type.__name__}, got {type(explicit).__name__}")
            return explicit, "explicit"
        if self.tuned is not None and device_kind is not None:
            entry = self.tuned.lookup(device_kind, self.tuning_key(*args, **kwargs))
            if entry is not None:
                return self.config_type.from_dict(entry.config), f"tuned for {entry.device} ({entry.evidence or 'no evidence named'})"
        return self.heuristic_config(*args, **kwargs), "heuristic"

    def call(self, args: Sequence[Any], kwargs: Mapping[str, Any], config: KernelConfig | None) -> Any:
        if self.config_type is None:
            return self.fn(*args, **kwargs)
        return self.fn(*args, config=config, **kwargs)


# A registry entry is an Implementation, or "module.path:ATTRIBUTE" naming one (loaded lazily).
ImplementationRef = Implementation | str
