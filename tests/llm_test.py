"""The LLM example (examples/llm): a short CPU run learns, `xla` and `auto` agree, resume is
bit-exact, the sampler and the kernel report run, and every data loader reads its format."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest

import forgeax
from forgeax.examples.llm import data as data_lib
from forgeax.examples.llm import train

# A model small enough for CI (2 layers, d 64, seq 32): tens of ms per step on one CPU core.
SMALL = ["--d-model", "64", "--n-layers", "2", "--n-heads", "4", "--n-kv-heads", "2", "--d-ff", "128",
         "--seq-len", "32", "--batch", "8", "--eval-batches", "1", "--quiet", "--warmup", "5"]
QUIET = ["--no-report", "--no-plot", "--samples", "0"]


@pytest.fixture(autouse=True)
def _auto_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FORGEAX_LLM_CACHE", str(tmp_path / "cache"))


def test_short_run_loss_falls_and_writes_log_plot_samples_and_report(tmp_path):
    out = tmp_path / "run"
    rec = train.run(SMALL + ["--steps", "40", "--eval-every", "20", "--ops", "xla", "--samples", "2",
                             "--sample-tokens", "12", "--out", str(out)])
    losses = rec["losses"]
    assert len(losses) == 40 and all(np.isfinite(losses))
    assert np.mean(losses[-5:]) < losses[0] - 1.5, losses  # from ~ln(256)=5.5 to the byte statistics
    assert rec["eval"][-1]["loss"] < losses[0] - 1.5
    log = json.loads((out / "run.json").read_text())
    assert log["losses"] == losses and log["backends"]["attention"] == "xla"
    assert (out / "loss.png").stat().st_size > 1000
    assert len(rec["samples"]) == 2 and all(isinstance(s, str) and len(s) > 4 for s in rec["samples"])
    report = {r["op"]: r for r in rec["kernel_report"]}
    for op in ("norm", "residual_norm", "rope", "attention", "mlp", "loss", "train step"):
        assert op in report, report.keys()
    # The layers are one scan: attention is traced once, whatever the depth.
    assert report["attention"]["backend"] == "xla" and report["attention"]["calls"] == 1
    assert report["train step"]["temp_bytes"] > 0


def test_xla_and_auto_give_the_same_losses_within_bf16_noise(tmp_path):
    args = SMALL + QUIET + ["--steps", "4", "--dtype", "bfloat16"]
    xla = train.run(args + ["--ops", "xla", "--out", str(tmp_path / "xla")])
    auto = train.run(args + ["--ops", "auto", "--out", str(tmp_path / "auto")])
    np.testing.assert_allclose(auto["losses"], xla["losses"], rtol=2e-2)
    # auto's measurements are a forgeax Tuning on disk: fwd+bwd times of every native backend
    # (on a CPU the XLA ones) for each op's call at the model's shapes.
    cache = forgeax.Tuning.loads((tmp_path / "cache" / "llm_auto_tuning.json").read_text())
    assert {e.op for e in cache.entries} == {"rms_norm", "add_rms_norm", "rope_qk", "attention", "gated_mlp",
                                             "linear_cross_entropy"}
    assert all(e.timed == "fwd+bwd" and e.seconds > 0 for e in cache.entries)
    assert {e.op for e in cache.entries if e.backend == "xla"} == {e.op for e in cache.entries}
    again = train.run(args + ["--ops", "auto", "--out", str(tmp_path / "again")])  # from the cache: same choices
    assert again["backends"] == auto["backends"] and again["losses"] == auto["losses"]


def test_rolled_and_unrolled_layer_loops_train_the_same_model(tmp_path):
    # --layer-loop only changes how XLA sees the layers (one loop body, or written out).
    args = SMALL + QUIET + ["--steps", "3", "--ops", "xla"]
    unrolled = train.run(args + ["--out", str(tmp_path / "unrolled")])
    rolled = train.run(args + ["--out", str(tmp_path / "rolled"), "--layer-loop", "rolled"])
    assert unrolled["config"]["unroll_layers"] and not rolled["config"]["unroll_layers"]
    np.testing.assert_allclose(rolled["losses"], unrolled["losses"], rtol=1e-5)


def test_plain_baseline_computes_the_same_model(tmp_path):
    # `--ops plain` (plain JAX code, the benchmark's baseline) must train the same model as forgeax's ops,
    # in f32 to within rounding, or the tokens/s comparison would compare different work.
    args = SMALL + QUIET + ["--steps", "3"]
    xla = train.run(args + ["--ops", "xla", "--out", str(tmp_path / "xla")])
    plain = train.run(args + ["--ops", "plain", "--out", str(tmp_path / "plain")])
    np.testing.assert_allclose(plain["losses"], xla["losses"], rtol=1e-4)
    assert set(plain["backends"].values()) == {"plain"}


def test_resume_reproduces_the_uninterrupted_run_bit_for_bit(tmp_path):
    args = SMALL + QUIET + ["--steps", "10", "--ops", "xla", "--untied"]
    whole = train.run(args + ["--out", str(tmp_path / "whole")])
    first = train.run(args + ["--out", str(tmp_path / "cut"), "--save-every", "3", "--stop-after", "7"])
    assert len(first["losses"]) == 7
    resumed = train.run(args + ["--out", str(tmp_path / "cut"), "--save-every", "3", "--resume"])
    assert resumed["losses"] == whole["losses"]  # restored from step 6, steps 6..9 recomputed
    assert "unembed" in whole["final_params"]  # untied embeddings
    for a, b in zip(jax.tree.leaves(resumed["final_params"]), jax.tree.leaves(whole["final_params"])):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_sampler_is_greedy_deterministic_and_bounded():
    from forgeax.examples.llm import config, model

    cfg = config.ModelConfig(d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=64, seq_len=16)
    params = model.init_params(cfg, jax.random.PRNGKey(0))
    backends = {k: "xla" for k in config.OPS}
    a = model.sample(params, [list(b"ab"), list(b"xyz")], cfg, backends, new_tokens=5)
    b = model.sample(params, [list(b"ab"), list(b"xyz")], cfg, backends, new_tokens=5)
    assert a == b and [len(x) for x in a] == [5, 5] and all(0 <= t < 256 for x in a for t in x)
    hot = model.sample(params, [list(b"ab")], cfg, backends, new_tokens=20, temperature=1.0, key=jax.random.PRNGKey(3))
    assert len(hot[0]) == 14  # bounded by the window: 16 - len("ab")


def test_default_corpus_needs_no_download():
    c = data_lib.load_corpus(None)
    assert c.vocab == 256 and len(c.train) > 100_000 and len(c.eval) > 10_000
    assert b"Python" in bytes(c.train[:200_000])


def test_text_file_and_folder_loaders(tmp_path):
    (tmp_path / "a.txt").write_text("hello world\n" * 50)
    sub = tmp_path / "d"
    sub.mkdir()
    (sub / "b.md").write_text("second file " * 40)
    (sub / "blob.bin.dat").write_bytes(bytes([0xff, 0xfe, 0x80]) * 10)  # not UTF-8: skipped
    tokens, vocab, _ = data_lib.load_tokens(str(tmp_path / "a.txt"))
    assert vocab == 256 and bytes(tokens) == b"hello world\n" * 50
    tokens, _, _ = data_lib.load_tokens(str(tmp_path))
    assert b"hello world" in bytes(tokens) and b"second file" in bytes(tokens) and b"\xff\xfe" not in bytes(tokens)
    with pytest.raises(FileNotFoundError, match="data"):
        data_lib.load_tokens(str(tmp_path / "missing"))


def test_token_files_are_memory_mapped(tmp_path):
    ids = np.random.default_rng(0).integers(0, 5000, size=4000).astype(np.uint16)
    ids.tofile(tmp_path / "t.bin")
    np.save(tmp_path / "t.npy", ids.astype(np.int32))
    for name in ("t.bin", "t.npy"):
        tokens, vocab, _ = data_lib.load_tokens(str(tmp_path / name))
        assert isinstance(tokens, np.memmap) or isinstance(getattr(tokens, "base", None), np.memmap) or tokens.base is not None
        assert vocab == int(ids.max()) + 1
        np.testing.assert_array_equal(np.asarray(tokens), ids)
    x, y = data_lib.get_batch(tokens, step=3, batch=4, seq_len=16)
    assert x.shape == y.shape == (4, 16) and x.dtype == np.int32
    np.testing.assert_array_equal(x[:, 1:], y[:, :-1])  # targets are the next tokens
    x2, _ = data_lib.get_batch(tokens, step=3, batch=4, seq_len=16)
    np.testing.assert_array_equal(x, x2)  # a pure function of (seed, step): resumable


def test_muon_without_forgeax_optim_fails_clearly(tmp_path):
    try:
        import forgeax.optim  # noqa: F401
    except ImportError:
        with pytest.raises(SystemExit, match="forgeax.optim.muon"):
            train.run(SMALL + QUIET + ["--steps", "1", "--ops", "xla", "--optimizer", "muon", "--out", str(tmp_path)])
    else:
        rec = train.run(SMALL + QUIET + ["--steps", "3", "--ops", "xla", "--optimizer", "muon", "--out", str(tmp_path)])
        assert all(np.isfinite(rec["losses"]))
