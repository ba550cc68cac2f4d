"""A stop keeps the work or says what it cost (issue 46 item 4): its grace covers a step and a save as the
run measured them (a 125m run on CPU, 7-11 s a step, was SIGKILLed at 10.6 s with 15 steps gone and the
end line said only "stopped"); when it must kill, the end line counts the steps lost since the last
checkpoint."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from shardconsole.runlog import protocol as P
from shardconsole.session.stop import HANG_GRACE_S, _Seen, describe_stop, stop_run
from tests.conftest import messages, of_kind


def _step(step: int, step_s: float) -> P.Step:
    return P.Step(run="r", rank=0, step=step, steps=100, loss=1.0, step_s=step_s)


def test_the_grace_covers_a_measured_step_and_save_capped_by_the_save_timeout():
    seen = _Seen(asked_at=time.time())
    seen.add([_step(1, 11.0), _step(2, 11.0),
              P.SaveProgress(run="r", rank=0, step=2, what="checkpoint", written_bytes=1, total_bytes=1,
                             elapsed_s=4.0, path="x", done=True)])
    assert seen.grace(10.0, 300.0) == pytest.approx(1.5 * 11.0 + 4.0 + 2.0)
    assert seen.grace(10.0, 20.0) == 20.0                  # train.stop_save_timeout_s caps it
    assert seen.grace(HANG_GRACE_S, 300.0) == HANG_GRACE_S  # a hang's ranks are not stepping
    fast = _Seen(asked_at=time.time())
    fast.add([_step(1, 0.1)])
    assert fast.grace(10.0, 300.0) == 10.0                 # never shorter than asked


@pytest.mark.slow
def test_a_stop_that_must_kill_says_how_many_steps_were_lost_since_which_checkpoint(tmp_path):
    """Rank 1 hangs at step 5 (checkpoints every 3 steps): the stop cannot save and kills; its end line
    names the step-3 checkpoint and the one step trained since."""
    from shardconsole.launch.job import Job
    run_dir = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "shardconsole", "--preset", "tiny-cpu", "--headless",
                             "--run-dir", str(run_dir), "--set", "train.steps=50", "--set", "train.log_every=1",
                             "--set", "train.checkpoint_every=3"], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, env={**os.environ, "SHARDCONSOLE_FAULT": "sleep@rank=1,step=5"})
    try:
        deadline = time.monotonic() + 300
        while not (run_dir / "metrics.jsonl").is_file() or not any(
                m.step == 4 for m in of_kind(messages(run_dir), "step")):
            assert proc.poll() is None and time.monotonic() < deadline, "the run never reached step 4"
            time.sleep(0.1)
        hellos = [m.pid for m in of_kind(messages(run_dir), "hello")]
        report = stop_run(Job.from_run_dir(run_dir), hellos, who="test", grace_s=HANG_GRACE_S + 1, check_gpus=False)
    finally:
        proc.kill()
        proc.wait()
    assert report.killed and report.clean
    line = describe_stop(report)
    assert "1 step(s) lost since the checkpoint of step 3" in line and "step_00000003" in line, line


@pytest.mark.slow
def test_runs_shows_the_step_a_stop_saved_at_not_the_last_step_line(tmp_path):
    """Step lines every 1000 steps, a checkpoint every 4: a stop saves at a step no step line named (the
    Slurm pass: `runs` said 230 where the run stopped and saved at 236)."""
    import json
    from tests.conftest import shardconsole, wait_until
    run_dir = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "shardconsole", "--preset", "tiny-cpu", "--headless",
                             "--run-dir", str(run_dir), "--set", "train.steps=100000", "--set", "train.log_every=1000",
                             "--set", "train.checkpoint_every=4", "--set", "train.keep_checkpoints=1"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_until(lambda: (run_dir / "metrics.jsonl").is_file() and any(
            m.name == "checkpoint_saved" for m in of_kind(messages(run_dir), "event")), 300, "a checkpoint")
        res = shardconsole("stop", str(run_dir), timeout=120)
        assert res.returncode == 0, res.stderr[-2000:]
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    msgs = messages(run_dir)
    stopped = [m for m in of_kind(msgs, "failed") if m.cause == "stopped"]
    assert stopped and "saved it" in stopped[0].message, stopped
    saved = max(int(p.name.split("_")[1]) for p in (run_dir / "checkpoints").glob("step_*"))
    assert saved == stopped[0].step and not of_kind(msgs, "step")       # no step line ever said it
    rows = [json.loads(line) for line in shardconsole("runs", "--json", "--runs-root", str(tmp_path)).stdout.splitlines()]
    assert [(r["status"], r["step"], r["steps"]) for r in rows] == [("stopped", saved, 100000)], rows
    table = shardconsole("runs", "--runs-root", str(tmp_path)).stdout
    assert f"{saved}/100000" in table, table


def _start(run_dir, *sets: str, fault: str = "") -> subprocess.Popen:
    env = {**os.environ, **({"SHARDCONSOLE_FAULT": fault} if fault else {})}
    return subprocess.Popen([sys.executable, "-m", "shardconsole", "--preset", "tiny-cpu", "--headless",
                             "--run-dir", str(run_dir), "--set", "train.steps=100000", "--set", "train.log_every=1",
                             *[a for s in sets for a in ("--set", s)]],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)


def _events(run_dir, name: str) -> list:
    return [m for m in of_kind(messages(run_dir), "event") if m.name == name] if (run_dir / "metrics.jsonl").is_file() else []


@pytest.mark.slow
def test_a_stop_during_a_periodic_save_longer_than_the_grace_waits_for_it_and_says_so(tmp_path):
    """The checkpoint of step 4 takes 20 s (slow_save), twice the stop's 10 s grace: the stop waits for
    it to complete (the ranks act on SIGTERM after it), kills nothing, and its end line says what it
    waited for. Issue 64 item 3: it was SIGKILLed mid-save, the save and the steps lost, "run stopped"."""
    from shardconsole.launch.job import Job
    from tests.conftest import wait_until
    run_dir = tmp_path / "run"
    proc = _start(run_dir, "train.checkpoint_every=4", "train.save_on_stop=false", fault="slow_save@step=4,ms=20000")
    try:
        wait_until(lambda: any(m.detail == "saving checkpoint" for m in _events(run_dir, "phase")), 300, "the save")
        hellos = [m.pid for m in of_kind(messages(run_dir), "hello")]
        report = stop_run(Job.from_run_dir(run_dir), hellos, who="test", check_gpus=False)
    finally:
        proc.kill()
        proc.wait()
    line = describe_stop(report)
    assert not report.killed and report.clean, line
    assert "for the checkpoint save under way at step 4" in line, line
    assert (run_dir / "checkpoints" / "step_00000004" / "shardconsole.json").is_file()


@pytest.mark.slow
def test_a_stop_ends_once_the_ranks_saved_though_their_launcher_is_sigstopped(tmp_path):
    """The launcher stopped with SIGSTOP cannot act on SIGTERM: the ranks save on stop and end within
    seconds, and the stop SIGKILLs the launcher then, not after the whole save timeout."""
    import json
    import signal
    from shardconsole.launch.job import Job
    from tests.conftest import wait_until
    run_dir = tmp_path / "run"
    proc = _start(run_dir)
    launcher = 0
    try:
        wait_until(lambda: (run_dir / "metrics.jsonl").is_file() and len(of_kind(messages(run_dir), "step")) >= 2,
                   300, "two steps")
        launcher = json.loads((run_dir / "job.json").read_text())["pid"]
        os.kill(launcher, signal.SIGSTOP)
        hellos = [m.pid for m in of_kind(messages(run_dir), "hello")]
        report = stop_run(Job.from_run_dir(run_dir), hellos, who="test", save_timeout_s=90, check_gpus=False)
    finally:
        if launcher:
            for sig in (signal.SIGKILL, signal.SIGCONT):
                try:
                    os.kill(launcher, sig)
                except ProcessLookupError:
                    pass
        proc.kill()
        proc.wait()
    line = describe_stop(report)
    assert report.clean and _events(run_dir, "checkpoint_saved"), line
    assert report.seconds < 45, line             # the save timeout (90 s) is not waited out
    assert "the ranks were done (their save on stop complete)" in line, line
