"""The exported ds_config file (`shardconsole export --format deepspeed`): the rank's config of export.py
plus the schedule as a DeepSpeed scheduler block, for a user's own script. Kept out of export.py, whose
code is what DeepSpeed receives in a run (the planner's calibration hashes it)."""

from __future__ import annotations

from typing import Any

from shardconsole.settings import config as C
from shardconsole.ds_json.export import device_type, to_ds_config


def scheduler_block(cfg: C.RunConfig) -> dict[str, Any] | None:
    """DeepSpeed's scheduler for shardconsole's schedule, for a file a user runs with their own script
    (the rank's config has none: shardconsole's loop applies train.schedule itself). None where DeepSpeed
    without a scheduler already runs the same: a constant rate with no warm-up. DeepSpeed's
    WarmupCosineLR warms up over 2 steps at least; shardconsole's warm-up of 0 or 1 step has none."""
    t = cfg.train
    if t.schedule == "constant":
        if t.warmup_steps == 0:
            return None
        return {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": t.lr,
                                               "warmup_num_steps": t.warmup_steps, "warmup_type": "linear"}}
    return {"type": "WarmupCosineLR", "params": {
        "total_num_steps": t.steps, "warmup_min_ratio": 0, "warmup_num_steps": max(1, t.warmup_steps),
        "cos_min_ratio": t.min_lr_ratio, "warmup_type": "linear"}}


def file_config(cfg: C.RunConfig) -> dict[str, Any]:
    """`shardconsole export --format deepspeed`: the rank's ds_config for the machine the settings name
    (parallel.device = "auto" is a GPU machine, whatever this one has: the file must not depend on where
    it was exported), with the schedule as a DeepSpeed scheduler block."""
    out = to_ds_config(cfg, device=device_type(cfg))
    sched = scheduler_block(cfg)
    if sched is not None:
        out["scheduler"] = sched
    return out
