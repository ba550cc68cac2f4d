"""Issue 32: the Slurm script on two nodes, stopped through the run folder and resubmitted.

The sbatch script shardconsole writes runs as Slurm runs it on a two-node allocation: srun and scontrol
are stand-ins on PATH (srun starts its command once per node, scontrol names 127.0.0.1), so two real
torchrun agents meet in one c10d rendezvous on loopback, one rank each, one shared run folder."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shardconsole.launch.job import PRESET_FILE
from shardconsole.settings import config as C
from tests.conftest import messages, of_kind, pids_alive, shardconsole, wait_for_steps, wait_until

FAKE_SRUN = """#!/bin/bash
while [[ "$1" == --* ]]; do shift; done
pids=()
for node in 0 1; do SLURM_NODEID=$node SLURM_PROCID=$node "$@" & pids+=($!); done
rc=0
for p in "${pids[@]}"; do wait "$p" || rc=$?; done
exit $rc
"""


def _job_id_with_a_free_port() -> int:
    """The script's rendezvous port is 20000 + job id % 20000: a job id whose port is free."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if 20000 <= port < 40000:
            return port - 20000
    return 12345


def _slurm_env(tmp_path: Path, srun: str = FAKE_SRUN) -> dict[str, str]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "srun").write_text(srun)
    # `scontrol show config` names KillWait (1 s: no time to save), `show hostnames` node 0 (127.0.0.1)
    (bin_dir / "scontrol").write_text('#!/bin/bash\n[ "$2" = config ] && echo "KillWait                = 1 sec" '
                                      '&& exit 0\necho 127.0.0.1\n')
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    return {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_NODELIST": "node[0-1]",
            "SLURM_NNODES": "2", "SLURM_CPUS_ON_NODE": "1"}


def _submit(script: Path, env: dict[str, str]) -> subprocess.Popen:
    """The batch shell in a process group of its own with everything it starts: a plain scancel's
    SIGTERM reaches them all (killpg)."""
    return subprocess.Popen(["bash", str(script)], env={**env, "SLURM_JOB_ID": str(_job_id_with_a_free_port())},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)


