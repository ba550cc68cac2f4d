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
from shardconsole import process_identity as PI

from shardconsole.runfolder import JOB_FILE as RUN_FILE, LAUNCHER_LOG, METRICS_FILE, PRESET_FILE  # noqa: F401
WORKER_MODULE = PI.WORKER_MODULE


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
    local = p.nnodes == 1 and not p.rdzv_endpoint
    # One node: torchrun through loopback_torchrun, whose stores listen on 127.0.0.1 only (torchrun's
    # own listen on every interface); the rendezvous on master_port, or on a free port (0).
    module = "shardconsole.loopback_torchrun" if local else "torch.distributed.run"
    argv = [python, "-m", module, f"--nproc-per-node={p.nproc_per_node}", f"--nnodes={p.nnodes}",
            "--max-restarts=0"]
    if local:
        argv += ["--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{p.master_port or 0}",
                 f"--rdzv-id={run_id}", "--local-addr=127.0.0.1"]
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
    # sbatch reads the #SBATCH lines itself, where shell quoting cannot hold a newline: names go there
    # (and into the comment) with control characters escaped; the shell lines are quoted so that each
    # stays one line ($'...' for a word with a control character in it).
    out_file = str(run_dir / "slurm-%j.out")
    lines = ["#!/bin/bash",
             f"# shardconsole run {_one_line(run_id)}: {p.nnodes} node(s) x {p.nproc_per_node} rank(s), "
             f"backend {p.backend}",
             f"#SBATCH --job-name={shlex.quote(_one_line(run_id))}",
             f"#SBATCH --nodes={p.nnodes}",
             "#SBATCH --ntasks-per-node=1"]
    if _one_line(out_file) == out_file:
        lines.append(f"#SBATCH --output={shlex.quote(out_file)}")
    else:
        lines.append(f"# the run folder's name holds a control character: output in slurm-%j.out where sbatch runs")
    if p.device != "cpu":
        lines.append(f"#SBATCH --gpus-per-node={p.nproc_per_node}")
    lines += ["set -euo pipefail", f"cd {_sh_quote(str(Path(workdir or os.getcwd()).resolve()))}"]
    env = child_env(cfg, base={})
    lines += [f"export {k}={_sh_quote(v)}" for k, v in sorted(env.items())]
    lines += ['head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
              "# one torchrun agent per node; the first node hosts the rendezvous",
              f"srun --kill-on-bad-exit=1 {_sh_join(torchrun)} --nnodes=\"$SLURM_NNODES\" "
              f"--rdzv-endpoint=\"$head_node:{port}\" --rdzv-id=\"$SLURM_JOB_ID\" {_sh_join(worker)}"]
    return "\n".join(lines) + "\n"


