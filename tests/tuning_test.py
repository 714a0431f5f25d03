"""Tunings: JSON round trip and merge, the context manager's precedence, stale entries, fallback
when a tuned backend refuses a call, fwd and fwd+bwd entries (a split), autotune (inside
jax.grad too) and FORGEAX_AUTOTUNE."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import threading
import time

import jax
import jax.numpy as jnp
import pytest

import forgeax
from forgeax import core, ops
from forgeax.core import autotuning, tuning
from forgeax.core.tuning import StaleTuningWarning, Tuning, TuningEntry


@dataclasses.dataclass(frozen=True, kw_only=True)
class ScaleConfig(forgeax.KernelConfig):
    scale: int = 3


COMPILE_THREADS: set[str] = set()  # the threads that traced a `kern` call
XLA_THREADS: set[str] = set()  # the threads that traced an `xla` call of the probe


def _doubled(x):
    XLA_THREADS.add(threading.current_thread().name)
    return 2 * x


def _scaled(x, *, config):
    COMPILE_THREADS.add(threading.current_thread().name)
    if config.scale == 13:
        raise RuntimeError("13 does not compile")
    if config.scale == 14:
        time.sleep(6)  # a compile that runs past autotune's timeout
    return x * config.scale


@pytest.fixture
def probe():
    """A test op whose config changes its result (so a test sees which config a call compiled
    with): `xla` doubles, `kern` multiplies by its config's scale and refuses odd widths."""
    kern = forgeax.Implementation(
        fn=_scaled, platforms=set(core.PLATFORMS), config_type=ScaleConfig,
        heuristic_config=lambda x: ScaleConfig(), candidate_configs=lambda x: [ScaleConfig(scale=s) for s in (3, 4, 13) + ((14,) if x.shape[0] == 3 else ())],
        supports=lambda x: None if x.shape[-1] % 2 == 0 else "odd widths are not handled")
    op = forgeax.define_op("tuning_probe", {"xla": forgeax.Implementation(fn=_doubled), "kern": kern},
                           priority={p: ("kern",) for p in core.PLATFORMS})
    yield op
    del core.OPS["tuning_probe"]


def _entry(x, backend, config=None, device=None, **kwargs):
    return TuningEntry(device or core.current_device_kind(), "tuning_probe", tuning.signature((x,), {}), backend, config, **kwargs)


def test_round_trip_and_merge_right_wins():
    a = Tuning([TuningEntry("NVIDIA H100", "attention", "k1", "triton", {"block_m": 64}, 1e-3, "fwd+bwd"),
                TuningEntry("NVIDIA H100", "attention", "k1", "xla", None, 2e-3, "fwd+bwd"),
                TuningEntry("NVIDIA H100", "rms_norm", "k2", "xla")], report=[{"op": "attention", "error": "boom"}])
    again = Tuning.loads(a.dumps())
    assert again == a and again.entries == a.entries and again.report == a.report
    data = json.loads(a.dumps())
    assert data["forgeax"] == forgeax.__version__
    assert set(data["entries"][0]) == {"device", "op", "key", "backend", "config", "seconds", "timed"}
    b = Tuning([TuningEntry("NVIDIA H100", "attention", "k1", "pallas_gpu", {"block_q": 128}, 5e-4)])
    merged = a | b
    assert [e.backend for e in merged.lookup("NVIDIA H100 80GB HBM3", "attention", "k1")] == ["pallas_gpu", "triton", "xla"]
    assert [e.backend for e in (b | a).lookup("NVIDIA H100", "attention", "k1")] == ["triton", "xla", "pallas_gpu"]
    assert len(merged) == 4 and merged[("NVIDIA H100", "rms_norm", "k2", "xla", "fwd")].backend == "xla"
    assert merged.lookup("NVIDIA H200", "attention", "k1") == ()
    with pytest.raises(ValueError, match="not a forgeax tuning"):
        Tuning.loads('{"entries": []}')


