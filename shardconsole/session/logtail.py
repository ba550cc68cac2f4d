"""The new lines of a run's launcher.log and logs/rank*.log, each prefixed with where it came from.

What a reader on an 80-column panel needs, not a byte-for-byte copy (the files keep that):
- torchrun's glog prefix (`W1201 04:47:51.591000 23777 torch/distributed/run.py:874] `) shrinks to its
  level letter, and its banner rules of asterisks go;
- the traceback torchrun prints when it is told to stop (SignalException: a stop, not a crash) folds
  into one line saying so; every other traceback is shown whole, as it came.
"""

from __future__ import annotations

import re
import signal
import time
from pathlib import Path

from shardconsole.runlog.runfolder import RunFolder

LOG_TAIL_BYTES = 16 * 1024        # what a log shows of its past when first opened
TRACEBACK_HOLD_S = 3.0            # a traceback whose last line has not come yet is shown after this long
_RANK_LOG = re.compile(r"rank(\d+)\.log$")
_CONTROL = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|[\x00-\x08\x0b-\x1f\x7f]")
# torchrun's Python glog prefix, and c10's C++ one ("[W1201 05:18:22.839261287 Utils.hpp:137] ")
_GLOG = re.compile(r"^\[?([IWEF])\d{4} \d\d:\d\d:\d\d\.\d+\s+(?:\d+ )?[^\]\s]+:\d+\] ?")
_SIGNAL_EXC = re.compile(r"SignalException: Process (\d+) got signal: (\d+)")
_CHAIN = ("Traceback (most recent call last):", "During handling of the above exception",
          "The above exception was the direct cause")


def tidy(text: str) -> str:
    """One log line as the panel shows it: no control codes, torchrun's prefix cut to its level."""
    text = _CONTROL.sub("", text.rsplit("\r", 1)[-1])
    if text.startswith('{"v":') and '"kind":' in text:
        return ""     # a stream line a rank also logs (its end, for stream_gone): the panels show it in words
    m = _GLOG.match(text)
    if m:
        rest = text[m.end():]
        text = "" if not rest.strip("* ") else f"{m.group(1)} {rest}"
    return text


def signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


class _Traceback:
    """A traceback being read, held until its exception line says what it was."""

    def __init__(self, first: str, after_stop: bool = False) -> None:
        self.lines = [first]
        self.since = time.monotonic()
        self.indented = False
        self.after_stop = after_stop   # chained to a SignalException already said in one line

    def add(self, line: str) -> list[str] | None:
        """Take the next line; once it is the exception line, what to show (None: not ended yet)."""
        self.lines.append(line)
        if line.startswith((" ", "\t")):
            self.indented = True
            return None
        if not self.indented or line.startswith(_CHAIN) or not line.strip():
            return None
        m = _SIGNAL_EXC.search(line)
        if m is None:
            return self.lines
        if self.after_stop:
            return []
        # torchrun's handler raises this when the launcher gets a signal: our stop (or someone's kill)
        # asked for it, and the agent has shut its workers down. A stop is not a crash.
        return [f"torchrun (pid {m.group(1)}) got {signal_name(int(m.group(2)))} and shut its workers down: "
                f"a stop, not a crash (its traceback is in launcher.log)"]


class LogTail:
    def __init__(self, run_dir: Path, rescan_s: float = 1.0) -> None:
        self.folder = RunFolder(Path(run_dir))
        self.rescan_s = rescan_s
        self._files: list[tuple[str, Path]] = []
        self._pos: dict[Path, int] = {}
        self._partial: dict[Path, bytes] = {}
        self._traceback: dict[Path, _Traceback] = {}
        self._after_stop: set[Path] = set()
        self._scanned = float("-inf")

    def _scan(self) -> None:
        ranks = []
        for p in self.folder.logs.glob("rank*.log"):
            m = _RANK_LOG.search(p.name)
            if m:
                ranks.append((int(m.group(1)), p))
        self._files = [("launch", self.folder.launcher_log)] + [(f"r{n}", p) for n, p in sorted(ranks)]

    def poll(self) -> list[str]:
        now = time.monotonic()
        if now - self._scanned >= self.rescan_s:   # ranks create their logs after start-up
            self._scanned = now
            self._scan()
        out: list[str] = []
        for label, path in self._files:
            out += [f"{label:>6}│ {text}" for text in self._read(path)]
        return out

    def _read(self, path: Path) -> list[str]:
        try:
            with open(path, "rb") as fh:
                size = fh.seek(0, 2)
                known = self._pos.get(path)
                first = known is None
                pos = max(0, size - LOG_TAIL_BYTES) if known is None else known
                if size < pos:          # truncated or replaced: start over
                    pos = 0
                fh.seek(pos)
                chunk = fh.read(size - pos)
        except OSError:
            return []
        self._pos[path] = pos + len(chunk)
        data = self._partial.get(path, b"") + chunk
        lines = data.split(b"\n")
        self._partial[path] = lines.pop()
        if first and pos > 0 and lines:
            lines = lines[1:]           # the first line of a tail starts mid-line
        out: list[str] = []
        for raw in lines:
            text = tidy(raw.decode("utf-8", "replace"))
            held = self._traceback.get(path)
            if held is not None:
                shown = held.add(text)
                if shown is not None:
                    out += shown
                    del self._traceback[path]
                    if shown != held.lines:      # said as a stop: its chained parts are the same stop
                        self._after_stop.add(path)
                continue
            if text.startswith(_CHAIN[0]):
                self._traceback[path] = _Traceback(text, after_stop=path in self._after_stop)
            elif path in self._after_stop and (not text.strip() or text.startswith(_CHAIN[1:])):
                continue
            else:
                self._after_stop.discard(path)
                out.append(text)
        held = self._traceback.get(path)
        if held is not None and time.monotonic() - held.since >= TRACEBACK_HOLD_S:
            out += held.lines           # its exception line never came (a killed process): show what there is
            del self._traceback[path]
        return [line for line in out if line.strip()]
