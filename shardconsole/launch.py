"""Launching a run: its folder, the launcher's argv, the child process group, and stopping it.

No shell anywhere: argv lists only, so a preset value is never pasted into a shell string. The child
(torchrun or the deepspeed launcher) runs in its own session, so Ctrl-C in the front end's terminal
does not reach the ranks directly: the front end stops them on purpose (SIGTERM to the group, a grace
period, SIGKILL) and then checks that no process of the group is left.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from shardconsole import config as C

from shardconsole.runfolder import JOB_FILE as RUN_FILE, LAUNCHER_LOG, METRICS_FILE, PRESET_FILE  # noqa: F401
WORKER_MODULE = "shardconsole.backends"


def new_run_dir(preset_name: str, root: str | Path = "runs") -> Path:
    """runs/<time>-<preset>, made unique if two runs start in the same second."""
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in Path(preset_name).stem) or "run"
    base = Path(root) / f"{stamp}-{safe}"
    path, n = base, 1
    while path.exists():
        n += 1
        path = Path(f"{base}-{n}")
    return path


def run_id_of(run_dir: Path) -> str:
    return run_dir.resolve().name


def build_argv(cfg: C.RunConfig, run_dir: str | Path, run_id: str, python: str = sys.executable) -> list[str]:
    """The exact command that starts the ranks of this node."""
    p = cfg.parallel
    worker = ["-m", WORKER_MODULE, "--run-dir", str(run_dir), "--run-id", run_id]
    if p.launcher == "deepspeed":
        return _deepspeed_argv(cfg, worker, python)
    argv = [python, "-m", "torch.distributed.run", f"--nproc-per-node={p.nproc_per_node}",
            f"--nnodes={p.nnodes}", "--max-restarts=0"]
    if p.nnodes == 1 and not p.rdzv_endpoint:
        if p.master_port:
            argv += ["--master-addr=127.0.0.1", f"--master-port={p.master_port}"]
        else:
            argv += ["--standalone"]   # c10d rendezvous on a free local port
    else:
        argv += ["--rdzv-backend=c10d", f"--rdzv-endpoint={p.rdzv_endpoint}", f"--rdzv-id={p.rdzv_id or run_id}"]
        if p.node_rank >= 0:
            argv += [f"--node-rank={p.node_rank}"]
    return argv + worker


SLURM_RDZV_PORT = 20000


def slurm_script(cfg: C.RunConfig, run_dir: str | Path, run_id: str, python: str = sys.executable,
                 workdir: str | Path | None = None) -> str:
    """An sbatch script for this run: one torchrun agent per node (srun, one task a node), the c10d
    rendezvous on the job's first node, the job id as the rendezvous id. Slurm places the nodes; the
    ranks, the stream and the checkpoints are the same as a local run's. The run folder must be on a
    filesystem every node shares (it holds preset.toml and receives the metrics), as for any
    multi-node run. The deepspeed launcher is not used under Slurm: torchrun starts DeepSpeed ranks
    just as well and needs no hostfile or ssh."""
    p = cfg.parallel
    run_dir = Path(run_dir).resolve()
    # A port of the user's, else one per job: two jobs sharing a node must not meet in one rendezvous.
    port = p.rdzv_endpoint.rsplit(":", 1)[1] if p.rdzv_endpoint else f"$(({SLURM_RDZV_PORT} + SLURM_JOB_ID % 20000))"
    torchrun = [python, "-m", "torch.distributed.run", f"--nproc-per-node={p.nproc_per_node}", "--max-restarts=0",
                "--rdzv-backend=c10d"]
    worker = ["-m", WORKER_MODULE, "--run-dir", str(run_dir), "--run-id", run_id]
    lines = ["#!/bin/bash",
             f"# shardconsole run {run_id}: {p.nnodes} node(s) x {p.nproc_per_node} rank(s), backend {p.backend}",
             f"#SBATCH --job-name={shlex.quote(run_id)}",
             f"#SBATCH --nodes={p.nnodes}",
             "#SBATCH --ntasks-per-node=1",
             f"#SBATCH --output={shlex.quote(str(run_dir / 'slurm-%j.out'))}"]
    if p.device != "cpu":
        lines.append(f"#SBATCH --gpus-per-node={p.nproc_per_node}")
    lines += ["set -euo pipefail", f"cd {shlex.quote(str(Path(workdir or os.getcwd()).resolve()))}"]
    env = child_env(cfg, base={})
    lines += [f"export {k}={shlex.quote(v)}" for k, v in sorted(env.items())]
    lines += ['head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
              "# one torchrun agent per node; the first node hosts the rendezvous",
              f"srun --kill-on-bad-exit=1 {shlex.join(torchrun)} --nnodes=\"$SLURM_NNODES\" "
              f"--rdzv-endpoint=\"$head_node:{port}\" --rdzv-id=\"$SLURM_JOB_ID\" {shlex.join(worker)}"]
    return "\n".join(lines) + "\n"


def _deepspeed_argv(cfg: C.RunConfig, worker: list[str], python: str) -> list[str]:
    p = cfg.parallel
    argv = [python, "-m", "deepspeed.launcher.runner", f"--num_gpus={p.nproc_per_node}",
            f"--num_nodes={p.nnodes}"]
    if p.nnodes > 1:
        host, port = p.rdzv_endpoint.rsplit(":", 1)
        argv += [f"--master_addr={host}", f"--master_port={port}"]
        if p.node_rank >= 0:
            argv += [f"--node_rank={p.node_rank}"]
    elif p.master_port:
        argv += [f"--master_port={p.master_port}"]
    else:
        # The runner's default port is 29500 for every run, so two runs on one machine would meet in
        # one rendezvous (torchrun's --standalone picks a free port; this does the same).
        argv += [f"--master_port={_free_port()}"]
    # deepspeed's runner takes the script and its args; --module runs a module instead of a file.
    return argv + ["--module", worker[1]] + worker[2:]


def _free_port() -> int:
    import socket
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def format_argv(argv: list[str]) -> str:
    return shlex.join(argv)


def child_env(cfg: C.RunConfig, base: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ if base is None else base)
    env["PYTHONUNBUFFERED"] = "1"
    if cfg.parallel.device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""   # the ranks must not grab a GPU they were told not to use
    if cfg.parallel.backend == "deepspeed" and cfg.parallel.device == "cpu":
        env.setdefault("DS_ACCELERATOR", "cpu")
    return env


@dataclass
class StopReport:
    signalled: list[int] = field(default_factory=list)   # pids that were alive when the stop began
    killed: bool = False                                  # SIGKILL was needed
    left: list[int] = field(default_factory=list)         # pids still alive at the end (should be empty)
    seconds: float = 0.0
    gpu_note: str = ""                                    # what NVML says after the stop (front ends fill it)

    @property
    def clean(self) -> bool:
        return not self.left


def _live(pids) -> list[int]:
    import psutil
    out = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                out.append(pid)
        except psutil.Error:
            continue
    return out


def _tree(pid: int) -> set[int]:
    """The launcher and every descendant. torchrun starts each worker in a session of its own, so the
    launcher's process group alone does not reach the ranks."""
    import psutil
    try:
        root = psutil.Process(pid)
        return {pid} | {c.pid for c in root.children(recursive=True)}
    except psutil.Error:
        return set()