def test_merge_and_round_trip_keep_each_mode():
    a = Tuning([TuningEntry("NVIDIA H100", "rms_norm", "k", "xla", None, 2e-4, "fwd"),
                TuningEntry("NVIDIA H100", "rms_norm", "k", "triton", None, 5e-4, "fwd+bwd")])
    b = Tuning([TuningEntry("NVIDIA H100", "rms_norm", "k", "triton", None, 1e-4, "fwd"),
                TuningEntry("NVIDIA H100", "rms_norm", "k", "xla", None, 9e-4, "fwd+bwd")])
    merged = a | b
    assert len(merged) == 4  # an entry of one mode never replaces one of the other
    assert merged[("NVIDIA H100", "rms_norm", "k", "triton", "fwd+bwd")].seconds == 5e-4
    assert [(e.backend, e.timed) for e in merged.lookup("NVIDIA H100", "rms_norm", "k")] == [
        ("triton", "fwd"), ("xla", "fwd+bwd"), ("xla", "fwd"), ("triton", "fwd+bwd")]  # b first, per mode
    again = a | Tuning([TuningEntry("NVIDIA H100", "rms_norm", "k", "xla", None, 3e-4, "fwd")])
    assert len(again) == 2 and again[("NVIDIA H100", "rms_norm", "k", "xla", "fwd")].seconds == 3e-4  # same mode: replaced
    assert Tuning.loads(merged.dumps()).entries == merged.entries


def test_fwd_and_fwd_bwd_entries_split_forward_and_gradient(probe):
    x = jnp.ones((4, 6))
    f = jax.jit(lambda x: jnp.sum(probe(x)))  # traced once: the split decides per use, not per trace
    with Tuning([_entry(x, "xla", seconds=1e-6), _entry(x, "kern", {"scale": 5}, seconds=2e-6, timed="fwd+bwd"),
                 _entry(x, "xla", seconds=3e-6, timed="fwd+bwd")]):
        assert float(f(x)) == 2.0 * 24  # forward only: the fwd entry's xla
        assert float(jax.grad(f)(x)[0, 0]) == 5.0  # differentiated: the fwd+bwd entry's kern
        assert float(jax.grad(jax.checkpoint(jax.jit(f)))(x)[0, 0]) == 5.0
        value, _ = jax.value_and_grad(f)(x)
        assert float(value) == 5.0 * 24  # a value and its gradient come from one backend
        decision = forgeax.explain(f, x).decisions[0]
    assert (decision.backend, decision.gradient_backend) == ("xla", "kern")
    assert decision.rule.startswith("active tuning: tuning entry tuning_probe[float32[4,6]]") and decision.rule.endswith("-> xla, 0.001 ms fwd")
    assert decision.gradient.startswith("kern with ScaleConfig(scale=5) (active tuning: tuning entry")
    assert decision.gradient.endswith("-> kern, 0.002 ms fwd+bwd)")
    f = jax.jit(lambda x: jnp.sum(probe(x)))  # a function jitted again: traced under the next tuning
    with Tuning([_entry(x, "kern", {"scale": 4}), _entry(x, "kern", {"scale": 6}, timed="fwd+bwd")]):
        assert float(f(x)) == 4.0 * 24 and float(jax.grad(f)(x)[0, 0]) == 6.0  # one backend, two configs
    with Tuning([_entry(x, "kern", {"scale": 4}), _entry(x, "kern", {"scale": 4}, timed="fwd+bwd")]):
        assert forgeax.explain(f, x).decisions[0].gradient is None  # the same in both modes: no split
    y = jnp.ones((4, 5))  # kern refuses odd widths: the gradient falls back to the fwd entries' xla
    with Tuning([_entry(y, "xla"), _entry(y, "kern", {"scale": 5}, timed="fwd+bwd")]):
        decision = forgeax.explain(jax.grad(lambda y: jnp.sum(probe(y))), y).decisions[0]
    assert (decision.backend, decision.gradient) == ("xla", None) and decision.skipped[0][0] == "kern"


def test_a_file_with_one_mode_serves_both(probe):
    x = jnp.ones((4, 6))
    f = lambda x: jnp.sum(probe(x))  # noqa: E731
    old = json.loads(Tuning([_entry(x, "kern", {"scale": 5})]).dumps())
    del old["entries"][0]["timed"]  # an older file: no mode, read as fwd
    for entries in (old["entries"], [dict(old["entries"][0], timed="fwd+bwd")]):
        with Tuning.loads(json.dumps(dict(old, entries=entries))):
            assert float(jax.jit(f)(x)) == 5.0 * 24 and float(jax.grad(f)(x)[0, 0]) == 5.0
            assert forgeax.explain(jax.grad(f), x).decisions[0].gradient is None


