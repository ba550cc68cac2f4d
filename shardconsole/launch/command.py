"""What starts a run: the launcher's argv for this node, the sbatch script, the ranks' environment.

No shell anywhere: argv lists only, so a preset value is never pasted into a shell string; the one
text meant for a shell (the sbatch script) quotes every word and keeps each on its line. The
processes these start are launch.py's.
"""

from __future__ import annotations

import math
import os
import shlex
import sys
from datetime import datetime
from pathlib import Path

from shardconsole.envvars import read
from shardconsole.settings import config as C
from shardconsole.machine import doctor_verdict, flight_recorder
from shardconsole.launch import process_identity as PI
from shardconsole.user_folders import runs_root

WORKER_MODULE = PI.WORKER_MODULE


def new_run_dir(preset_name: str, root: str | Path | None = None) -> Path:
    """<runs root>/<time>-<preset>, made unique if two runs start in the same second."""
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in Path(preset_name).stem) or "run"
    base = (runs_root() if root is None else Path(root)) / f"{stamp}-{safe}"
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
    module = "shardconsole.launch.loopback_torchrun" if local else "torch.distributed.run"
    argv = [python, "-m", module, f"--nproc-per-node={p.nproc_per_node}", f"--nnodes={p.nnodes}",
            "--max-restarts=0"]
    if local:
        argv += ["--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{p.master_port or 0}",
                 f"--rdzv-id={run_id}", "--local-addr=127.0.0.1"]
    else:
        argv += ["--rdzv-backend=c10d", f"--rdzv-endpoint={p.rdzv_endpoint}", f"--rdzv-id={p.rdzv_id or run_id}",
                 rdzv_conf(p)]
        if p.node_rank >= 0:
            argv += [f"--node-rank={p.node_rank}"]
    return argv + worker


def rdzv_conf(p: C.ParallelSettings) -> str:
    """torchrun's rendezvous timeouts for a run of several nodes (settings/tables.py says what each bounds)."""
    return f"--rdzv-conf=read_timeout={p.rdzv_connect_timeout_s},join_timeout={p.rdzv_join_timeout_s}"


SLURM_RDZV_PORT = 20000
# Past the save budget, Slurm's USR1 comes this much earlier: the ranks look for the stop request once a
# second and save at the next step boundary, then torchrun and srun end.
SLURM_SIGNAL_MARGIN_S = 60
HOST_MEMORY_MARGIN = 1.10      # the planner's host figure was within 6% of every calibration run
# The interface gloo and NCCL bind to on every node: chosen where the script is written, and kept in it.
INTERFACE_VARS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
SESSION_MODULE = "shardconsole.session.cluster"
KILL_WAIT_ENV = "SHARDCONSOLE_KILL_WAIT_S"     # backends/rank/knobs.py reads it (Slurm's KillWait)


