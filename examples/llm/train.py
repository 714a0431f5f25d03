"""Train the Llama-style example model with forgeax ops.

    bazel run //examples/llm:train                      # default corpus, tiny model, CPU or GPU
    python -m examples.llm.train --data notes/ --steps 2000
    python examples/llm/train.py --ops plain --preset 1b --benchmark-steps 20 --batch 4 --remat   # the baseline

Shows a progress bar (loss, tokens/s, step time), evaluates on the held-out split, samples text,
prints the kernel report (per op: backend, time and temporary memory against the XLA reference),
and writes run.json, loss.png and (with --save-every) orbax checkpoints under --out. A run started
again with --resume continues from the latest checkpoint with bit-identical losses.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a plain script (or by Bazel): import the package by path
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    __package__ = "examples.llm"  # noqa: A001
    import examples.llm  # noqa: F401

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from . import data as data_lib
from . import kernels
from . import model as model_lib
from .config import OPS, PRESETS, ModelConfig, OpsConfig

# Dense bf16 matrix peak (FLOP/s) by device kind, for MFU.
PEAK_FLOPS = {"H100": 989e12, "H200": 989e12, "GH200": 989e12, "A100": 312e12, "B200": 2250e12, "L4": 121e12}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    for name in ("d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff", "seq_len"):
        p.add_argument("--" + name.replace("_", "-"), type=int, help="override the preset's " + name)
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help="compute dtype (default: the preset's)")
    p.add_argument("--untied", action="store_true", help="separate output projection (untied embeddings)")
    p.add_argument("--remat", action="store_true", help="recompute layer activations in the backward (less memory)")
    p.add_argument("--layer-loop", choices=["unrolled", "rolled"], help="the layers written out (the faster step) or "
                   "one loop body (compile time flat in depth); default: rolled with --mesh, else unrolled")
    p.add_argument("--data", help="text file, folder of text files, or .bin (uint16) / .npy tokens (default: pydoc_data.topics)")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--optimizer", choices=["adamw", "muon"], default="adamw")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ops", default="auto", help="every op's backend: auto (measured, cached), xla, default "
                   "(forgeax's own selection), plain (plain JAX code, no forgeax: the baseline) or a backend name")
    for name in OPS:
        p.add_argument("--" + name.replace("_", "-"), help=f"backend of {OPS[name]} (overrides --ops)")
    p.add_argument("--auto-configs", type=int, default=1, help="configs per backend auto times (1: each backend's "
                   "default config, a backend choice)")
    p.add_argument("--mesh", help="DATAxMODEL devices, e.g. 2x4: data and Megatron tensor parallelism")
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--eval-batches", type=int, default=4)
    p.add_argument("--out", default="llm_run", help="folder for run.json, loss.png and checkpoints")
    p.add_argument("--save-every", type=int, default=0, help="checkpoint every N steps (0: none)")
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --out")
    p.add_argument("--stop-after", type=int, help="stop after this many steps (the schedule still spans --steps)")
    p.add_argument("--samples", type=int, default=3, help="lines of text sampled at the end")
    p.add_argument("--sample-tokens", type=int, default=80)
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    p.add_argument("--no-report", action="store_true", help="skip the kernel report")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--quiet", action="store_true", help="no progress bar or tables")
    p.add_argument("--benchmark-steps", type=int, help="time N steps; print tokens/s, MFU, peak memory as JSON")
    p.add_argument("--peak-tflops", type=float, help="the device's peak for MFU (default: by device kind)")
    return p


def model_config(args, vocab: int) -> ModelConfig:
    cfg = PRESETS[args.preset]
    over = {k: getattr(args, k) for k in ("d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff", "seq_len", "dtype")
            if getattr(args, k) is not None}
    if args.untied:
        over["tie_embeddings"] = False
    if args.remat:
        over["remat"] = True
    # Under a mesh every kernel call is partitioned by a Python callback at compile time, once per
    # written-out layer: the 18-layer 1B model did not compile in 280 s unrolled on 4 H100s.
    over["unroll_layers"] = (args.layer_loop or ("rolled" if args.mesh else "unrolled")) == "unrolled"
    over["vocab"] = max(cfg.vocab, vocab)
    cfg = dataclasses.replace(cfg, **over)
    cfg.validate()
    return cfg


def make_optimizer(args):
    sched = optax.warmup_cosine_decay_schedule(0.0, args.lr, args.warmup, max(args.steps, args.warmup + 1), args.lr * 0.1)
    if args.optimizer == "muon":
        try:
            from forgeax.optim import muon  # noqa: PLC0415
        except ImportError as e:
            raise SystemExit(f"--optimizer muon needs forgeax.optim.muon, which this forgeax does not have ({e}); "
                             "use --optimizer adamw") from None
        return optax.chain(optax.clip_by_global_norm(1.0), muon(learning_rate=sched, weight_decay=args.weight_decay, scale="adamw_rms"))
    decay = lambda params: jax.tree.map(lambda x: x.ndim >= 2, params)  # noqa: E731 - no decay on norm gains
    return optax.chain(optax.clip_by_global_norm(1.0),
                       optax.adamw(sched, b1=0.9, b2=0.95, weight_decay=args.weight_decay, mask=decay))


def make_mesh(spec: str | None) -> Mesh | None:
    if not spec:
        return None
    try:
        d, m = (int(x) for x in spec.lower().split("x"))
    except ValueError:
        raise SystemExit(f"--mesh: expected DATAxMODEL such as 2x4, got {spec!r}") from None
    devices = jax.devices()
    if d * m > len(devices):
        raise SystemExit(f"--mesh {spec}: needs {d * m} devices, this process has {len(devices)}")
    return Mesh(np.array(devices[:d * m]).reshape(d, m), ("data", "model"))


def out_dir(args) -> Path:
    base = Path(os.environ.get("BUILD_WORKING_DIRECTORY", "."))  # `bazel run` runs in the runfiles tree
    return (base / args.out).resolve()


def run(argv: list[str] | None = None) -> dict:
    """Parses `argv`, trains, and returns the run's log (also written to <out>/run.json)."""
    args = build_parser().parse_args(argv)
    from rich.console import Console  # noqa: PLC0415

    console = Console(quiet=args.quiet)
    log = console.print
    corpus = data_lib.load_corpus(args.data)
    cfg = model_config(args, corpus.vocab)
    settings = OpsConfig.all(args.ops, **{k: getattr(args, k) for k in OPS}).as_dict()
    mesh = make_mesh(args.mesh)
    log(f"[bold]forgeax LLM example[/]: {cfg.num_params() / 1e6:.2f}M parameters, {cfg.n_layers} layers, d={cfg.d_model}, "
        f"heads {cfg.n_heads}/{cfg.n_kv_heads}, seq {cfg.seq_len}, {cfg.dtype}; data {corpus.name} "
        f"({len(corpus.train):,} train / {len(corpus.eval):,} eval tokens); {jax.devices()[0].device_kind}"
        + (f", mesh {dict(mesh.shape)}" if mesh else ""))
    backends, tuning = kernels.resolve(settings, cfg, args.batch, max_configs=args.auto_configs, log=log)
    log("backends: " + ", ".join(f"{k}={v or 'forgeax default'}" for k, v in backends.items()))
    with tuning:  # auto's configs apply wherever the model is traced (train step, eval, sampler, report)
        return train(args, cfg, corpus, settings, backends, mesh, console)


