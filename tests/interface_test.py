"""The shared interface: registry, selection, fallback, explain, user backends."""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import pytest

import forgeax
from forgeax import ops
from forgeax.kernels.xla import norms as reference
from forgeax import core as interface
from forgeax.core import runtime
from forgeax.core.selection import Selection


@pytest.fixture
def scratch_op():
    """A throwaway op defined through the public API, removed afterwards."""
    op = forgeax.define_op(
        "scale_by_two",
        {"xla": forgeax.Implementation(fn=lambda x: 2 * x)},
        priority={"cpu": (), "gpu": (), "tpu": ()},
    )
    yield op
    del interface.OPS["scale_by_two"]


def test_import_forgeax_exposes_the_public_surface():
    assert forgeax.ops is ops
    assert ops.__name__ == "forgeax.ops"
    assert issubclass(forgeax.UnsupportedError, NotImplementedError)
    assert {"rms_norm", "layer_norm"} <= set(interface.OPS)


def test_default_selection_on_cpu_is_xla_and_explain_says_so():
    x = jax.random.normal(jax.random.key(0), (4, 16))
    scale = jnp.ones((16,))
    report = forgeax.explain(lambda x: ops.rms_norm(x, scale) + ops.layer_norm(x, scale, scale), x)
    if interface.current_platform() == "cpu":
        assert report.backends() == ("xla", "xla")
    assert [d.op for d in report.decisions] == ["rms_norm", "layer_norm"]
    assert "rms_norm(x=float32[4, 16], scale=float32[16], eps=1e-06) ->" in str(report)


def test_explain_sees_inside_jit_and_grad():
    x = jax.random.normal(jax.random.key(1), (4, 16))
    scale = jnp.ones((16,))
    step = jax.jit(jax.grad(lambda x: jnp.sum(ops.rms_norm(x, scale, backend="xla"))))
    step(x)  # traced once already: explain must still see the call
    assert forgeax.explain(step, x).backends() == ("xla",)


def test_user_backend_preferred_when_it_supports_the_call(scratch_op):
    calls = []

    def triple(x):
        calls.append(x.shape)
        return 3 * x

    refuse_odd = lambda x: None if x.shape[-1] % 2 == 0 else "odd widths are not handled"  # noqa: E731
    platform = interface.current_platform()
    forgeax.register_backend("scale_by_two", "mine", forgeax.Implementation(fn=triple, platforms={platform}, supports=refuse_odd), prefer_on=(platform,))
    assert float(scratch_op(jnp.ones((2, 4)))[0, 0]) == 3.0  # the user's backend was chosen
    assert float(scratch_op(jnp.ones((2, 3)))[0, 0]) == 2.0  # refused: fell back to xla
    report = forgeax.explain(lambda x: scratch_op(x), jnp.ones((2, 3)))
    assert report.decisions[0].backend == "xla"
    assert report.decisions[0].skipped == (("mine", "odd widths are not handled"),)
    with pytest.raises(forgeax.UnsupportedError, match="odd widths are not handled"):
        scratch_op(jnp.ones((2, 3)), backend="mine")


def test_user_backend_for_a_builtin_op_by_name():
    platform = interface.current_platform()
    impl = forgeax.Implementation(fn=lambda x, scale, *, eps: reference.rms_norm(x, scale, eps=eps) + 1.0, platforms={platform})
    forgeax.register_backend("rms_norm", "plus_one", impl)
    try:
        x = jax.random.normal(jax.random.key(2), (3, 8))
        got = ops.rms_norm(x, jnp.ones((8,)), backend="plus_one")
        assert jnp.allclose(got, reference.rms_norm(x, jnp.ones((8,)), eps=1e-6) + 1.0)
        # Not preferred anywhere: the default stays as it was.
        assert forgeax.explain(lambda x: ops.rms_norm(x, jnp.ones((8,))), x).backends()[0] != "plus_one"
    finally:
        op = interface.OPS["rms_norm"]
        op._refs.pop("plus_one")  # noqa: SLF001 - test cleanup
        op._loaded.pop("plus_one", None)  # noqa: SLF001


def test_a_backend_that_fails_to_import_is_skipped_with_the_reason(scratch_op):
    platform = interface.current_platform()
    scratch_op.add_backend("broken", "forgeax.kernels.does_not_exist:IMPL", prefer_on=(platform,))
    report = forgeax.explain(lambda x: scratch_op(x), jnp.ones((2,)))
    assert report.decisions[0].backend == "xla"
    name, reason = report.decisions[0].skipped[0]
    assert name == "broken" and "could not import forgeax.kernels.does_not_exist:IMPL" in reason
    with pytest.raises(forgeax.UnsupportedError, match="could not import"):
        scratch_op(jnp.ones((2,)), backend="broken")


