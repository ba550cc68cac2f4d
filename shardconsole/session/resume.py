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
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path

from shardconsole.launch import process_identity as PI
from shardconsole.launch.owner import owning

from shardconsole.settings import config as C
from shardconsole.settings import resolve as settings
from shardconsole.runlog import protocol as P
from shardconsole.runlog.checkpoint_files import (MANIFEST, SHAPE_KEYS, listed_bytes, shapes_of, step_folders,
                                                  why_corrupt, why_incomplete, why_manifest_altered)
from shardconsole.runlog.runfolder import RunFolder
from shardconsole.session.resume_data import check_same_data, loaded_checkpoint

PREV_SUFFIX = ".prev"


def checkpoints_in(folder: Path) -> list[tuple[int, Path]]:
    """Step folders that look complete (newest first): the ranks check each in full and fall back."""
    return [(step, p) for step, p in step_folders(folder)
            if (p / MANIFEST).is_file() or (p / ".metadata").is_file() or (p / "latest").is_file()]


def _what(path: Path) -> str:
    """A step folder's kind as its manifest says ("checkpoint" or "model"); older folders are checkpoints."""
    try:
        return str(json.loads((path / MANIFEST).read_text()).get("what", "checkpoint"))
    except (OSError, ValueError, AttributeError):
        return "checkpoint"


def complete_checkpoints(folder: Path, backend: str) -> list[tuple[int, Path]]:
    """checkpoints_in's folders that also pass the test export-model and the ranks apply (every file the
    manifest lists, at its size): the steps a chat (`chat RUN --step N`) can be given, newest first."""
    return [(step, p) for step, p in checkpoints_in(folder) if why_incomplete(p, backend) is None]


def _still_running(folder: RunFolder) -> str:
    """What of the folder still runs ('' when nothing): the launcher job.json names (its identity
    checked: host, start time, command line), or any rank of the folder, whatever session started it:
    a launcher killed with SIGKILL leaves its ranks training, and a resume over them would interleave
    two runs' checkpoints."""
    from shardconsole.launch.job import Job
    try:
        job = Job.from_run_dir(folder.path)
    except (OSError, ValueError, KeyError, TypeError):
        job = None
    if job is not None and job.launcher_state()[0] == "ours":
        return f"its launcher (pid {job.pid}) is running"
    ranks = PI.folder_ranks(folder.path)
    if not ranks:
        return ""
    orphaned = " (orphaned: their launcher is gone)" if job is not None else ""
    return f"rank process(es) {', '.join(map(str, sorted(ranks)))} of this folder are still training{orphaned}"


def prepare_resume(run_dir: Path, overrides: list, check: Callable[[C.RunConfig, str], None] | None = None
                   ) -> C.RunConfig:
    """overrides: `table.key=value` strings (errors name `--set table.key`) or settings.Override objects.
    Under the folder's owner lock (launch/owner.py): a caller that goes on to launch holds it across
    both (`owning(run_dir, ...)` around this and Job.start), so a second resume meanwhile is refused.
    check(cfg, source): a last check of the settings to resume with (the free disk), before any file is
    written; it raises a ConfigError to refuse."""
    folder = RunFolder(Path(run_dir))
    if not folder.path.is_dir():
        raise C.ConfigError(f"{folder.path}: no such run folder")
    if not folder.preset.is_file():
        raise C.ConfigError(f"{folder.path}: not a run folder (no {folder.preset.name})")
    with owning(folder.path, f"`resume` of {folder.path.name}"):
        return _prepare(folder, overrides, check)


