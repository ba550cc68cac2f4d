"""Saving without a second copy of the state: DCP's files written one tensor at a time, the progress of
a save, and a failed save told by its cause.

Where the copy came from (torch 2.13, torch/distributed/checkpoint/filesystem.py, measured in
tests/test_save_path.py): `_write_files_from_queue` keeps every tensor it wrote in `tensor_dict` until the
rank's file is closed (for the safetensors format, unused by us), and its loaders copy each tensor to a
fresh one first: `.cpu()` for GPU tensors, `.clone()` for a CPU tensor whose storage is larger than the
tensor, which is every shard that is a view into the host arena (pinned_arena.py) or a flat parameter.
So the rank's whole state is copied into host memory before the file is closed: the +35 GiB of the 3b
offload run at its final save. `StreamingWriter` writes the same file (torch.save records at offsets,
the same .metadata), copying at most one tensor at a time and dropping it once written: the host peak
of a save is the training peak plus the largest single tensor. Resume and export read it as before.
Every byte of the file passes through its checksum on the way (checksums.HashingFile), for the manifest.
"""

from __future__ import annotations

import errno
import os
import threading
import time
from torch.futures import Future
from pathlib import Path
from typing import Callable

import torch
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import DEFAULT_SUFFIX, _write_item
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult

from shardconsole.backends.checkpoint.checksums import HashingFile
from shardconsole.runlog import protocol as P
from shardconsole.backends.rank.errors import DiskFullError, SaveOOMError  # noqa: F401  (raised here; re-exported)

DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
PROGRESS_EVERY_S = 1.0


class StreamingWriter(FileSystemWriter):
    """DCP's file system writer, one file per rank, each tensor copied (when it must be: a GPU tensor, a
    view into a larger storage) just before it is written and dropped right after."""

    def __init__(self, path: str | os.PathLike, on_bytes: Callable[[int], None] | None = None) -> None:
        super().__init__(path, single_file_per_rank=True, sync_files=True, thread_count=1)
        self.on_bytes = on_bytes or (lambda n: None)
        self.checksums: dict[str, str] = {}    # the files written, by name in the folder: for the manifest

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        name = f"{plan.storage_data.prefix}0{DEFAULT_SUFFIX}"
        results: list[WriteResult] = []
        path = self.fs.concat_path(self.path, name)
        with self.fs.create_stream(path, "wb") as raw:
            stream = HashingFile(raw)
            for item in plan.items:
                if item.type == WriteItemType.BYTE_IO:
                    data = planner.resolve_data(item)
                else:
                    data = _alone(planner.resolve_data(item).detach())
                results.append(_write_item(self.transforms, stream, data, item, name, self.serialization_format))
                self.on_bytes(results[-1].size_in_bytes)
                del data                  # the copy, if one was made, goes before the next is made
            stream.flush()
            os.fsync(stream.fileno())
            self.checksums[name] = stream.done()
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut


def _alone(t: torch.Tensor) -> torch.Tensor:
    """The tensor on the host with a storage of its own size (torch.save writes a tensor's whole storage:
    a view into the arena would write the arena)."""
    if t.device.type != "cpu":
        return t.to("cpu")
    if t.untyped_storage().nbytes() != t.numel() * t.element_size():
        return t.clone()
    return t


# ---------------------------------------------------------------------------------------------------
# Progress

def folder_bytes(path: Path) -> int:
    """The bytes of the files under path so far (every rank's, on a file system they share)."""
    total = 0
    for root, _, files in os.walk(path):
        for f in files:
            try:
                total += os.stat(os.path.join(root, f)).st_size
            except OSError:
                pass
    return total


# The folder's real bytes over the engine's estimate (the tensors' bytes), per kind of save, as the last save
# of this process measured them. The estimate leaves out each record's zip framing, DCP's .metadata, the
# rank states and the manifest (20% of a tiny model's checkpoint); every save of a kind holds the same
# tensors, so the second one on knows its total to the byte (the progress line said 'of 1.6 MB' of a save
# that was 1.9 MB).
_REAL_OVER_ESTIMATE: dict[str, float] = {}


def _last_save_bytes(path: Path, what: str) -> int:
    """The bytes of the newest complete step folder of this kind ("checkpoint", "model") beside path
    (its manifest says the kind); 0 when there is none (a run's first save, an export's folder)."""
    import json
    from shardconsole.runlog.checkpoint_files import MANIFEST, step_folders
    for _, p in step_folders(path.parent):
        try:
            kind = json.loads((p / MANIFEST).read_text()).get("what", "checkpoint")
        except (OSError, ValueError, AttributeError):
            continue        # a save of before manifests
        if kind == what:
            return folder_bytes(p)
    return 0