def _group_pids(pgid: int) -> list[int]:
    """Every live process in process group pgid."""
    import psutil
    out = []
    for proc in psutil.process_iter(["pid", "status"]):
        try:
            if proc.info["status"] != psutil.STATUS_ZOMBIE and os.getpgid(proc.pid) == pgid:
                out.append(proc.pid)
        except (ProcessLookupError, psutil.Error, OSError):
            continue
    return out


class Job:
    """A started run: the launcher process and its process group."""

    external = False     # started by this machine's front end (see ExternalJob)

    def __init__(self, run_dir: Path, pid: int, pgid: int, argv: list[str],
                 proc: subprocess.Popen | None = None) -> None:
        self.run_dir, self.pid, self.pgid, self.argv, self.proc = run_dir, pid, pgid, argv, proc

    @classmethod
    def start(cls, cfg: C.RunConfig, run_dir: Path, run_id: str, env: dict[str, str] | None = None) -> "Job":
        run_dir.mkdir(parents=True, exist_ok=True)
        argv = build_argv(cfg, run_dir, run_id)
        log = open(run_dir / LAUNCHER_LOG, "ab")
        try:
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                    env=child_env(cfg, env), start_new_session=True)
        finally:
            log.close()
        job = cls(run_dir, proc.pid, proc.pid, argv, proc)
        tmp = run_dir / f"{RUN_FILE}.{os.getpid()}.tmp"   # agents of a multi-node run may share the folder
        tmp.write_text(json.dumps({"pid": proc.pid, "pgid": proc.pid, "argv": argv, "started": time.time(),
                                   "host": os.uname().nodename}))
        os.replace(tmp, run_dir / RUN_FILE)
        return job

    @classmethod
    def from_run_dir(cls, run_dir: Path) -> "Job":
        info = json.loads((run_dir / RUN_FILE).read_text())
        return cls(run_dir, int(info["pid"]), int(info["pgid"]), list(info["argv"]))

    def poll(self) -> int | None:
        """The launcher's exit code, or None while it runs."""
        if self.proc is not None:
            return self.proc.poll()
        # Attached from another front end: not our child, so no exit code; alive or not is all we know.
        return None if self.alive() else 0

    def alive(self) -> bool:
        return bool(_live([self.pid]) or self.processes())

    def processes(self, extra: tuple[int, ...] = ()) -> list[int]:
        """Live processes of the run: the launcher's tree, its process group, the ranks' own groups, and
        any rank pids the caller knows from the stream (orphans of a killed launcher)."""
        pids = _tree(self.pid) | set(_group_pids(self.pgid)) | set(extra)
        for pid in list(pids):
            try:
                if os.getpgid(pid) == pid:          # a worker's own session: its children too
                    pids |= set(_group_pids(pid))
            except OSError:
                continue
        return sorted(_live(pids))

    def wait(self, timeout: float | None = None) -> int | None:
        if self.proc is not None:
            try:
                return self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                return None
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.alive():
            if deadline is not None and time.monotonic() > deadline:
                return None
            time.sleep(0.1)
        return 0

    def stop(self, grace_s: float = 10.0, rank_pids: tuple[int, ...] = ()) -> StopReport:
        """SIGTERM to every process of the run, wait up to grace_s, then SIGKILL; report what is left."""
        t0 = time.monotonic()
        targets = self.processes(tuple(rank_pids))
        report = StopReport(signalled=targets)
        self._signal_all(targets, signal.SIGTERM)
        deadline = t0 + grace_s
        while time.monotonic() < deadline:
            self._reap()
            if not _live(targets):
                break
            time.sleep(0.05)
        else:
            report.killed = True
            targets = sorted(set(targets) | set(self.processes(tuple(rank_pids))))
            self._signal_all(targets, signal.SIGKILL)
            end = time.monotonic() + 5.0
            while time.monotonic() < end and _live(targets):
                self._reap()
                time.sleep(0.05)
        self._reap()
        report.left = _live(set(targets) | set(self.processes(tuple(rank_pids))))
        report.seconds = time.monotonic() - t0
        return report

    def _signal_all(self, pids: list[int], sig: int) -> None:
        groups = set()
        for pid in pids:
            try:
                groups.add(os.getpgid(pid))
            except OSError:
                continue
        for g in groups:
            if g in (os.getpgid(0),):
                continue   # never our own group (an attached front end shares nothing, but be safe)
            try:
                os.killpg(g, sig)
            except (ProcessLookupError, PermissionError):
                pass
        for pid in pids:
            try:
                os.kill(pid, sig)
            except (ProcessLookupError, PermissionError):
                pass

    def _reap(self) -> None:
        if self.proc is not None:
            self.proc.poll()


