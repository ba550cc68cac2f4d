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

import enum
import errno
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch.distributed as dist

from shardconsole.backends.checkpoint import checksums, folder_owner, save_stream
from shardconsole.backends.rank import run_folder
from shardconsole.backends.rank.common import Rank
from shardconsole.backends.rank.errors import CheckpointError  # noqa: F401  (raised here; re-exported)
# The completeness test lives beside the run folder's layout (no torch): export and the console use it too.
from shardconsole.runlog.checkpoint_files import MANIFEST, why_incomplete  # noqa: F401  (re-exported)
from shardconsole.runlog.checkpoint_files import STEP_PREFIX as PREFIX, step_folders
from shardconsole.runlog import base_weights
from shardconsole.runlog.checkpoint_files import MANIFEST_SUM, manifest_checksum, shapes_of
from shardconsole.runlog.checkpoint_files import checksums as checksums_of, make_private, safe_reason, why_corrupt
from shardconsole.settings.values import format_size

RANK_STATE_DIR = "rank_state"
PARTIAL = ".partial"


# CheckpointError (a checkpoint that cannot be used; the message names its folder, and never passes on torch's
# advice to load with weights_only=False) lives in rank/errors.py.


class NoLoadableCheckpoint(CheckpointError):
    """Step folders none of which loads: the resume is refused and they are left as they are. Not
    CheckpointError's hint: train.resume = false in this folder would save over them."""
    hint = ("restore a good copy of one of them, or start a new run in another folder (a run here with "
            "train.resume = false would save over them)")


class SaveKind(enum.Enum):
    """What a save writes. CHECKPOINT resumes (weights, optimizer, rank states); MODEL is the weights
    alone (train.save_final = "model", or a stop short of time), which export-model reads and resume
    passes by. An engine that cannot write the weights alone writes a checkpoint for MODEL (DeepSpeed:
    its master weights are in the optimizer's partitions)."""
    CHECKPOINT = "checkpoint"
    MODEL = "model"


@dataclass(frozen=True)
class Found:
    step: int
    path: Path
    meta: dict     # the manifest ({} for a folder written before manifests existed)


def _dir(r: Rank) -> Path:
    """The checkpoint folder, moved with a run folder renamed mid-run when it is inside it."""
    return run_folder.rebased(r, r.checkpoint_dir())


def checkpoint_path(r: Rank, step: int) -> Path:
    return _dir(r) / f"{PREFIX}{step:08d}"


def partial_path(r: Rank, step: int) -> Path:
    return _dir(r) / f"{PREFIX}{step:08d}{PARTIAL}"


def newest_complete(r: Rank) -> Found | None:
    """The newest complete checkpoint of this run whose files have their checksums; each newer folder
    that is not is skipped with a warning naming it (and the file at fault). None only where the folder
    holds no step at all; step folders none of which loads are a CheckpointError naming each. Every
    rank calls it."""
    backend = r.cfg.parallel.backend
    folder = _dir(r)
    ours = folder_owner.loadable_runs_of(r, folder)
    skipped: list[str] = []
    for step, path in step_folders(folder):
        why = why_incomplete(path, backend)
        if why is None:
            try:
                meta = json.loads((path / MANIFEST).read_text())
            except (OSError, ValueError):
                meta = {}
            if meta.get("what") == "model":
                why = "it holds the weights alone (train.save_final = \"model\"; export-model reads it)"
            elif ours is not None and meta.get("run_dir") and meta["run_dir"] not in ours:
                why = f"another run wrote it ({meta['run_dir']}), not this one"
            else:
                why = _verify(r, path)
        if why is None and (other := base_weights.why_other_base(
                r.cfg.model.name, r.cfg.adapters and not r.cfg.lora.allow_changed_base, meta)):
            raise CheckpointError(f"{path}: {other}; put them back, or set lora.allow_changed_base = true")
        if why is None:
            from shardconsole.backends.data import sources as data_mod
            data_mod.check_resume(r, meta.get("data"), path)     # the data it was trained on, or a refusal
            return Found(step, path, meta)
        r.event("warning", f"skipping checkpoint {path}: {why}; trying the previous one")
        skipped.append(f"{path.name}: {why}")
    if skipped:
        # A resume asked for these steps: starting again from step 0 would prune and overwrite them
        # (the damaged ones may still be mended or copied back) and call it a resume.
        raise NoLoadableCheckpoint(f"{folder}: no loadable checkpoint to resume from ({'; '.join(skipped)}); "
                                   f"nothing was changed")
    return None


