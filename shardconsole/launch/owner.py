"""One owner per run folder: an advisory flock on the folder's .owner.lock.

A resume holds it while it prepares (reads the settings, checks that no rank of the folder lives,
rewrites preset.toml); Job.start hands it to the launcher as an inherited descriptor, so the
launcher's process holds it for the run's life and this front end can let go. A second resume or
launch meanwhile is refused in one line naming the holder. A launcher killed with SIGKILL drops the
lock with its descriptor: the ranks it orphaned are found by their command lines instead
(process_identity.folder_ranks), and resume refuses while any lives.
A multi-node run's agents share one folder (often over NFS, where flock reaches across hosts): they
take no lock, their ranks are told apart by host.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path

from shardconsole.settings import config as C

OWNER_FILE = ".owner.lock"


class FolderInUse(C.ConfigError):
    """Another process owns the run folder: one line, exit 2."""


class OwnerLock:
    """This process's hold on a run folder's owner lock (re-entrant: `owning` inside `owning` shares it)."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path, self.fd, self.depth = path, fd, 0

    def note(self, holder: str) -> None:
        """Say in the lock file who holds it, for the refusal a second owner reads."""
        try:
            os.ftruncate(self.fd, 0)
            os.pwrite(self.fd, (holder + "\n").encode(), 0)
        except OSError:
            pass


_HELD: dict[Path, OwnerLock] = {}


def take_owner(run_dir: Path, holder: str) -> OwnerLock:
    """Own run_dir now, or FolderInUse naming who does. Never waits: a second owner is refused."""
    key = Path(run_dir).resolve()
    held = _HELD.get(key)
    if held is not None:
        held.depth += 1
        return held
    path = key / OWNER_FILE
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
    except OSError as e:
        raise FolderInUse(f"{run_dir}: cannot open its owner lock {path}: {e.strerror}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        who = _holder(fd)
        os.close(fd)
        if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
            raise FolderInUse(f"{run_dir}: cannot lock {path}: {e.strerror}") from None
        raise FolderInUse(f"{run_dir}: the run folder is in use by {who or 'another process'}; "
                          f"`shardconsole attach {run_dir}` follows it, `shardconsole stop {run_dir}` stops it") from None
    lock = OwnerLock(path, fd)
    lock.note(f"{holder} (pid {os.getpid()})")
    lock.depth = 1
    _HELD[key] = lock
    return lock


def release_owner(lock: OwnerLock) -> None:
    """This process lets go (a launcher it started keeps holding the lock through its inherited copy)."""
    lock.depth -= 1
    if lock.depth > 0:
        return
    _HELD.pop(lock.path.parent, None)
    try:
        os.close(lock.fd)
    except OSError:
        pass


@contextlib.contextmanager
def owning(run_dir: Path, holder: str) -> Iterator[OwnerLock]:
    lock = take_owner(run_dir, holder)
    try:
        yield lock
    finally:
        release_owner(lock)


def _holder(fd: int) -> str:
    try:
        return os.pread(fd, 300, 0).decode("utf-8", "replace").strip()
    except OSError:
        return ""
