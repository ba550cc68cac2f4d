"""Issue 65 item 11: what a Slurm run says when its nodes go, by what is known.

- node_lost points to `resume RUN --slurm` (a plain `resume` refuses a run of several nodes);
- every rank of every node gone at once (no end line from anyone) is named at once by attach, runs and
  stop (attach waited 120 s and said 'run hung', runs 'unknown', stop 420 s);
- Slurm's SIGTERM is worded by what `scontrol show job` says (it was 'scancel or the time limit' for a
  failed node and a requeue too);
- after a stop that saved, the job's output ends with our line, not torchrun's FAILED report.

The two nodes are tests/test_cluster.py's: srun and scontrol stand-ins on PATH, two real torchrun agents."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

from shardconsole.runlog import protocol as P
from shardconsole.runlog.runstate import RunState
from shardconsole.session import cluster
from shardconsole.session.outcome import explain_exit
from tests.conftest import of_kind, messages, shardconsole, wait_for_steps, wait_until
from tests.test_cluster import _slurm_env, _submit


def _two_node_script(tmp_path):
    run_dir = tmp_path / "run"
    res = shardconsole("--preset", "tiny-cpu", "--slurm", "--run-dir", str(run_dir), "--set", "parallel.nnodes=2",
                       "--set", "parallel.nproc_per_node=1", "--set", "train.steps=100000", "--set", "train.log_every=1",
                       "--set", "fsdp.sharding=hybrid_shard", env={"GLOO_SOCKET_IFNAME": "lo"}, timeout=60)
    assert res.returncode == 0, res.stderr
    script = tmp_path / "job.sbatch"
    script.write_text(res.stdout)
    return run_dir, script


def test_a_lost_node_of_a_slurm_run_points_to_resume_slurm(tmp_path):
    run_dir, _ = _two_node_script(tmp_path)
    state = RunState()
    for msg in [P.Hello(run="r", rank=0, world=2, host="node0"), P.Hello(run="r", rank=1, world=2, host="node1"),
                P.Step(run="r", rank=0, step=36),
                P.Failed(run="r", rank=0, cause="crash", exc_type="DistBackendError",
                         message="[../gloo/transport/tcp/pair.cc:534] Connection reset by peer")]:
        state.apply(msg)
    cause, message = explain_exit(state, 1, run_dir)
    assert cause == "node_lost" and "`shardconsole resume` continues" not in message, message
    assert f"`shardconsole resume {run_dir} --slurm` writes it again continues" in message, message
    # a folder whose settings do not read: the hosts alone say several nodes
    cause, message = explain_exit(state, 1, tmp_path / "elsewhere")
    assert cause == "node_lost" and "--slurm" in message and "--print-command" in message, message


def test_slurms_sigterm_is_worded_by_what_scontrol_says(tmp_path, monkeypatch):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    scontrol = bin_dir / "scontrol"
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    who = "Slurm (SIGTERM to job 812; KillWait 30s)"
    for said, words in (("JobId=812 JobState=NODE_FAIL Reason=NodeDown", "a failed node"),
                        ("JobId=812 JobState=TIMEOUT Reason=TimeLimit", "its time limit"),
                        ("JobId=812 JobState=REQUEUED Reason=BeginTime", "a requeue"),
                        ("JobId=812 JobState=CANCELLED Reason=None", "scancel"),
                        ("", "Slurm did not say why: a scancel, the time limit, a requeue or a failed node")):
        scontrol.write_text(f"#!/bin/bash\necho '{said}'\n")
        scontrol.chmod(0o755)
        assert cluster.sigterm_words(who, "812") == f"Slurm (SIGTERM to job 812: {words}; KillWait 30s)"
    assert cluster.sigterm_words("Slurm (USR1 to job 812)", "812") == "Slurm (USR1 to job 812)"
    (tmp_path / "x").mkdir()
    script = _two_node_script(tmp_path / "x")[1].read_text()
    assert "scancel or the time limit" not in script and "SIGTERM to job $SLURM_JOB_ID; KillWait" in script


def _rank_pids(run_dir) -> list[int]:
    session = of_kind(messages(run_dir), "hello")[-1].run
    return [h.pid for h in of_kind(messages(run_dir), "hello") if h.run == session]


def test_a_saved_stop_ends_the_output_with_our_line_and_nodes_lost_at_once_are_named(tmp_path):
    run_dir, script = _two_node_script(tmp_path)
    env = _slurm_env(tmp_path)
    job = _submit(script, env)
    wait_for_steps(run_dir, 2, 120, job)
    stop = shardconsole("stop", str(run_dir), timeout=120)
    assert stop.returncode == 0, stop.stderr
    out, err = job.communicate(timeout=60)
    assert job.returncode == 0, err[-2000:]
    last = out.strip().splitlines()[-1]
    assert last.startswith(f"shardconsole: run {run_dir} stopped as asked at step ") and "every rank saved" in last, out

    # resubmitted, then every process of the job SIGKILLed at once: no rank writes a line
    job = _submit(script, env)
    wait_until(lambda: len({m.step for m in of_kind(messages(run_dir), "step")
                            if m.run.startswith(f"{run_dir.name}-resume-")}) >= 2, 120, "two resumed steps", every_s=0.5)
    pids = _rank_pids(run_dir)
    os.killpg(job.pid, signal.SIGKILL)          # the batch shell, srun's stand-in and the agents
    for pid in pids:                            # the ranks (torchrun starts each in a session of its own)
        os.kill(pid, signal.SIGKILL)
    job.communicate(timeout=60)
    wait_until(lambda: not any(_alive(p) for p in pids), 30, "the ranks gone")
    t0 = time.monotonic()
    attach = shardconsole("attach", str(run_dir), "--headless", timeout=100)
    assert attach.returncode == 11, attach.stderr[-2000:]            # node_lost; it was 5 (hung) after 120 s
    assert time.monotonic() - t0 < 60
    assert "run failed (node_lost): every rank gone at once with no end line" in attach.stderr, attach.stderr[-2000:]
    assert f"`shardconsole resume {run_dir} --slurm`" in attach.stderr
    res = shardconsole("runs", "--runs-root", str(run_dir.parent), "--json", str(run_dir), timeout=60)
    row = json.loads(res.stdout.splitlines()[0])
    assert row["status"] == "failed" and row["cause"] == "node_lost", row       # it was 'unknown'
    t0 = time.monotonic()
    stop = shardconsole("stop", str(run_dir), timeout=100)
    assert stop.returncode == 0 and time.monotonic() - t0 < 60, stop.stderr     # it waited 420 s
    assert "nothing to stop: run failed (node_lost): every rank gone at once" in stop.stderr, stop.stderr
    assert not (run_dir / "stop_request.json").exists()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split(") ")[-1][0] != "Z"
    except OSError:
        return False


def test_the_script_still_runs_its_helpers(tmp_path):
    """The `saved` helper of a session with no saved stop says nothing and exits 1 (the job keeps its code)."""
    res = subprocess.run([sys.executable, "-m", "shardconsole.session.cluster", "saved", str(tmp_path), "x"],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 1 and res.stdout == ""


def _written_elsewhere(tmp_path, hosts: list[str], hang_s: int):
    """A Slurm run folder whose stream says two ranks on `hosts` trained two steps and then fell silent;
    a host named "" is this one, its rank a process that has exited."""
    from shardconsole.launch.process_identity import this_host
    from shardconsole.runlog.stream import MetricsWriter
    run_dir = tmp_path / "run"
    res = shardconsole("--preset", "tiny-cpu", "--slurm", "--run-dir", str(run_dir), "--set", "parallel.nnodes=2",
                       "--set", "parallel.nproc_per_node=1", "--set", f"train.hang_timeout_s={hang_s}",
                       env={"GLOO_SOCKET_IFNAME": "lo"}, timeout=60)
    assert res.returncode == 0, res.stderr
    gone_pid = subprocess.Popen(["true"])
    gone_pid.wait()
    run, now = run_dir.name, time.time()
    for rank, host in enumerate(hosts):
        w = MetricsWriter(run_dir / ("metrics.jsonl" if rank == 0 else f"metrics.node{rank}.jsonl"), run, rank)
        w.emit(P.Hello(run=run, rank=rank, world=2, host=host or this_host(), pid=gone_pid.pid if not host else 4242,
                       t=now - 5))
        w.emit(P.Event(run=run, rank=rank, name="phase", detail="training", t=now - 4))
        for step in (1, 2):
            w.emit(P.Step(run=run, rank=rank, step=step, steps=100, step_s=0.1, t=now - 4 + step))
        w.close()
    return run_dir


def test_a_node_here_gone_and_one_elsewhere_silent_are_nodes_lost_together(tmp_path):
    """The real cluster's case (hosts differ): this host's rank is gone by its pid, the other host's has
    written nothing for 20 s: named lost, well before the hang limit (60 s here)."""
    run_dir = _written_elsewhere(tmp_path, ["", "node9"], hang_s=60)
    t0 = time.monotonic()
    attach = shardconsole("attach", str(run_dir), "--headless", timeout=120)
    assert attach.returncode == 11 and time.monotonic() - t0 < 55, attach.stderr[-2000:]
    assert "every rank gone at once with no end line (rank(s) 0 on " in attach.stderr
    assert "rank(s) 1 on node9; last step seen 2)" in attach.stderr, attach.stderr[-2000:]


def test_silent_ranks_none_of_which_runs_here_are_a_hang_that_names_the_lost_nodes_case(tmp_path):
    run_dir = _written_elsewhere(tmp_path, ["node8", "node9"], hang_s=3)
    attach = shardconsole("attach", str(run_dir), "--headless", timeout=120)
    assert attach.returncode == 5, attach.stderr[-2000:]
    assert "no rank of it runs on this host to check: if its nodes were lost at once" in attach.stderr
