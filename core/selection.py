"""Backend selection as data: a priority per platform and ordered rules, read from JSON.

An op's selection file (`ops/rules/<op>.json`) holds

    {"op": "attention",
     "priority": {"gpu": ["cudnn", "pallas_gpu", "triton"], "tpu": ["pallas_tpu"], "cpu": []},
     "rules": [
       {"id": "causal-head-dim-64-96-192",
        "platform": "gpu", "devices": ["NVIDIA H100", "NVIDIA H200"],
        "calls": "all",
        "when": {"causal": true, "window": false, "head_dim": [64, 96, 192], ...},
        "prefer": ["pallas_gpu"],
        "why": "one sentence",
        "evidence": {"file": "benchmarks/results/....json", "claims": [...]}}]}

A rule fires for a call on its platform, on a device whose kind starts with one of `devices`
(empty: any device), when every condition of `when` holds for the op's call features
(`Op.features(args, kwargs)`, a dict of plain values): a scalar must equal the feature, a
list must contain it, `{"min": a, "max": b}` bounds it (inclusive, either side optional).
`calls` is "all" (forward and backward of every call) or "forward_only" (calls that are not
differentiated: the call runs the rule's backend, its gradient the "all" choice; see
`dispatch._split`). The first rule of each kind that fires puts its `prefer` backends ahead of
the priority; `xla` is always the last resort. Devices no rule names get the plain priority.

`evidence.claims` are machine-checked comparisons (`tools/selection.py --check`): each
`{"faster": PATH, "than": PATH, "margin": m}` says the number at `faster` is at most
`(1 + m)` times the number at `than` in the evidence file, a PATH being '/'-separated keys
and `[key=value,...]` list selections (the first element whose fields match).
"""

from __future__ import annotations

import dataclasses
import importlib.resources
import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from forgeax.core.runtime import PLATFORMS

CALL_KINDS = ("all", "forward_only")

# Features an op computes for its rules: (args, kwargs) -> {name: plain value}.
Features = Callable[[Sequence[Any], Mapping[str, Any]], Mapping[str, Any]]


def _condition_holds(condition: Any, value: Any) -> bool:
    if isinstance(condition, Mapping):
        low, high = condition.get("min"), condition.get("max")
        return (low is None or value >= low) and (high is None or value <= high)
    if isinstance(condition, (list, tuple)):
        return value in condition
    return value == condition


def _check_condition(rule_id: str, name: str, condition: Any) -> None:
    if isinstance(condition, Mapping) and (not condition or set(condition) - {"min", "max"}):
        raise ValueError(f"rule {rule_id!r}: condition {name!r} must be a value, a list or {{'min', 'max'}}, got {condition!r}")


@dataclasses.dataclass(frozen=True)
class Rule:
    """One measured preference (see the module docstring for the fields)."""

    id: str
    prefer: tuple[str, ...]
    evidence: Mapping[str, Any]
    platform: str = "gpu"
    devices: tuple[str, ...] = ()
    calls: str = "all"
    when: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    why: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "prefer", tuple(self.prefer))
        object.__setattr__(self, "devices", tuple(self.devices))
        if self.platform not in PLATFORMS:
            raise ValueError(f"rule {self.id!r}: platform {self.platform!r} is not one of {PLATFORMS}")
        if self.calls not in CALL_KINDS:
            raise ValueError(f"rule {self.id!r}: calls {self.calls!r} is not one of {CALL_KINDS}")
        if not self.prefer:
            raise ValueError(f"rule {self.id!r}: prefer names no backend")
        if not (isinstance(self.evidence, Mapping) and self.evidence.get("file")):
            raise ValueError(f"rule {self.id!r}: evidence must name a committed result file")
        for name, condition in self.when.items():
            _check_condition(self.id, name, condition)

    def applies_to(self, platform: str, device_kind: str) -> bool:
        return platform == self.platform and (not self.devices or any(device_kind.startswith(d) for d in self.devices))

    def fires(self, features: Mapping[str, Any]) -> bool:
        for name, condition in self.when.items():
            if name not in features:
                raise KeyError(f"rule {self.id!r}: the op computes no feature {name!r} (it has {sorted(features)})")
            if not _condition_holds(condition, features[name]):
                return False
        return True


