"""A run's metrics stream folded into its summary's figures and curves (history/index.py's RunSummary) and a
RunState of its last session, line by line. Apart from index.py because it is the one part that reads the
stream: a whole-stream fold is kept per run while the run may still grow, so asking again (the console's
ctrl+l, ctrl+o) reads only the lines written since, not the stream from byte 0. No UI, no torch.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from shardconsole.history.refused import SessionEnds
from shardconsole.runlog import protocol as P
from shardconsole.runlog.runfolder import RunFolder
from shardconsole.runlog.runstate import RunState

class Summary(Protocol):
    """What the fold fills: history/index.py's RunSummary (named here by its fields, so that this module,
    which index.py imports, imports nothing of index.py)."""
    step: int
    steps: int
    tokens_per_s: float | None
    mfu: float | None
    peak_gpu_bytes: int | None
    peak_host_bytes: int | None
    last_loss: float | None
    eval_loss: float | None
    eval_pref_accuracy: float | None
    loss: list[tuple[int, float]]
    eval: list[tuple[int, float]]
    throughput: list[tuple[int, float]]
    bad_lines: int


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


@dataclass
class _Figures:
    """The fold's running figures, named as RunSummary's fields that _Fold.into copies them to (its own
    class: index.py imports this module, so this one cannot build a RunSummary)."""
    step: int = 0
    steps: int = 0
    last_loss: float | None = None
    eval_loss: float | None = None
    eval_pref_accuracy: float | None = None
    loss: list[tuple[int, float]] = field(default_factory=list)
    eval: list[tuple[int, float]] = field(default_factory=list)
    throughput: list[tuple[int, float]] = field(default_factory=list)
    bad_lines: int = 0


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
        self.acc = _Figures()
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

    def into(self, s: Summary) -> None:
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


def fold_run(folder: RunFolder, s: Summary, tail_bytes: int | None = None) -> tuple[RunState, str, str]:
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
