"""The run's processes and its folder under faults (issue 22 items 1, 2, 6, 9, 11), with real processes:
a stranger process tree, a launcher killed with SIGKILL, a full tmpfs, another uid."""

from __future__ import annotations

import json
import os
import pwd
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest

from shardconsole.settings import config as C
from shardconsole.runlog import protocol as P
from shardconsole.launch.job import Job
from shardconsole.runlog.runfolder import RunFolder
from shardconsole.session.outcome import classify
from shardconsole.session.rundir import create_run_dir, stream_stopped_note
from shardconsole.session.stop import stop_run
from shardconsole.session.watcher import Watcher
from shardconsole.runlog.stream import MetricsReader
from tests.conftest import messages, of_kind, pids_alive, shardconsole, wait_until as _wait

REPO = Path(__file__).resolve().parent.parent



# ---------------------------------------------------------------------------------------------------
# Item 1: a job.json or hello line pointing at someone else's processes

@pytest.fixture
def stranger():
    """A process tree that is not a run: a parent in a session of its own and its child."""
    code = ("import subprocess, sys, time\n"
            "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)'])\n"
            "time.sleep(300)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
    child = _wait(lambda: psutil.Process(proc.pid).children(), 30, "the stranger's child")[0].pid
    yield proc, child
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    _wait(lambda: not pids_alive([child]), 10, "the stranger's child to end")


def _forged_folder(path: Path, info: dict, hello_pids=()) -> Path:
    create_run_dir(C.build({}), path)
    RunFolder(path).job.write_text(json.dumps(info))
    with open(RunFolder(path).metrics, "a") as fh:
        for r, pid in enumerate(hello_pids):
            fh.write(P.encode(P.Hello(run=path.name, rank=r, world=2, host=socket.gethostname(), pid=pid)) + "\n")
    return path


def test_a_stranger_is_never_signalled(tmp_path, stranger):
    proc, child = stranger
    me = socket.gethostname()
    started = psutil.Process(proc.pid).create_time()
    cmd = psutil.Process(proc.pid).cmdline()
    forged = {
        # a stale job.json after pid reuse: the pid is the stranger's, the recorded start time is not
        "reused": {"pid": proc.pid, "pgid": proc.pid, "argv": cmd, "cmdline": cmd, "host": me,
                   "create_time": started - 3600},
        # start time right, but the command line is not a launcher of this folder
        "other-cmd": {"pid": proc.pid, "pgid": proc.pid, "argv": cmd, "cmdline": cmd, "host": me,
                      "create_time": started},
        # a shared multi-node folder: job.json last written on another node
        "other-host": {"pid": proc.pid, "pgid": proc.pid, "argv": cmd, "host": "node-elsewhere",
                       "create_time": started},
        # an older job.json with no start time
        "no-time": {"pid": proc.pid, "pgid": proc.pid, "argv": cmd, "host": me},
        "pid-1": {"pid": 1, "pgid": 1, "argv": ["init"], "host": me, "create_time": 0.0},
        "own-group": {"pid": os.getpid(), "pgid": os.getpgid(0), "argv": [], "host": me,
                      "create_time": psutil.Process().create_time()},
    }
    whys = {"reused": "reused", "other-cmd": "not this run's launcher", "other-host": "node-elsewhere",
            "no-time": "no start time", "pid-1": "never signalled", "own-group": "this front end"}
    for name, info in forged.items():
        # the stranger's pids also announced as ranks in the stream (hello lines are forgeable too)
        run_dir = _forged_folder(tmp_path / name, info, hello_pids=(proc.pid, child))
        job = Job.from_run_dir(run_dir)
        assert not job.alive(), name
        assert job.processes() == [], name
        # the real stop path, given the stream's hello pids as every front end passes them
        report = stop_run(job, [proc.pid, child], who="test", grace_s=0.5, check_gpus=False)
        assert report.signalled == [] and report.clean, name
        assert whys[name] in report.refused, (name, report.refused)
        assert pids_alive([proc.pid, child]) == [proc.pid, child], f"{name}: the stranger was signalled"
        if name in ("reused", "pid-1"):     # the same through the commands a user types
            res = shardconsole("stop", str(run_dir), timeout=60)
            assert "Traceback" not in res.stderr, res.stderr
            assert pids_alive([proc.pid, child]) == [proc.pid, child], f"{name}: `shardconsole stop` signalled it"
    assert proc.poll() is None


# ---------------------------------------------------------------------------------------------------
# Items 2, 9, 11: one real 2-rank run; its launcher killed with SIGKILL (what the OOM killer does)

@pytest.fixture(scope="module")
def orphaned_run():
    """A real tiny run whose torchrun was SIGKILLed mid-training, leaving its ranks orphaned. A folder
    that other users can traverse (the read-only follower test below runs as another uid)."""
    # outside pytest's basetemp, which pytest keeps at 0700 (another pytest may reset it at any time)
    base = Path(tempfile.mkdtemp(prefix="shardconsole-faults-", dir="/tmp"))
    base.chmod(0o755)
    cfg = C.load(REPO / "presets" / "tiny-cpu.toml", ["train.steps=3000", "train.log_every=1"])
    old = os.umask(0o022)
    try:
        run_dir = create_run_dir(cfg, base / "run")
        job = Job.start(cfg, run_dir, run_dir.name)
    finally:
        os.umask(old)
    try:
        _wait(lambda: len(of_kind(_msgs(run_dir), "step")) >= 2, 120, "two steps")
        listening = _listening(job.processes())
        hellos = [h.pid for h in of_kind(_msgs(run_dir), "hello")]
        os.kill(job.pid, signal.SIGKILL)
        job.proc.wait()
        yield run_dir, job, hellos, listening
    finally:
        for pid in job.processes():
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        shutil.rmtree(base, ignore_errors=True)


def _msgs(run_dir: Path):
    r = MetricsReader(RunFolder(run_dir).metrics)
    try:
        return r.poll()
    finally:
        r.close()


def _listening(pids) -> list[str]:
    """ss lines of TCP sockets listening in those processes."""
    out = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, check=True).stdout
    return [line for line in out.splitlines() if any(re.search(rf"pid={p},", line) for p in pids)]


