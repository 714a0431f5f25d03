"""The shared interface every op and backend is written against.

An *op* (`Op`) is one public function's contract: a name, the backends that
implement it (by module path, loaded lazily), and a per-platform priority. A
*backend implementation* (`Implementation`) is a function with exactly the op's
signature (minus `backend=`), the platforms it runs on natively, whether it runs
on CPU in interpret mode, and a `supports(...)` predicate that returns `None` for
"yes" or a sentence saying why not.

Selection, written once for every op:
  * `backend=None`: walk the op's priority for this platform (a matching
    measured `Tuned` rule for this device kind and shape goes first), take the
    first implementation that loads, runs on this platform and `supports(...)`
    the call; `xla` is always the last resort.
  * An op may name, per call, backends to try before its priority
    (`training_order`: a forward + backward pair measured faster for this kind of
    call), and backends to try first when the call is not differentiated
    (`inference_order`: a forward measured faster than the best training pair's).
    When the inference choice differs from the training one, the call runs
    the inference backend and its gradient (under `jax.grad`/`vjp`) the training
    backend's forward and backward: see `_split`.
  * `backend="<name>"`: that implementation, or `UnsupportedError` with the
    reason. `"pallas"` is an alias for the Pallas variant of this platform
    (`pallas_gpu` on GPUs, `pallas_tpu` on TPUs).

The only mutable state is the explicit registry (`OPS`), the lazily-loaded
implementation cache inside each `Op`, and the recorder `explain` installs for
the duration of one trace.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import importlib
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import jax

__all__ = [
    "Decision",
    "Explanation",
    "Implementation",
    "Op",
    "OPS",
    "Tuned",
    "UnsupportedError",
    "current_platform",
    "define_op",
    "explain",
    "interpret_enabled",
    "interpret_mode",
    "register_backend",
    "xla_gpu_deterministic_ops",
]

PLATFORMS = ("cpu", "gpu", "tpu")

# Backend names that ship with forgeax. Users may register others.
BUILTIN_BACKENDS = ("xla", "triton", "pallas_gpu", "pallas_tpu")

# "pallas" names the Pallas variant that targets the current platform.
_PALLAS_ALIAS = {"gpu": ("pallas_gpu",), "tpu": ("pallas_tpu",), "cpu": ("pallas_gpu", "pallas_tpu")}


class UnsupportedError(NotImplementedError):
    """An explicitly requested backend cannot handle this call (the message says why)."""


# ----------------------------------------------------------------------------- runtime

_INTERPRET = contextvars.ContextVar("forgeax_interpret", default=None)


def interpret_enabled() -> bool:
    """Whether kernels should run in their CPU interpreters.

    True inside `with interpret_mode():`, else when the environment variable
    FORGEAX_INTERPRET is set to a true value (1/true/yes).
    """
    forced = _INTERPRET.get()
    if forced is not None:
        return forced
    return os.environ.get("FORGEAX_INTERPRET", "").strip().lower() in ("1", "true", "yes", "on")


@contextlib.contextmanager
def interpret_mode(enabled: bool = True) -> Iterator[None]:
    """Run Pallas and Triton kernels in their interpreters (CPU) within this block.

    Kernels decide at trace time, so a function jitted outside the block keeps
    the mode it was traced with.
    """
    token = _INTERPRET.set(enabled)
    try:
        yield
    finally:
        _INTERPRET.reset(token)


def current_platform() -> str:
    """'cpu', 'gpu' or 'tpu': the platform of JAX's default backend."""
    backend = jax.default_backend()
    if backend in ("cuda", "rocm", "gpu"):
        return "gpu"
    return backend if backend in PLATFORMS else "cpu"


# ----------------------------------------------------------------------------- implementations


def _supports_everything(*args: Any, **kwargs: Any) -> str | None:
    del args, kwargs
    return None