def _one_line(text: str) -> str:
    """text with every control character escaped (a newline becomes \\n): safe inside one line."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def _sh_quote(word: str) -> str:
    """shlex.quote, but a word holding a control character becomes $'...' with it escaped: the word
    stays on its line (sbatch reads #SBATCH directives line by line)."""
    if word == _one_line(word):
        return shlex.quote(word)
    escaped = "".join("\\\\" if c == "\\" else "\\'" if c == "'" else
                      (c if c.isprintable() else f"\\x{ord(c):02x}" if ord(c) < 256 else c) for c in word)
    return f"$'{escaped}'"


def _sh_join(words: list[str]) -> str:
    return " ".join(_sh_quote(w) for w in words)


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
    # deepspeed's runner takes the script and its args; --module runs a module instead of a file. One
    # node: the rank module through loopback_rank, so rank 0's rendezvous store listens on 127.0.0.1.
    module = PI.LOOPBACK_WORKER_MODULE if p.nnodes == 1 else worker[1]
    return argv + ["--module", module] + worker[2:]


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


def _launch_env(cfg: C.RunConfig, env: dict[str, str] | None) -> dict[str, str]:
    out = child_env(cfg, env)
    if cfg.parallel.nnodes == 1 and not cfg.parallel.rdzv_endpoint:
        out.setdefault("GLOO_SOCKET_IFNAME", "lo")    # one node: gloo's pair sockets on loopback too
    return out


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


class Job:
    """A started run: the launcher process, its process group, and the ranks the stream announced.

    Only verified processes are ever signalled (process_identity.py): the launcher when host, start
    time and command line match job.json; a rank when its hello line's host is this one and its
    command line runs this run. A launcher killed from outside leaves its ranks running: alive(),
    poll() and stop() still see them through their hello lines."""

    external = False     # started by this machine's front end (see ExternalJob)

    def __init__(self, run_dir: Path, pid: int, pgid: int, argv: list[str],
                 proc: subprocess.Popen | None = None, info: dict | None = None) -> None:
        self.run_dir, self.pid, self.pgid, self.argv, self.proc = run_dir, pid, pgid, argv, proc
        self.info = info if info is not None else {"pid": pid, "pgid": pgid, "argv": argv}
        self.run_id = str(self.info.get("run_id") or run_id_of(run_dir))
        self._reader = None
        self._hello_hosts: dict[int, str] = {}

    @classmethod
    def start(cls, cfg: C.RunConfig, run_dir: Path, run_id: str, env: dict[str, str] | None = None) -> "Job":
        """Start the launcher in run_dir. The folder is not created here: a new run's folder is made
        once, atomically, by session.rundir.create_run_dir; `shardconsole resume` starts on the
        folder of an earlier run on purpose (job.json is then replaced)."""
        run_dir.mkdir(parents=True, exist_ok=True)
        argv = build_argv(cfg, run_dir, run_id)
        log_fd = os.open(run_dir / LAUNCHER_LOG, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o666)
        try:
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log_fd, stderr=subprocess.STDOUT,
                                    env=_launch_env(cfg, env), start_new_session=True)
        finally:
            os.close(log_fd)
        info = {"pid": proc.pid, "pgid": proc.pid, "argv": argv, "cmdline": argv, "started": time.time(),
                "create_time": PI.start_time(proc.pid), "host": PI.this_host(),
                "run_dir": str(run_dir.resolve()), "run_id": run_id}
        job = cls(run_dir, proc.pid, proc.pid, argv, proc, info)
        tmp = run_dir / f"{RUN_FILE}.{os.getpid()}.tmp"   # agents of a multi-node run may share the folder
        tmp.write_text(json.dumps(info))
        os.replace(tmp, run_dir / RUN_FILE)
        return job

    @classmethod
    def from_run_dir(cls, run_dir: Path) -> "Job":
        info = json.loads((run_dir / RUN_FILE).read_text())
        if not isinstance(info, dict):
            raise ValueError("not a JSON object")
        return cls(run_dir, int(info["pid"]), int(info.get("pgid", info["pid"])), list(info.get("argv", [])),
                   info=info)

    # -- who is who ------------------------------------------------------------------------------

    def launcher_state(self) -> tuple[str, str]:
        """("ours" | "gone" | "stranger", why): see process_identity.check_launcher."""
        if self.proc is not None:      # our own child: the pid cannot be reused before we reap it
            return ("ours", "") if self.proc.poll() is None else ("gone", f"the launcher exited ({self.proc.returncode})")
        return PI.check_launcher(self.info, self.run_dir)

    def _read_hellos(self) -> None:
        from shardconsole.protocol import Hello
        from shardconsole.stream import MetricsReader
        if self._reader is None:
            self._reader = MetricsReader(self.run_dir / METRICS_FILE)
        for msg in self._reader.poll():
            if isinstance(msg, Hello) and msg.run == self.run_id and msg.pid > 0:
                self._hello_hosts[msg.pid] = msg.host

    def rank_pids(self, extra: tuple[int, ...] = ()) -> list[int]:
        """Live ranks of this run on this host, verified: the stream's hello pids and any the caller
        knows (also hello pids), each checked against its command line."""
        self._read_hellos()
        pids = set(self._hello_hosts) | {int(p) for p in extra}
        return sorted(p for p in PI.live(pids)
                      if PI.is_rank_of(p, self._hello_hosts.get(p), self.run_dir, self.run_id))

    def facts(self, extra: tuple[int, ...] = ()) -> JobFacts:
        state, why = self.launcher_state()
        rc = self.proc.poll() if self.proc is not None else None
        return JobFacts(state, rc, self.rank_pids(extra), why)

    # -- the questions a front end asks -------------------------------------------------------------

    def poll(self) -> int | None:
        """The launcher's exit code once the run is over, None while any process of it runs (ranks
        orphaned by a killed launcher included)."""
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

    def stop(self, grace_s: float = 10.0, rank_pids: tuple[int, ...] = ()) -> StopReport:
        """SIGTERM to every verified process of the run, wait up to grace_s, then SIGKILL; report what
        is left. A launcher that job.json names but that is not ours is left alone (report.refused)."""
        t0 = time.monotonic()
        state, why = self.launcher_state()
        targets = self.processes(tuple(rank_pids))
        report = StopReport(signalled=targets, refused=why if state == "stranger" else "")
        self._signal_all(targets, signal.SIGTERM)
        deadline = t0 + grace_s
        while time.monotonic() < deadline:
            self._reap()
            if not PI.live(targets):
                break
            time.sleep(0.05)
        else:
            report.killed = True
            targets = sorted(set(targets) | set(self.processes(tuple(rank_pids))))
            self._signal_all(targets, signal.SIGKILL)
            end = time.monotonic() + 5.0
            while time.monotonic() < end and PI.live(targets):
                self._reap()
                time.sleep(0.05)
        self._reap()
        report.left = PI.live(set(targets) | set(self.processes(tuple(rank_pids))))
        report.seconds = time.monotonic() - t0
        return report

    def _signal_all(self, pids: list[int], sig: int) -> None:
        """Each verified process by pid, and the process groups that verified processes lead (a group
        leader is the launcher or a worker in its own session); never a group we only joined."""
        own = os.getpgid(0)
        for pid in pids:
            try:
                if os.getpgid(pid) == pid and pid != own:
                    os.killpg(pid, sig)
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