def _verify(r: Rank, path: Path) -> str | None:
    """The files' checksums, each rank reading a share of them; the first failure any rank found, the
    same answer on every rank. A checkpoint saved before checksums loads unverified, said once."""
    sums = checksums_of(path)
    if sums is None:
        r.event("warning", f"{path} has no checksums (saved before shardconsole wrote them): loaded unverified")
        return None
    mine = sorted(sums)[r.rank::r.world]
    found: list[str | None] = [None] * r.world
    dist.all_gather_object(found, why_corrupt(path, mine))
    return next((w for w in found if w), None)


def _what(path: Path) -> str:
    try:
        return str(json.loads((path / MANIFEST).read_text()).get("what", "checkpoint"))
    except (OSError, ValueError, AttributeError):
        return "checkpoint"


def latest_checkpoint(folder: Path) -> tuple[int, Path] | None:
    """The highest-numbered step folder, complete or not (for tools that only list)."""
    found = step_folders(folder)
    return found[0] if found else None


def remove_partials(r: Rank) -> None:
    """Rank 0: `.partial` folders are saves that were killed; none is ever resumed from."""
    if r.rank != 0 or not _dir(r).is_dir():
        return
    for p in _dir(r).iterdir():
        if p.is_dir() and p.name.startswith(PREFIX) and p.name.endswith(PARTIAL):
            shutil.rmtree(p, ignore_errors=True)
            r.log(f"removed {p}: a save that did not finish")


def prepare_checkpoint(r: Rank, step: int) -> Path:
    run_folder.follow_move(r)        # renamed since the last step boundary: the save goes to its new path
    tmp = partial_path(r, step)
    if r.rank == 0:
        folder_owner.claim(r, _dir(r))
        remove_partials(r)
        if not r.cfg.train.checkpoint_dir:
            # checkpoints/ of the run folder, never the run folder itself: one deleted or renamed under a
            # save would come back as a half folder at the old path
            tmp.parent.mkdir(exist_ok=True)
        # 0700 from its creation (umask can only narrow it): no other local user reads a shard while it
        # is written; train.checkpoint_private = false leaves the umask's mode.
        tmp.mkdir(parents=True, mode=0o700 if r.cfg.train.checkpoint_private else 0o777)
    dist.barrier()
    r.faults.on_save(step)
    return tmp


def resumed_tokens(r: Rank, step: int) -> int | None:
    """The real tokens the checkpoint of `step` recorded (GRPO's), None where it has none."""
    try:
        value = json.loads((checkpoint_path(r, step) / MANIFEST).read_text()).get("real_tokens")
    except (OSError, ValueError):
        return None
    return int(value) if isinstance(value, int) else None


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


def finish_checkpoint(r: Rank, step: int, meta: dict, streamed: dict[str, str]) -> Path:
    """After every rank wrote its part: the manifest, the rename (rank 0), the pruning, then everyone
    goes on. `streamed`: the checksums of the files this rank hashed as it wrote them."""
    dist.barrier()
    final, tmp = checkpoint_path(r, step), partial_path(r, step)
    # Rank 0's listing (the folder is on a file system every rank writes to, as the manifest needs),
    # the same names on every rank for the checksums' split.
    listed = [sorted(str(f.relative_to(tmp)) for f in tmp.rglob("*") if f.is_file()) if r.rank == 0 else None]
    dist.broadcast_object_list(listed, src=0)
    names: list[str] = listed[0] or []
    sums = checksums.collect(tmp, names, streamed, r.rank, r.world)
    if r.rank == 0:
        files = {name: (tmp / name).stat().st_size for name in names}
        from shardconsole.backends.data import sources as data_mod
        manifest = {**meta, "step": step, "world": r.world, "backend": r.cfg.parallel.backend,
                    "data": data_mod.identity(r), "files": files, "checksums": sums,
                    "run_dir": str(r.run_dir.resolve()), "base": base_weights.of_run(r.cfg.model.name, r.cfg.adapters),
                    "shapes": shapes_of(r.cfg)}
        if r.cfg.train.objective == "grpo" and r.progress.tokens is not None:
            # the prompt and completion tokens trained on up to this step: sampled, so a resume cannot
            # recount them from the data as DPO's pairs are (loop.Tail._save sets it, resumed_tokens reads it)
            manifest["real_tokens"] = int(r.progress.tokens)
        # over the manifest as a reader will parse it (an int key comes back a string, and sorts otherwise)
        manifest[MANIFEST_SUM] = manifest_checksum(json.loads(json.dumps(manifest)))
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))
        if r.cfg.train.checkpoint_private:
            make_private(tmp)
        _fsync_dir(tmp)
        if final.exists():
            _keep_aside(r, final)
        os.replace(tmp, final)
        _fsync_dir(final.parent)
        r.event("checkpoint_saved", str(final))
        prune(r, keep=r.cfg.train.keep_checkpoints)
    dist.barrier()
    return final