def test_active_tuning_sets_backend_and_config_and_explain_names_the_entry(probe):
    x = jnp.ones((4, 6))
    assert float(probe(x)[0, 0]) == 3.0  # priority: kern with the heuristic config
    with Tuning([_entry(x, "kern", {"scale": 5})]):
        assert float(jax.jit(probe)(x)[0, 0]) == 5.0  # compiled with the tuned config
        report = forgeax.explain(probe, x)
        assert float(probe(x, config=ScaleConfig(scale=7))[0, 0]) == 7.0  # explicit config wins
        assert float(probe(x, backend="xla")[0, 0]) == 2.0  # explicit backend wins
    decision = report.decisions[0]
    assert decision.backend == "kern" and decision.config == "ScaleConfig(scale=5) [active tuning]"
    assert decision.rule.startswith("active tuning: tuning entry tuning_probe[float32[4,6]]")
    assert ("xla", "could run this call") in decision.alternatives
    assert float(probe(x)[0, 0]) == 3.0  # the block ended
    with Tuning([_entry(x, "xla", seconds=1e-6), _entry(x, "kern", {"scale": 4}, seconds=2e-6)]):
        assert float(probe(x)[0, 0]) == 2.0  # the tuning's first backend beats the priority
        assert float(probe(x, backend="kern")[0, 0]) == 4.0  # a named backend takes its tuned config
        assert "1e-06" not in str(forgeax.explain(probe, x)) and "0.002 ms fwd" in str(forgeax.explain(probe, x))


def test_nested_tunings_merge_and_threads_do_not_share(probe):
    import threading

    x = jnp.ones((2, 4))
    seen = []
    with Tuning([_entry(x, "kern", {"scale": 5})]):
        with Tuning([_entry(jnp.ones((2, 8)), "kern", {"scale": 6})]):
            assert float(probe(x)[0, 0]) == 5.0 and float(probe(jnp.ones((2, 8)))[0, 0]) == 6.0
            thread = threading.Thread(target=lambda: seen.append(float(probe(x)[0, 0])))
            thread.start()
            thread.join()
    assert seen == [3.0]


def test_stale_and_foreign_entries_are_ignored_with_a_warning(probe):
    x = jnp.ones((4, 6))
    old = json.loads(Tuning([_entry(x, "kern", {"scale": 5})]).dumps())
    old["forgeax"] = "0.0.1"
    with pytest.warns(StaleTuningWarning, match="written by forgeax 0.0.1"):
        assert len(Tuning.loads(json.dumps(old))) == 0
    with pytest.warns(StaleTuningWarning, match="entries for \\['NVIDIA H200'\\] are ignored"):
        with Tuning([_entry(x, "kern", {"scale": 5}, device="NVIDIA H200")]):
            assert float(probe(x)[0, 0]) == 3.0
    with Tuning([_entry(x, "kern", {"scale": 5, "block": 64})]):
        with pytest.warns(StaleTuningWarning, match="unknown fields \\['block'\\]"):
            assert float(probe(x)[0, 0]) == 3.0  # the config no longer fits: the heuristic


def test_selection_falls_back_when_the_tuned_backend_refuses(probe):
    x = jnp.ones((4, 5))  # odd width: kern refuses
    with Tuning([_entry(x, "kern", {"scale": 5})]):
        assert float(probe(x)[0, 0]) == 2.0
        decision = forgeax.explain(probe, x).decisions[0]
    assert decision.backend == "xla"
    assert decision.skipped[0] == ("kern", "odd widths are not handled (refused the active tuning entry)")


def test_autotune_finds_calls_inside_grad_times_them_and_round_trips(probe):
    x, scale = jnp.ones((3, 8)), jnp.ones((8,))

    def loss(x):
        return jnp.sum(ops.rms_norm(probe(x), scale))

    calls = autotuning.find_calls(jax.grad(loss), x)
    assert [(c.op, c.differentiated) for c in calls] == [("tuning_probe", True), ("rms_norm", True)]
    assert [c.differentiated for c in autotuning.find_calls(loss, x)] == [False, False]
    assert [c.differentiated for c in autotuning.find_calls(jax.grad(jax.checkpoint(jax.jit(loss))), x)] == [True, True]
    assert [c.differentiated for c in autotuning.find_calls(loss, x, grad=True)] == [True, True]
    tuned = forgeax.autotune(jax.grad(loss), x, rounds=1, calls=1, progress=False, timeout_s=3)
    probe_entries = tuned.lookup(core.current_device_kind(), "tuning_probe", tuning.signature((x,), {}))
    assert {e.backend for e in probe_entries} == {"xla", "kern"}
    assert all(e.timed == "fwd+bwd" and e.seconds > 0 for e in probe_entries)
    assert [e.seconds for e in probe_entries] == sorted(e.seconds for e in probe_entries)
    assert any(e.op == "rms_norm" and e.backend == "xla" for e in tuned.entries)
    failed = [r for r in tuned.report if "error" in r and r["op"] == "tuning_probe"]
    assert [(r["backend"], r["config"]) for r in failed] == [("kern", {"scale": 13}), ("kern", {"scale": 14})]
    assert "13 does not compile" in failed[0]["error"] and "TimeoutError" in failed[1]["error"]  # recorded, skipped
    assert Tuning.loads(tuned.dumps()) == tuned
    with tuned:
        decision = forgeax.explain(jax.grad(loss), x).decisions[0]
    assert decision.backend == probe_entries[0].backend and decision.rule.startswith("active tuning")


