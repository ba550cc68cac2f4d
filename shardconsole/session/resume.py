"""Continue a stopped, failed or finished run in its own folder (issue 15 item 5).

`prepare_resume(run_dir, overrides)` reads the folder's preset.toml, applies the overrides, turns
train.resume on (the ranks then load the newest complete checkpoint of the folder's own checkpoint
folder, with its step, data position, RNG states and loss scaler), keeps the old settings as
preset.toml.prev and writes the new ones atomically. The ranks append to the same metrics.jsonl under
a run id of their own (`resume_run_id`), so a front end tells this session's end lines from the
earlier ones.

Front-end side: standard library and the settings layer only (no torch, no backends).
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

from shardconsole.settings import config as C
from shardconsole.settings import resolve as settings
from shardconsole.runlog.runfolder import RunFolder

PREV_SUFFIX = ".prev"
MANIFEST = "shardconsole.json"     # written by backends/checkpoints.py into every complete checkpoint


def checkpoints_in(folder: Path) -> list[tuple[int, Path]]:
    """Step folders that look complete (newest first): the ranks check each in full and fall back."""
    if not folder.is_dir():
        return []
    out = []
    for p in folder.iterdir():
        name = p.name
        if not (p.is_dir() and name.startswith("step_") and name[5:].isdigit()):
            continue     # .partial folders are saves that never finished
        if (p / MANIFEST).is_file() or (p / ".metadata").is_file() or (p / "latest").is_file():
            out.append((int(name[5:]), p))
    return sorted(out, reverse=True)


def _running(folder: RunFolder) -> bool:
    """Whether this run's launcher is alive (job.json's pid, checked against its start time)."""
    try:
        info = json.loads(folder.job.read_text())
        pid, started = int(info["pid"]), float(info.get("started", 0))
    except (OSError, ValueError, KeyError, TypeError):
        return False
    try:
        import psutil
        proc = psutil.Process(pid)
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE and proc.create_time() <= started + 5
    except Exception:
        return False


def prepare_resume(run_dir: Path, overrides: list) -> C.RunConfig:
    """overrides: `table.key=value` strings (errors name `--set table.key`) or settings.Override objects."""
    folder = RunFolder(Path(run_dir))
    if not folder.path.is_dir():
        raise C.ConfigError(f"{folder.path}: no such run folder")
    if not folder.preset.is_file():
        raise C.ConfigError(f"{folder.path}: not a run folder (no {folder.preset.name})")
    if _running(folder):
        raise C.ConfigError(f"{folder.path}: the run is still going; stop it first "
                            f"(`shardconsole stop {folder.path}`), or follow it with `shardconsole attach`")
    cfg = settings.resolve_doc(C.load_toml(folder.preset), folder.path.name, folder.preset, list(overrides)).cfg
    ckpt_dir = folder.checkpoints(cfg.train.checkpoint_dir)
    found = checkpoints_in(ckpt_dir)
    if not found:
        raise C.ConfigError(f"{folder.path}: no checkpoint in {ckpt_dir} to resume from (the run saved none: "
                            f"train.checkpoint_every was 0 and it ended before its final save)")
    newest = found[0][0]
    if cfg.train.steps <= newest:
        raise C.ConfigError(f"{folder.path}: its newest checkpoint is step {newest} and train.steps is "
                            f"{cfg.train.steps}: nothing left to train; add --set train.steps=N with N > {newest}")
    cfg.train.resume = True
    prev = folder.preset.with_name(folder.preset.name + PREV_SUFFIX)
    shutil.copy2(folder.preset, prev)
    C.save(cfg, folder.preset)
    return cfg


def resume_run_id(run_dir: Path) -> str:
    """A run id for this session: the folder's name and the time, so its finished/failed lines are its own."""
    return f"{RunFolder(Path(run_dir)).run_id}-resume-{time.strftime('%Y%m%d-%H%M%S')}"