def _keep_aside(r: Rank, final: Path) -> None:
    """A step folder this save would replace: one the resume skipped (damaged, the weights alone, another
    run's), which it then trained up to again. Renamed, never deleted: a damaged save is evidence that may
    be mended or copied back, and no name but step_<N> is ever loaded or pruned."""
    aside, n = final.with_name(f"{final.name}.replaced"), 1
    while aside.exists():
        aside, n = final.with_name(f"{final.name}.replaced{n + 1}"), n + 1
    os.replace(final, aside)
    r.event("warning", f"{final} was saved again by this session; the earlier one, which it did not load, "
                       f"is kept as {aside.name}")


def run_save(r: Rank, step: int, kind: SaveKind, total_bytes: int, write: Callable[[Path], dict[str, str]],
             meta: dict) -> Path:
    """Every rank: one save from the .partial folder to the renamed one, with SaveProgress from rank 0
    while it runs. `write(tmp)` writes this rank's files and returns the checksums of those it hashed on
    the way (name in tmp -> checksum; the rest are hashed after); `kind` is what they hold (SaveKind).
    A save that fails removes only its own .partial folder (the last complete checkpoint is never
    touched: pruning follows a complete save) and raises DiskFullError / SaveOOMError where that is the
    cause."""
    what = kind.value
    r.phase("saving checkpoint")
    training_peak, start = host_peak_bytes(), reset_host_peak()
    watch = None
    try:
        tmp = prepare_checkpoint(r, step)
        watch = save_stream.SaveWatch(r, step, what, tmp, total_bytes)
        streamed = write(tmp)
        final = finish_checkpoint(r, step, {**meta, "what": what}, streamed)
    except BaseException as e:
        if watch is not None:
            watch.finish()
        err = _failed_save(r, step, total_bytes, e)
        if err is e:
            raise
        raise err from e
    seconds = watch.finish(final)
    r.progress.save_seconds[what] = seconds      # a stop with little time left decides from it (trainstate)
    # The host peaks on every rank: training's before the save, the save's own, and the resident bytes
    # when it began (the save's rise is save_peak - start; tests/test_save_path.py and the GPU
    # benchmark read them).
    r.event("save_host_peak", f"step={step} what={what} training_peak={training_peak} start={start} "
                              f"save_peak={host_peak_bytes()} seconds={seconds:.3f} total={total_bytes}",
            all_ranks=True)
    return final


def _failed_save(r: Rank, step: int, total_bytes: int, e: BaseException) -> BaseException:
    """Rank 0 removes the failed save's folder (a full disk gets its space back); the error, named."""
    if r.rank == 0:
        shutil.rmtree(partial_path(r, step), ignore_errors=True)
    where = _dir(r)
    free = save_stream.free_bytes(where)
    if save_stream.disk_full_in(e, free, total_bytes):
        return save_stream.DiskFullError(
            errno.ENOSPC, f"disk full at the checkpoint of step {step}: {save_stream.full_words(where, total_bytes)}")
    if save_stream.oom_in(e):
        return save_stream.SaveOOMError(f"host out of memory during the save of step {step} "
                                        f"({format_size(total_bytes)} to write)")
    return e


def _status_bytes(field: str) -> int:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def host_peak_bytes() -> int:
    """This process's peak resident set since start or the last reset (VmHWM), 0 where /proc has none."""
    return _status_bytes("VmHWM:")


def reset_host_peak() -> int:
    """Start the peak afresh at the resident set now (Linux: clear_refs 5), so the save's own peak is
    told from training's; returns the resident bytes now. Where it cannot be reset, the later peak
    is the larger of both."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass
    return _status_bytes("VmRSS:")


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
    complete = [(s, p) for s, p in step_folders(_dir(r))
                if why_incomplete(p, r.cfg.parallel.backend) is None]
    if complete and r.step < r.cfg.train.steps and _what(complete[0][1]) == "model":
        return      # the weights alone, saved by a stop short of time: the resumable checkpoints all stay
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


def final_what(r: Rank) -> SaveKind:
    """The final save's kind: "model" only when asked for and no periodic checkpoint falls on the last
    step (that one is resumable, as checkpoint_every promises)."""
    t = r.cfg.train
    periodic = bool(t.checkpoint_every and t.steps % t.checkpoint_every == 0)
    return SaveKind.MODEL if t.save_final == "model" and not periodic else SaveKind.CHECKPOINT
