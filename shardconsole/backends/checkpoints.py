"""Checkpoint folders, the same for both backends.

A save writes step_<N>.partial/ (the backend's files, each rank's `rank_state/rank<N>.json`), then rank 0
writes `shardconsole.json` (the step, the data position, the world size and every file with its size)
and renames the folder to step_<N>/. So a kill mid-save never leaves a folder that resume would pick,
and a folder truncated or emptied later (a full disk, a copy cut short) is told from a complete one by
its manifest: resume skips it, with a warning naming it, and takes the previous complete one.

Nothing here is unpickled: the manifest and the rank states are JSON. What the backends load is not
(README's resume section): DCP's .metadata is a pickle, and DeepSpeed's files are torch.save pickles,
loaded with weights_only=True and an allow-list of DeepSpeed's own classes (deepspeed.py).
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist

from shardconsole.backends.common import Rank

MANIFEST = "shardconsole.json"
RANK_STATE_DIR = "rank_state"
PREFIX, PARTIAL = "step_", ".partial"


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used; the message names its folder."""


@dataclass(frozen=True)
class Found:
    step: int
    path: Path
    meta: dict     # the manifest ({} for a folder written before manifests existed)


def checkpoint_path(r: Rank, step: int) -> Path:
    return r.checkpoint_dir() / f"{PREFIX}{step:08d}"


def partial_path(r: Rank, step: int) -> Path:
    return r.checkpoint_dir() / f"{PREFIX}{step:08d}{PARTIAL}"


def _step_folders(folder: Path) -> list[tuple[int, Path]]:
    if not folder.is_dir():
        return []
    out = []
    for p in folder.iterdir():
        if p.is_dir() and p.name.startswith(PREFIX) and p.name[len(PREFIX):].isdigit():
            out.append((int(p.name[len(PREFIX):]), p))
    return sorted(out, reverse=True)


def why_incomplete(path: Path, backend: str) -> str | None:
    """None when the folder holds a complete checkpoint, else what is wrong with it."""
    manifest = path / MANIFEST
    if manifest.is_file():
        try:
            meta = json.loads(manifest.read_text())
            files = dict(meta["files"])
        except (OSError, ValueError, KeyError, TypeError):
            return f"its {MANIFEST} is unreadable"
        if meta.get("backend") != backend:
            return f"written by a {meta.get('backend')} run, this run is {backend}"
        for name, size in files.items():
            f = path / name
            if not f.is_file():
                return f"{name} is missing"
            if f.stat().st_size != size:
                return f"{name} is truncated ({f.stat().st_size} of {size} bytes)"
        return None
    # Written before manifests: only the backend's own marker can be checked.
    if backend == "fsdp":
        meta_file = path / ".metadata"
        return None if meta_file.is_file() and meta_file.stat().st_size > 0 else "no DCP .metadata (empty or cut short)"
    if (path / "latest").is_file():
        return None
    return "no DeepSpeed 'latest' file (empty, cut short, or written by an FSDP run)"


def newest_complete(r: Rank) -> Found | None:
    """The newest complete checkpoint; each newer folder that is not complete is skipped with a warning."""
    backend = r.cfg.parallel.backend
    for step, path in _step_folders(r.checkpoint_dir()):
        why = why_incomplete(path, backend)
        if why is None:
            try:
                meta = json.loads((path / MANIFEST).read_text())
            except (OSError, ValueError):
                meta = {}
            from shardconsole.backends import data as data_mod
            data_mod.check_resume(r, meta.get("data"), path)     # the data it was trained on, or a refusal
            return Found(step, path, meta)
        r.event("warning", f"skipping checkpoint {path}: {why}; trying the previous one")
    return None


def latest_checkpoint(folder: Path) -> tuple[int, Path] | None:
    """The highest-numbered step folder, complete or not (for tools that only list)."""
    found = _step_folders(folder)
    return found[0] if found else None


def remove_partials(r: Rank) -> None:
    """Rank 0: `.partial` folders are saves that were killed; none is ever resumed from."""
    if r.rank != 0 or not r.checkpoint_dir().is_dir():
        return
    for p in r.checkpoint_dir().iterdir():
        if p.is_dir() and p.name.startswith(PREFIX) and p.name.endswith(PARTIAL):
            shutil.rmtree(p, ignore_errors=True)
            r.log(f"removed {p}: a save that did not finish")


def prepare_checkpoint(r: Rank, step: int) -> Path:
    tmp = partial_path(r, step)
    if r.rank == 0:
        remove_partials(r)
        tmp.mkdir(parents=True)
    dist.barrier()
    r.faults.on_save(step)
    return tmp


def write_rank_state(tmp: Path, rank: int, state: dict) -> None:
    d = tmp / RANK_STATE_DIR
    d.mkdir(parents=True, exist_ok=True)
    (d / f"rank{rank}.json").write_text(json.dumps(state))


def read_rank_state(path: Path, rank: int) -> dict | None:
    f = path / RANK_STATE_DIR / f"rank{rank}.json"
    if not f.is_file():
        return None
    try:
        return json.loads(f.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{f}: unreadable ({e})") from None


def finish_checkpoint(r: Rank, step: int, meta: dict) -> Path:
    """After every rank wrote its part: the manifest, the rename (rank 0), the pruning, then everyone
    goes on."""
    dist.barrier()
    final = checkpoint_path(r, step)
    if r.rank == 0:
        tmp = partial_path(r, step)
        files = {str(f.relative_to(tmp)): f.stat().st_size for f in sorted(tmp.rglob("*")) if f.is_file()}
        from shardconsole.backends import data as data_mod
        manifest = {**meta, "step": step, "world": r.world, "backend": r.cfg.parallel.backend,
                    "data": data_mod.identity(r), "files": files}
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))
        _fsync_dir(tmp)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync_dir(final.parent)
        r.event("checkpoint_saved", str(final))
        prune(r, keep=r.cfg.train.keep_checkpoints)
    dist.barrier()
    return final


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def prune(r: Rank, keep: int) -> None:
    """Keep the newest `keep` complete checkpoints (0: all); called right after a new one is complete."""
    if keep <= 0:
        return
    complete = [(s, p) for s, p in _step_folders(r.checkpoint_dir())
                if why_incomplete(p, r.cfg.parallel.backend) is None]
    for _, p in complete[keep:]:
        shutil.rmtree(p, ignore_errors=True)
        r.log(f"removed {p}: train.keep_checkpoints = {keep}")


def save_due(r: Rank, step: int) -> bool:
    """A periodic checkpoint after this step (the last step is the final save's)."""
    every = r.cfg.train.checkpoint_every
    return bool(every) and step % every == 0 and step != r.cfg.train.steps


def final_save_due(r: Rank) -> bool:
    t = r.cfg.train
    return t.save_final != "none" or bool(t.checkpoint_every and t.steps % t.checkpoint_every == 0)
