"""What a run folder says about its run: status (running, finished, stopped, failed with its cause),
its figures and its curves, read from job.json, metrics.jsonl and the session outcome; and the runs
under a runs root, newest first. No UI, no torch.
"""

from __future__ import annotations

import json
import re
import statistics
from dataclasses import dataclass, field
from pathlib import Path

from shardconsole.settings import config as C
from shardconsole.settings.paths import kind_of
from shardconsole.runlog import protocol as P
from shardconsole.history import cache
from shardconsole.history.refused import SessionEnds
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
    state, session, refused = _fold(folder, s, tail_bytes)
    if s.step and not s.steps and s.settings is not None:
        s.steps = s.settings.train.steps        # stopped before its first step line: the step of its save
    _status(folder, s, state, session)
    s.detail += refused
    if tail_bytes is None and s.status in cache.KEPT:
        cache.store(folder.metrics, s)
        forget(folder.path)
    return s


# Lines folded by this process (all runs): what a test counts to see each line read once, not per poll.
FOLDED = {"lines": 0}
# The folds of runs not in the disk cache (running, or of unknown end), by stream path: asked again
# (the console's ctrl+l, ctrl+o), a run's fold goes on from where it stopped instead of from byte 0.
_LIVE: dict[str, "_Fold"] = {}
_LIVE_MAX = 64


def _replace_from(points: list[tuple[int, float]], step: int) -> None:
    """Drop the points at step and after (a resumed run replays steps past its checkpoint: the curve keeps
    the newest value). The points are in step order, so they go from the end: each point is dropped at
    most once, and a stream of n steps costs O(n), not the O(n^2) of filtering the list per line."""
    while points and points[-1][0] >= step:
        points.pop()


class _Fold:
    """The stream folded into a summary's figures and a RunState of its last session (a resumed run
    appends sessions under run ids of their own: the end that counts is the last one's), line by line,
    resumable at the reader's offset."""

    def __init__(self, folder: RunFolder, tail_bytes: int | None) -> None:
        from shardconsole.runlog.stream import MetricsReader
        self.reader = MetricsReader(folder.metrics)
        if tail_bytes is not None:
            _skip_to_tail(self.reader, folder.metrics, tail_bytes)
        self.state, self.session = RunState(), ""
        self.ends = SessionEnds()
        self.acc = RunSummary(path=folder.path)
        self.rates: list[float] = []
        self.mfus: list[float] = []
        self.gpu_peak: int | None = None
        self.nvml_peak: int | None = None
        self.host_peak: int | None = None
        self.rss: dict[int, int] = {}
        self.inode = _inode(folder.metrics)

    def feed(self) -> None:
        """Every whole line written since the last feed."""
        while True:
            before = self.reader._pos
            for msg in self.reader.poll():
                FOLDED["lines"] += 1
                self._apply(msg)
            if self.reader._pos == before:
                break
        self.acc.bad_lines = self.reader.bad_lines

    def _apply(self, msg: P.Message) -> None:
        s, state = self.acc, self.state
        if isinstance(msg, P.Hello) and msg.run != self.session:
            if self.session:
                self.ends.new_session(state)
                state.new_session()
            self.session = msg.run
        if isinstance(msg, (P.Finished, P.Failed)) and self.session and msg.run and msg.run != self.session:
            return
        state.apply(msg)
        self.ends.saw(msg)
        if isinstance(msg, P.Step):
            s.step, s.steps = msg.step, msg.steps
            _replace_from(s.loss, msg.step)
            _replace_from(s.throughput, msg.step)
            if msg.loss is not None:
                s.loss.append((msg.step, msg.loss))
                s.last_loss = msg.loss
            if msg.tokens_per_s:
                s.throughput.append((msg.step, msg.tokens_per_s))
                self.rates.append(msg.tokens_per_s)
            if msg.mfu is not None:
                self.mfus.append(msg.mfu)
        elif _saved_or_stopped_at(msg) > s.step:
            # A stop saves at the step it reached, which is rarely a log step (the Slurm pass: the last step
            # line said 230, the run stopped and saved at 236): the run is where its save or its stop says.
            s.step = _saved_or_stopped_at(msg)
        elif isinstance(msg, P.Eval) and msg.loss is not None:
            _replace_from(s.eval, msg.step)
            s.eval.append((msg.step, msg.loss))
            s.eval_loss = msg.loss
            s.eval_pref_accuracy = msg.pref_accuracy
        elif isinstance(msg, P.Memory):
            peak = msg.peak_reserved_bytes or msg.reserved_bytes
            if peak is not None:
                self.gpu_peak = max(self.gpu_peak or 0, peak)
            self.rss[msg.rank] = msg.host_rss_bytes
            self.host_peak = max(self.host_peak or 0, sum(self.rss.values()))
        elif isinstance(msg, P.GpuSample) and msg.used_bytes:
            self.nvml_peak = max(self.nvml_peak or 0, msg.used_bytes)
        elif isinstance(msg, P.HostSample) and msg.ranks_rss_bytes:
            self.host_peak = max(self.host_peak or 0, msg.ranks_rss_bytes)

    def into(self, s: RunSummary) -> None:
        a = self.acc
        s.step, s.steps, s.last_loss, s.eval_loss, s.bad_lines = a.step, a.steps, a.last_loss, a.eval_loss, a.bad_lines
        s.eval_pref_accuracy = a.eval_pref_accuracy
        s.loss, s.eval, s.throughput = list(a.loss), list(a.eval), list(a.throughput)
        # The first step line carries compile and warm-up: it is not the run's speed.
        steady = self.rates[1:] or self.rates
        s.tokens_per_s = statistics.median(steady) if steady else None
        s.mfu = statistics.median(self.mfus[1:] or self.mfus) if self.mfus else None
        s.peak_gpu_bytes = self.gpu_peak if self.gpu_peak is not None else self.nvml_peak
        s.peak_host_bytes = self.host_peak


