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

    def __init__(self, path: str | Path | None, run: str = "", rank: int = -1, *, make_folder: bool = True) -> None:
        """make_folder: create the file's folder when missing (a rank's at its start). A front end's writer
        never does: a run folder renamed or deleted under it would come back as a half folder at the old
        path, which the next look calls a run."""
        self.path = Path(path) if path else None
        self.run, self.rank = run, rank
        self.dropped = 0
        self.last_error = ""          # why the last line was dropped ("No space left on device")
        self.last_step = 0            # the step of the last line written whole
        self._torn = False            # a short write left half a line: the next line ends it first
        self._fd: int | None = None
        if self.path is not None:
            if make_folder:
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

    def folder_now(self) -> Path | None:
        """The folder this writer's file is in now, as the kernel names it (/proc/self/fd): another than
        `path`'s once the run folder was renamed or moved; None when the file was deleted or the kernel
        cannot say."""
        if self._fd is None:
            return None
        try:
            if os.fstat(self._fd).st_nlink == 0:
                return None
            return Path(os.readlink(f"/proc/self/fd/{self._fd}")).parent
        except OSError:
            return None

    def reopen_if_renamed(self) -> bool:
        """When `path` no longer leads to this writer's file (the file deleted or replaced, its folder where
        it was), open `path` again, a new file if need be, so that later lines land where every reader
        looks (a deleted metrics.jsonl used to stay deleted: a later attach found no stream and called a
        finished run crashed). Never creates the folder. True when it reopened. The caller has made sure
        the folder itself was not moved (folder_now): the old path may hold something else by now."""
        if self._fd is None or self.path is None:
            return False
        try:
            mine = os.fstat(self._fd)
            try:
                now = os.stat(self.path)
                if (now.st_dev, now.st_ino) == (mine.st_dev, mine.st_ino):
                    return False
            except FileNotFoundError:
                pass
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
        except OSError:
            return False
        os.close(self._fd)
        self._fd, self._torn = fd, False
        return True

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
        self._looked_at = time.monotonic()

    def append(self, samples: list[Message]) -> list[Message]:
        """Write `samples` to the stream; returns those not written (a read-only folder)."""
        if self.writable and self._writer is None:
            try:
                self._writer = MetricsWriter(self.path, self.run, -1, make_folder=False)
            except OSError:
                self.writable = False
        if self._writer is None:
            return samples
        if time.monotonic() - self._looked_at >= NAME_EVERY_S:
            # A metrics.jsonl deleted mid-run is started again (by the ranks, or here first): the samples
            # follow it there. A renamed run folder is followed through the open file, never recreated.
            self._looked_at = time.monotonic()
            if _same_folder(self._writer.folder_now(), self.path.parent):
                self._writer.reopen_if_renamed()
        for s in samples:
            self._writer.emit(s)
        return []

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()


def _same_folder(a: Path | None, b: Path) -> bool:
    try:
        return a is not None and os.path.samefile(a, b)
    except OSError:
        return False


class MetricsReader:
    """Follows a run's stream from the start: metrics.jsonl and, on a run of several nodes, the files
    of the other nodes' ranks beside it (runfolder.node_metrics_files), read as one stream. poll()
    returns the messages written since last time; those of several files are merged by their time,
    each file's own order kept (a node's lines are never reordered among themselves)."""

    LOOK_EVERY_S = 1.0      # a listing of the folder for new node files (NFS round trips)

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._main = FileReader(self.path)
        self._retired: list[FileReader] = []    # metrics.jsonl files deleted since: still read to their end
        self._nodes: dict[Path, FileReader] = {}
        self._looked_at = float("-inf")
        self.notes: list[str] = []              # said once by the watcher (a new metrics.jsonl started)

    def poll(self, max_bytes: int = 8 << 20) -> list[Message]:
        if self._main.superseded():
            # The ranks started the name again (MetricsWriter.reopen_if_renamed): the new file is read from
            # its start, the old one on to its end (a rank may write a last line there before it reopens).
            self._retired.append(self._main)
            self._main = FileReader(self.path)
            self.notes.append(f"a new {self.path} was started: the ranks' lines go on there (those before "
                              f"it are in this front end only)")
        out = self._main.poll(max_bytes)
        if self._retired:
            out = list(heapq.merge(out, *(r.poll(max_bytes) for r in self._retired), key=lambda m: m.t))
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
        return [self._main, *self._retired, *self._nodes.values()]

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
        return {r.path: r.offset for r in [self._main, *self._nodes.values()]}

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
        except OSError:
            return
        where = self._where_now(mine)
        if where is not None and not _same_folder(where.parent, self.path.parent):
            # Renamed with its run folder: followed through the open file, never looked for at the old path
            # (a front end that recreated it there made a half run folder and called the run deleted).
            self.lost = (f"the run folder {self.path.parent} was moved to {where.parent} while the run was going; "
                         f"still reading its stream there")
            return
        deleted = (f"{self.path} was deleted; still reading the ranks' open file until they start a new one "
                   f"(the lines up to then are not in it)")
        try:
            now = os.stat(self.path)
        except FileNotFoundError:
            self.lost = deleted
            return
        except OSError:
            return
        if (now.st_dev, now.st_ino) != (mine.st_dev, mine.st_ino):
            # deleted and started again by the ranks before this look, or another file put in its place
            self.lost = deleted if mine.st_nlink == 0 else (
                f"{self.path} was replaced by another file; still reading the one the ranks wrote to")

    def _where_now(self, mine: os.stat_result) -> Path | None:
        """The read file's path now (/proc/self/fd), None when it was deleted or the kernel cannot say."""
        if mine.st_nlink == 0:
            return None
        try:
            return Path(os.readlink(f"/proc/self/fd/{self._fd}"))
        except OSError:
            return None

    def superseded(self) -> bool:
        """Whether a new file at `path` takes over: the one read was deleted (or renamed within its folder)
        and the name leads to another file, which the ranks append to (MetricsWriter.reopen_if_renamed).
        Never after the run folder moved away: the old path may hold anything since."""
        if not self.lost or self._fd is None:
            return False
        try:
            mine, now = os.fstat(self._fd), os.stat(self.path)
        except OSError:
            return False
        if (now.st_dev, now.st_ino) == (mine.st_dev, mine.st_ino):
            return False
        where = self._where_now(mine)
        return where is None or _same_folder(where.parent, self.path.parent)

    def _count_bad(self, why: str) -> None:
        self.bad_lines += 1
        self.last_error = why

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
