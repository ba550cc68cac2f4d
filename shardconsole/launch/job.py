"""A started run's processes: the launcher in a session of its own, and which of them may be signalled
(session/stop.py stops them).

The child (torchrun or the deepspeed launcher) runs in its own session, so Ctrl-C in the front end's
terminal does not reach the ranks directly: the front end stops them on purpose (SIGTERM, a grace
period, SIGKILL) and then checks that none is left. What is started (argv, environment, the sbatch
script) is launch_command.py's, re-exported here for the modules that import it from launch.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, cast

from shardconsole.settings import config as C
from shardconsole.launch import process_identity as PI
from shardconsole.runlog import protocol as P
from shardconsole.launch.owner import FolderInUse, owning  # noqa: F401  (FolderInUse: for the front ends)
from shardconsole.launch.command import (WORKER_MODULE, launch_env, build_argv, child_env,  # noqa: F401
                                         format_argv, new_run_dir, run_id_of, slurm_script)
from shardconsole.runlog.runfolder import JOB_FILE as RUN_FILE, LAUNCHER_LOG, METRICS_FILE, PRESET_FILE  # noqa: F401
from shardconsole.runlog.runfolder import RunFolder, agent_file_name, agent_here, agent_host, read_json


@dataclass
class StopReport:
    signalled: list[int] = field(default_factory=list)   # pids that were alive when the stop began
    killed: bool = False                                  # SIGKILL was needed
    left: list[int] = field(default_factory=list)         # pids still alive at the end (should be empty)
    seconds: float = 0.0
    gpu_note: str = ""                                    # what NVML says after the stop (front ends fill it)
    refused: str = ""                                     # why some process named by the run was not signalled

    @property
    def clean(self) -> bool:
        return not self.left


@dataclass(frozen=True)
class JobFacts:
    """What the processes say about a run, for the outcome: a launcher killed with its ranks still
    training is neither a finished run nor a crash."""
    launcher: str             # "ours" (alive), "gone" (ended), "stranger" (job.json names another process)
    launcher_rc: int | None   # its exit code, when this front end started it and it has ended
    ranks_alive: list[int]    # verified rank pids still running
    note: str = ""            # why the launcher is not ours, or how it ended

    @property
    def orphaned(self) -> bool:
        """The launcher is gone (killed: OOM killer, kill -9) while ranks of the run still run."""
        return self.launcher != "ours" and bool(self.ranks_alive)


_live, _tree, _group_pids = PI.live, PI.tree, PI.group_pids     # tests/conftest.py reads _group_pids


class RunJob(Protocol):
    """What a run session (session/run.py) and its watcher ask of a run's processes: Job (started by
    this machine, ours to signal) and ExternalJob (started elsewhere: only its stream says it ended)."""

    run_dir: Path
    pid: int           # the launcher's (0 when none is known here)

    @property
    def external(self) -> bool:
        """Started on other machines: nothing here to poll or signal; the stream says when it ends."""

    @property
    def rc_known(self) -> bool:
        """Whether poll()'s code is the launcher's exit code (only its parent learns it)."""

    def poll(self) -> int | None:
        """An exit code once the run is over, None while it runs."""

    def alive(self) -> bool: ...

    def heard(self, hellos: list[P.Hello]) -> None:
        """The hello lines the front end's one reader of the stream read (session/watcher.py), so the
        job reads none itself; called first with none, before the job is asked anything."""


class Job:
    """A started run: the launcher process, its process group, and the ranks the stream announced.

    Only verified processes are ever signalled (process_identity.py): the launcher when host, start
    time and command line match job.json; a rank when its hello line's host is this one and its
    command line runs this run. A launcher killed from outside leaves its ranks running: alive(),
    poll() and session/stop.stop_run still see them by their command lines (process_identity.folder_ranks).
    Stopping is session/stop.py's, the one stop path."""

    external = False     # started by this machine's front end (see ExternalJob)

    def __init__(self, run_dir: Path, pid: int, pgid: int, argv: list[str],
                 proc: subprocess.Popen | None = None, info: dict | None = None) -> None:
        self.run_dir, self.pid, self.pgid, self.argv, self.proc = run_dir, pid, pgid, argv, proc
        self.info = info if info is not None else {"pid": pid, "pgid": pgid, "argv": argv}
        self.run_id = str(self.info.get("run_id") or run_id_of(run_dir))
        self._pos, self._partial = 0, b""          # how far the stream has been read for hello lines
        self._hello_hosts: dict[int, str] = {}
        self._told = False            # a watcher hands the hello lines over (heard): no reading of our own

    @classmethod
    def start(cls, cfg: C.RunConfig, run_dir: Path, run_id: str, env: dict[str, str] | None = None) -> "Job":
        """Start the launcher in run_dir. The folder is not created here: a new run's folder is made
        once, atomically, by session.rundir.create_run_dir; `shardconsole resume` starts on the
        folder of an earlier run on purpose (job.json is then replaced). The folder's owner lock
        (owner.py) is taken (or is already this process's: a resume took it to prepare) and handed to
        the launcher, which holds it while it lives; FolderInUse when another process owns the folder."""
        run_dir.mkdir(parents=True, exist_ok=True)
        argv = build_argv(cfg, run_dir, run_id)
        shared = cfg.parallel.nnodes > 1      # agents of a multi-node run share the folder: no lock (owner.py)
        with contextlib.nullcontext() if shared else owning(run_dir, f"the launch of run {run_id}") as lock:
            log_fd = os.open(run_dir / LAUNCHER_LOG, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o666)
            try:
                proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log_fd, stderr=subprocess.STDOUT,
                                        env=launch_env(cfg, env), start_new_session=True,
                                        pass_fds=(lock.fd,) if lock is not None else ())
            finally:
                os.close(log_fd)
            if lock is not None:
                lock.note(f"run {run_id} (its launcher, pid {proc.pid})")
        info: dict[str, Any] = {
            "pid": proc.pid, "pgid": proc.pid, "argv": argv, "cmdline": argv, "started": time.time(),
            "create_time": PI.start_time(proc.pid), "host": PI.this_host(),
            "run_dir": str(run_dir.resolve()), "run_id": run_id, "oom_kills": PI.oom_kills()}
        job = cls(run_dir, proc.pid, proc.pid, argv, proc, info)
        # Agents of a multi-node run share the folder: each node's has a file of its own (RunFolder.job
        # reads this host's), so node 0's attach or stop never reads node 1's launcher.
        name = agent_file_name(info["host"], proc.pid) if shared else RUN_FILE
        tmp = run_dir / f".{name}.{os.getpid()}.tmp"
        tmp.write_text(json.dumps(info))
        os.replace(tmp, run_dir / name)
        return job

    @classmethod
    def from_run_dir(cls, run_dir: Path) -> "Job":
        info = json.loads(RunFolder(run_dir).job.read_text())
        if not isinstance(info, dict):
            raise ValueError("not a JSON object")
        return cls(run_dir, int(info["pid"]), int(cast(Any, info.get("pgid", info["pid"]))),
                   list(info.get("argv", [])), info=info)

    # -- who is who ------------------------------------------------------------------------------

    def launcher_state(self) -> tuple[str, str]:
        """("ours" | "gone" | "stranger", why): see process_identity.check_launcher."""
        if self.proc is not None:      # our own child: the pid cannot be reused before we reap it
            return ("ours", "") if self.proc.poll() is None else ("gone", f"the launcher exited ({self.proc.returncode})")
        return PI.check_launcher(self.info, self.run_dir)

    def _read_hellos(self) -> None:
        """The hello lines appended since the last call, of every session of the folder (a rank
        orphaned by an earlier session's killed launcher trains the same folder). Only those lines are
        decoded: a long run's stream is mostly step lines, and alive() is asked several times a second.
        Not when a watcher tells them (heard): a front end reads its run's stream once."""
        if self._told:
            return
        try:
            with open(self.run_dir / METRICS_FILE, "rb") as fh:
                fh.seek(self._pos)
                chunk = fh.read(64 << 20)
        except OSError:
            return
        self._pos += len(chunk)
        lines = (self._partial + chunk).split(b"\n")
        self._partial = lines.pop()
        if len(self._partial) > P.MAX_LINE:
            self._partial = b""
        for raw in lines:
            if b'"kind":"hello"' not in raw:
                continue
            try:
                msg = P.decode(raw)
            except P.DecodeError:
                continue
            if isinstance(msg, P.Hello) and msg.pid > 0:
                self._hello_hosts[msg.pid] = msg.host

    def rank_pids(self, extra: tuple[int, ...] = ()) -> list[int]:
        """Live ranks of this run folder on this host, whatever session (run id) started them: those
        the process table shows running the rank module on this folder, and the stream's hello pids
        and any the caller knows, each checked against its command line."""
        self._read_hellos()
        found = set(PI.folder_ranks(self.run_dir))
        named = (set(self._hello_hosts) | {int(p) for p in extra}) - found
        found |= {p for p in PI.live(named) if PI.is_rank_of(p, self._hello_hosts.get(p), self.run_dir, None)}
        return sorted(found)

    def heard(self, hellos: list[P.Hello]) -> None:
        self._told = True
        for msg in hellos:
            if msg.pid > 0:
                self._hello_hosts[msg.pid] = msg.host

    def facts(self, extra: tuple[int, ...] = ()) -> JobFacts:
        state, why = self.launcher_state()
        rc = self.proc.poll() if self.proc is not None else None
        return JobFacts(state, rc, self.rank_pids(extra), why)

    # -- the questions a front end asks -------------------------------------------------------------

    @property
    def rc_known(self) -> bool:
        """Whether poll()'s code is the launcher's: only its parent (this front end) learns it."""
        return self.proc is not None

    def poll(self) -> int | None:
        """The launcher's exit code once the run is over, None while any process of it runs (ranks
        orphaned by a killed launcher included). Attached (not our child): 0 once nothing runs, which
        is no exit code (rc_known is False)."""
        if self.proc is not None:
            rc = self.proc.poll()
            return None if rc is None or self.rank_pids() else rc
        # Attached from another front end: not our child, so no exit code; alive or not is all we know.
        return None if self.alive() else 0

    def alive(self) -> bool:
        return self.launcher_state()[0] == "ours" or bool(self.rank_pids())

    def processes(self, extra: tuple[int, ...] = ()) -> list[int]:
        """Live processes of the run that may be signalled: the verified launcher's tree and group, the
        verified ranks, and each rank's own session and children."""
        pids: set[int] = set()
        if self.launcher_state()[0] == "ours":
            pids |= PI.tree(self.pid) | set(PI.group_pids(self.pgid))
        for rank in self.rank_pids(extra):
            pids |= PI.tree(rank)
        for pid in list(pids):
            try:
                if os.getpgid(pid) == pid:          # a worker's own session: its children too
                    pids |= set(PI.group_pids(pid))
            except OSError:
                continue
        return sorted(p for p in PI.live(pids) if p > 1 and p != os.getpid())

    def reap(self) -> None:
        """Collect our child's exit status, so that an ended launcher is not left a zombie."""
        if self.proc is not None:
            self.proc.poll()