@pytest.mark.slow
def test_rendezvous_listens_on_loopback_only(orphaned_run):
    """Item 9: torchrun's stores (and gloo's pair sockets) of a one-node run listen on 127.0.0.1 only."""
    _, _, _, listening = orphaned_run
    assert len(listening) >= 2, listening            # at least the rendezvous store and the ranks' store
    local = [line.split()[3] for line in listening]      # State Recv-Q Send-Q Local Peer
    assert all(addr.startswith("127.0.0.1:") for addr in local), listening


@pytest.mark.slow
def test_deepspeed_launcher_rendezvous_listens_on_loopback_only(tmp_path):
    """Item 9, the deepspeed launcher: rank 0 hosts the env:// store itself (loopback_rank.py)."""
    cfg = C.load(REPO / "presets" / "tiny-cpu.toml", ["train.steps=3000", "train.log_every=1",
                                                       "parallel.backend=deepspeed", "parallel.launcher=deepspeed",
                                                       "train.save_final=false"])
    run_dir = create_run_dir(cfg, tmp_path / "run")
    job = Job.start(cfg, run_dir, run_dir.name, env={**os.environ, "DS_ACCELERATOR": "cpu"})
    try:
        _wait(lambda: of_kind(_msgs(run_dir), "step"), 240, "a step")
        listening = _listening(job.processes())
    finally:
        report = stop_run(job, [], who="test", grace_s=0.0, check_gpus=False)
    assert report.clean
    assert len(listening) >= 3, listening           # rank 0's store, and gloo's pairs
    assert all(line.split()[3].startswith("127.0.0.1:") for line in listening), listening


@pytest.mark.slow
def test_killed_launcher_leaves_ranks_that_are_seen_and_stopped(orphaned_run):
    """Item 2: the ranks of a SIGKILLed torchrun train on; a front end (this one, or attach/stop from
    job.json) sees them through the hello pids, says the launcher is gone, and stops every rank."""
    run_dir, job, hellos, _ = orphaned_run
    assert len(hellos) == 2 and sorted(pids_alive(hellos)) == sorted(hellos)    # orphans, still training
    n = len(of_kind(_msgs(run_dir), "step"))
    _wait(lambda: len(of_kind(_msgs(run_dir), "step")) > n, 60, "a step after the launcher died")
    assert job.poll() is None                     # not over while its ranks run
    attached = Job.from_run_dir(run_dir)          # what attach and `shardconsole stop` build
    facts = attached.facts()
    assert facts.launcher == "gone" and facts.orphaned and facts.ranks_alive == sorted(hellos)
    assert attached.alive() and attached.poll() is None
    report = stop_run(attached, [], who="test", grace_s=10.0, check_gpus=False)
    assert report.clean and set(hellos) <= set(report.signalled)
    assert pids_alive(hellos) == []
    assert not attached.alive() and attached.poll() == 0 and job.poll() == -signal.SIGKILL


