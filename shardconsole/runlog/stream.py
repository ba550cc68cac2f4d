"""Transport of the metrics stream: JSON lines appended to the run's metrics.jsonl.

Each rank and the front end append whole lines with O_APPEND, one write() per line (< 4 KiB), so
lines from different processes never interleave. Readers tail the file. The file is the stream:
a front end that dies loses nothing (the ranks keep writing), and `attach` replays the whole history
before following new lines. The training loop never waits on a reader, because there is none to wait
on; a failed write (disk full) drops the line and counts it, it never raises into training.

Standard library only.
"""

from __future__ import annotations

import heapq
import os
import time
from collections.abc import Iterator
from pathlib import Path

from shardconsole.runlog.protocol import MAX_LINE, DecodeError, Message, decode, encode
from shardconsole.runlog.runfolder import node_metrics_files

NAME_EVERY_S = 1.0      # how often a reader that keeps finding lines still stats its file's name


class MetricsWriter:
    """Appends one rank's (or the front end's) lines. A line the file refuses (a full disk, a folder
    gone read-only) is dropped and counted, never raised into training; the first refusal is told once
    on stderr, which is the rank's log (session.rundir.stream_stopped_note reads it back), because the
    stream itself cannot carry the news."""

    def __init__(self, path: str | Path | None, run: str = "", rank: int = -1) -> None:
        self.path = Path(path) if path else None
        self.run, self.rank = run, rank
        self.dropped = 0
        self.last_error = ""          # why the last line was dropped ("No space left on device")
        self.last_step = 0            # the step of the last line written whole
        self._torn = False            # a short write left half a line: the next line ends it first
        self._fd: int | None = None
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            # 0o666 and the umask decide, like every file of the run folder: a follower reads them all
            self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)

    def emit(self, msg: Message) -> None:
        if self._fd is None:
            return
        try:
            data = (("\n" if self._torn else "") + encode(msg) + "\n").encode()
            n = os.write(self._fd, data)
            if n < len(data):          # the disk filled mid-line: the rest, to learn why (ENOSPC)
                self._torn = True
                os.write(self._fd, data[n:])
            self._torn = False
            step = getattr(msg, "step", None)       # any line's step: rank 1 writes no step lines
            if isinstance(step, int) and step > self.last_step:
                self.last_step = step
        except (OSError, ValueError) as e:
            self.dropped += 1
            first = not self.last_error
            self.last_error = getattr(e, "strerror", None) or str(e)
            if first and self.rank >= 0:
                self._tell(f"shardconsole: metrics stream: rank {self.rank} could not write a line to {self.path} "
                           f"after step {self.last_step}: {self.last_error}; later lines are dropped and counted")

    @staticmethod
    def _tell(line: str) -> None:
        try:
            os.write(2, (line + "\n").encode())
        except OSError:
            pass     # the log is on the same full disk: stream_stopped_note then sees the disk itself

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
    """Follows a run's stream from the start: metrics.jsonl and, on a run of several nodes, the files
    of the other nodes' ranks beside it (runfolder.node_metrics_files), read as one stream. poll()
    returns the messages written since last time; those of several files are merged by their time,
    each file's own order kept (a node's lines are never reordered among themselves)."""

    LOOK_EVERY_S = 1.0      # a listing of the folder for new node files (NFS round trips)

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._main = FileReader(self.path)
        self._nodes: dict[Path, FileReader] = {}
        self._looked_at = float("-inf")

    def poll(self, max_bytes: int = 8 << 20) -> list[Message]:
        out = self._main.poll(max_bytes)
        now = time.monotonic()
        if now - self._looked_at >= self.LOOK_EVERY_S:
            self._looked_at = now
            for found in node_metrics_files(self.path):
                self._nodes.setdefault(found, FileReader(found))
        if not self._nodes:
            return out
        batches = [out, *(r.poll(max_bytes) for r in self._nodes.values())]
        return list(heapq.merge(*batches, key=lambda m: m.t))

    @property
    def _readers(self) -> list[FileReader]:
        return [self._main, *self._nodes.values()]

    def check_names(self) -> None:
        """Look now whether a file's name went (a run's last tick: a deletion must still be said)."""
        for r in self._readers:
            r.check_name()

    @property
    def bad_lines(self) -> int:
        return sum(r.bad_lines for r in self._readers)

    @property
    def last_error(self) -> str:
        return next((r.last_error for r in self._readers if r.last_error), "")

    @property
    def lost(self) -> str:
        return next((r.lost for r in self._readers if r.lost), "")

    @property
    def caught_up(self) -> bool:
        """Whether the last poll read every file to its end (an attach's history is read 8 MiB a poll)."""
        return all(r.caught_up for r in self._readers)

    @property
    def offset(self) -> int:
        """How far into metrics.jsonl the lines have been read (attach's replay compares its size)."""
        return self._main.offset

    def positions(self) -> dict[Path, int]:
        """How far each file has been read (a partial last line included): a reader that begins later
        reads the same bytes up to here with read_until, then takes what this one reads next."""
        return {r.path: r.offset for r in self._readers}

    @property
    def _pos(self) -> int:
        """Bytes read of every file: grows when anything was read (history's progress)."""
        return sum(r._pos for r in self._readers)

    @_pos.setter
    def _pos(self, value: int) -> None:     # history's tail skip: metrics.jsonl's offset
        self._main._pos = value

    def close(self) -> None:
        for r in self._readers:
            r.close()