def test_registry_errors_name_the_argument(scratch_op):
    with pytest.raises(ValueError, match="^op:"):
        forgeax.register_backend("no_such_op", "x", forgeax.Implementation(fn=abs))
    with pytest.raises(ValueError, match="^name:"):
        forgeax.define_op("scale_by_two", {"xla": forgeax.Implementation(fn=abs)}, {})
    with pytest.raises(ValueError, match="^platforms:"):
        forgeax.Implementation(fn=abs, platforms={"quantum"})
    with pytest.raises(ValueError, match="^prefer_on:"):
        scratch_op.add_backend("y", forgeax.Implementation(fn=abs), prefer_on=("quantum",))


def test_interpret_mode_is_scoped():
    before = interface.interpret_enabled()
    with forgeax.interpret_mode(not before):
        assert interface.interpret_enabled() is (not before)
    assert interface.interpret_enabled() is before


def _rule(id, prefer, calls="all", devices=("NVIDIA H200",), **when):
    return {"id": id, "prefer": list(prefer), "calls": calls, "platform": "gpu", "devices": list(devices),
            "when": when, "why": "a test", "evidence": {"file": "benchmarks/results/none.json"}}


def test_a_rule_reorders_the_priority_on_its_device_and_calls_only(monkeypatch):
    everywhere = {"cpu", "gpu", "tpu"}
    op = interface.Op(
        "rule_probe",
        {
            "xla": forgeax.Implementation(fn=lambda x: x, platforms=everywhere),
            "fast_wide": forgeax.Implementation(fn=lambda x: x, platforms=everywhere),
            "fast_narrow": forgeax.Implementation(fn=lambda x: x, platforms=everywhere),
        },
        Selection.from_dict({"priority": {"gpu": ["fast_wide", "fast_narrow"]},
                             "rules": [_rule("narrow", ["fast_narrow"], dim={"max": 1024})]}),
        features=lambda args, kwargs: {"dim": args[0].shape[-1]},
    )
    monkeypatch.setattr(runtime, "current_platform", lambda: "gpu")
    narrow, wide = jnp.ones((4, 768)), jnp.ones((4, 4096))
    monkeypatch.setattr(runtime, "current_device_kind", lambda: "NVIDIA H200")
    assert op.choose((narrow,), {}).backend == "fast_narrow"
    assert op.choose((narrow,), {}).rule.id == "narrow"
    assert op.choose((wide,), {}).backend == "fast_wide"
    assert op.choose((narrow,), {}, backend="fast_wide").backend == "fast_wide"  # an explicit choice is never overridden
    monkeypatch.setattr(runtime, "current_device_kind", lambda: "NVIDIA H100 80GB HBM3")
    assert op.choose((narrow,), {}).backend == "fast_wide"  # a device no rule names: the priority


def test_bad_rules_are_refused_with_the_field_named():
    with pytest.raises(ValueError, match="calls"):
        Selection.from_dict({"rules": [_rule("r", ["a"], calls="sometimes")]})
    with pytest.raises(ValueError, match="evidence"):
        Selection.from_dict({"rules": [dict(_rule("r", ["a"]), evidence={})]})
    with pytest.raises(ValueError, match="ids must be unique"):
        Selection.from_dict({"rules": [_rule("r", ["a"]), _rule("r", ["b"])]})
    with pytest.raises(ValueError, match="condition"):
        Selection.from_dict({"rules": [_rule("r", ["a"], dim={"below": 3})]})
    rule = Selection.from_dict({"rules": [_rule("r", ["a"], width=3)]}).rules[0]
    with pytest.raises(KeyError, match="no feature 'width'"):
        rule.fires({"dim": 3})


def _with_gradient(forward, gradient):
    """forward(x, *, power) whose derivative is gradient(x, power) (so a test sees which one ran)."""

    def fn(x, ids, *, power):
        @jax.custom_vjp
        def f(x):
            return forward(x, power)

        f.defvjp(lambda x: (f(x), x), lambda x, g: (g * gradient(x, power),))
        return f(x), ids

    return fn