def train(args, cfg: ModelConfig, corpus, settings: dict, backends: dict, mesh: Mesh | None, console) -> dict:
    """Trains (or, with --benchmark-steps, times) the model; returns the run's log."""
    log = console.print
    local_batch = args.batch
    opt = make_optimizer(args)
    params = model_lib.init_params(cfg, jax.random.PRNGKey(args.seed))
    shardings = None
    if mesh is not None:
        shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), model_lib.param_specs(params),
                                 is_leaf=lambda x: isinstance(x, P))
        params = jax.device_put(params, shardings)
    state = {"params": params, "opt_state": jax.jit(opt.init)(params), "rng": jax.random.PRNGKey(args.seed + 1)}

    def train_step(params, opt_state, x, y):
        loss, grads = jax.value_and_grad(model_lib.loss_fn)(params, x, y, cfg, backends)
        updates, opt_state = opt.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        if shardings is not None:
            params = jax.lax.with_sharding_constraint(params, shardings)
        return params, opt_state, loss

    step_fn = jax.jit(train_step, donate_argnums=(0, 1))
    eval_fn = jax.jit(lambda p, x, y: model_lib.loss_fn(p, x, y, cfg, backends))
    batch_sharding = NamedSharding(mesh, P("data", None)) if mesh is not None else None

    def put(batch):
        return tuple(jax.device_put(a, batch_sharding) if batch_sharding else jnp.asarray(a) for a in batch)

    eval_set = [put(b) for b in data_lib.eval_batches(corpus.eval, args.eval_batches, local_batch, cfg.seq_len)]

    def evaluate(params) -> float:
        return float(np.mean([float(eval_fn(params, x, y)) for x, y in eval_set]))

    if args.benchmark_steps:
        return benchmark(args, cfg, settings, backends, state, step_fn, corpus, put, log)

    out = out_dir(args)
    out.mkdir(parents=True, exist_ok=True)
    record = {"config": dataclasses.asdict(cfg), "args": vars(args), "ops": settings, "backends": backends,
              "device": jax.devices()[0].device_kind, "params": cfg.num_params(), "losses": [], "step_seconds": [],
              "eval": []}
    start = 0
    manager = None
    if args.save_every or args.resume:
        from . import checkpoint  # noqa: PLC0415 - orbax loads only when checkpointing

        manager = checkpoint.manager(out / "checkpoints", args.save_every or 1)
        if args.resume:
            restored = checkpoint.restore(manager, state)
            if restored is not None:
                state, meta = restored
                start = meta["data_position"]
                for k in ("losses", "step_seconds", "eval"):
                    record[k] = meta[k]
                log(f"resumed at step {start} from {out / 'checkpoints'}")

    stop = min(args.steps, args.stop_after if args.stop_after is not None else args.steps)
    tokens_per_step = local_batch * cfg.seq_len
    params, opt_state = state["params"], state["opt_state"]
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn  # noqa: PLC0415

    columns = [TextColumn("train"), BarColumn(), MofNCompleteColumn(), TextColumn("loss {task.fields[loss]}"),
               TextColumn("{task.fields[tps]} tok/s"), TextColumn("{task.fields[ms]} ms/step"), TimeElapsedColumn()]
    with Progress(*columns, console=console, disable=args.quiet) as bar:
        task = bar.add_task("train", total=args.steps, completed=start, loss="-", tps="-", ms="-")
        for step in range(start, stop):
            x, y = put(data_lib.get_batch(corpus.train, step, local_batch, cfg.seq_len, seed=args.seed))
            t0 = time.perf_counter()
            params, opt_state, loss = step_fn(params, opt_state, x, y)
            loss = float(loss)
            dt = time.perf_counter() - t0
            record["losses"].append(loss)
            record["step_seconds"].append(dt)
            bar.update(task, advance=1, loss=f"{loss:.4f}", tps=f"{tokens_per_step / dt:,.0f}", ms=f"{dt * 1e3:.1f}")
            done = step + 1
            if args.eval_every and done % args.eval_every == 0 and done < stop:
                record["eval"].append({"step": done, "loss": evaluate(params)})
                bar.console.print(f"step {done}: eval loss {record['eval'][-1]['loss']:.4f}")
            if manager is not None and args.save_every and done % args.save_every == 0:
                # Copies of the log: orbax writes the JSON asynchronously, while the next steps append to it.
                checkpoint.save(manager, done, {"params": params, "opt_state": opt_state, "rng": state["rng"]},
                                {"data_position": done, "seed": args.seed,
                                 **{k: list(record[k]) for k in ("losses", "step_seconds", "eval")}})
    if manager is not None:
        manager.wait_until_finished()
    if not record["eval"] or record["eval"][-1]["step"] != stop:
        record["eval"].append({"step": stop, "loss": evaluate(params)})
    timed = record["step_seconds"][1:] or record["step_seconds"]
    record["tokens_per_second"] = tokens_per_step / float(np.median(timed)) if timed else None
    if record["losses"]:
        log(f"loss {record['losses'][0]:.4f} -> {record['losses'][-1]:.4f}; eval {record['eval'][-1]['loss']:.4f}; "
            f"{record['tokens_per_second']:,.0f} tokens/s")

    if mesh is not None:
        record["sharding"] = {"wq": str(params["layers"]["wq"].sharding.spec), "w_down": str(params["layers"]["w_down"].sharding.spec)}
    host_params = jax.device_get(params)
    if args.samples:
        record["samples"] = samples(host_params, cfg, backends, corpus, args, log)
    if not args.no_report:
        x, y = data_lib.get_batch(corpus.train, 0, local_batch, cfg.seq_len, seed=args.seed)
        rows = kernels.report(model_lib.loss_fn, host_params, (jnp.asarray(x), jnp.asarray(y)), backends, cfg, local_batch)
        record["kernel_report"] = rows
        if not args.quiet:
            kernels.print_report(rows, console)
    if not args.no_plot and record["losses"]:
        plot(record, out / "loss.png")
        log(f"loss curve: {out / 'loss.png'}")
    (out / "run.json").write_text(json.dumps(record, indent=1, default=str))
    log(f"run log: {out / 'run.json'}")
    record["final_params"] = host_params
    return record