def test_autotune_times_a_call_made_plain_and_differentiated_in_both_modes(probe):
    x = jnp.ones((2, 8))

    def both(x):
        return probe(x), jax.grad(lambda x: jnp.sum(probe(x)))(x)

    assert sorted(c.differentiated for c in autotuning.find_calls(both, x)) == [False, True]
    tuned = forgeax.autotune(both, x, rounds=1, calls=1, progress=False, timeout_s=3, max_configs=2)
    entries = tuned.lookup(core.current_device_kind(), "tuning_probe", tuning.signature((x,), {}))
    assert sorted((e.timed, e.backend) for e in entries) == [("fwd", "kern"), ("fwd", "xla"), ("fwd+bwd", "kern"), ("fwd+bwd", "xla")]


def test_autotune_compiles_a_serial_backend_alone_and_the_rest_in_the_pool(probe, monkeypatch):
    # cuDNN's first runs failed on an H200 while other threads compiled: a backend in
    # SERIAL_COMPILE compiles in the calling thread, after the other candidates' pooled compiles.
    x = jnp.ones((2, 8))
    here = threading.current_thread().name
    for serial, want_kern_here in ((frozenset(), False), (frozenset({"kern"}), True)):
        monkeypatch.setattr(autotuning, "SERIAL_COMPILE", serial)
        COMPILE_THREADS.clear()
        XLA_THREADS.clear()
        forgeax.autotune(jax.jit(probe), x, rounds=1, calls=1, progress=False, timeout_s=5, max_configs=2, workers=4)
        assert (COMPILE_THREADS == {here}) == want_kern_here
        assert XLA_THREADS and here not in XLA_THREADS  # xla's compiles stay in the pool either way


def test_compile_all_runs_serial_keys_after_the_pooled_ones():
    order = []
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        got = autotuning.compile_all({k: (lambda k=k: (order.append(k), k)[1]) for k in ("a", "cudnn", "b")}, pool,
                                     serial=lambda k: k == "cudnn")
    assert got == {"a": "a", "cudnn": "cudnn", "b": "b"} and list(got) == ["a", "cudnn", "b"]
    assert order[-1] == "cudnn" and sorted(order[:2]) == ["a", "b"]


def test_autotune_inputs_take_integer_values_from_the_functions_arguments():
    sizes = jnp.array([3, 0, 5], jnp.int32)
    call = tuning.Call.of("ragged_dot", (jnp.ones((8, 4)), jnp.ones((3, 4, 2)), sizes, jnp.ones(5, jnp.int32)), {})
    lhs, rhs, got, zeros = autotuning.random_inputs(call, given=[jnp.ones(2, jnp.int32), sizes])
    assert lhs.shape == (8, 4) and float(jnp.std(lhs)) > 0.1 and rhs.dtype == jnp.float32
    assert got.tolist() == [3, 0, 5] and zeros.tolist() == [0] * 5


def test_autotune_times_a_gradient_with_a_random_output_gradient():
    # With the gradient of a plain sum (a constant cotangent) XLA folds the output gradient away
    # and times the XLA backend without the read every backward pays in a model.
    x, scale = jnp.ones((4, 8)), jnp.ones(8)
    call = tuning.Call.of("rms_norm", (x, scale), {"eps": 1e-6})
    call = dataclasses.replace(call, differentiated=True)
    op = core.OPS["rms_norm"]
    args = autotuning.random_inputs(call)
    (ct,) = autotuning.cotangents(op, call, args)
    assert ct.shape == x.shape and float(jnp.std(ct)) > 0.1
    timed = autotuning._build(op, call, "xla", None)
    _, (dx, dscale) = timed(*args, ct)
    _, (dx_ones, _) = timed(*args, jnp.ones_like(ct))
    want_dx = jax.vjp(lambda a: ops.rms_norm(a, args[1], backend="xla"), args[0])[1](ct)[0]
    assert float(jnp.max(jnp.abs(dx - want_dx))) < 1e-5 and float(jnp.max(jnp.abs(dx - dx_ones))) > 1e-3
    assert autotuning.cotangents(op, dataclasses.replace(call, differentiated=False), args) == ()