def test_inference_order_runs_one_backend_and_differentiates_another(monkeypatch):
    """An op's inference_order picks the backend of a call that is not differentiated; under
    jax.grad the training backend's forward and backward run (a custom_vjp around both)."""
    everywhere = {"cpu", "gpu", "tpu"}
    exact = lambda x, p: x ** p  # noqa: E731
    op = interface.Op(
        "split_probe",
        {
            # Each backend marks its output (+1000 / +2000 on the forward, x3 on the gradient) so
            # the test can tell which one ran; `ids` (an int array) passes through untouched.
            "xla": forgeax.Implementation(fn=_with_gradient(exact, lambda x, p: p * x ** (p - 1)), platforms=everywhere),
            "fast_forward": forgeax.Implementation(fn=_with_gradient(lambda x, p: exact(x, p) + 1000, lambda x, p: 0 * x), platforms=everywhere),
            "fast_training": forgeax.Implementation(fn=_with_gradient(lambda x, p: exact(x, p) + 2000, lambda x, p: 3 * p * x ** (p - 1)), platforms=everywhere),
        },
        selection=Selection.from_dict({"priority": {"gpu": ["fast_training"]},
                                       "rules": [_rule("square", ["fast_forward"], calls="forward_only", devices=(), power=2)]}),
        features=lambda args, kwargs: {"power": kwargs["power"]},
    )
    monkeypatch.setattr(runtime, "current_platform", lambda: "gpu")
    x, ids = jnp.array([1.0, 2.0, 3.0]), jnp.arange(3)
    call = lambda x: op(x, ids, power=2)  # noqa: E731
    out, same_ids = call(x)
    assert jnp.allclose(out, x ** 2 + 1000) and jnp.array_equal(same_ids, ids)  # the inference backend
    assert jnp.allclose(jax.jit(lambda x: call(x)[0])(x), x ** 2 + 1000)
    value, grad = jax.value_and_grad(lambda x: jnp.sum(call(x)[0]))(x)
    assert float(value) == pytest.approx(float(jnp.sum(x ** 2 + 2000)))  # forward and backward: training
    assert jnp.allclose(grad, 3 * 2 * x)
    assert jnp.allclose(jax.vmap(jax.grad(lambda x: call(x)[0].sum()))(x[:, None]), 6 * x[:, None])
    report = forgeax.explain(lambda x: call(x)[0], x)
    assert report.decisions[0].backend == "fast_forward"
    assert report.decisions[0].gradient.startswith("fast_training")
    assert "-> fast_forward" in str(report) and "under a gradient: fast_training" in str(report)
    assert "rule 'square'" in str(report)
    # No inference preference for this call, or an explicit backend: one backend, no split.
    assert jnp.allclose(op(x, ids, power=3)[0], x ** 3 + 2000)
    assert forgeax.explain(lambda x: op(x, ids, power=3)[0], x).decisions[0].gradient is None
    assert jnp.allclose(jax.grad(lambda x: op(x, ids, power=2, backend="fast_forward")[0].sum())(x), 0 * x)


def test_an_all_calls_rule_puts_backends_before_the_priority_per_call(monkeypatch):
    """A rule for all calls picks, per call, backends to try before the priority, for the call
    and its gradient alike (also when a forward-only rule's backend cannot run the call); an
    explicit backend ignores it."""
    everywhere = {"cpu", "gpu", "tpu"}
    exact = lambda x, p: x ** p  # noqa: E731
    op = interface.Op(
        "training_order_probe",
        {
            "xla": forgeax.Implementation(fn=_with_gradient(exact, lambda x, p: p * x ** (p - 1)), platforms=everywhere),
            "usual": forgeax.Implementation(fn=_with_gradient(lambda x, p: exact(x, p) + 1000, lambda x, p: 2 * p * x ** (p - 1)), platforms=everywhere),
            "better_here": forgeax.Implementation(fn=_with_gradient(lambda x, p: exact(x, p) + 2000, lambda x, p: 3 * p * x ** (p - 1)), platforms=everywhere),
        },
        selection=Selection.from_dict({"priority": {"gpu": ["usual", "better_here"]},
                                       "rules": [_rule("square", ["better_here"], devices=(), power=2),
                                                 _rule("any", ["not_registered"], calls="forward_only", devices=())]}),
        features=lambda args, kwargs: {"power": kwargs["power"]},
    )
    monkeypatch.setattr(runtime, "current_platform", lambda: "gpu")
    x, ids = jnp.array([1.0, 2.0, 3.0]), jnp.arange(3)
    assert jnp.allclose(op(x, ids, power=2)[0], x ** 2 + 2000)
    assert jnp.allclose(jax.grad(lambda x: op(x, ids, power=2)[0].sum())(x), 3 * 2 * x)
    assert forgeax.explain(lambda x: op(x, ids, power=2)[0], x).decisions[0].backend == "better_here"
    assert jnp.allclose(op(x, ids, power=3)[0], x ** 3 + 1000)  # no preference: the priority
    assert jnp.allclose(op(x, ids, power=2, backend="usual")[0], x ** 2 + 1000)