def slurm_script(cfg: C.RunConfig, run_dir: str | Path, run_id: str, python: str = sys.executable,
                 workdir: str | Path | None = None, host_bytes: int | None = None) -> str:
    """An sbatch script for this run: one torchrun agent per node (srun, one task a node, the node's
    cores: --exclusive), the c10d rendezvous on the job's first node, the job id as the rendezvous id.
    host_bytes: the planner's host RAM for one node (--mem asks it, with a margin; None: not asked).
    Requeue-safe: a resubmitted or requeued job resumes from the folder's newest complete checkpoint
    under a session of its own (session/cluster.py start); USR1 before the time limit asks every
    node's ranks to save and stop through the run folder. The run folder must be on a filesystem every
    node shares. The deepspeed launcher is not used under Slurm: torchrun starts DeepSpeed ranks just
    as well and needs no hostfile or ssh."""
    p, t = cfg.parallel, cfg.train
    run_dir = Path(run_dir).resolve()
    # A port of the user's, else one per job: two jobs sharing a node must not meet in one rendezvous.
    port = p.rdzv_endpoint.rsplit(":", 1)[1] if p.rdzv_endpoint else f"$(({SLURM_RDZV_PORT} + SLURM_JOB_ID % 20000))"
    torchrun = [python, "-m", "torch.distributed.run", f"--nproc-per-node={p.nproc_per_node}", "--max-restarts=0",
                "--rdzv-backend=c10d", rdzv_conf(p)]
    worker = ["-m", WORKER_MODULE, "--run-dir", str(run_dir), "--run-id"]
    session = [python, "-m", SESSION_MODULE]
    # sbatch reads the #SBATCH lines itself, where shell quoting cannot hold a newline: names go there
    # (and into the comment) with control characters escaped; the shell lines are quoted so that each
    # stays one line ($'...' for a word with a control character in it).
    out_file = str(run_dir / "slurm-%j.out")
    lines = ["#!/bin/bash",
             f"# shardconsole run {_one_line(run_id)}: {p.nnodes} node(s) x {p.nproc_per_node} rank(s), "
             f"backend {p.backend}",
             f"#SBATCH --job-name={shlex.quote(_one_line(run_id))}",
             f"#SBATCH --nodes={p.nnodes}",
             "#SBATCH --ntasks-per-node=1",
             # the agent, its ranks and their offload threads share the task's CPUs (one by default)
             "#SBATCH --exclusive"]
    if host_bytes:
        lines.append(f"#SBATCH --mem={math.ceil(host_bytes * HOST_MEMORY_MARGIN / 2**30)}G")
    if p.device != "cpu":
        lines.append(f"#SBATCH --gpus-per-node={p.nproc_per_node}")
    if t.save_on_stop:
        lines.append(f"#SBATCH --signal=B:USR1@{int(t.stop_save_timeout_s) + SLURM_SIGNAL_MARGIN_S}")
    lines += ["#SBATCH --requeue", "#SBATCH --open-mode=append"]
    if _one_line(out_file) == out_file:
        lines.append(f"#SBATCH --output={shlex.quote(out_file)}")
    else:
        lines.append(f"# the run folder's name holds a control character: output in slurm-%j.out where sbatch runs")
    lines += ["set -euo pipefail", f"cd {_sh_quote(str(Path(workdir or os.getcwd()).resolve()))}"]
    env = child_env(cfg, base={k: os.environ[k] for k in INTERFACE_VARS if os.environ.get(k)})
    lines += [f"export {k}={_sh_quote(v)}" for k, v in sorted(env.items())]
    if _split_cores(cfg, env):
        n = p.nproc_per_node
        lines += ["# the host optimizer step's threads: a rank's share of the node's cores (torchrun's default is 1)",
                  f"export OMP_NUM_THREADS=$(( ${{SLURM_CPUS_ON_NODE:-{n}}} / {n} > 0 ? ${{SLURM_CPUS_ON_NODE:-{n}}} / {n} : 1 ))"]
    lines += [f"run_dir={_sh_quote(str(run_dir))}",
              'head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
              "# a resubmitted or requeued job resumes from the newest complete checkpoint, as a session of its own",
              f'session=$({_sh_join(session)} start "$run_dir" "$SLURM_JOB_ID" "$head_node")',
              "# USR1 (--signal above; or `scancel --batch --signal=USR1 JOB`): every node's ranks save and stop",
              f"stop_request() {{ {_sh_join(session)} stop \"$run_dir\" \"$session\" \"$1\"; }}",
              'trap \'stop_request "Slurm (USR1 to job $SLURM_JOB_ID)"\' USR1',
              "# a plain scancel, the time limit, a requeue or a failed node: Slurm SIGTERMs every process and",
              "# SIGKILLs them KillWait later; the ranks save what fits in it (backends/engine/trainstate.py), and the",
              "# stream says which it was where Slurm tells (session/cluster.py asks scontrol)",
              f"export {KILL_WAIT_ENV}=\"$(scontrol show config 2>/dev/null | sed -n 's/^KillWait *= *\\([0-9]*\\).*/\\1/p')\"",
              f'trap \'stop_request "Slurm (SIGTERM to job $SLURM_JOB_ID; KillWait ${{{KILL_WAIT_ENV}:-?}}s)"\' TERM',
              "# one torchrun agent per node; the first node hosts the rendezvous",
              f"srun --kill-on-bad-exit=1 --cpus-per-task=\"$SLURM_CPUS_ON_NODE\" {_sh_join(torchrun)} "
              f"--nnodes=\"$SLURM_NNODES\" --rdzv-endpoint=\"$head_node:{port}\" --rdzv-id=\"$SLURM_JOB_ID\" "
              f"{_sh_join(worker)} \"$session\" &",
              # in the background: bash runs a trap only between commands, and a wait returns for it
              "srun_pid=$!",
              'while kill -0 "$srun_pid" 2>/dev/null; do wait "$srun_pid" || true; done',
              'rc=0; wait "$srun_pid" || rc=$?',     # srun's own status, which bash keeps
              "# a stop asked of the run (USR1, `shardconsole stop`) after which every rank saved: COMPLETED, exit 0",
              f'if [ "$rc" -ne 0 ] && {_sh_join(session)} saved "$run_dir" "$session"; then rc=0; fi',
              'exit "$rc"']
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
    if cfg.train.save_on_stop:
        # torchrun's agent SIGKILLs its workers this long after it forwards a SIGTERM (30 s by default): a
        # checkpoint saved on stop must fit inside it (the ranks read the same variable for their bound).
        env.setdefault("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", str(int(cfg.train.stop_save_timeout_s) + 30))
    # torch's flight recorder: a hang report names the collective each rank is in (flight_recorder.py).
    # One name, the installed torch's: the old one set beside the new made torch warn in every rank log.
    if not any(key in env for key in flight_recorder.ENV_VARS):
        env[flight_recorder.buffer_env_var()] = flight_recorder.BUFFER_ENTRIES
    return env


def launch_env(cfg: C.RunConfig, env: dict[str, str] | None) -> dict[str, str]:
    out = child_env(cfg, env)
    if cfg.parallel.device != "cpu" and "NCCL_P2P_DISABLE" not in out:
        why = doctor_verdict.p2p_broken_here()   # this machine's saved doctor verdict; rank 0 says it
        if why:
            out["NCCL_P2P_DISABLE"] = "1"
            out[doctor_verdict.P2P_NOTE_ENV] = why
    if cfg.parallel.nnodes == 1 and not cfg.parallel.rdzv_endpoint:
        out.setdefault("GLOO_SOCKET_IFNAME", "lo")    # one node: gloo's pair sockets on loopback too
    if _split_cores(cfg, out):
        out["OMP_NUM_THREADS"] = str(max(1, len(os.sched_getaffinity(0)) // cfg.parallel.nproc_per_node))
    return out


def _split_cores(cfg: C.RunConfig, env: dict[str, str]) -> bool:
    """Whether the launch sets OMP_NUM_THREADS itself: torchrun gives each of several ranks a node one
    thread unless it is set, and an offloaded run's host optimizer step (FSDP2's, DeepSpeed's CPUAdam)
    would then run on one core; the node's cores are split between its ranks instead. A value of the
    user's is kept; CPU ranks keep torchrun's (their compute is the host's already)."""
    if cfg.parallel.device == "cpu" or cfg.parallel.nproc_per_node < 2 or "OMP_NUM_THREADS" in env:
        return False
    d = cfg.deepspeed
    return bool(cfg.fsdp.cpu_offload) if cfg.parallel.backend == "fsdp" else \
        d.offload_optimizer != "none" or d.offload_param != "none"