class ExternalJob:
    """A run whose launchers this machine did not start (--print-command run by hand on other nodes, a
    Slurm job): no process to poll or signal, only its stream, which says when it has ended."""

    external = True
    rc_known = True      # poll() says 0 or 1 from the stream's own end lines
    argv: list[str]      # none known here: []

    def __init__(self, run_dir: Path) -> None:
        from shardconsole.runlog.stream import MetricsReader
        self.run_dir, self.pid, self.argv, self.proc = run_dir, 0, [], None
        self._reader = MetricsReader(run_dir / METRICS_FILE)
        self._rc: int | None = None

    def poll(self) -> int | None:
        """0 once the stream says finished, 1 once a rank reports a failure, else None (still running,
        as far as this machine can tell). Reads only what was appended since the last call."""
        from shardconsole.runlog.protocol import Failed, Finished
        for msg in self._reader.poll():
            if self._rc is None and isinstance(msg, (Finished, Failed)):
                self._rc = 0 if isinstance(msg, Finished) else 1
        return self._rc

    def alive(self) -> bool:
        return self.poll() is None

    def heard(self, hellos: list[P.Hello]) -> None:
        """Nothing to signal here: the hello lines change nothing."""


def node_agents(run_dir: Path) -> str:
    """Every node's agent of a run of several nodes (its newest session's), for attach, stop and runs:
    'node0 pid 4242 (here: running), node1 pid 977'; '' when the run has no agent files (one node, or
    started by --slurm / by hand with --print-command)."""
    folder = RunFolder(run_dir)
    newest = folder.agents()
    if not newest:
        return ""
    words = []
    for path in reversed(folder.agents(read_json(newest[0]).get("run_id"))):     # in the order they started
        info = read_json(path)
        here = info.get("host") == PI.this_host()
        state = f" (here: {'running' if PI.check_launcher(info, run_dir)[0] == 'ours' else 'ended'})" if here else ""
        words.append(f"{info.get('host', '?')} pid {info.get('pid', '?')}{state}")
    return ", ".join(words)


def open_run(run_dir: Path) -> Job | ExternalJob:     # both are RunJobs; stop_run needs a Job
    """The run in a folder, for attach: the job this machine started (job.json, or this host's agent
    file on a run of several nodes), or one started elsewhere that only its stream describes (no job
    file, or agent files of other hosts only). ValueError with a one-line reason otherwise."""
    if not (run_dir / PRESET_FILE).is_file():
        raise ValueError(f"{run_dir}: not a run folder (no {PRESET_FILE})")
    job_file = RunFolder(run_dir).job
    if not job_file.is_file() or (agent_host(job_file) and not agent_here(job_file)):
        # started by --print-command / --slurm on other machines, or by agents none of which is here
        return ExternalJob(run_dir)
    try:
        return Job.from_run_dir(run_dir)
    except (ValueError, KeyError, OSError) as e:
        raise ValueError(f"{run_dir / RUN_FILE}: unreadable ({e})") from None
