"""A run whose stream cannot be written stops, saying why (issue 46 item 3).

The stream is the run's only voice: a rank whose metrics.jsonl refuses its lines (a full disk, a quota)
or whose run folder was deleted trained on blind, for hours, and ended "finished" with nothing a front
end could show, resume or export. At every step boundary (Tail.after_step) `check` looks: a line
dropped by the writer, the run folder gone (with the stream file in it), or its disk with less free than a
few lines (a run that logs every 50 steps writes nothing for 49 of them). A rank that finds one says it
where it can (its stderr, the launcher's log, the checkpoint folder) and asks the run to stop, as a stop
signal would: every rank agrees at the next boundary and saves first (train.save_on_stop; a save that
does not fit fails as disk_full and keeps the last complete checkpoint). That rank then ends with the
verdict (cause disk_full, or run_folder_gone) instead of "stopped": at most one step trains unseen.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import time
from pathlib import Path
from typing import Iterator

from shardconsole.backends.rank import run_folder
from shardconsole.backends.rank.common import Rank
from shardconsole.backends.rank.errors import StreamFailed
from shardconsole.runlog.runfolder import RunFolder

LOW_SPACE = 64 << 10        # free bytes under which the next lines would not fit (16 lines of 4 KiB)
LOOK_EVERY_S = 1.0          # statvfs at most once a second (NFS round trips)
NOTE_FILE = "stream_failed.txt"


# StreamFailed (cause "disk_full" or "run_folder_gone", with its hint) lives in rank/errors.py.


class _Watch:
    def __init__(self) -> None:
        self.looked_at = float("-inf")
        self.verdict: tuple[str, str] | None = None     # (cause, what happened)


_watch = _Watch()


def _problem(r: Rank) -> tuple[str, str] | None:
    """(cause, what) when this rank's stream cannot be written, else None."""
    w = r.writer
    if w.path is None:
        return None
    if w.dropped:
        if not r.run_dir.is_dir():
            return "run_folder_gone", f"the run folder {r.run_dir} is gone"
        # ENOSPC / EDQUOT, or another refusal of the stream's file (an I/O error): the run is as blind
        return "disk_full", f"{w.path} refused a line after step {w.last_step}: {w.last_error}"
    try:
        # The stream file alone deleted, its folder still there: the ranks write on through their open file
        # and a front end reads on through its own (issue 22: a healthy run is not stopped for it); with
        # the folder gone nothing resumable or exportable can come of the run, so it stops.
        if w._fd is not None and os.fstat(w._fd).st_nlink == 0 and not r.run_dir.is_dir():
            return "run_folder_gone", f"{w.path} was deleted with its run folder"
    except OSError:
        pass
    now = time.monotonic()
    if now - _watch.looked_at < LOOK_EVERY_S:
        return None
    _watch.looked_at = now
    if not r.run_dir.is_dir():
        return "run_folder_gone", f"the run folder {r.run_dir} is gone"
    try:
        free = shutil.disk_usage(r.run_dir).free
    except OSError:
        return None
    if free < LOW_SPACE:
        return "disk_full", f"the disk holding {r.run_dir} is full ({free} bytes free): the stream cannot be written"
    return None


def _say(r: Rank, line: str) -> None:
    """Wherever it can be read: the rank's log (stderr), the launcher's log, the checkpoint folder."""
    data = (line + "\n").encode()
    for path in (None, RunFolder(r.run_dir).launcher_log, r.checkpoint_dir() / NOTE_FILE):
        try:
            if path is None:
                os.write(2, data)
                continue
            if not path.parent.is_dir():
                continue
            fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
            try:
                os.write(fd, data)
            finally:
                os.close(fd)
        except OSError:
            pass


def check(r: Rank, stop) -> None:
    """Every rank at every step boundary, before the stop agreement: a problem found asks the run to stop
    (the agreement at the next boundary reaches every rank, which then saves as on a stop signal)."""
    moved_from = run_folder.follow_move(r)
    if _watch.verdict is not None:
        return
    if moved_from is not None:
        found: tuple[str, str] | None = (
            "run_folder_moved", f"the run folder {moved_from} was moved to {r.run_dir} while the run was going")
    else:
        run_folder.keep_stream(r)        # a metrics.jsonl deleted alone is started again
        found = _problem(r)
    if found is None:
        return
    _watch.verdict = found
    cause, what = found
    _say(r, f"shardconsole: {cause}: rank {r.rank}: {what}; stopping the run at the next step boundary "
            f"(after step {r.step + 1}), saving first when train.save_on_stop and the checkpoint disk allow")
    stop.local = True              # as a stop signal would: every rank learns it at the next boundary


@contextlib.contextmanager
def verdict(r: Rank) -> Iterator[None]:
    """Around the stop's save: on the rank that found the stream broken, the stop's end (trainstate's
    Stopped, after the save or without one) becomes StreamFailed with the verdict; elsewhere unchanged."""
    try:
        yield
    except Exception as e:
        if _watch.verdict is None or type(e).__name__ != "Stopped":
            raise
        cause, what = _watch.verdict
        hint = ("free space on that disk (or move the run folder to a larger one), then `shardconsole resume RUN` "
                "continues from the newest complete checkpoint" if cause == "disk_full" else
                f"`shardconsole resume {r.run_dir}` continues from the checkpoint it saved"
                if cause == "run_folder_moved" else
                "the run folder was deleted while the run was going; checkpoints kept elsewhere "
                "(train.checkpoint_dir) continue in a new run with train.resume = true")
        message = f"{cause.replace('_', ' ')}: rank {r.rank}: {what}; {e}"
        _say(r, f"shardconsole: {message}")
        raise StreamFailed(cause, message, hint) from None