def _prepare(folder: RunFolder, overrides: list, check: Callable[[C.RunConfig, str], None] | None) -> C.RunConfig:
    running = _still_running(folder)
    if running:
        raise C.ConfigError(f"{folder.path}: the run is still going: {running}; stop it first "
                            f"(`shardconsole stop {folder.path}`), or follow it with `shardconsole attach {folder.path}`")
    doc = C.load_toml(folder.preset)
    # What the run was, compared against below, not launched: read leniently, since today's checks on this
    # machine may refuse it where the overrides given are the cure (fp8 on a CPU: resume --set precision.fp8=none
    # was refused with the advice to set fp8 to none). The settings launched are `resolved`'s, checked in full.
    saved = settings.resolve_doc(doc, folder.path.name, folder.preset, [], lenient=True).cfg
    before = saved.train
    resolved = settings.resolve_doc(doc, folder.path.name, folder.preset, list(overrides))
    cfg = resolved.cfg
    if "train.schedule_steps" not in resolved.origins:
        # More steps continue the schedule the run had (a constant tail at the lr it ended on), never a
        # cosine re-stretched over the new length, which sent the lr back up at the first resumed step.
        cfg.train.schedule_steps = before.schedule_steps or before.steps
    _follow_rename(folder, cfg)
    ckpt_dir = folder.checkpoints(cfg.train.checkpoint_dir)
    found = checkpoints_in(ckpt_dir)
    if not found:
        every = before.checkpoint_every
        # what the run's own settings say of why (it said "checkpoint_every was 0" of a run that had 20, whose
        # stop killed its first save)
        why = (f"train.checkpoint_every was {every} and it ended before step {every}" if every else
               "train.checkpoint_every was 0 and it ended before its final save")
        raise C.ConfigError(f"{folder.path}: no checkpoint in {ckpt_dir} to resume from (the run saved none: {why}; "
                            f"a stop or a failure during its first save leaves none)")
    # The ranks skip a weights-alone save (train.save_final = "model"): with nothing else they would start
    # again from step 0 under the name of a resume.
    resumable = [(step, p) for step, p in found if _what(p) != "model"]
    if not resumable:
        raise C.ConfigError(f"{folder.path}: its checkpoint (step {found[0][0]}) holds the weights alone "
                            f"(train.save_final = \"model\"): nothing to resume from; `shardconsole export-model "
                            f"{folder.path}` reads it, and a run resumes from train.save_final = \"full\" or "
                            f"train.checkpoint_every saves")
    # the checkpoint's own record of its shapes when it has one; else preset.toml's (an older save)
    _check_same_shapes(saved, resolved, keys=not _check_saved_shapes(resolved, resumable))
    loaded = _check_some_complete(folder.path, resumable, cfg.parallel.backend)     # the one the ranks load
    _check_same_base(cfg, resolved, loaded)
    newest = resumable[0][0]
    if cfg.train.steps <= newest:
        raise C.ConfigError(f"{folder.path}: its newest checkpoint is step {newest} and train.steps is "
                            f"{cfg.train.steps}: nothing left to train; add --set train.steps=N with N > {newest}")
    _check_export_dir(cfg, resolved.origin("train", "export_dir"))
    check_same_data(saved, resolved, loaded)
    cfg.train.resume = True
    from shardconsole.session import checkpoint_owner, rundir
    rundir.check_resume_writable(cfg, folder.path, str(folder.preset))
    checkpoint_owner.check(cfg, folder.path, str(folder.preset), new_run=False,
                           export_source=resolved.origin("train", "export_dir"))
    if check is not None:
        check(cfg, str(folder.preset))
    checkpoint_owner.claim(cfg, folder.path)
    prev = folder.preset.with_name(folder.preset.name + PREV_SUFFIX)
    shutil.copy2(folder.preset, prev)
    C.save(cfg, folder.preset)
    return cfg


# Checksums read before the launch, newest checkpoint first, up to this many bytes: a damaged one is then
# refused in one line with nothing written (the ranks found it only after the launch). Read once more here,
# the files come from the page cache for the ranks' own check and load; past it (a checkpoint of tens of
# GB) the ranks, each reading a share, are the check, and refuse the same way.
PRELAUNCH_VERIFY_BYTES = 8 << 30


def _follow_rename(folder: RunFolder, cfg: C.RunConfig) -> None:
    """A train.checkpoint_dir or export_dir named inside the run folder was written absolute at the launch:
    once the folder was renamed it points at the old path (the ranks saved at the new one). Moved with
    the folder when nothing is at the launch's path (job.json's) now; and the runs root links the folder
    again (its link leads to the old path: the run had gone from `runs`)."""
    from shardconsole.runlog.runfolder import read_json
    from shardconsole.session.runs_link import link_into_runs_root
    launched = str(read_json(folder.job).get("run_dir") or "")
    here = folder.path.absolute()
    if not launched or Path(launched) == here or Path(launched).exists():
        return
    link_into_runs_root(here)
    for key in ("checkpoint_dir", "export_dir"):
        text = getattr(cfg.train, key)
        if not text:
            continue
        try:
            inside = Path(text).relative_to(launched)
        except ValueError:
            continue
        setattr(cfg.train, key, str(here / inside))


