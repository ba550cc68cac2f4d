"""The new lines of a run's launcher.log and logs/rank*.log, each prefixed with where it came from."""

from __future__ import annotations

import re
import time
from pathlib import Path

from shardconsole.runfolder import RunFolder

LOG_TAIL_BYTES = 16 * 1024        # what a log shows of its past when first opened
_RANK_LOG = re.compile(r"rank(\d+)\.log$")
_CONTROL = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|[\x00-\x08\x0b-\x1f\x7f]")


class LogTail:
    def __init__(self, run_dir: Path, rescan_s: float = 1.0) -> None:
        self.folder = RunFolder(Path(run_dir))
        self.rescan_s = rescan_s
        self._files: list[tuple[str, Path]] = []
        self._pos: dict[Path, int] = {}
        self._partial: dict[Path, bytes] = {}
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