def test_two_node_slurm_job_stops_from_the_first_node_and_a_resubmit_resumes(tmp_path):
    run_dir = tmp_path / "run"
    # the interface chosen where the script is written travels in it (loopback: both nodes are here)
    res = shardconsole("--preset", "tiny-cpu", "--slurm", "--run-dir", str(run_dir), "--set", "parallel.nnodes=2",
                       "--set", "parallel.nproc_per_node=1", "--set", "train.steps=100000", "--set", "train.log_every=1",
                       "--set", "fsdp.sharding=hybrid_shard", env={"GLOO_SOCKET_IFNAME": "lo"}, timeout=60)
    assert res.returncode == 0, res.stderr
    text = res.stdout
    assert {"#SBATCH --nodes=2", "#SBATCH --exclusive", "#SBATCH --requeue", "export GLOO_SOCKET_IFNAME=lo",
            f"#SBATCH --signal=B:USR1@{300 + 60}"} <= set(text.splitlines())
    assert any(line.startswith("#SBATCH --mem=") for line in text.splitlines())
    # the ranks validate the folder's preset.toml again: it says the job names node 0
    assert C.load(run_dir / PRESET_FILE).parallel.rendezvous == "slurm"
    script = tmp_path / "job.sbatch"
    script.write_text(text)
    env = _slurm_env(tmp_path)

    job = _submit(script, env)
    wait_for_steps(run_dir, 2, 120, job)
    stop = shardconsole("stop", str(run_dir), timeout=120)        # from "the first node": a plain shell here
    assert stop.returncode == 0, stop.stderr
    out, err = job.communicate(timeout=60)                         # both agents ended: srun, then the job
    assert job.returncode == 0, err[-2000:]                        # a stop that saved: COMPLETED, not FAILED
    msgs = messages(run_dir)
    hellos = of_kind(msgs, "hello")
    assert sorted(h.rank for h in hellos) == [0, 1] and pids_alive(h.pid for h in hellos) == []
    stopped = [m for m in of_kind(msgs, "failed") if m.cause == "stopped"]
    assert sorted(m.rank for m in stopped) == [0, 1], err[-2000:]
    assert all("saved it" in m.message for m in stopped)
    assert f"node {socket.gethostname()}: rank(s) 0, 1 ended" in stop.stderr
    saved = max(m.step for m in stopped)
    assert not (run_dir / "job.json").exists()                     # no front end of ours started it
    # each node's ranks wrote a file of their own: node 1's lines are not in node 0's
    assert (run_dir / "metrics.node1.jsonl").is_file()
    assert '"rank":1,' not in (run_dir / "metrics.jsonl").read_text()

    # `resume RUN --slurm` writes the same script (any resubmit resumes); resubmitted, it resumes, saving
    # each step; a plain scancel then SIGTERMs every process, with KillWait (1 s) to go: no time to save
    res = shardconsole("resume", str(run_dir), "--slurm", "--set", "train.checkpoint_every=1",
                       env={"GLOO_SOCKET_IFNAME": "lo"}, timeout=60)
    assert res.returncode == 0, res.stderr
    assert res.stdout == text
    job = _submit(script, env)
    wait_until(lambda: len({m.step for m in of_kind(messages(run_dir), "step")
                            if m.run.startswith(f"{run_dir.name}-resume-")}) >= 2, 120, "two resumed steps", every_s=0.5)
    os.killpg(job.pid, signal.SIGTERM)
    out, err = job.communicate(timeout=60)
    assert job.returncode != 0                                     # no time to save: the job failed
    msgs = messages(run_dir)
    session = of_kind(msgs, "hello")[-1].run
    cancelled = [m for m in of_kind(msgs, "failed") if m.run == session]
    assert sorted(m.rank for m in cancelled) == [0, 1] and {m.cause for m in cancelled} == {"stopped"}, err[-2000:]
    assert all("without a save: Slurm's KillWait (1s" in m.message for m in cancelled), cancelled[0].message
    who = [e.detail for e in of_kind(msgs, "event") if e.name == "stop_requested" and e.run == session]
    assert len(who) == 1 and "SIGTERM" in who[0] and "KillWait 1s" in who[0], who
    saved = max(int(p.name[5:]) for p in (run_dir / "checkpoints").glob("step_*") if p.name[5:].isdigit())

    # resubmitted once more, it continues from the newest complete checkpoint to the end
    res = shardconsole("resume", str(run_dir), "--slurm", "--set", f"train.steps={saved + 3}",
                       "--set", "train.checkpoint_every=0", env={"GLOO_SOCKET_IFNAME": "lo"}, timeout=60)
    assert res.returncode == 0, res.stderr
    job = _submit(script, env)
    out, err = job.communicate(timeout=180)
    assert job.returncode == 0, err[-3000:]
    msgs = messages(run_dir)
    session = of_kind(msgs, "hello")[-1].run
    assert session.startswith(f"{run_dir.name}-resume-") and {h.run for h in of_kind(msgs, "hello")[-2:]} == {session}
    assert [m.step for m in of_kind(msgs, "step") if m.run == session] == [saved + 1, saved + 2, saved + 3]
    assert [f.run for f in of_kind(msgs, "finished")] == [session]

    res = shardconsole("attach", str(run_dir), "--headless", timeout=60)
    assert res.returncode == 0, res.stderr
    assert f"finished: {saved + 3} steps" in res.stderr


def test_usr1_to_the_batch_shell_asks_every_node_to_stop(tmp_path):
    """Slurm's --signal=B:USR1 reaches the batch shell only: its trap writes the stop request that every
    node's ranks watch (here srun's stand-in waits for that file, as the ranks would)."""
    run_dir = tmp_path / "run"
    res = shardconsole("--preset", "tiny-cpu", "--slurm", "--run-dir", str(run_dir), timeout=60)
    assert res.returncode == 0, res.stderr
    script = tmp_path / "job.sbatch"
    script.write_text(res.stdout)
    waits = f"#!/bin/bash\ntouch {tmp_path}/started\nuntil [ -e {run_dir}/stop_request.json ]; do sleep 0.1; done\n"
    job = _submit(script, _slurm_env(tmp_path, srun=waits))
    deadline = time.monotonic() + 60
    while not (tmp_path / "started").exists():
        assert time.monotonic() < deadline and job.poll() is None, job.communicate()[1]
        time.sleep(0.05)
    job.send_signal(signal.SIGUSR1)
    out, err = job.communicate(timeout=60)
    assert job.returncode == 0, err
    request = json.loads((run_dir / "stop_request.json").read_text())
    assert request["session"] == run_dir.name and "USR1" in request["who"]
    assert [m.detail for m in of_kind(messages(run_dir), "event") if m.name == "stop_requested"] == [request["who"]]