def _check_some_complete(run_dir: Path, found: list[tuple[int, Path]], backend: str) -> Path:
    """The step folder the ranks will load first; refuse, before the launch, a resume none of whose
    checkpoints passes the test (every file at its listed size, the manifest as saved, and, within
    PRELAUNCH_VERIFY_BYTES, every file's checksum): the ranks would refuse after the launch, or an older
    version started again from step 0 and pruned the damaged ones. Nothing is written before this."""
    whys = []
    budget = PRELAUNCH_VERIFY_BYTES
    for _, p in found:
        why = why_incomplete(p, backend)
        if why is None:
            size = listed_bytes(p) or 0
            if size > budget:
                return p          # the ranks verify it
            budget -= size
            why = why_corrupt(p)
        if why is None:
            return p
        whys.append((p, why))
    raise C.ConfigError(f"{run_dir}: no loadable checkpoint to resume from ("
                        + "; ".join(f"{p.name}: {why}" for p, why in whys)
                        + "); nothing was changed: restore a good copy, or start a new run")


def _check_same_base(cfg: C.RunConfig, resolved, checkpoint: Path) -> None:
    """A LoRA checkpoint holds the adapters alone: refuse, before the launch, a base folder whose weights
    changed since the save (runlog/base_weights; the ranks refuse the same way)."""
    from shardconsole.runlog import base_weights
    folder = base_weights.base_folder(cfg.model.name)
    if not cfg.adapters or folder is None or cfg.lora.allow_changed_base:
        return
    why = base_weights.why_changed(base_weights.saved_fingerprint(checkpoint, MANIFEST), folder)
    if why is not None:
        raise resolved.error("model", "name", f"{folder}: the base model of this LoRA run, but {why}; the adapters "
                                              f"of {checkpoint.name} were trained on the earlier weights: put them "
                                              f"back, or --set lora.allow_changed_base=true to train them on from "
                                              f"the new weights")


def _recorded_shapes(found: list[tuple[int, Path]]) -> tuple[Path, dict] | None:
    """The newest step folder whose manifest, as saved (its own checksum holds), recorded SHAPE_KEYS."""
    for _, p in found:
        try:
            meta = json.loads((p / MANIFEST).read_text())
        except (OSError, ValueError):
            continue
        if isinstance(meta, dict) and isinstance(meta.get("shapes"), dict) and why_manifest_altered(meta) is None:
            return p, meta["shapes"]
    return None


def _check_saved_shapes(resolved, found: list[tuple[int, Path]]) -> bool:
    """SHAPE_KEYS against what the checkpoints' manifest recorded (a save of this version): preset.toml
    edited by hand since (optim.name, say) was compared with itself and crashed at the first step.
    False when no manifest recorded them (saved before: preset.toml is all there is)."""
    recorded = _recorded_shapes(found)
    if recorded is None:
        return False
    checkpoint, saved = recorded
    now = shapes_of(resolved.cfg)
    for table, key in SHAPE_KEYS:
        name = f"{table}.{key}"
        if table == "lora" and saved.get("train.method") == "full":
            continue        # no adapters in a full fine-tune's checkpoint
        if name in saved and saved[name] != now[name]:
            raise resolved.error(table, key, f"the checkpoints were saved with {name} = {saved[name]!r} ("
                                             f"{checkpoint.name}'s manifest); a resume loads their tensors as they "
                                             f"are: keep {saved[name]!r}, or start a new run with {now[name]!r}")
    return True


def _check_export_dir(cfg: C.RunConfig, source: str) -> None:
    """train.export_dir is written again at the resumed run's end, and the export never overwrites: a
    folder the earlier session filled failed the run then, after its training (refused now instead)."""
    text = cfg.train.export_dir
    path = Path(text).expanduser() if text else None
    if path is not None and path.exists() and (not path.is_dir() or any(path.iterdir())):
        raise C.ConfigError(f"{path} already holds files (the earlier session's export?) and the export never "
                            f"overwrites: add --set train.export_dir=NEW_FOLDER, or --set train.export_dir= for none",
                            source=source, table="train", key="export_dir")


