"""Transport of the metrics stream: JSON lines appended to the run's metrics.jsonl.

Each rank and the front end append whole lines with O_APPEND, one write() per line (< 4 KiB), so
lines from different processes never interleave. Readers tail the file. The file is the stream:
a front end that dies loses nothing (the ranks keep writing), and `attach` replays the whole history
before following new lines. The training loop never waits on a reader, because there is none to wait
on; a failed write (disk full) drops the line and counts it, it never raises into training.

Standard library only.
"""

from __future__ import annotations

import os
from pathlib import Path

from shardconsole.protocol import MAX_LINE, DecodeError, Message, decode, encode


class MetricsWriter:
    def __init__(self, path: str | Path | None, run: str = "", rank: int = -1) -> None:
        self.path = Path(path) if path else None
        self.run, self.rank = run, rank
        self.dropped = 0
        self._fd: int | None = None
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)

    def emit(self, msg: Message) -> None:
        if self._fd is None:
            return
        try:
            data = (encode(msg) + "\n").encode()
            os.write(self._fd, data)
        except (OSError, ValueError):
            self.dropped += 1

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


class SampleAppender:
    """The front end's machine samples (each GPU, the host) into a run's stream, so the file keeps the
    whole story and a later attach replays the memory curves too. Shared by `--headless` and the
    console. A run folder this user cannot write (someone else's run, attached) is followed read-only:
    `append` then hands the samples back for the caller to show instead of writing them."""

    def __init__(self, path: str | Path, run: str) -> None:
        self.path, self.run = Path(path), run
        self.writable = True
        self._writer: MetricsWriter | None = None

    def append(self, samples: list[Message]) -> list[Message]:
        """Write `samples` to the stream; returns those not written (a read-only folder)."""
        if self.writable and self._writer is None:
            try:
                self._writer = MetricsWriter(self.path, self.run, -1)
            except OSError:
                self.writable = False
        if self._writer is None:
            return samples
        for s in samples:
            self._writer.emit(s)
        return []

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()


class MetricsReader:
    """Follows a metrics.jsonl from the start. poll() returns the messages written since last time."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.bad_lines = 0
        self.last_error = ""
        self._pos = 0
        self._partial = b""

    def poll(self, max_bytes: int = 8 << 20) -> list[Message]:
        try:
            with open(self.path, "rb") as fh:
                fh.seek(self._pos)
                chunk = fh.read(max_bytes)
        except FileNotFoundError:
            return []
        self._pos += len(chunk)
        data = self._partial + chunk
        lines = data.split(b"\n")
        self._partial = lines.pop()  # an unfinished line stays for the next poll
        if len(self._partial) > MAX_LINE:
            self._count_bad("line too long")
            self._partial = b""
        out: list[Message] = []
        for raw in lines:
            if not raw.strip():
                continue
            try:
                out.append(decode(raw))
            except DecodeError as e:
                self._count_bad(str(e))
        return out

    def _count_bad(self, why: str) -> None:
        self.bad_lines += 1
        self.last_error = why