@dataclasses.dataclass(frozen=True)
class Implementation:
    """One backend's implementation of one op.

    Attributes:
      fn: the implementation; same positional and keyword arguments as the
        public op, without `backend`. Must be differentiable (a `custom_vjp`
        for kernels) and traceable under `jax.jit`.
      platforms: platforms where it runs natively.
      interpretable: whether it also runs on CPU when `interpret_enabled()`.
      supports: `supports(*args, **kwargs) -> None | str`; `None` if the call is
        handled, else the reason it is not. Called with the op's arguments
        (arrays may be tracers: look at shapes and dtypes only).
    """

    fn: Callable[..., Any]
    platforms: frozenset[str] = frozenset(PLATFORMS)
    interpretable: bool = False
    supports: Callable[..., str | None] = _supports_everything

    def __post_init__(self) -> None:
        object.__setattr__(self, "platforms", frozenset(self.platforms))
        unknown = self.platforms - set(PLATFORMS)
        if unknown:
            raise ValueError(f"platforms: unknown {sorted(unknown)}; expected a subset of {PLATFORMS}")

    def why_not(self, platform: str, args: Sequence[Any], kwargs: Mapping[str, Any]) -> str | None:
        """None if this implementation can run the call on `platform`, else why not."""
        if platform not in self.platforms:
            if not (platform == "cpu" and self.interpretable and interpret_enabled()):
                hint = " (set FORGEAX_INTERPRET=1 to run its interpreter on CPU)" if self.interpretable else ""
                return f"runs on {'/'.join(sorted(self.platforms))}, this is {platform}{hint}"
        return self.supports(*args, **kwargs)


# A registry entry is an Implementation, or "module.path:ATTRIBUTE" naming one.
ImplementationRef = Implementation | str


@dataclasses.dataclass(frozen=True)
class Tuned:
    """A measured preference that overrides an op's platform priority.

    On devices whose `device_kind` starts with `device`, calls whose first
    argument's last axis lies in [min_last_dim, max_last_dim] try `order` first
    (then the platform priority). `evidence` names the benchmark result that
    justifies it.
    """

    device: str
    order: tuple[str, ...]
    evidence: str
    min_last_dim: int = 0
    max_last_dim: int | None = None

    def matches(self, device_kind: str, args: Sequence[Any]) -> bool:
        if not device_kind.startswith(self.device) or not args or not hasattr(args[0], "shape") or not args[0].shape:
            return False
        last = args[0].shape[-1]
        return self.min_last_dim <= last and (self.max_last_dim is None or last <= self.max_last_dim)


def xla_gpu_deterministic_ops() -> bool:
    """Whether XLA_FLAGS turns on --xla_gpu_deterministic_ops (JAX's switch for reproducible GPU ops)."""
    value = None
    for flag in os.environ.get("XLA_FLAGS", "").split():
        name, _, setting = flag.partition("=")
        if name == "--xla_gpu_deterministic_ops":
            value = setting.lower() in ("", "true", "1")
    return bool(value)


def current_device_kind() -> str:
    """The default device's kind, e.g. 'NVIDIA H200' (what `Tuned.device` matches)."""
    return jax.devices()[0].device_kind


def current_compute_capability() -> str:
    """The default device's CUDA compute capability, e.g. '9.0'; '' when it reports none (CPU, TPU)."""
    return str(getattr(jax.devices()[0], "compute_capability", ""))


def current_compute_capability_major() -> int:
    """The major version of `current_compute_capability()` (9 on Hopper); 0 when there is none."""
    major = current_compute_capability().split(".")[0]
    return int(major) if major.isdigit() else 0


def gpu_sm_count() -> int:
    """Streaming multiprocessors of the first local GPU (what persistent grids size to); 132, an
    H100/H200 SXM's, when there is no GPU backend (interpret mode, cross-lowering on CPU)."""
    try:
        return int(getattr(jax.local_devices(backend="gpu")[0], "core_count", 0) or 132)
    except RuntimeError:
        return 132


@dataclasses.dataclass(frozen=True)
class Decision:
    """Which backend one op call used, and why each better-ranked one was skipped.

    `gradient_backend` is set when a differentiated call runs another backend's forward and
    backward (the op's `inference_order` picked `backend` for the call itself)."""

    op: str
    backend: str
    skipped: tuple[tuple[str, str], ...]
    shapes: tuple[str, ...]
    gradient_backend: str | None = None

    def __str__(self) -> str:
        target = self.backend
        if self.gradient_backend is not None:
            target = f"{self.backend} (under a gradient: {self.gradient_backend})"
        lines = [f"{self.op}({', '.join(self.shapes)}) -> {target}"]
        lines += [f"    skipped {name}: {reason}" for name, reason in self.skipped]
        return "\n".join(lines)


_RECORDER: contextvars.ContextVar[list[Decision] | None] = contextvars.ContextVar("forgeax_recorder", default=None)