def test_the_nodes_files_read_as_one_stream(tmp_path):
    """Node 1's ranks append to a file of their own (NFS keeps no O_APPEND whole across hosts); the reader
    merges it in by time, keeps each file's order, and holds a torn line until its end arrives."""
    from shardconsole.runlog import protocol as P
    from shardconsole.runlog.runfolder import metrics_file_of_node
    from shardconsole.runlog.stream import MetricsReader, MetricsWriter
    main = tmp_path / "metrics.jsonl"
    assert metrics_file_of_node(0) == main.name
    node1 = tmp_path / metrics_file_of_node(1)
    MetricsWriter(main, "r", 0).emit(P.Hello(run="r", rank=0, t=1.0, world=2))
    reader = MetricsReader(main)
    assert [m.rank for m in reader.poll()] == [0]
    line = P.encode(P.Hello(run="r", rank=1, t=2.0, world=2)) + "\n"
    node1.write_text(line[:10])                                   # half a line: a write still under way
    reader.LOOK_EVERY_S = 0.0
    assert reader.poll() == []
    with open(node1, "a") as fh:
        fh.write(line[10:] + P.encode(P.Failed(run="r", rank=1, t=4.0, cause="stopped")) + "\n")
    w = MetricsWriter(main, "r", 0)
    w.emit(P.Step(run="r", rank=0, t=3.0, step=1))
    w.emit(P.Failed(run="r", rank=0, t=5.0, cause="stopped"))
    assert [(m.kind, m.rank) for m in reader.poll()] == [("hello", 1), ("step", 0), ("failed", 1), ("failed", 0)]
    assert reader.bad_lines == 0
    # a front end on another node appends its samples to its host's file, read with the rest
    from shardconsole.runlog.runfolder import metrics_file_of_host
    MetricsWriter(tmp_path / metrics_file_of_host("node 1"), "r", -1).emit(P.Event(run="r", rank=-1, t=6.0, name="x"))
    assert [(m.kind, m.rank) for m in reader.poll()] == [("event", -1)]


def _my_addresses() -> tuple[set[str], str]:
    """(what this hostname resolves to, a non-loopback address of this machine or "")."""
    import ipaddress

    import psutil
    named = {i[4][0] for i in socket.getaddrinfo(socket.gethostname(), None, proto=socket.IPPROTO_TCP)}
    other = next((a.address for addrs in psutil.net_if_addrs().values() for a in addrs
                  if a.family == socket.AF_INET and not ipaddress.ip_address(a.address).is_loopback
                  and a.address not in named), "")
    return named, other


