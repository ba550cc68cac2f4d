"""What a run folder says about its run: status (running, finished, stopped, failed with its cause),
its figures and its curves, read from job.json, metrics.jsonl and the session outcome; and the runs
under a runs root, newest first. No UI, no torch.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from shardconsole.settings import config as C
from shardconsole.settings.paths import kind_of
from shardconsole.history import cache, stream_fold
from shardconsole.user_folders import OLD_RUNS_ROOT, runs_root
from shardconsole.runlog.runfolder import RunFolder
from shardconsole.launch.process_identity import this_host
from shardconsole.runlog.runstate import RunState

RUNNING, FINISHED, STOPPED, FAILED, UNKNOWN = "running", "finished", "stopped", "failed", "unknown"
PREPARED = "prepared"      # --print-command / --slurm wrote the folder; no rank has written yet
HOST = this_host()
_STAMPED = re.compile(r"^(\d{8}-\d{6})-(.+?)(-\d+)?$")     # new_run_dir's <time>-<preset>[-n]


@dataclass
class RunSummary:
    path: Path
    status: str = UNKNOWN
    cause: str = ""                  # a failure's class (gpu_oom, nan_loss, crash, ...)
    detail: str = ""                 # the outcome's first line
    started: float = 0.0
    description: str = ""
    preset: str = ""
    backend: str = ""
    training: str = ""               # train.method/train.objective ("lora/dpo"): whose losses compare
    model: str = ""
    settings: C.RunConfig | None = None
    step: int = 0
    steps: int = 0
    tokens_per_s: float | None = None     # median over the step lines after the first (compile, warm-up)
    mfu: float | None = None
    peak_gpu_bytes: int | None = None     # the largest rank's allocator peak, else NVML's used
    peak_host_bytes: int | None = None    # the ranks' resident memory together, at its highest
    last_loss: float | None = None
    eval_loss: float | None = None
    eval_pref_accuracy: float | None = None   # a DPO / ORPO run's held-out preference accuracy, last eval
    loss: list[tuple[int, float]] = field(default_factory=list)
    eval: list[tuple[int, float]] = field(default_factory=list)
    throughput: list[tuple[int, float]] = field(default_factory=list)
    bad_lines: int = 0

    @property
    def run_id(self) -> str:
        return self.path.name

    @property
    def status_text(self) -> str:
        return f"{FAILED} ({self.cause})" if self.status == FAILED and self.cause else self.status


def is_run_folder(path: Path) -> bool:
    return (Path(path) / RunFolder(Path(path)).preset.name).is_file()


def roots(explicit: str | Path | None = None) -> list[Path]:
    """The runs root, then the old default ./runs when it holds runs too (the runs of an earlier version)."""
    root = runs_root(explicit)
    out = [root]
    old = OLD_RUNS_ROOT.absolute()
    if explicit is None and old.is_dir() and old.resolve() != root.resolve():
        out.append(old)
    return out


def list_runs(explicit_root: str | Path | None = None, limit: int | None = None,
              tail_bytes: int | None = None) -> list[RunSummary]:
    """Every run folder under the runs root(s), newest first (tail_bytes: see summarize)."""
    folders = []
    for root in roots(explicit_root):
        try:
            # a link: a run made with --run-dir elsewhere (session/runs_link.py), listed at its own path
            folders += [d.resolve() if d.is_symlink() else d for d in root.iterdir() if d.is_dir() and is_run_folder(d)]
        except OSError:
            continue
    folders = sorted(set(folders), key=_started, reverse=True)
    return [summarize(d, tail_bytes) for d in folders[:limit]]


def find_run(ref: str | Path, explicit_root: str | Path | None = None) -> Path:
    """A run folder from a path, or an id (whole, or a part that names one run) under the runs root(s).
    ValueError with one line when none or several match."""
    path = Path(ref).expanduser()
    if kind_of(path) == "folder":     # PathError (a ValueError) for a path too long to look at
        if is_run_folder(path):
            return path
        raise ValueError(f"{path}: not a run folder (no {RunFolder(path).preset.name})")
    searched = roots(explicit_root)
    if path.name == str(ref):      # an id, not a path
        for root in searched:
            if is_run_folder(root / path.name):
                return root / path.name
        hits = []
        for root in searched:
            try:
                hits += [d for d in root.iterdir() if str(ref) in d.name and is_run_folder(d)]
            except OSError:
                continue
        if len(hits) == 1:
            return hits[0]
        if len(hits) > 1:
            names = ", ".join(sorted(h.name for h in hits)[:5])
            raise ValueError(f"{ref!r} names {len(hits)} runs ({names}{', ...' if len(hits) > 5 else ''}): give more of the id")
    else:       # a path (it has a folder part) that is not there: said as a path, not as an unknown id
        raise ValueError(f"{path}: not a run folder (no such folder)")
    where = " or ".join(str(r) for r in searched)
    raise ValueError(f"no run {str(ref)!r}: not a folder, and no run of that id in {where} "
                     f"(`shardconsole runs` lists them)")


def _started(path: Path) -> float:
    try:
        return float(json.loads(RunFolder(path).job.read_text())["started"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    try:
        return RunFolder(path).preset.stat().st_mtime
    except OSError:
        return 0.0


def summarize(path: Path, tail_bytes: int | None = None) -> RunSummary:
    """Everything `runs`, `compare` and the console's runs screen show of one folder. Never raises for
    what is in the folder: an unreadable part leaves its fields empty. tail_bytes: read only the end of
    the stream (a picker's status at a glance: how a run ended is written last; the curves and peaks
    are then those of the tail only)."""
    folder = RunFolder(Path(path))
    s = RunSummary(path=folder.path, started=_started(folder.path))
    m = _STAMPED.match(folder.path.name)
    origin = folder.read_origin()
    s.preset = str(origin.get("preset") or "") or (m.group(2) if m else "")
    try:
        cfg = C.load(folder.preset)
        s.settings, s.description = cfg, cfg.description.splitlines()[0] if cfg.description else ""
        s.backend, s.model = cfg.parallel.backend, cfg.model.name
        s.training = f"{cfg.train.method}/{cfg.train.objective}"
        if s.backend == "deepspeed":
            s.backend = f"zero{cfg.deepspeed.stage}"
    except (C.ConfigError, OSError, ValueError):
        pass
    if tail_bytes is None:
        cached = cache.load(folder.metrics)
        if cached is not None and cache.apply(s, cached):
            return s
    state, session, refused = stream_fold.fold_run(folder, s, tail_bytes)
    if s.step and not s.steps and s.settings is not None:
        s.steps = s.settings.train.steps        # stopped before its first step line: the step of its save
    _status(folder, s, state, session)
    s.detail += refused
    if tail_bytes is None and s.status in cache.KEPT:
        cache.store(folder.metrics, s)
        stream_fold.forget(folder.path)
    return s


def _status(folder: RunFolder, s: RunSummary, state: RunState, session: str) -> None:
    from shardconsole.session.outcome import explain_exit
    if state.finished is not None and not state.failed:
        s.status, s.detail = FINISHED, f"finished: {state.finished.steps} steps"
        return
    if _alive(folder, state):
        s.status = RUNNING
        s.detail = f"{state.phase}" + (f", step {s.step}/{s.steps}" if s.steps else "")
        return
    if not state.hellos and not state.failed and not folder.job.is_file():
        how = folder.read_origin().get("prepared")
        if how and never_started(folder):
            s.status, s.detail = PREPARED, (f"written by --{how}, not started yet (`shardconsole runs --prune` "
                                            f"removes such folders)")
        else:
            s.status, s.detail = UNKNOWN, "not started here (no job.json, no rank has written)"
        return
    host = _job_host(folder)
    if (not folder.job.is_file() or (host and host != HOST)) and not state.failed:
        # Started elsewhere (--print-command, --slurm, another node of a shared folder): only its stream
        # could say it ended, or its ranks all gone without a word (session/faults/lost.py).
        from shardconsole.session.faults import lost
        if lost.gone(state.hellos, set(), folder.path, lost.silent_for(folder.path)):
            cause, message = lost.message(state.hellos, s.step, folder.path, s.settings)
            s.status, s.cause, s.detail = FAILED, cause, message.splitlines()[0]
            return
        from shardconsole.launch.job import node_agents
        agents = node_agents(folder.path)       # a run of several nodes: every node's agent, not the last
        where = (f"by the node agents {agents}" if agents else f"on host {host}" if host and host != HOST
                 else "elsewhere")
        s.status, s.detail = UNKNOWN, f"started {where}; its stream has no end (still running there, or killed)"
        return
    cause, message = explain_exit(state, None, folder.path)     # "ok": its stream deleted, its logs say so
    s.status = FINISHED if cause == "ok" else STOPPED if cause == "stopped" else FAILED
    s.cause = "" if cause in ("ok", "stopped") else cause
    s.detail = message.splitlines()[0]


def never_started(folder: RunFolder) -> bool:
    """A folder --print-command or --slurm prepared that no run has touched: nothing in it but its
    preset.toml and origin.json (no stream, job.json, logs or checkpoints)."""
    try:
        names = {p.name for p in folder.path.iterdir()}
    except OSError:
        return False
    return bool(folder.read_origin().get("prepared")) and names <= {folder.preset.name, folder.origin.name}


def _job_host(folder: RunFolder) -> str:
    try:
        return str(json.loads(folder.job.read_text()).get("host", ""))
    except (OSError, ValueError, AttributeError):
        return ""


def _alive(folder: RunFolder, state: RunState) -> bool:
    """The run's launcher still runs on this host (verified as this run's: a reused pid is not), or one
    of its ranks outlived it."""
    from shardconsole.launch.job import Job
    from shardconsole.session.watcher import rank_alive
    if folder.job.is_file():
        try:
            if Job.from_run_dir(folder.path).launcher_state()[0] == "ours":
                return True
        except (OSError, ValueError, KeyError, TypeError):
            pass
    return any(rank_alive(h, folder.path) for h in state.hellos.values())