def _check_same_shapes(saved: C.RunConfig, resolved, keys: bool = True) -> None:
    """Refuse, before the launch, an override of a setting the checkpoint's tensors depend on, naming it
    and the value the checkpoint was saved with. keys: SHAPE_KEYS too (not when the checkpoint's manifest
    recorded them: _check_saved_shapes)."""
    method = saved.train.method
    for table, key in SHAPE_KEYS if keys else ():
        if table == "lora" and method == "full":
            continue        # no adapters in a full fine-tune's checkpoint
        old, new = getattr(getattr(saved, table), key), getattr(getattr(resolved.cfg, table), key)
        if old != new:
            raise resolved.error(table, key, f"the checkpoints were saved with {table}.{key} = {old!r}; a resume "
                                             f"loads their tensors as they are: keep {old!r}, or start a new run "
                                             f"with {new!r}")
    if saved.split_masters != resolved.cfg.split_masters:
        # adam-mini keeps fp32 masters' low bits as an optimizer state (weight_low): a checkpoint with it
        # and settings without it (or the reverse) have different tensors
        for table, key in (("precision", "master_dtype"), ("precision", "dtype")):
            old, new = getattr(getattr(saved, table), key), getattr(getattr(resolved.cfg, table), key)
            if old != new:
                raise resolved.error(table, key, f"the checkpoints were saved with {table}.{key} = {old!r}, which "
                                                 f"decides how adam-mini keeps the masters: keep {old!r}, or start "
                                                 f"a new run with {new!r}")


class EarlierPart:
    """What a resumed session's stream held before it, told in one line instead of replayed: its step
    lines, sessions and how the last one ended."""

    def __init__(self, log_every: int | None = None) -> None:
        """log_every: the run's train.log_every, for a session of one step line (else read from its lines)."""
        self.sessions: list[str] = []
        self.last: P.Step | None = None
        self.ended = ""
        self.log_every = log_every
        self._lines: dict[str, list[int]] = {}      # each session's first two step lines

    @property
    def first_step(self) -> int | None:
        """The first step the earlier sessions trained: a step line comes every log_every steps (and at
        the last), so a session whose first line is step 5 trained from step 1 (it said "steps 5-40"
        of a session of steps 1-40); a resumed one from its checkpoint's next step."""
        firsts = []
        for lines in self._lines.values():
            every = lines[1] - lines[0] if len(lines) > 1 else (self.log_every or 1)
            firsts.append(lines[0] - (lines[0] - 1) % max(1, every))
        return min(firsts, default=None)

    def add(self, msg: P.Message) -> None:
        if msg.run and msg.run not in self.sessions:
            self.sessions.append(msg.run)
        if isinstance(msg, P.Step):
            lines = self._lines.setdefault(msg.run, [])
            if len(lines) < 2 and msg.step not in lines:
                lines.append(msg.step)
            self.last = msg
            self.ended = ""
        elif isinstance(msg, P.Event) and msg.name == "phase" and msg.detail == "finished":
            self.ended = f"finished at step {msg.step}"      # (the watcher keeps other sessions' end lines)
        elif isinstance(msg, P.Event) and msg.name == "stop_save":
            self.ended = f"stopped at step {msg.step}"

    def __bool__(self) -> bool:
        return bool(self.sessions)

    def line(self) -> str:
        n = len(self.sessions)
        text = f"earlier in this folder ({n} session{'s' if n != 1 else ''}): "
        if self.last is None:
            text += "no step lines"
        else:
            loss = "n/a" if self.last.loss is None else f"{self.last.loss:.4f}"
            text += f"steps {self.first_step}-{self.last.step}, last loss {loss}, lr {self.last.lr:.2e}"
        ended = self.ended or (f"ended at step {self.last.step} of {self.last.steps}" if self.last else "")
        return text + (f"; {ended}" if ended else "")


def resume_run_id(run_dir: Path) -> str:
    """A run id for this session: the folder's name, the time and this process, so its finished/failed
    lines are its own (two resumes in one second still differ; the owner lock lets only one launch)."""
    now = time.time()
    stamp = time.strftime('%Y%m%d-%H%M%S', time.localtime(now)) + f".{int(now % 1 * 1e6):06d}"
    return f"{RunFolder(Path(run_dir)).run_id}-resume-{stamp}-{os.getpid()}"