def test_forgeax_autotune_tunes_each_new_call_once(probe, monkeypatch):
    monkeypatch.setenv("FORGEAX_AUTOTUNE", "1")
    x = jnp.ones((2, 10))
    key = tuning.signature((x,), {})
    assert float(jax.jit(probe)(x)[0, 0]) in (2.0, 3.0, 4.0)  # tuned inside the jit trace
    implicit = tuning.implicit().lookup(core.current_device_kind(), "tuning_probe", key)
    assert {e.backend for e in implicit} == {"xla", "kern"}
    assert forgeax.explain(probe, x).decisions[0].rule.startswith("FORGEAX_AUTOTUNE tuning")
    monkeypatch.delenv("FORGEAX_AUTOTUNE")
    assert not tuning.autotune_enabled()


def test_shipped_tunings_load_when_present():
    shipped = tuning.shipped()
    assert isinstance(shipped, Tuning)
    assert all(e.device and e.op in core.OPS for e in shipped.entries)


def test_a_tuning_from_bench_results_orders_backends_by_time_for_the_calls_signature(tmp_path):
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools"))
    import autotune as tool  # tools/autotune.py

    rows = [{"op": "rms_norm", "shape": "small f32", "mode": mode, "backend": backend, "median_ms": ms}
            for mode, backend, ms in [("fwd", "xla", 0.2), ("fwd", "triton", 0.1), ("fwd+bwd", "xla", 0.5),
                                      ("fwd+bwd", "triton", 0.7), ("fwd+bwd", "anchor:jax", 0.1)]]
    (tmp_path / "bench.json").write_text(json.dumps({"device": "NVIDIA H100 80GB HBM3", "results": rows}))
    made = tool.tuning_from_bench([str(tmp_path / "bench.json")], device="NVIDIA H100")
    x, scale = jnp.zeros((4096, 1024)), jnp.zeros((1024,))
    (call,) = autotuning.find_calls(lambda x: ops.rms_norm(x, scale), x)
    entries = made.lookup("NVIDIA H100 80GB HBM3", "rms_norm", call.key)
    assert sorted((e.timed, e.backend, e.seconds) for e in entries) == [
        ("fwd", "triton", 1e-4), ("fwd", "xla", 2e-4), ("fwd+bwd", "triton", 7e-4), ("fwd+bwd", "xla", 5e-4)]
    by_mode = {t: [e.backend for e in entries if e.timed == t] for t in ("fwd", "fwd+bwd")}
    assert by_mode == {"fwd": ["triton", "xla"], "fwd+bwd": ["xla", "triton"]}  # each mode's order, fastest first


def _top_level_field_names(text: str, start: int) -> list[str]:
    """The `name=` names of the dataclass repr whose fields begin at text[start] (nested values skipped)."""
    names, token, depth, in_name = [], "", 0, True
    for c in text[start:]:
        if depth == 0 and c == ")":
            break
        depth += c in "(["
        depth -= c in ")]"
        if depth == 0 and in_name and c == "=":
            names.append(token)
            token, in_name = "", False
        elif depth == 0 and in_name:
            token += c
        elif depth == 0 and c == ",":
            in_name = True
    return names


def test_shipped_tuning_keys_spell_the_current_specs():
    """A spec dataclass that gains or loses a field changes every call key that embeds it: the
    shipped entries must be rewritten with it, or they silently stop matching any call."""
    import dataclasses
    import importlib
    import pkgutil
    import re

    import forgeax.kernels.common as common

    classes = {}
    for module in pkgutil.iter_modules(common.__path__):
        for name, obj in vars(importlib.import_module(f"forgeax.kernels.common.{module.name}")).items():
            if isinstance(obj, type) and dataclasses.is_dataclass(obj):
                classes[name] = obj
    checked = 0
    for entry in tuning.shipped().entries:
        for found in re.finditer(r"([A-Z][A-Za-z0-9]*)\(", entry.key):
            cls = classes.get(found.group(1))
            if cls is None:
                continue
            names = _top_level_field_names(entry.key, found.end())
            assert names == [f.name for f in dataclasses.fields(cls)], (entry.op, cls.__name__, names)
            checked += 1
    assert checked or not tuning.shipped().entries