@pytest.mark.slow
def test_a_follower_of_another_uid_reads_the_run(orphaned_run):
    """Item 11: one permission policy (0o666 and the umask), and `attach --headless` as another user."""
    run_dir, job, hellos, _ = orphaned_run
    folder = RunFolder(run_dir)
    for path in (folder.metrics, folder.preset, folder.job, folder.launcher_log, folder.rank_log(0), folder.rank_log(1)):
        assert path.stat().st_mode & 0o777 == 0o644, path
    _wait(lambda: not pids_alive(hellos + job.processes()), 60, "the run to be stopped (previous test)")
    user = "shardconsole-follower"
    if subprocess.run(["id", user], capture_output=True).returncode != 0:
        subprocess.run(["useradd", "--no-create-home", "--shell", "/usr/sbin/nologin", user], check=True)
    pw = pwd.getpwnam(user)
    env = {"PATH": os.environ["PATH"], "HOME": "/tmp", "PYTHONPATH": str(REPO)}
    res = subprocess.run(["setpriv", f"--reuid={pw.pw_uid}", f"--regid={pw.pw_gid}", "--clear-groups",
                          sys.executable, "-m", "shardconsole", "attach", str(run_dir), "--headless"],
                         capture_output=True, text=True, timeout=120, env=env, cwd="/tmp")
    assert "Traceback" not in res.stderr and "PermissionError" not in res.stderr, res.stderr
    printed = [line for line in res.stdout.splitlines() if line.startswith("step ")]
    steps = of_kind(messages(run_dir), "step")
    assert len(printed) == len({s.step for s in steps}) > 0, res.stdout[-2000:] + res.stderr[-2000:]
    assert folder.metrics.stat().st_uid == 0      # still root's: the follower only read it


# ---------------------------------------------------------------------------------------------------
# Item 6: a full disk

@pytest.fixture
def small_tmpfs(tmp_path):
    mnt = tmp_path / "small"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mnt)], check=True)
    yield mnt
    subprocess.run(["umount", "--lazy", str(mnt)], check=True)


def test_full_disk_is_told_in_the_rank_log_and_explained(small_tmpfs):
    """A rank's stream writes until the filesystem is full: the lines after are dropped and counted, the
    rank's log says why once, and stream_stopped_note explains the end as the outcome will show it."""
    run_dir = small_tmpfs / "run"
    create_run_dir(C.build({}), run_dir)
    folder = RunFolder(run_dir)
    folder.logs.mkdir()
    rank_code = (
        "import sys\n"
        "from shardconsole.runlog import protocol as P\n"
        "from shardconsole.runlog.stream import MetricsWriter\n"
        "print('[rank 1] starting', flush=True)\n"          # a rank's log holds its start-up lines
        f"w = MetricsWriter({str(folder.metrics)!r}, 'run', 1)\n"
        "w.emit(P.Event(run='run', rank=1, name='phase', detail='training'))\n"
        "step = 0\n"
        "while w.dropped < 20:\n"
        "    step += 1\n"
        "    w.emit(P.Step(run='run', rank=1, step=step, steps=10**6, loss=1.0))\n"
        "sys.exit(0 if w.last_error == 'No space left on device' else 3)\n")
    with open(folder.rank_log(1), "ab") as log:
        res = subprocess.run([sys.executable, "-c", rank_code], stdout=log, stderr=log, timeout=60,
                             env={**os.environ, "PYTHONPATH": str(REPO)})
    assert res.returncode == 0
    text = folder.rank_log(1).read_text()
    assert text.count("No space left on device") == 1, text          # said once, not per dropped line
    reader = MetricsReader(folder.metrics)
    written = [m.step for m in reader.poll() if m.kind == "step"]
    reader.close()
    assert written == list(range(1, len(written) + 1)) and reader.bad_lines <= 1   # at most one torn line
    note = stream_stopped_note(run_dir)
    assert note == f"the stream stopped at step {written[-1]}: No space left on device (logs/rank1.log)", note


class _LiveLauncher:
    """A launcher that has not ended (what the watcher is told while the ranks train on)."""
    external = False
    rc_known = False
    pid = 0
    run_dir = None

    def poll(self):
        return None

    def heard(self, hellos):
        pass


def test_a_stream_stopped_by_a_full_disk_is_not_a_hang_and_the_end_says_why(small_tmpfs):
    """The ranks of a run whose disk filled up may train on without a step line reaching the stream: the
    hang watch must not kill them, and the outcome names the full disk (disk_full), not a crash without a report."""
    test_full_disk_is_told_in_the_rank_log_and_explained(small_tmpfs)
    run_dir = small_tmpfs / "run"
    w = Watcher(_LiveLauncher(), run_dir, "run", hang_timeout_s=0.001)
    notes, deadline = [], time.monotonic() + 10
    while time.monotonic() < deadline and not notes:
        notes += w.poll().notes
        assert not w.hung(), "a stream stopped by a full disk was judged a hang"
    notes += w.poll().notes
    assert any("No space left on device" in n and "not judged hung" in n for n in notes), notes
    cause, message = classify(w.state, 0, run_dir)
    assert cause == "disk_full" and "No space left on device" in message and "exit code 0" in message, message
    w.close()