def test_explain_names_the_arguments_as_the_user_wrote_them():
    q = jax.random.normal(jax.random.key(2), (2, 128, 8, 64))
    k = jax.random.normal(jax.random.key(3), (2, 128, 2, 64))
    text = str(forgeax.explain(lambda q, k: ops.attention(q, k, k, causal=True, window=(32, None)), q, k))
    assert text.startswith("attention(q=float32[2, 128, 8, 64], k=float32[2, 128, 2, 64], v=float32[2, 128, 2, 64], causal=True")
    assert "window_left=32" in text and "None" not in text.split("->")[0]
    assert "chosen by:" in text
    text = str(forgeax.explain(lambda x: ops.rms_norm(x, jnp.ones(64), eps=1e-5), q))
    assert text.startswith("rms_norm(x=float32[2, 128, 8, 64], scale=float32[64], eps=1e-05) -> ")


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Blocks(forgeax.KernelConfig):
    block: int = 128
    stages: int = 2

    def validate(self):
        super().validate()
        if self.block % 16:
            raise ValueError(f"_Blocks.block: expected a multiple of 16, got {self.block}")


def test_kernel_configs_are_validated_serialised_and_reach_the_kernel(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="block"):
        _Blocks(block=100)
    with pytest.raises(ValueError, match="stages"):
        _Blocks(stages=0)
    assert _Blocks.from_dict(_Blocks(block=64).to_dict()) == _Blocks(block=64)
    with pytest.raises(ValueError, match="unknown fields"):
        _Blocks.from_dict({"blok": 64})
    seen = []
    kernel = forgeax.Implementation(
        fn=lambda x, *, config: (seen.append(config), x * 2)[1], config_type=_Blocks,
        heuristic_config=lambda x: _Blocks(block=32 if x.shape[-1] < 128 else 128),
        candidate_configs=lambda x: [_Blocks(block=b) for b in (32, 64, 128)])
    op = interface.Op("config_probe", {"xla": forgeax.Implementation(fn=lambda x: x * 2), "kern": kernel},
                      Selection.from_dict({"priority": {"cpu": ["kern"], "gpu": ["kern"], "tpu": ["kern"]}}))
    x = jnp.ones((4, 16))
    op(x)
    assert seen[-1] == _Blocks(block=32)  # the heuristic
    op(x, config=_Blocks(block=64))
    assert seen[-1] == _Blocks(block=64)  # explicit
    with pytest.raises(forgeax.UnsupportedError, match="config: this backend takes _Blocks"):
        op(x, backend="kern", config=forgeax.KernelConfig())
    with pytest.raises(forgeax.UnsupportedError, match="takes no config"):
        op(x, backend="xla", config=_Blocks())
    # A tuned entry for this device kind wins over the heuristic; another device's is ignored.
    (tmp_path / "tuned.json").write_text(json.dumps({"entries": [
        {"device": "NVIDIA H200", "key": "*", "config": {"block": 16, "stages": 3}, "evidence": "a test"}]}))
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "tuned_probe_pkg").mkdir()
    (tmp_path / "tuned_probe_pkg" / "__init__.py").write_text("")
    (tmp_path / "tuned_probe_pkg" / "tuned.json").write_text((tmp_path / "tuned.json").read_text())
    tuned = dataclasses.replace(kernel, tuned=forgeax.core.TunedConfigs("tuned_probe_pkg", "tuned.json"))
    assert tuned.resolve_config((x,), {}, None, "NVIDIA H200")[0] == _Blocks(block=16, stages=3)
    assert tuned.resolve_config((x,), {}, None, "NVIDIA H100 80GB HBM3") == (_Blocks(block=32), "heuristic")
    assert "explicit" in tuned.resolve_config((x,), {}, _Blocks(block=48), "NVIDIA H200")[1]
    assert "config: _Blocks(block=64, stages=2) [explicit]" in str(forgeax.explain(lambda x: op(x, config=_Blocks(block=64)), x))


def test_timing_rounds_never_time_a_candidate_twice_in_a_row():
    from forgeax.core.timing import alternating  # noqa: PLC0415

    for n in range(1, 7):
        names = [f"c{i}" for i in range(n)]
        order = list(alternating(names, 2 * n + 1))
        rounds = [order[r * n:(r + 1) * n] for r in range(2 * n + 1)]
        assert all(sorted(r) == names for r in rounds)  # every candidate once per round
        if n > 1:
            assert all(a != b for a, b in zip(order, order[1:]))  # no back-to-back double run
