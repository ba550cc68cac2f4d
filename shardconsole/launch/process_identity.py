"""Which processes belong to a run, checked before any signal is sent.

A pid alone names a process only while that process lives: after it ends the kernel hands the number
to the next process, and a job.json can be stale (pid reuse), copied from another host (a shared
multi-node folder, last writer wins) or forged (pid 1). So a pid is signalled only when this host, the
process's start time and its command line all match what the run recorded:
- the launcher: job.json's host, pid, start time (psutil create_time) and command line (it names the
  run folder);
- a rank: a pid from a hello line of this run's stream whose host is this one, and whose command line
  runs the rank module with this run's id.
Never pid 1 (or 0), never this process or its process group.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

import psutil

WORKER_MODULE = "shardconsole.backends"
LOOPBACK_WORKER_MODULE = "shardconsole.launch.loopback_rank"     # the same rank, its store on loopback
# create_time is derived from the boot time and the start tick; two reads of one process agree to far
# better than this, while a reused pid starts at a different moment.
_START_SLACK_S = 0.05


def this_host() -> str:
    return socket.gethostname()


def start_time(pid: int) -> float | None:
    try:
        return psutil.Process(pid).create_time()
    except (psutil.Error, ValueError, OverflowError):
        return None


def _cmdline(pid: int) -> list[str] | None:
    try:
        return psutil.Process(pid).cmdline()
    except (psutil.Error, ValueError, OverflowError):
        return None


def _never(pid: int) -> str:
    """Why pid may never be signalled, or ''."""
    if pid <= 1:
        return f"pid {pid} is never signalled"
    if pid == os.getpid():
        return f"pid {pid} is this front end"
    try:
        if os.getpgid(pid) == os.getpgid(0):
            return f"pid {pid} is in this front end's own process group"
    except OSError:
        pass
    return ""


def check_launcher(info: dict, run_dir: Path) -> tuple[str, str]:
    """(state, why) for the launcher job.json describes: ("ours", ""), ("gone", why) when its process
    has ended (its ranks may still run), or ("stranger", why) when it must not be signalled."""
    host = str(info.get("host", ""))
    if host != this_host():
        return "stranger", (f"job.json was written on host {host or '?'!r}, this is {this_host()!r}: "
                            f"its processes are not signalled from here")
    try:
        pid, pgid = int(info["pid"]), int(info.get("pgid", info["pid"]))
    except (KeyError, TypeError, ValueError):
        return "stranger", "job.json names no valid launcher pid"
    why = _never(pid) or (_never(pgid) if pgid != pid else "")
    if why:
        return "stranger", f"job.json: {why}"
    now = start_time(pid)
    if now is None or not live([pid]):
        return "gone", f"the launcher (pid {pid}) has ended"
    recorded = info.get("create_time")
    if not isinstance(recorded, (int, float)):
        return "stranger", f"job.json records no start time for pid {pid}: it cannot be told from a reused pid"
    if abs(now - float(recorded)) > _START_SLACK_S:
        return "stranger", (f"pid {pid} started at {now:.2f}, not at the launcher's recorded {recorded:.2f}: "
                            f"the pid was reused by another process")
    cmd = _cmdline(pid) or []
    if cmd != list(info.get("cmdline") or info.get("argv") or []) or not _names_run_dir(cmd, run_dir):
        return "stranger", f"pid {pid} runs {' '.join(cmd)[:120]!r}, not this run's launcher"
    return "ours", ""


def _names_run_dir(cmd: list[str], run_dir: Path) -> bool:
    for i, arg in enumerate(cmd[:-1]):
        if arg == "--run-dir" and Path(cmd[i + 1]).name == run_dir.resolve().name:
            return True
    return False


def is_rank_of(pid: int, host: str | None, run_dir: Path, run_id: str) -> bool:
    """pid is a live rank of this run on this host (host None: the caller does not know it)."""
    if host is not None and host != this_host():
        return False
    if _never(pid):
        return False
    cmd = _cmdline(pid)
    if not cmd or not {WORKER_MODULE, LOOPBACK_WORKER_MODULE} & set(cmd):
        return False
    ids = [cmd[i + 1] for i, a in enumerate(cmd[:-1]) if a == "--run-id"]
    return ids == [run_id] and _names_run_dir(cmd, run_dir)


def live(pids) -> list[int]:
    out = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                out.append(pid)
        except (psutil.Error, ValueError, OverflowError):
            continue
    return out


def tree(pid: int) -> set[int]:
    """A process and every descendant. torchrun starts each worker in a session of its own, so the
    launcher's process group alone does not reach the ranks."""
    try:
        root = psutil.Process(pid)
        return {pid} | {c.pid for c in root.children(recursive=True)}
    except (psutil.Error, ValueError, OverflowError):
        return set()


def group_pids(pgid: int) -> list[int]:
    """Every live process in process group pgid."""
    if pgid <= 1:
        return []
    out = []
    for proc in psutil.process_iter(["pid", "status"]):
        try:
            if proc.info["status"] != psutil.STATUS_ZOMBIE and os.getpgid(proc.pid) == pgid:
                out.append(proc.pid)
        except (ProcessLookupError, psutil.Error, OSError):
            continue
    return out
