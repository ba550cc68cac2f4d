"""A run folder has one owner (issue 31 items 1, 2, 3, 6, 11), with real processes: front ends and
launchers killed with SIGKILL, leaving their ranks training; two resumes at once; Ctrl-C in an attach
whose history is over a poll's 8 MiB; ranks killed by SIGSEGV and SIGKILL."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import psutil
import pytest

from shardconsole.runlog import protocol as P
from shardconsole.settings import config as C
from shardconsole.settings import resolve as settings
from shardconsole.session.rundir import create_run_dir
from tests.conftest import messages, of_kind, pids_alive, shardconsole, wait_until as _wait

REPO = Path(__file__).resolve().parent.parent
# A front end as the CLI runs one (cli/run.py after create_run_dir): follows the run, prints its steps.
FRONT_END = ("import sys; from pathlib import Path; from shardconsole.settings import config as C; "
             "from shardconsole import headless; from shardconsole.session.run import RunSession; "
             "d = Path(sys.argv[1]); sys.exit(headless.follow(RunSession.launch(C.load(d / 'preset.toml'), d, d.name)))")



def _folder(tmp: Path, name: str, sets: list[str], pad_bytes: int = 0) -> Path:
    cfg = C.load(REPO / "presets" / "tiny-cpu.toml", ["train.log_every=1", *sets])
    run_dir = create_run_dir(cfg, tmp / name)
    if pad_bytes:
        _pad(run_dir, pad_bytes)
    return run_dir


def _pad(run_dir: Path, total: int) -> None:
    """A long history: event lines of an earlier front end, with a marker past the first 8 MiB."""
    line = P.encode(P.Event(run="earlier", rank=-1, name="note", detail="x" * 900)) + "\n"
    mark = P.encode(P.Event(run="earlier", rank=-1, name="note", detail="mark-past-the-first-poll")) + "\n"
    n = total // len(line)
    with open(run_dir / "metrics.jsonl", "a") as fh:
        for i in range(n):
            fh.write(mark if i == (9 << 20) // len(line) else line)


def _front_end(run_dir: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", FRONT_END, str(run_dir)], stdout=subprocess.DEVNULL,
                            stderr=open(run_dir.parent / f"{run_dir.name}.fe.log", "w"), cwd=REPO)


def _launcher(run_dir: Path) -> int:
    return _wait(lambda: (run_dir / "job.json").is_file() and json.loads((run_dir / "job.json").read_text())["pid"],
                 60, "job.json")


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _clean(run_dir: Path) -> None:
    """Whatever a failing test left: every process naming the folder on its command line."""
    for proc in psutil.process_iter(["pid", "cmdline"]):
        if str(run_dir) in " ".join(proc.info["cmdline"] or []) and proc.pid != os.getpid():
            _kill(proc.pid)


def _ranks(run_dir: Path) -> dict[int, str]:
    """The folder's rank processes, seen independently of the code under test: `-m shardconsole.backends`
    first, --run-dir this folder."""
    out = {}
    for proc in psutil.process_iter(["pid", "cmdline", "status"]):
        cmd = proc.info["cmdline"] or []
        if proc.info["status"] != psutil.STATUS_ZOMBIE and "-m" in cmd and \
                cmd[cmd.index("-m") + 1:cmd.index("-m") + 2] == ["shardconsole.backends"] and \
                str(run_dir) in cmd:
            out[proc.pid] = cmd[cmd.index("--run-id") + 1] if "--run-id" in cmd else ""
    return out


def _steps(run_dir: Path) -> int:
    return (run_dir / "metrics.jsonl").read_text().count('"kind":"step"') if (run_dir / "metrics.jsonl").exists() else 0


# ---------------------------------------------------------------------------------------------------
# One 2-rank run with a long history: attached, orphaned (front end and launcher killed), stopped, resumed

@pytest.fixture(scope="module")
def long_run(tmp_path_factory):
    base = tmp_path_factory.mktemp("owner")
    run_dir = _folder(base, "run", ["train.steps=3000", "train.checkpoint_every=2"], pad_bytes=24 << 20)
    fe = _front_end(run_dir)
    try:
        _wait(lambda: len(_ranks(run_dir)) == 2 and (run_dir / "checkpoints" / "step_00000002").is_dir(),
              180, "two ranks and the step-2 checkpoint")
        yield run_dir, fe
    finally:
        _kill(fe.pid)
        fe.wait()
        _clean(run_dir)


@pytest.mark.slow
def test_ctrl_c_while_the_history_replays_detaches_however_long_it_is(long_run):
    """Item 3: the history (24 MiB, three polls' worth) is what existed when the attach began; a Ctrl-C
    before its end detaches (8) and the run trains on; it is never taken as "stop the run"."""
    run_dir, _ = long_run
    ranks = sorted(_ranks(run_dir))
    attach = subprocess.Popen([sys.executable, "-m", "shardconsole", "attach", str(run_dir), "--headless"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    seen = threading.Event()
    out: list[str] = []

    def read() -> None:
        for line in attach.stdout:
            out.append(line)
            if "mark-past-the-first-poll" in line:
                seen.set()
    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    assert seen.wait(120), "the marker past the first 8 MiB was never printed"
    attach.send_signal(signal.SIGINT)
    err = attach.stderr.read()
    assert attach.wait(60) == 8, err
    reader.join(10)
    assert "Traceback" not in err and "stopping" not in err, err
    assert "detached" in err, err
    assert sorted(_ranks(run_dir)) == ranks          # the run goes on
    assert not any(e.name == "stop_requested" for e in of_kind(messages(run_dir), "event"))


@pytest.mark.slow
def test_resume_over_orphaned_ranks_is_refused_naming_them(long_run):
    """Item 1: kill -9 the front end, then the launcher: the ranks train on. resume refuses, naming
    the ranks and `shardconsole stop`; nothing new is launched."""
    run_dir, fe = long_run
    launcher = _launcher(run_dir)
    _kill(fe.pid)
    fe.wait()
    _kill(launcher)
    _wait(lambda: not pids_alive([launcher]), 30, "the launcher to die")
    orphans = sorted(_ranks(run_dir))
    assert len(orphans) == 2
    n = _steps(run_dir)
    _wait(lambda: _steps(run_dir) > n, 60, "a step of the orphans")
    job_before = (run_dir / "job.json").read_text()
    res = shardconsole("resume", str(run_dir), "--set", "train.steps=4000", timeout=90)
    assert res.returncode == 2, res.stderr
    assert len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert all(str(p) in res.stderr for p in orphans) and f"shardconsole stop {run_dir}" in res.stderr, res.stderr
    assert (run_dir / "job.json").read_text() == job_before        # no second launch
    assert sorted(_ranks(run_dir)) == orphans


@pytest.mark.slow
def test_two_resumes_at_once_one_runs_the_other_is_refused(long_run):
    """Items 1 and 2: `shardconsole stop` ends the orphans (found by their command lines); then two
    resumes started together: exactly one launches, the other is refused in one line (the folder's
    owner lock), and the one that ran finished from the newest checkpoint."""
    run_dir, _ = long_run
    orphans = sorted(_ranks(run_dir))
    res = shardconsole("stop", str(run_dir), timeout=120)
    assert res.returncode == 0, res.stderr
    assert f"{len(orphans)} rank(s)" in res.stderr and "none left" in res.stderr, res.stderr
    assert pids_alive(orphans) == [] and _ranks(run_dir) == {}
    newest = max(int(p.name[5:]) for p in (run_dir / "checkpoints").iterdir() if p.name[5:].isdigit())
    cmd = [sys.executable, "-m", "shardconsole", "resume", str(run_dir), "--set", f"train.steps={newest + 2}"]
    errs = [run_dir.parent / f"resume{i}.err" for i in range(2)]
    both = [subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=open(e, "w")) for e in errs]
    results = [(p.wait(180), e.read_text()) for p, e in zip(both, errs)]
    codes = sorted(rc for rc, _ in results)
    assert codes == [0, 2], results
    refused = next(err for rc, err in results if rc == 2)
    assert "in use by" in refused and "Traceback" not in refused, refused
    msgs = messages(run_dir)
    sessions = {h.run for h in of_kind(msgs, "hello") if "-resume-" in h.run}
    assert len(sessions) == 1, sessions
    assert [f.steps for f in of_kind(msgs, "finished") if f.run in sessions] == [newest + 2]


# ---------------------------------------------------------------------------------------------------
# Orphans before their hello line; a run whose every process was SIGKILLed

@pytest.mark.slow
def test_stop_finds_ranks_that_have_not_said_hello(tmp_path):
    """Item 1, another orphaning order: front end and launcher SIGKILLed as soon as the ranks exist
    (before any hello line): `shardconsole stop` still finds them by their command lines."""
    run_dir = _folder(tmp_path, "early", ["parallel.nproc_per_node=1"])
    fe = _front_end(run_dir)
    try:
        ranks = _wait(lambda: sorted(_ranks(run_dir)), 120, "the rank process")
        _kill(fe.pid)
        _kill(_launcher(run_dir))
        fe.wait()
        res = shardconsole("stop", str(run_dir), timeout=120)
        assert res.returncode == 0, res.stderr
        assert pids_alive(ranks) == [] and _ranks(run_dir) == {}, res.stderr
    finally:
        _clean(run_dir)


@pytest.mark.slow
def test_a_run_killed_whole_is_said_as_killed_not_exit_code_0(tmp_path):
    """Item 11: front end, launcher and rank all SIGKILLed: `stop` and `runs` say the launcher is gone
    without a report (killed), not "exit code 0" / "exit code None"."""
    run_dir = _folder(tmp_path, "whole", ["parallel.nproc_per_node=1"])
    fe = _front_end(run_dir)
    try:
        ranks = _wait(lambda: sorted(_ranks(run_dir)), 120, "the rank process")
        launcher = _launcher(run_dir)
        for pid in (fe.pid, launcher, *ranks):
            _kill(pid)
        fe.wait()
        _wait(lambda: not pids_alive([launcher, *ranks]), 30, "every process to die")
        res = shardconsole("stop", str(run_dir), timeout=60)
        assert res.returncode == 0 and "nothing to stop" in res.stderr, res.stderr
        assert "exit code 0" not in res.stderr and f"launcher (pid {launcher}) is gone" in res.stderr, res.stderr
        assert "killed" in res.stderr and "host_oom" not in res.stderr, res.stderr
        listed = shardconsole("runs", "--runs-root", str(tmp_path), timeout=60)
        assert "exit code None" not in listed.stdout + listed.stderr, listed.stdout
    finally:
        _clean(run_dir)


# ---------------------------------------------------------------------------------------------------
# Item 6: a rank's death by a signal, named by its signal (a SIGKILL without a recorded OOM kill:
# tests/test_failures.py)

def _headless_with_killed_rank(run_dir: Path, sig: int) -> tuple[int, str]:
    proc = subprocess.Popen([sys.executable, "-c", FRONT_END, str(run_dir)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    try:
        _wait(lambda: _steps(run_dir) >= 1 and len(of_kind(messages(run_dir), "hello")) == 2, 180,
              "two ranks training")
        os.kill(max(h.pid for h in of_kind(messages(run_dir), "hello")), sig)
        _, err = proc.communicate(timeout=120)
        return proc.returncode, err
    finally:
        _kill(proc.pid)
        _clean(run_dir)


@pytest.mark.slow
def test_a_rank_dying_of_sigsegv_is_a_crash_named_by_its_signal(tmp_path):
    run_dir = _folder(tmp_path, "segv", ["train.steps=3000"])
    rc, err = _headless_with_killed_rank(run_dir, signal.SIGSEGV)
    assert rc == 1, err
    assert "SIGSEGV" in err and "run stopped" not in err, err


# ---------------------------------------------------------------------------------------------------
# Issue 29 item 2: the console starts a run as the CLI does

@pytest.mark.slow
def test_a_console_started_run_folder_is_made_as_the_clis(tmp_path, monkeypatch):
    """TorchrunLauncher.start goes through RunSession.start and create_run_dir: preset.toml holds absolute paths (data.path
    given relative), a planned name taken meanwhile gets the next suffix, and the folder is claimed (a
    CLI launch naming it is refused)."""
    from shardconsole.console.services import TorchrunLauncher
    from shardconsole.session.rundir import RunDirError
    from shardconsole.session.stop import Hurry
    monkeypatch.chdir(tmp_path)
    (tmp_path / "corpus.jsonl").write_text("".join(json.dumps({"text": f"record {i}"}) + "\n" for i in range(8)))
    resolved = settings.resolve(str(REPO / "presets" / "tiny-cpu.toml"), ["data.path=corpus.jsonl", "train.steps=2000"])
    cfg = resolved.cfg
    launcher = TorchrunLauncher(tmp_path / "runs")
    planned = launcher.plan(cfg, "tiny-cpu")
    create_run_dir(cfg, planned.run_dir)            # a CLI launch took the planned name meanwhile
    session = launcher.start(resolved, planned)
    try:
        assert session.run_dir == planned.run_dir.with_name(planned.run_dir.name + "-2")
        saved = C.load(session.run_dir / "preset.toml")
        assert saved.data.path == str(tmp_path / "corpus.jsonl")
        assert session.settings.data.path == saved.data.path     # what the session holds is what the ranks read
        with pytest.raises(RunDirError, match="folder exists and holds a run"):
            create_run_dir(cfg, session.run_dir)
    finally:
        report = session.stop("test", grace_s=0.0, hurry=Hurry())
    assert report.clean


def test_the_consoles_resume_is_refused_while_another_process_owns_the_folder(tmp_path):
    """Item 2, the console's side: a folder owned by another process (a resume preparing, a launcher)
    is refused in one line naming the holder, before anything is read or written."""
    from shardconsole.console.services import TorchrunLauncher
    run_dir = _folder(tmp_path, "owned", [])
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from pathlib import Path; "
                               "from shardconsole.launch.owner import take_owner; "
                               "take_owner(Path(sys.argv[1]), 'a test holder'); print('held', flush=True); "
                               "time.sleep(600)", str(run_dir)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        preset = (run_dir / "preset.toml").read_text()
        with pytest.raises(C.ConfigError, match=f"in use by a test holder \\(pid {holder.pid}\\)"):
            TorchrunLauncher(tmp_path).resume(run_dir)
        assert (run_dir / "preset.toml").read_text() == preset and not (run_dir / "preset.toml.prev").exists()
    finally:
        holder.kill()
        holder.wait()
    with pytest.raises(C.ConfigError, match="no checkpoint"):       # the holder gone, the folder is free
        TorchrunLauncher(tmp_path).resume(run_dir)
