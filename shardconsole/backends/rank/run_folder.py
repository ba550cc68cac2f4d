"""A rank's run folder renamed, or its metrics.jsonl deleted, while the run goes on (issue 64).

The ranks write the stream through an open file, which follows a rename of its folder; everything else
they write (a checkpoint, a note) goes by the path they were started with. A renamed run folder therefore
came back as a half folder at the old path (the next save made it again) and the run was called
deleted. `follow_move` points the rank at the folder's new path (the kernel names it through the
stream's open file); observe/stream_health then stops the run there, saving first, with the verdict
run_folder_moved. A metrics.jsonl deleted alone is started again (`keep_stream`), so a later attach
still finds the run's end.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

from shardconsole.backends.rank.common import Rank
from shardconsole.runlog import protocol as P


def _same(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


class _Moved:
    first: Path | None = None        # the path the run was started in, once the folder moved from it


def follow_move(r: Rank) -> Path | None:
    """When the run folder was renamed or moved: point the rank at its new path, so that the saves and
    notes to come land in it, and return the path it was started in (every call after the move, so the
    first look to see it, at a step boundary or at a save, decides); None while it has not moved (also
    when it was deleted: stream_health's run_folder_gone)."""
    now = r.writer.folder_now()
    if now is not None and not _same(now, r.run_dir):
        _Moved.first = _Moved.first or r.run_dir
        # Rank is frozen because nothing else may change where a rank writes; this is the one place that
        # must: the folder itself moved, and every path derived from run_dir has to move with it.
        object.__setattr__(r, "run_dir", now)
    return _Moved.first


def started_in() -> tuple[str, ...]:
    """The path the run was started in, as written then (resolved and not), once its folder moved; ()."""
    first = _Moved.first
    return () if first is None else (str(first), str(first.resolve()))


def rebased(r: Rank, path: Path) -> Path:
    """A path the settings name inside the run folder (made absolute at launch: a train.checkpoint_dir or
    export_dir in it), moved with the folder once it was renamed; any other path as it is."""
    first = _Moved.first
    if first is None:
        return path
    for start in (str(first), str(first.resolve())):
        try:
            return r.run_dir / Path(path).relative_to(start)
        except ValueError:
            continue
    return path


def keep_stream(r: Rank) -> bool:
    """When metrics.jsonl was deleted (or replaced) in a folder still in place: append to the name again,
    a new file if need be, and say in it who this rank is (a later attach matches the run's lines to its
    session and pids by the hello) and, on rank 0, what happened. True when it reopened."""
    w = r.writer
    if w.path is None or not r.run_dir.is_dir() or not w.reopen_if_renamed():
        return False
    r.emit(P.Hello(run=r.run_id, rank=r.rank, world=r.world, local_rank=r.local_rank, host=socket.gethostname(),
                   pid=os.getpid(), device=str(r.device), backend=r.cfg.parallel.backend,
                   n_params=r.spec.n_params))
    r.event(STREAM_RESTARTED, f"{w.path.name} was deleted or replaced during step {r.step}: the lines before "
                              f"this one are not in this file")
    return True


STREAM_RESTARTED = "stream_restarted"