# An op's per-call preference: (platform, args, kwargs) -> backends to try first.
BackendOrder = Callable[[str, Sequence[Any], Mapping[str, Any]], Sequence[str]]


def _split(inference: Implementation, training: Implementation, args: Sequence[Any], kwargs: Mapping[str, Any]) -> Any:
    """`inference.fn(*args, **kwargs)`, differentiated as `training.fn`: under jax.grad / vjp the
    forward and backward are the training backend's (its forward recomputes the output, so the
    value and its gradient come from one backend). Both compute the op's contract; they may
    differ by rounding. Keyword arguments are static (the ops pass only hashable options there)."""

    @jax.custom_vjp
    def run(*args):
        return inference.fn(*args, **kwargs)

    def forward(*args):
        return jax.vjp(lambda *a: training.fn(*a, **kwargs), *args)

    def backward(pull, cotangent):
        return pull(cotangent)

    run.defvjp(forward, backward)
    return run(*args)


def _describe(value: Any) -> str:
    if hasattr(value, "shape") and hasattr(value, "dtype"):
        return f"{jax.numpy.dtype(value.dtype).name}{list(value.shape)}"
    return repr(value)


class Op:
    """One op: its backends (lazily loaded), their priority, and dispatch."""

    def __init__(
        self,
        name: str,
        backends: Mapping[str, ImplementationRef],
        priority: Mapping[str, Sequence[str]],
        tuned: Sequence[Tuned] = (),
        inference_order: BackendOrder | None = None,
        training_order: BackendOrder | None = None,
    ) -> None:
        if "xla" not in backends:
            raise ValueError(f"op {name!r}: backends must include the 'xla' reference")
        self.name = name
        self._refs: dict[str, ImplementationRef] = dict(backends)
        self._loaded: dict[str, Implementation | str] = {}  # cache: Implementation or import error
        self._priority: dict[str, tuple[str, ...]] = {p: tuple(priority.get(p, ())) for p in PLATFORMS}
        self.tuned: tuple[Tuned, ...] = tuple(tuned)
        self.inference_order = inference_order
        self.training_order = training_order

    # -- registry ---------------------------------------------------------------------------
    @property
    def backends(self) -> tuple[str, ...]:
        return tuple(self._refs)

    def priority(self, platform: str) -> tuple[str, ...]:
        """Backends tried by `backend=None` on `platform`, best first; `xla` last."""
        order = [b for b in self._priority.get(platform, ()) if b in self._refs and b != "xla"]
        return tuple(order) + ("xla",)

    def add_backend(self, backend: str, impl: ImplementationRef, *, prefer_on: Sequence[str] = ()) -> None:
        """Registers (or replaces) `backend`; `prefer_on` puts it first on those platforms."""
        self._refs[backend] = impl
        self._loaded.pop(backend, None)
        for platform in prefer_on:
            if platform not in PLATFORMS:
                raise ValueError(f"prefer_on: unknown platform {platform!r}; expected one of {PLATFORMS}")
            rest = tuple(b for b in self._priority[platform] if b != backend)
            self._priority[platform] = (backend,) + rest

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
    def _preferring(self, first: Sequence[str], order: Sequence[str]) -> tuple[str, ...]:
        """`order` with the registered backends of `first` moved to the front, in first's order."""
        front = tuple(b for b in first if b in self._refs)
        return front + tuple(b for b in order if b not in front)

    def _candidates(self, backend: str | None, platform: str, args: Sequence[Any]) -> tuple[str, ...]:
        if backend is None:
            order = self.priority(platform)
            if self.tuned and platform != "cpu":
                kind = current_device_kind()
                rule = next((t for t in self.tuned if t.matches(kind, args)), None)
                if rule is not None:
                    order = self._preferring(rule.order, order)
            return order
        if backend == "pallas" and "pallas" not in self._refs:
            return tuple(b for b in _PALLAS_ALIAS[platform] if b in self._refs) or ("pallas_gpu",)
        if not isinstance(backend, str) or backend not in self._refs:
            known = sorted(set(self._refs) | ({"pallas"} if any(b.startswith("pallas_") for b in self._refs) else set()))
            raise ValueError(f"backend: unknown backend {backend!r} for {self.name}; expected None or one of {known}")
        return (backend,)

    def select(self, backend: str | None, args: Sequence[Any], kwargs: Mapping[str, Any], *,
               prefer: Sequence[str] = ()) -> tuple[str, Implementation, tuple[tuple[str, str], ...]]:
        """(name, implementation, skipped) for this call; raises UnsupportedError if an explicit choice cannot run it.

        prefer: with backend=None, backends to try before the priority (the op's `training_order`
        or `inference_order`)."""
        platform = current_platform()
        candidates = self._candidates(backend, platform, args)
        if backend is None:
            candidates = self._preferring(prefer, candidates)
        skipped: list[tuple[str, str]] = []
        for name in candidates:
            impl = self.implementation(name) if name in self._refs else f"{name} is not registered for {self.name}"
            reason = impl if isinstance(impl, str) else impl.why_not(platform, args, kwargs)
            if reason is None:
                return name, impl, tuple(skipped)
            skipped.append((name, reason))
        detail = "; ".join(f"{n}: {r}" for n, r in skipped)
        raise UnsupportedError(f"{self.name}: backend={backend!r} cannot run this call on {platform}: {detail}")

    def __call__(self, *args: Any, backend: str | None = None, **kwargs: Any) -> Any:
        first: tuple[str, ...] = ()
        if backend is None and self.training_order is not None:
            first = tuple(self.training_order(current_platform(), args, kwargs))
        name, impl, skipped = self.select(backend, args, kwargs, prefer=first)
        gradient_name = None
        prefer: tuple[str, ...] = ()
        if backend is None and self.inference_order is not None:
            prefer = tuple(self.inference_order(current_platform(), args, kwargs))
        if prefer:  # else the forward-only choice is the one above
            # The training preference stays next in line, should no inference one run the call.
            inference_name, inference_impl, inference_skipped = self.select(None, args, kwargs, prefer=prefer + first)
            if inference_name != name:
                gradient_name, training = name, impl
                name, impl, skipped = inference_name, inference_impl, inference_skipped
        recorder = _RECORDER.get()
        if recorder is not None:
            shapes = tuple(_describe(a) for a in args)
            recorder.append(Decision(self.name, name, skipped, shapes, gradient_name))
        if gradient_name is not None:
            return _split(impl, training, args, kwargs)
        return impl.fn(*args, **kwargs)