def test_a_multi_node_launch_that_cannot_meet_is_refused_before_it_starts(tmp_path):
    """Issue 32 item 6, on a machine whose hostname resolves to loopback (Debian's 127.0.1.1 line) and that
    has another address: gloo would bind to loopback; and an endpoint given as that other address is
    hosted by no torchrun agent. Both refused with exit 2 before a run folder exists."""
    import ipaddress
    named, other = _my_addresses()
    if not other or not all(ipaddress.ip_address(a).is_loopback for a in named):
        pytest.skip("needs a hostname that resolves to loopback and another IPv4 address")
    argv = ["--preset", "tiny-cpu", "--headless", "--run-dir", str(tmp_path / "run"), "--set", "parallel.nnodes=2",
            "--set", f"parallel.rdzv_endpoint={other}:29400"]
    env = {k: v for k, v in os.environ.items() if k not in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")}
    res = subprocess.run([sys.executable, "-m", "shardconsole", *argv], capture_output=True, text=True, env=env,
                         timeout=60)
    assert res.returncode == 2 and "GLOO_SOCKET_IFNAME" in res.stderr and "loopback" in res.stderr, res.stderr
    assert "NCCL" not in res.stderr and "Traceback" not in res.stderr      # a gloo run: no NCCL hint
    res = subprocess.run([sys.executable, "-m", "shardconsole", *argv], capture_output=True, text=True,
                         env={**env, "GLOO_SOCKET_IFNAME": "lo"}, timeout=60)
    assert res.returncode == 2 and f"{other} is this machine's address" in res.stderr, res.stderr
    assert f"{socket.gethostname()}:PORT" in res.stderr and not (tmp_path / "run").exists()


def test_a_rank_that_vanished_is_named_with_its_host_and_last_step(tmp_path):
    """A node killed outright writes no end line; its peer's 'Connection reset by peer' is the echo."""
    from shardconsole.runlog import protocol as P
    from shardconsole.runlog.runstate import RunState
    from shardconsole.session.outcome import EXIT_CODES, explain_exit
    state = RunState()
    for msg in [P.Hello(run="r", rank=0, world=2, host="node0"), P.Hello(run="r", rank=1, world=2, host="node1"),
                P.Step(run="r", rank=0, step=36),
                P.Failed(run="r", rank=0, cause="crash", exc_type="DistBackendError",
                         message="[../gloo/transport/tcp/pair.cc:534] Connection reset by peer")]:
        state.apply(msg)
    cause, message = explain_exit(state, 1, tmp_path)
    assert cause == "node_lost" and EXIT_CODES[cause] == 11       # its own class (it was "crash")
    assert message.startswith("run failed (node_lost): rank(s) 1 on node1 (last step seen 36) gone, with no end line; "
                              "rank 0's DistBackendError"), message
    # or the launcher (srun --kill-on-bad-exit, torchrun) ended the survivor first: a stop nobody asked for
    state.failed[:] = [P.Failed(run="r", rank=0, cause="stopped", message="stopped at step 36: a stop signal")]
    cause, message = explain_exit(state, 1, tmp_path)
    assert cause == "node_lost" and message.startswith("run failed (node_lost): rank(s) 1 on node1 (last step seen 36) gone")
    # a rank gone on a node whose other rank reported is a crash of that rank, not a lost node
    state.hellos[1] = P.Hello(run="r", rank=1, world=2, host="node0")
    cause, message = explain_exit(state, 1, tmp_path)
    assert cause == "crash" and message.startswith("run failed (crash): rank(s) 1 on node0"), message


def test_a_gloo_timeout_names_no_nccl_setting(tmp_path):
    import torch.distributed as dist
    from shardconsole.backends.observe.failures import classify
    from shardconsole.backends.rank.knobs import Knobs
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        cause, hint = classify(RuntimeError("[gloo] Timed out waiting 10000ms for recv operation to complete"), Knobs())
    finally:
        dist.destroy_process_group()
    assert cause == "nccl_timeout" and "GLOO_SOCKET_IFNAME" in hint and "NCCL" not in hint


def test_a_rendezvous_nobody_hosts_is_named_while_the_ranks_wait_and_when_the_agent_gives_up(tmp_path):
    """Issue 32 item 6: node 1 started against an endpoint where no agent listens (192.0.2.0/24 is a
    documentation network: nothing answers there). While torchrun's agent retries its store (for
    parallel.rdzv_connect_timeout_s: 15 s here, not torch's 60, and the watch's first look comes at a third
    of it), the front end names the endpoint and who would host it; when the agent gives up, the outcome
    says so."""
    port = _job_id_with_a_free_port() + 20000
    res = shardconsole("--preset", "tiny-cpu", "--headless", "--run-dir", str(tmp_path / "run"),
                       "--set", "parallel.nnodes=2", "--set", "parallel.nproc_per_node=1",
                       "--set", "parallel.rdzv_connect_timeout_s=15",
                       "--set", f"parallel.rdzv_endpoint=192.0.2.77:{port}", env={"GLOO_SOCKET_IFNAME": "lo"},
                       timeout=240)
    note = next((line for line in res.stderr.splitlines() if line.startswith("note: no rank has started")), "")
    assert f"nothing answers at the rendezvous 192.0.2.77:{port}" in note and "nobody hosts it" in note, res.stderr
    assert f"this node ({socket.gethostname()}, which resolves to" in note
    assert res.returncode == 5, res.stderr
    assert f"run failed (rendezvous): the nodes never met: torchrun's agent gave up on the rendezvous at " \
           f"192.0.2.77:{port} before any rank started" in res.stderr
    assert "crash" not in res.stderr and "Traceback" not in res.stderr