def samples(params, cfg: ModelConfig, backends, corpus, args, log) -> list[str]:
    if corpus.vocab <= 256:
        prompts = [p.encode() for p in ("The ", "def ", "In Python, ", "Note: ", "For example", "A ")][:args.samples]
        prompts = [list(p) for p in prompts]
    else:
        prompts = [np.asarray(corpus.eval[i * 97:i * 97 + 8]).tolist() for i in range(args.samples)]
    outs = model_lib.sample(params, prompts, cfg, backends, new_tokens=args.sample_tokens,
                            temperature=args.temperature, key=jax.random.PRNGKey(args.seed))
    texts = []
    for p, o in zip(prompts, outs):
        text = bytes(p + o).decode("utf-8", errors="replace") if corpus.vocab <= 256 else f"{p} -> {o}"
        texts.append(text)
        log(f"[dim]sample:[/] {text!r}")
    return texts


def plot(record: dict, path: Path) -> None:
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(np.arange(1, len(record["losses"]) + 1), record["losses"], lw=1, label="train")
    if record["eval"]:
        ax.plot([e["step"] for e in record["eval"]], [e["loss"] for e in record["eval"]], "o-", label="held-out")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_title(f"forgeax LLM example: {record['params'] / 1e6:.2f}M params on {record['device']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def benchmark(args, cfg, settings, backends, state, step_fn, corpus, put, log) -> dict:
    """Times --benchmark-steps steps after two warm-up steps; prints one JSON line."""
    params, opt_state = state["params"], state["opt_state"]
    batches = [put(data_lib.get_batch(corpus.train, i, args.batch, cfg.seq_len, seed=args.seed)) for i in range(2)]
    for i in range(2):
        params, opt_state, loss = step_fn(params, opt_state, *batches[i % 2])
    jax.block_until_ready(loss)
    t0 = time.perf_counter()
    for i in range(args.benchmark_steps):
        params, opt_state, loss = step_fn(params, opt_state, *batches[i % 2])
    loss = float(loss)
    seconds = (time.perf_counter() - t0) / args.benchmark_steps
    tps = args.batch * cfg.seq_len / seconds
    kind = jax.devices()[0].device_kind
    # The step runs on every device the parameters live on (a --mesh): MFU is against all of them.
    devices = len(jax.tree.leaves(params)[0].sharding.device_set)
    peak = args.peak_tflops * 1e12 if args.peak_tflops else next((v for k, v in PEAK_FLOPS.items() if k in kind), None)
    peak = peak * devices if peak else None
    flops_per_token = 6 * cfg.num_params()
    palm_flops = 6 * (cfg.num_params() - cfg.vocab * cfg.d_model) + 12 * cfg.n_layers * cfg.d_model * cfg.seq_len
    stats = jax.devices()[0].memory_stats() or {}
    result = {"device": kind, "preset": args.preset, "params": cfg.num_params(), "batch": args.batch, "seq_len": cfg.seq_len,
              "dtype": cfg.dtype, "ops": settings, "backends": backends, "steps": args.benchmark_steps, "devices": devices,
              "step_seconds": seconds, "tokens_per_second": tps,
              "mfu": flops_per_token * tps / peak if peak else None, "peak_flops": peak,
              # PaLM's accounting: no embedding lookup, plus attention's score and value products.
              "mfu_palm": palm_flops * tps / peak if peak else None, "remat": cfg.remat,
              # Of the first device (with a mesh, each device holds its shard).
              "peak_bytes_in_use": stats.get("peak_bytes_in_use"), "loss": loss, "jax": jax.__version__}
    print(json.dumps(result))
    return result


def quiet_cuda_plugin(environ=os.environ) -> None:
    """With no NVIDIA GPU visible (and cuda not asked for), skip jax-cuda13-plugin's CUDA/cuDNN
    library check, which otherwise prints a long 'Unable to load cuDNN' traceback before JAX falls
    back to the CPU it would use anyway (as tools/bench.py does). Call before JAX's first backend lookup."""
    asked = environ.get("JAX_PLATFORMS", "")
    if not any(os.path.exists(n) for n in ("/dev/nvidia0", "/dev/nvidiactl", "/dev/dxg")) and "cuda" not in asked \
            and "gpu" not in asked:
        environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")


def main(argv: list[str] | None = None) -> None:
    quiet_cuda_plugin()
    run(argv)


if __name__ == "__main__":
    main()