@dataclasses.dataclass(frozen=True)
class Selection:
    """An op's priority per platform and its rules, best first."""

    priority: Mapping[str, tuple[str, ...]]
    rules: tuple[Rule, ...] = ()

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Selection:
        priority = {p: tuple(data.get("priority", {}).get(p, ())) for p in PLATFORMS}
        rules = tuple(Rule(**{k: (tuple(v) if k in ("prefer", "devices") else v) for k, v in r.items()})
                      for r in data.get("rules", ()))
        ids = [r.id for r in rules]
        if len(ids) != len(set(ids)):
            raise ValueError(f"rules: ids must be unique, got {ids}")
        return cls(priority, rules)

    @classmethod
    def load(cls, package: str, filename: str) -> Selection:
        """The selection in a JSON file shipped as package data (`ops/rules/<op>.json`)."""
        return cls.from_dict(json.loads(importlib.resources.files(package).joinpath(filename).read_text()))

    def with_first(self, backend: str, platforms: Sequence[str]) -> Selection:
        """This selection with `backend` first in the priority of `platforms`."""
        priority = dict(self.priority)
        for platform in platforms:
            if platform not in PLATFORMS:
                raise ValueError(f"prefer_on: unknown platform {platform!r}; expected one of {PLATFORMS}")
            priority[platform] = (backend,) + tuple(b for b in priority.get(platform, ()) if b != backend)
        return dataclasses.replace(self, priority=priority)

    def fired(self, platform: str, device_kind: str, features: Callable[[], Mapping[str, Any]]) -> dict[str, Rule]:
        """{"all": rule, "forward_only": rule}: the first rule of each kind that fires for this call.

        `features` is called only when a rule could apply on this platform and device."""
        candidates = [r for r in self.rules if r.applies_to(platform, device_kind)]
        if not candidates:
            return {}
        values = features()
        fired: dict[str, Rule] = {}
        for rule in candidates:
            if rule.calls not in fired and rule.fires(values):
                fired[rule.calls] = rule
        return fired


def resolve_path(data: Any, path: str) -> Any:
    """The value at `path` ('a/b/[k=v,k2=v2]/c') in parsed JSON (see the module docstring)."""
    value = data
    for part in path.strip("/").split("/"):
        if part.startswith("[") and part.endswith("]"):
            wanted = dict(item.split("=", 1) for item in part[1:-1].split(","))
            matches = [e for e in value if isinstance(e, Mapping) and all(str(e.get(k)) == v for k, v in wanted.items())]
            if not matches:
                raise KeyError(f"no element matches {part} in {path!r}")
            value = matches[0]
        elif isinstance(value, list):
            value = value[int(part)]
        else:
            if part not in value:
                raise KeyError(f"no key {part!r} in {path!r} (keys: {sorted(value)[:12]})")
            value = value[part]
    return value


def check_claims(rule: Rule, root: str) -> list[str]:
    """Re-derives a rule's claims from its evidence file under `root`: [] if all hold, else
    one line per failed claim."""
    import os  # noqa: PLC0415

    path = os.path.join(root, rule.evidence["file"])
    if not os.path.exists(path):
        return [f"{rule.id}: evidence file {rule.evidence['file']} is missing"]
    with open(path) as f:
        data = json.load(f)
    failures = []
    claims = rule.evidence.get("claims", ())
    if not claims:
        failures.append(f"{rule.id}: evidence states no checkable claim")
    for claim in claims:
        try:
            faster, than = float(resolve_path(data, claim["faster"])), float(resolve_path(data, claim["than"]))
        except (KeyError, IndexError, TypeError, ValueError) as e:
            failures.append(f"{rule.id}: {claim}: {e}")
            continue
        margin = float(claim.get("margin", 0.0))
        if not faster <= than * (1 + margin):
            failures.append(f"{rule.id}: {claim['faster']} = {faster:.4g} is not <= (1 + {margin}) x {claim['than']} = {than:.4g}")
    return failures