def read_until(positions: dict[Path, int], max_bytes: int = 8 << 20) -> Iterator[list[Message]]:
    """The lines of each file up to its position (MetricsReader.positions), in batches merged by time as
    MetricsReader.poll merges them; a line cut at a position is left to the reader that is there."""
    readers = {FileReader(path): end for path, end in positions.items()}
    try:
        while True:
            batches, moved = [], False
            for r, end in readers.items():
                if r.offset < end:
                    before = r.offset
                    batches.append(r.poll(min(max_bytes, end - r.offset)))
                    moved = moved or r.offset > before
            if not moved:       # every file read to its position (or shorter now: nothing more to read)
                return
            yield list(heapq.merge(*batches, key=lambda m: m.t))
    finally:
        for r in readers:
            r.close()


class FileReader:
    """Follows one stream file from the start. poll() returns the messages written since last time.

    The file stays open once found: the ranks append through descriptors of their own, so a
    metrics.jsonl deleted or replaced mid-run still grows under the old inode, and this reader keeps
    reading it there (`lost` then says what happened to the name, for the front end to show)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.bad_lines = 0
        self.last_error = ""
        self.lost = ""              # set once the file's name no longer leads to the file being read
        self._fd: int | None = None
        self._pos = 0
        self._partial = b""
        self._skipping = False      # inside an over-long line: dropped up to its newline, counted once
        self._named_at = float("-inf")
        self.caught_up = False      # the last poll read the file to its end

    def poll(self, max_bytes: int = 8 << 20) -> list[Message]:
        if self._fd is None:
            try:
                self._fd = os.open(self.path, os.O_RDONLY)
            except OSError as e:    # not there yet; or another user's 0600 file
                if not isinstance(e, FileNotFoundError):
                    self.last_error = f"{self.path}: {e.strerror}"
                self.caught_up = True       # nothing to read yet: the front end's samples may go first
                return []
        try:
            chunk = os.pread(self._fd, max_bytes, self._pos)
        except OSError as e:
            self.last_error = f"{self.path}: {e.strerror}"
            return []
        self._pos += len(chunk)
        self.caught_up = len(chunk) < max_bytes
        # Looked at when caught up, and at least once a second: a slow front end on a loaded machine may
        # find new lines at every poll until the run ends and would otherwise never notice the name go.
        if not chunk or time.monotonic() - self._named_at >= NAME_EVERY_S:
            self.check_name()
        data = self._partial + chunk
        lines = data.split(b"\n")
        self._partial = lines.pop()  # an unfinished line stays for the next poll
        if self._skipping and lines:
            lines.pop(0)             # the tail of the over-long line
            self._skipping = False
        if len(self._partial) > MAX_LINE:
            if not self._skipping:
                self._count_bad("line too long")
            self._skipping = True
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

    @property
    def offset(self) -> int:
        """How far into the file the lines have been read (a partial last line included)."""
        return self._pos

    def check_name(self) -> None:
        """Set `lost` when the file's name no longer leads to the file being read (deleted, replaced)."""
        if self.lost or self._fd is None:
            return
        self._named_at = time.monotonic()
        try:
            mine = os.fstat(self._fd)
            now = os.stat(self.path)
            if (now.st_dev, now.st_ino) != (mine.st_dev, mine.st_ino):
                self.lost = f"{self.path} was replaced by another file; still reading the one the ranks write to"
        except FileNotFoundError:
            self.lost = f"{self.path} was deleted; still reading the ranks' open file (a later attach cannot)"
        except OSError:
            pass

    def _count_bad(self, why: str) -> None:
        self.bad_lines += 1
        self.last_error = why

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