def _saved_or_stopped_at(msg: P.Message) -> int:
    """The step a checkpoint_saved event or a stop's end line was written at (0 for any other line)."""
    if isinstance(msg, P.Event) and msg.name == "checkpoint_saved":
        return msg.step or 0
    if isinstance(msg, P.Failed) and msg.cause == "stopped":
        return msg.step or 0
    return 0


def _inode(path: Path) -> tuple[int, int] | None:
    try:
        st = path.stat()
        return st.st_dev, st.st_ino
    except OSError:
        return None


def _fold(folder: RunFolder, s: RunSummary, tail_bytes: int | None = None) -> tuple[RunState, str, str]:
    """The stream into the summary's figures, a RunState of its last session (history/refused.py: of the
    one before a refused resume) and the refusal's words; a whole-stream fold goes on from the last one of
    this process when the file is the same and has only grown."""
    key = str(folder.metrics.resolve()) if tail_bytes is None else ""
    fold = _LIVE.pop(key, None) if key else None
    if fold is not None:
        size = _size(folder.metrics)
        if fold.inode != _inode(folder.metrics) or size is None or size < fold.reader._pos:
            fold.reader.close()
            fold = None          # replaced or cut: read again from the start
    fold = fold or _Fold(folder, tail_bytes)
    try:
        fold.feed()
    finally:
        fold.into(s)
    if key:
        _LIVE[key] = fold
        while len(_LIVE) > _LIVE_MAX:
            _LIVE.pop(next(iter(_LIVE))).reader.close()
    else:
        fold.reader.close()
    return fold.ends.view(fold.state), fold.session, fold.ends.note()


def forget(folder: Path) -> None:
    """Drop a run's kept fold (its summary went to the disk cache: it ended)."""
    fold = _LIVE.pop(str(RunFolder(Path(folder)).metrics.resolve()), None)
    if fold is not None:
        fold.reader.close()


def _size(path: Path) -> int | None:
    try:
        return path.stat().st_size
    except OSError:
        return None


def _skip_to_tail(reader, path: Path, tail_bytes: int) -> None:
    """Start the reader at the first whole line of the last tail_bytes of the file."""
    try:
        size = path.stat().st_size
        if size <= tail_bytes:
            return
        with open(path, "rb") as fh:
            fh.seek(size - tail_bytes)
            fh.readline()
            reader._pos = fh.tell()
    except OSError:
        pass


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
