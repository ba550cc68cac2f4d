"""The smaller cases of issue 46's adversarial pass (item 5), each with real processes: a resume whose
checkpoint folder turned read-only, a resume that changes what the checkpoint's tensors were made with,
a 255-character run folder name, a stop of another user's run, SIGHUP to attach in its first moments."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shardconsole.runlog.runfolder import RunFolder
from shardconsole.session.stop import not_yours
from tests.conftest import live_tiny_run, messages, of_kind, shardconsole


def run(run_dir: Path, *sets: str) -> subprocess.CompletedProcess:
    return shardconsole("--preset", "tiny-cpu", "--headless", "--run-dir", str(run_dir),
                        *[a for s in sets for a in ("--set", s)], timeout=600)


@pytest.fixture
def tmpfs(tmp_path):
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(mnt)], check=True)
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "--lazy", str(mnt)], check=True)


def one_line(res: subprocess.CompletedProcess) -> str:
    lines = [x for x in res.stderr.splitlines() if x.strip()]
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stdout[-2000:] + res.stderr[-2000:]
    return lines[-1]


@pytest.mark.slow
def test_resume_into_a_checkpoint_folder_made_read_only_is_refused_before_launch(tmp_path, tmpfs):
    run_dir, ckpt = tmp_path / "run", tmpfs / "ckpt"
    res = run(run_dir, "train.steps=2", f"train.checkpoint_dir={ckpt}")
    assert res.returncode == 0, res.stderr[-2000:]
    subprocess.run(["mount", "-o", "remount,ro", str(tmpfs)], check=True)
    preset = RunFolder(run_dir).preset.read_text()
    res = shardconsole("resume", str(run_dir), "--set", "train.steps=4", timeout=120)
    line = one_line(res)
    assert "checkpoint_dir" in line and "Read-only file system" in line, line
    assert RunFolder(run_dir).preset.read_text() == preset          # nothing written, nothing launched
    assert max(m.step for m in of_kind(messages(run_dir), "step")) == 2


@pytest.mark.slow
def test_a_resume_that_changes_what_the_tensors_were_made_with_names_the_setting(tmp_path):
    run_dir = tmp_path / "run"
    res = run(run_dir, "train.steps=2")
    assert res.returncode == 0, res.stderr[-2000:]
    for override, key in (("train.method=lora", "train"), ("parallel.backend=deepspeed", "parallel")):
        line = one_line(shardconsole("resume", str(run_dir), "--set", "train.steps=4", "--set", override, timeout=120))
        table_key = override.split("=")[0]
        assert f"--set {table_key}" in line and "checkpoints were saved with" in line, line
    assert max(m.step for m in of_kind(messages(run_dir), "step")) == 2


def test_a_run_folder_name_too_long_for_the_launcher_is_refused_in_one_line(tmp_path):
    for mode in ("--headless", "--print-command"):
        res = shardconsole("--preset", "tiny-cpu", mode, "--run-dir", str(tmp_path / ("r" * 255)), timeout=120)
        line = one_line(res)
        assert "255" in line and "at most 180" in line, line
    assert not any(tmp_path.iterdir())


def test_a_stop_of_another_users_run_says_not_your_run():
    """A process of uid 65534 (setpriv): a user who is not its owner is told whose it is, instead of
    signals that fail and a report of processes "still alive after SIGKILL"."""
    proc = subprocess.Popen(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "sleep", "60"])
    try:
        deadline = time.monotonic() + 30
        import psutil
        while psutil.Process(proc.pid).uids().real != 65534:          # setpriv has exec'd sleep
            assert time.monotonic() < deadline
            time.sleep(0.01)
        said = not_yours([proc.pid], uid=1000)
        assert f"pid {proc.pid} runs as user" in said, said
        assert not_yours([proc.pid], uid=65534) == "" and not_yours([proc.pid], uid=0) == ""
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.slow
def test_shardconsole_stop_by_another_user_says_not_your_run():
    """`shardconsole stop` run as uid 65534 on root's running run: one line naming the owner, exit 2, and
    the run goes on (it reported processes "still alive after SIGKILL")."""
    import shutil
    import tempfile
    shared = Path(tempfile.mkdtemp(prefix="shardconsole-shared-", dir="/tmp"))   # pytest's tmp is root's alone
    shared.chmod(0o755)
    run_dir = shared / "run"
    try:
        with live_tiny_run(run_dir) as runner:
            res = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable,
                                  "-m", "shardconsole", "stop", str(run_dir)], capture_output=True, text=True,
                                 timeout=120, env={**os.environ, "HOME": str(shared)}, cwd=shared)
            line = one_line(res)
            assert "not your run" in line and "runs as user root" in line, line
            assert runner.poll() is None          # nothing was signalled
            assert shardconsole("stop", str(run_dir), timeout=120).returncode == 0
    finally:
        shutil.rmtree(shared, ignore_errors=True)


def _catches(pid: int, sig: int) -> bool:
    """Whether process pid has a handler for sig (the SigCgt mask of /proc/PID/status)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    mask = next((int(line.split()[1], 16) for line in status.splitlines() if line.startswith("SigCgt:")), 0)
    return bool(mask >> (int(sig) - 1) & 1)


