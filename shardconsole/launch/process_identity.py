"""Which processes belong to a run, checked before any signal is sent.

A pid alone names a process only while that process lives: after it ends the kernel hands the number
to the next process, and a job.json can be stale (pid reuse), copied from another host (a shared
multi-node folder, last writer wins) or forged (pid 1). So a pid is signalled only when this host, the
process's start time and its command line all match what the run recorded:
- the launcher: job.json's host, pid, start time (psutil create_time) and command line (it names the
  run folder);
- a rank: a process of this host whose command line runs the rank module (its first `-m`) on this run
  folder (the resolved --run-dir), found by a scan of the process table or named by a hello line;
  whatever its run id, since every session of a folder (the first run, a resume) trains the one folder.
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


def _names_run_dir(cmd: list[str], run_dir: Path, cwd: str | None = None) -> bool:
    """cmd's --run-dir is run_dir: the same folder once resolved (a relative one against the process's
    working directory when known), else, without that directory, the same folder name."""
    want = run_dir.resolve()
    for i, arg in enumerate(cmd[:-1]):
        if arg != "--run-dir":
            continue
        given = Path(cmd[i + 1])
        if given.is_absolute() or cwd:
            if (Path(cwd or "/") / given).resolve() == want:
                return True
        elif given.name == want.name:
            return True
    return False


def _rank_module(cmd: list[str]) -> bool:
    """cmd runs the rank module itself: the first `-m` names it (a launcher's command line names the
    rank module too, after its own `-m`)."""
    try:
        i = cmd.index("-m")
    except ValueError:
        return False
    return i + 1 < len(cmd) and cmd[i + 1] in (WORKER_MODULE, LOOPBACK_WORKER_MODULE)


def _run_id_in(cmd: list[str]) -> str | None:
    ids = [cmd[i + 1] for i, a in enumerate(cmd[:-1]) if a == "--run-id"]
    return ids[0] if len(ids) == 1 else None


def is_rank_of(pid: int, host: str | None, run_dir: Path, run_id: str | None) -> bool:
    """pid is a live rank of this run folder on this host (host None: the caller does not know it);
    run_id None: of any session of the folder (a resume runs under a run id of its own)."""
    if host is not None and host != this_host():
        return False
    if _never(pid):
        return False
    try:
        proc = psutil.Process(pid)
        cmd, cwd = proc.cmdline(), _cwd(proc)
    except (psutil.Error, ValueError, OverflowError):
        return False
    if not cmd or not _rank_module(cmd):
        return False
    return (run_id is None or _run_id_in(cmd) == run_id) and _names_run_dir(cmd, run_dir, cwd)


def _cwd(proc: psutil.Process) -> str | None:
    try:
        return proc.cwd()
    except (psutil.Error, OSError):
        return None


def folder_ranks(run_dir: Path) -> dict[int, str]:
    """Every live rank process of this host whose command line runs the rank module on this run
    folder, whatever its run id ({pid: run id}): ranks orphaned by a killed launcher, ranks of an
    earlier session, ranks that have not said hello yet. Found by their command lines, not by a pid
    someone wrote down, so a reused pid is never among them."""
    out: dict[int, str] = {}
    for proc in psutil.process_iter(["pid", "cmdline", "status"]):
        try:
            cmd = proc.info["cmdline"] or []
            if proc.info["status"] == psutil.STATUS_ZOMBIE or "--run-dir" not in cmd or not _rank_module(cmd):
                continue
            if not _never(proc.pid) and _names_run_dir(cmd, run_dir, _cwd(proc)):
                out[proc.pid] = _run_id_in(cmd) or ""
        except (psutil.Error, OSError, ValueError):
            continue
    return out


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


def oom_kills() -> int | None:
    """How many processes the kernel's OOM killer has killed in this process's memory cgroup (cgroup v2
    memory.events, v1 memory.oom_control: `oom_kill N`), None where no cgroup file says. Recorded at a
    launch, so that a later SIGKILLed rank is called an OOM kill only when this count grew."""
    rel = {"v1": "", "v2": ""}
    try:
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            num, ctrl, path = (line.split(":", 2) + ["", ""])[:3]
            if num == "0" and ctrl == "":
                rel["v2"] = path.lstrip("/")
            elif "memory" in ctrl.split(","):
                rel["v1"] = path.lstrip("/")
    except OSError:
        pass
    root = Path("/sys/fs/cgroup")
    for events in (root / rel["v2"] / "memory.events", root / "memory" / rel["v1"] / "memory.oom_control",
                   root / "memory.events", root / "memory" / "memory.oom_control"):
        try:
            text = events.read_text()
        except OSError:
            continue
        for line in text.splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill" and value.strip().isdigit():
                return int(value)
    return None