class ExternalJob:
    """A run whose launchers this machine did not start (--print-command run by hand on other nodes, a
    Slurm job): no process to poll or signal, only its stream, which says when it has ended."""

    external = True

    def __init__(self, run_dir: Path) -> None:
        from shardconsole.stream import MetricsReader
        self.run_dir, self.pid, self.argv, self.proc = run_dir, 0, [], None
        self._reader = MetricsReader(run_dir / METRICS_FILE)
        self._rc: int | None = None

    def poll(self) -> int | None:
        """0 once the stream says finished, 1 once a rank reports a failure, else None (still running,
        as far as this machine can tell). Reads only what was appended since the last call."""
        from shardconsole.protocol import Failed, Finished
        for msg in self._reader.poll():
            if self._rc is None and isinstance(msg, (Finished, Failed)):
                self._rc = 0 if isinstance(msg, Finished) else 1
        return self._rc

    def alive(self) -> bool:
        return self.poll() is None


def open_run(run_dir: Path) -> Job | ExternalJob:
    """The run in a folder, for attach: the job this machine started (job.json), or one started
    elsewhere that only its stream describes. ValueError with a one-line reason otherwise."""
    if not (run_dir / PRESET_FILE).is_file():
        raise ValueError(f"{run_dir}: not a run folder (no {PRESET_FILE})")
    if not (run_dir / RUN_FILE).is_file():
        return ExternalJob(run_dir)     # started by --print-command / --slurm on other machines
    try:
        return Job.from_run_dir(run_dir)
    except (ValueError, KeyError, OSError) as e:
        raise ValueError(f"{run_dir / RUN_FILE}: unreadable ({e})") from None
