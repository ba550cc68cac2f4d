"""Checkpoint folders: written to step_<N>.partial, renamed to step_<N> by rank 0 once every rank is
done, so a kill mid-save never leaves a folder that resume would pick. The backends write the contents
(torch.distributed.checkpoint for FSDP2, engine.save_checkpoint for DeepSpeed)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch.distributed as dist

from shardconsole.backends.common import Rank



def checkpoint_path(r: Rank, step: int) -> Path:
    return r.checkpoint_dir() / f"step_{step:08d}"


def partial_path(r: Rank, step: int) -> Path:
    return r.checkpoint_dir() / f"step_{step:08d}.partial"


def latest_checkpoint(folder: Path) -> tuple[int, Path] | None:
    if not folder.is_dir():
        return None
    done = []
    for p in folder.iterdir():
        if p.is_dir() and p.name.startswith("step_") and p.name[5:].isdigit():
            done.append((int(p.name[5:]), p))
    return max(done) if done else None


def finish_checkpoint(r: Rank, step: int) -> Path:
    """After every rank wrote its part: make the checkpoint visible (rank 0), then tell everyone."""
    dist.barrier()
    final = checkpoint_path(r, step)
    if r.rank == 0:
        tmp = partial_path(r, step)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        r.event("checkpoint_saved", str(final))
    dist.barrier()
    return final


def prepare_checkpoint(r: Rank, step: int) -> Path:
    tmp = partial_path(r, step)
    if r.rank == 0:
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
    dist.barrier()
    r.faults.on_save(step)
    return tmp


def save_due(r: Rank, step: int) -> bool:
    """A periodic checkpoint after this step (the last step is the final save's)."""
    every = r.cfg.train.checkpoint_every
    return bool(every) and step % every == 0 and step != r.cfg.train.steps


def final_save_due(r: Rank) -> bool:
    t = r.cfg.train
    return t.save_final or bool(t.checkpoint_every and t.steps % t.checkpoint_every == 0)
