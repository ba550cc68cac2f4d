"""Following a run: its metrics stream, its ranks' log files and the machine. No Textual here.

RunFollower.tick() is called about four times a second from the run screen's thread worker. Like the
headless front end, it samples NVML and psutil once a second and appends those samples to the run's
metrics.jsonl, so the file keeps the whole story (a later `attach` replays the memory curve too); the
samples then come back through the reader like every other line, along one path.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from pathlib import Path

from shardconsole import protocol as P
from shardconsole.launch import LAUNCHER_LOG, METRICS_FILE
from shardconsole.stream import MetricsReader, SampleAppender

from shardconsole.console.services import Probes, RunHandle

LOG_TAIL_BYTES = 16 * 1024        # what a log shows of its past when first opened
_RANK_LOG = re.compile(r"rank(\d+)\.log$")
_CONTROL = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|[\x00-\x08\x0b-\x1f\x7f]")


class LogTail:
    """New lines of runs/<id>/launcher.log and logs/rank*.log, each prefixed with where it came from."""

    def __init__(self, run_dir: Path, rescan_s: float = 1.0) -> None:
        self.run_dir = run_dir
        self.rescan_s = rescan_s
        self._files: list[tuple[str, Path]] = []
        self._pos: dict[Path, int] = {}
        self._partial: dict[Path, bytes] = {}
        self._scanned = float("-inf")

    def _scan(self) -> None:
        ranks = []
        for p in (self.run_dir / "logs").glob("rank*.log"):
            m = _RANK_LOG.search(p.name)
            if m:
                ranks.append((int(m.group(1)), p))
        self._files = [("launch", self.run_dir / LAUNCHER_LOG)] + [(f"r{n}", p) for n, p in sorted(ranks)]

    def poll(self) -> list[str]:
        now = time.monotonic()
        if now - self._scanned >= self.rescan_s:   # ranks create their logs after start-up
            self._scanned = now
            self._scan()
        out: list[str] = []
        for label, path in self._files:
            try:
                with open(path, "rb") as fh:
                    size = fh.seek(0, 2)
                    pos = self._pos.get(path)
                    first = pos is None
                    if first:
                        pos = max(0, size - LOG_TAIL_BYTES)
                    if size < pos:          # truncated or replaced: start over
                        pos = 0
                    fh.seek(pos)
                    chunk = fh.read(size - pos)
            except OSError:
                continue
            self._pos[path] = pos + len(chunk)
            data = self._partial.get(path, b"") + chunk
            lines = data.split(b"\n")
            self._partial[path] = lines.pop()
            if first and pos > 0 and lines:
                lines = lines[1:]           # the first line of a tail starts mid-line
            for raw in lines:
                text = _CONTROL.sub("", raw.decode("utf-8", "replace").rsplit("\r", 1)[-1])
                if text.strip():
                    out.append(f"{label:>6}│ {text}")
        return out


@dataclass
class Tick:
    """What one look at the run found."""
    messages: list[P.Message] = field(default_factory=list)
    log_lines: list[str] = field(default_factory=list)
    bad_lines: int = 0
    exit_code: int | None = None      # set once the launcher has ended
    ended: bool = False


class RunFollower:
    def __init__(self, handle: RunHandle, run_id: str, probes: Probes, *, sample_every_s: float = 1.0,
                 sample: bool = True) -> None:
        self.handle = handle
        self.run_id = run_id
        self.probes = probes
        self.sample_every_s = sample_every_s
        self.reader = MetricsReader(handle.run_dir / METRICS_FILE)
        self.logs = LogTail(handle.run_dir)
        self.rank_pids: dict[int, int] = {}
        self._sample = sample
        self._samples = SampleAppender(handle.run_dir / METRICS_FILE, run_id)
        self._last_look = float("-inf")

    def tick(self) -> Tick:
        out = Tick()
        now = time.monotonic()
        due = now - self._last_look >= self.sample_every_s
        # Whether the job ended is asked first, so that every line written before the end is read below.
        # An attached job answers by scanning processes: once a second is enough.
        if due:
            self._last_look = now
            out.exit_code = self.handle.poll()
            out.ended = out.exit_code is not None
        out.messages = self.reader.poll()
        for msg in out.messages:
            if isinstance(msg, P.Hello):
                self.rank_pids[msg.rank] = msg.pid
        if due and not out.ended and self._sample:
            out.messages.extend(self._take_samples())
        out.log_lines = self.logs.poll()
        out.bad_lines = self.reader.bad_lines
        return out

    def _take_samples(self) -> list[P.Message]:
        """Append a sample of each GPU and of the host to the stream; returned only when the run folder is
        not writable (someone else's run), since otherwise the reader brings them back next tick."""
        return self._samples.append([*self.probes.gpus(self.run_id),
                                     self.probes.host(self.rank_pids.values(), self.run_id)])

    def close(self) -> None:
        self._samples.close()