class SaveWatch:
    """Rank 0: a SaveProgress line about once a second while a save runs (the bytes in its folder, of
    all ranks), and one with done=True at its end; the hang watch counts them as progress. The total is
    the estimate corrected by the last save of the same kind, never below the bytes written, and the
    done line's is the bytes written: what the progress says is what the folder holds."""

    def __init__(self, r, step: int, what: str, path: Path, total_bytes: int) -> None:
        self.estimate = int(total_bytes)
        self.r, self.step, self.what, self.path = r, step, what, path
        before = _REAL_OVER_ESTIMATE.get(what)
        # a session's first save: the newest complete save of this kind beside it holds the same tensors
        self.total = round(self.estimate * before) if before else (_last_save_bytes(path, what) or self.estimate)
        self.t0 = time.monotonic()
        self.done = threading.Event()
        self.thread: threading.Thread | None = None
        if r.rank == 0:
            self.emit(False)
            self.thread = threading.Thread(target=self._run, daemon=True, name="save-progress")
            self.thread.start()

    def _run(self) -> None:
        while not self.done.wait(PROGRESS_EVERY_S):
            self.emit(False)

    def emit(self, done: bool) -> None:
        written = folder_bytes(self.path) if self.path.exists() else 0
        if done and self.estimate > 0 and written > 0:
            _REAL_OVER_ESTIMATE[self.what] = written / self.estimate
        self.r.emit(P.SaveProgress(run=self.r.run_id, rank=self.r.rank, step=self.step, what=self.what,
                                   written_bytes=written, total_bytes=written if done else max(self.total, written),
                                   elapsed_s=round(time.monotonic() - self.t0, 3), path=str(self.path),
                                   done=done))

    def finish(self, path: Path | None = None) -> float:
        """Stop the ticks; with `path` (the save's final folder), the done line. The seconds it took."""
        self.done.set()
        if self.thread is not None:
            self.thread.join()
            if path is not None:
                self.path = path
                self.emit(True)
        return time.monotonic() - self.t0


# ---------------------------------------------------------------------------------------------------
# A save that failed

# DiskFullError (ENOSPC / EDQUOT: cause "disk_full") and SaveOOMError (cause "host_oom") live in rank/errors.py.


def _errors_in(exc: BaseException):
    """The exception and what it wraps: DCP's CheckpointException holds each rank's failure in
    `failures` ({rank: exception or (exception, frames)}), chained ones sit in __cause__ / __context__."""
    seen: set[int] = set()
    todo: list[BaseException | None] = [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        failures = getattr(e, "failures", None)
        if isinstance(failures, dict):
            for v in failures.values():
                todo.append(v[0] if isinstance(v, tuple) and v else getattr(v, "exc", v))
        todo += [e.__cause__, e.__context__]


def disk_full_in(exc: BaseException, free: int | None = None, needed: int = 0) -> bool:
    """ENOSPC / EDQUOT anywhere in the failure, or a failed write (torch.save's zip writer reports a
    short write as a RuntimeError without the errno: "unexpected pos 704 vs 598", "file write failed")
    on a file system with less free than the save needed."""
    errors = list(_errors_in(exc))
    if any(isinstance(e, OSError) and e.errno in DISK_FULL_ERRNOS for e in errors):
        return True
    wrote = any(isinstance(e, (OSError, RuntimeError)) for e in errors)
    return wrote and free is not None and free < needed


def oom_in(exc: BaseException) -> bool:
    return any(isinstance(e, MemoryError) for e in _errors_in(exc))


def full_words(path: Path, needed: int) -> str:
    """What filled the file system a save failed on, in its own terms: "out of inodes" where no file can be
    made (its bytes may be plenty: "needs 1.5 MiB, 48.1 MiB free" contradicted itself), else the bytes needed
    against those free."""
    from shardconsole.settings.values import format_size
    for p in (path, *path.parents):
        try:
            st = os.statvfs(p)
        except OSError:
            continue
        if st.f_files and st.f_favail == 0:
            return f"out of inodes on {path} (no file can be made; {format_size(st.f_bavail * st.f_frsize)} free)"
        return f"needs {format_size(needed)}, {format_size(st.f_bavail * st.f_frsize)} free on {path}"
    return f"needs {format_size(needed)} on {path}"


def free_bytes(path: Path) -> int | None:
    for p in (path, *path.parents):
        try:
            st = os.statvfs(p)
            return st.f_bavail * st.f_frsize
        except OSError:
            continue
    return None
