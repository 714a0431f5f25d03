"""Orbax checkpoints of the training state: params, optimizer state and RNG as arrays, and the
data iterator's position (the step) with the run's log so far as JSON."""

from __future__ import annotations

from pathlib import Path

import orbax.checkpoint as ocp


def manager(path: Path, save_every: int) -> ocp.CheckpointManager:
    options = ocp.CheckpointManagerOptions(save_interval_steps=save_every, max_to_keep=2)
    return ocp.CheckpointManager(Path(path).resolve(), options=options, item_names=("state", "meta"))


def save(mgr: ocp.CheckpointManager, step: int, state: dict, meta: dict) -> None:
    mgr.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)))


def restore(mgr: ocp.CheckpointManager, template: dict) -> tuple[dict, dict] | None:
    """(state, meta) of the latest checkpoint, shaped and sharded like `template`; None if none."""
    step = mgr.latest_step()
    if step is None:
        return None
    out = mgr.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(template), meta=ocp.args.JsonRestore()))
    return out["state"], out["meta"]