@pytest.mark.slow
def test_sighup_to_attach_in_its_first_moments_is_a_detach(tmp_path):
    """SIGHUP before attach follows (its imports, its replay) exits 8, the run going on; it was 129."""
    run_dir = tmp_path / "run"
    with live_tiny_run(run_dir) as runner:
        for delay in (0.0, 0.15, 0.45):
            attach = subprocess.Popen([sys.executable, "-m", "shardconsole", "attach", str(run_dir), "--headless"],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            # From the moment its first line of Python has run (the handler is in cli/__init__.py): before
            # that the interpreter itself is starting, which no program catches, and on a loaded machine
            # that start-up alone can outlast a fixed delay.
            caught_by = time.monotonic() + 60
            while not _catches(attach.pid, signal.SIGHUP):
                assert attach.poll() is None, attach.communicate()[1][-2000:]
                assert time.monotonic() < caught_by, "attach never set a SIGHUP handler"
                time.sleep(0.005)
            time.sleep(delay)
            attach.send_signal(signal.SIGHUP)
            _, err = attach.communicate(timeout=60)
            assert attach.returncode == 8, (delay, attach.returncode, err[-2000:])
        assert runner.poll() is None          # the run went on


@pytest.mark.slow
def test_attach_of_a_copied_finished_folder_says_finished(tmp_path):
    """The copy's name is not the run id its lines carry: they are still its run's (it said "killed or
    crashed", exit 1)."""
    import shutil
    run_dir = tmp_path / "run"
    res = run(run_dir, "train.steps=2")
    assert res.returncode == 0, res.stderr[-2000:]
    copy = tmp_path / "copy-of-the-run"
    shutil.copytree(run_dir, copy, symlinks=True)
    res = shardconsole("attach", str(copy), "--headless", timeout=120)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    assert "finished: 2 steps" in res.stdout + res.stderr and "crashed" not in res.stdout + res.stderr


@pytest.mark.slow
def test_a_stopped_launcher_does_not_hang_the_front_end_after_the_run_ended(tmp_path):
    """SIGSTOP to torchrun: the ranks finish without it; the front end ends with them, saying so (it
    waited for the launcher until SIGCONT)."""
    import json
    run_dir = tmp_path / "run"
    front = subprocess.Popen([sys.executable, "-m", "shardconsole", "--preset", "tiny-cpu", "--headless",
                              "--run-dir", str(run_dir), "--set", "train.steps=40", "--set", "train.log_every=1"],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    launcher = 0
    try:
        deadline = time.monotonic() + 300
        while not (run_dir / "metrics.jsonl").is_file() or not of_kind(messages(run_dir), "step"):
            assert front.poll() is None and time.monotonic() < deadline, "the run never stepped"
            time.sleep(0.1)
        launcher = json.loads((run_dir / "job.json").read_text())["pid"]
        os.kill(launcher, signal.SIGSTOP)
        out, _ = front.communicate(timeout=180)
    finally:
        if launcher:
            os.kill(launcher, signal.SIGCONT)
        if front.poll() is None:
            front.kill()
            front.wait()
    assert front.returncode == 0, out[-3000:]
    assert "finished: 40 steps" in out and f"launcher (pid {launcher}) is stopped" in out, out[-3000:]


@pytest.mark.slow
def test_a_run_folder_on_a_full_disk_is_refused_before_launch_and_resume(tmp_path, tmpfs):
    """The ranks stop a run whose stream's disk has under 64 KiB free (stream_health): a launch or a resume
    into such a run folder is refused before any rank starts, as an unwritable one is (it launched, trained
    a step and stopped with disk_full)."""
    run_dir, ckpt = tmpfs / "run", tmp_path / "ckpt"
    res = run(run_dir, "train.steps=2", f"train.checkpoint_dir={ckpt}")
    assert res.returncode == 0, res.stderr[-2000:]
    subprocess.run(["dd", "if=/dev/zero", f"of={tmpfs / 'fill'}", "bs=64k"], capture_output=True)   # to ENOSPC
    stream = (run_dir / "metrics.jsonl").read_text()
    line = one_line(shardconsole("resume", str(run_dir), "--set", "train.steps=4", timeout=120))
    assert f"run folder {run_dir}" in line and "KiB free, under the 64 KiB the stream needs" in line, line
    line = one_line(run(tmpfs / "new", "train.steps=2", f"train.checkpoint_dir={tmp_path / 'ckpt2'}"))
    assert f"--run-dir {tmpfs / 'new'}" in line and "KiB free" in line, line
    assert (run_dir / "metrics.jsonl").read_text() == stream and not (tmpfs / "new").exists()