# The registry: op name -> Op.
OPS: dict[str, Op] = {}


def define_op(
    name: str,
    backends: Mapping[str, ImplementationRef],
    priority: Mapping[str, Sequence[str]],
    tuned: Sequence[Tuned] = (),
    inference_order: BackendOrder | None = None,
    training_order: BackendOrder | None = None,
) -> Op:
    """Creates and registers a new op (forgeax's own ops are defined this way too)."""
    if name in OPS:
        raise ValueError(f"name: op {name!r} is already defined")
    op = Op(name, backends, priority, tuned, inference_order, training_order)
    OPS[name] = op
    return op


def register_backend(op: str, backend: str, impl: ImplementationRef, *, prefer_on: Sequence[str] = ()) -> None:
    """Registers a user implementation `backend` for `op` (an existing op name).

    `prefer_on=("gpu",)` makes `backend=None` try it first on GPUs; otherwise it
    is used only when asked for by name.
    """
    if op not in OPS:
        raise ValueError(f"op: unknown op {op!r}; expected one of {sorted(OPS)}")
    OPS[op].add_backend(backend, impl, prefer_on=prefer_on)


# ----------------------------------------------------------------------------- explain


@dataclasses.dataclass(frozen=True)
class Explanation:
    """The backend decisions of every forgeax op call in one traced function."""

    decisions: tuple[Decision, ...]

    def __str__(self) -> str:
        if not self.decisions:
            return "no forgeax op calls"
        return "\n".join(str(d) for d in self.decisions)

    def backends(self) -> tuple[str, ...]:
        return tuple(d.backend for d in self.decisions)


def explain(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Explanation:
    """Traces `fn(*args, **kwargs)` abstractly and reports each op's backend choice.

    Nothing runs on the device. JAX's trace caches are cleared first so that
    functions already jitted are traced again (their next call recompiles).
    """
    decisions: list[Decision] = []
    token = _RECORDER.set(decisions)
    try:
        jax.clear_caches()
        jax.eval_shape(fn, *args, **kwargs)
    finally:
        _RECORDER.reset(token)
    return Explanation(tuple(decisions))
