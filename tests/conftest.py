"""Shared fixtures. Runs that launch real ranks are marked `slow`; they use the tiny model on CPU."""

from __future__ import annotations

import contextlib
import heapq
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest

from shardconsole.launch.job import _group_pids
from shardconsole.runlog.protocol import decode
from shardconsole.runlog.runfolder import node_metrics_files

# A suite started as a background job (`pytest &`, nohup, some CI runners) inherits SIGINT ignored, and
# an ignored signal stays ignored across exec: every front end a test starts would then ignore the
# Ctrl-C the tests send it. Restore the default here, so children start as from a terminal.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

REPO = Path(__file__).resolve().parent.parent


def pytest_report_header(config) -> str:
    """The combination matrix's seed (tests/test_combinations.py), so a CI log names the sample it ran."""
    from tests.combinations import SEED, SEED_ENV
    return f"combination matrix: {SEED_ENV}={SEED}"


@pytest.fixture(autouse=True)
def _user_presets(tmp_path_factory, monkeypatch):
    """Never read or write the real user's presets folder."""
    d = tmp_path_factory.mktemp("user-presets")
    monkeypatch.setenv("SHARDCONSOLE_PRESETS_DIR", str(d))
    return d


@pytest.fixture(autouse=True)
def _runs_root(tmp_path_factory, monkeypatch):
    """Runs started without --run-dir go to a temporary runs root, never the user's."""
    d = tmp_path_factory.mktemp("runs-root")
    monkeypatch.setenv("SHARDCONSOLE_RUNS_ROOT", str(d))
    return d


@pytest.fixture(autouse=True)
def _speeds_file(tmp_path_factory, monkeypatch):
    """Measured speeds (plan/speed/book.py) go to a temporary file, never the user's data folder."""
    f = tmp_path_factory.mktemp("speeds") / "speeds.jsonl"
    monkeypatch.setenv("SHARDCONSOLE_SPEEDS_FILE", str(f))
    return f


@pytest.fixture(autouse=True)
def _token_cache(tmp_path_factory, monkeypatch):
    """Token caches of test runs go to a temporary folder, never the user's cache (one per session:
    tests that read the same file share its cache, as ranks of one machine do)."""
    monkeypatch.setenv("SHARDCONSOLE_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "token-cache"))


def _end_processes_naming(folder: Path) -> None:
    """SIGKILL to every process whose command line names `folder` (this process excepted)."""
    import psutil
    for proc in psutil.process_iter(["pid", "cmdline"]):
        if proc.pid != os.getpid() and str(folder) in " ".join(proc.info["cmdline"] or []):
            try:
                proc.kill()
            except psutil.Error:
                pass


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A test that fails while its run goes on (a stop test's `communicate` timing out on a loaded box)
    left that run training (train.steps=100000) through the rest of the suite, on the suite's 2 cores:
    the processes naming the failed test's tmp_path end with it. Passing tests pay nothing."""
    outcome = yield
    tmp = getattr(item, "funcargs", {}).get("tmp_path")
    if call.when == "call" and tmp is not None and outcome.get_result().failed:
        _end_processes_naming(tmp)


def shardconsole(*args: str, timeout: float = 180, env: dict | None = None, cwd: Path | None = None
                 ) -> subprocess.CompletedProcess:
    """Run the real CLI in a subprocess, as a user would."""
    full_env = {**os.environ, **(env or {})}
    return subprocess.run([sys.executable, "-m", "shardconsole", *args], capture_output=True, text=True,
                          timeout=timeout, env=full_env, cwd=cwd)


def in_terminal(*args: str, columns: int = 80, rc: int = 0, timeout: float = 120) -> list[str]:
    """Run the real CLI with its stdout on a real terminal (a pty of `columns` x 24, as a user's window);
    the lines it showed there, once it exited with `rc`."""
    import fcntl
    import pty
    import struct
    import termios
    main, sub = pty.openpty()
    fcntl.ioctl(sub, termios.TIOCSWINSZ, struct.pack("HHHH", 24, columns, 0, 0))
    proc = subprocess.Popen([sys.executable, "-m", "shardconsole", *args], stdout=sub, stderr=subprocess.DEVNULL,
                            env={**os.environ, "COLUMNS": "", "LINES": ""})
    os.close(sub)
    chunks = []
    while True:
        try:
            chunk = os.read(main, 4096)
        except OSError:        # EIO: the command ended and closed its end of the terminal
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(main)
    assert proc.wait(timeout=timeout) == rc, b"".join(chunks)[-2000:]
    return b"".join(chunks).decode().replace("\r\n", "\n").split("\n")


FINISHED_RUN_TIMEOUT = 900      # a cold machine builds DeepSpeed's ops inside its first DeepSpeed run


def _finished_run(tmp_path_factory, name: str, *sets: str) -> SimpleNamespace:
    """A tiny-cpu run to its end through the headless front end: its folder (`run`) and the front end's
    CompletedProcess (`res`); each test asserts on them itself. A session fixture is made before the
    function-scoped ones above, so the run is given their temporary folders itself."""
    base = tmp_path_factory.mktemp(name)
    env = {"SHARDCONSOLE_PRESETS_DIR": str(base / "user-presets"), "SHARDCONSOLE_RUNS_ROOT": str(base / "runs-root"),
           "SHARDCONSOLE_SPEEDS_FILE": str(base / "speeds.jsonl"),
           "SHARDCONSOLE_CACHE_DIR": str(tmp_path_factory.getbasetemp() / "token-cache")}
    run_dir = base / "run"
    res = shardconsole("--preset", "tiny-cpu", "--headless", "--run-dir", str(run_dir),
                       *[a for s in sets for a in ("--set", s)], timeout=FINISHED_RUN_TIMEOUT, env=env)
    return SimpleNamespace(run=run_dir, res=res)


# One real run per behaviour: the tests that only read a finished run of these settings share it (each
# costs 20-60 s of the 2-core box). A test that changes the folder copies it first.

@pytest.fixture(scope="session")
def fsdp_tiny_run(tmp_path_factory):
    """FSDP2, 2 ranks, 12 steps, a step line every 3, the final save: test_runs' clean end and
    test_plan_saves' DCP checkpoint size."""
    return _finished_run(tmp_path_factory, "fsdp-tiny-run", "train.steps=12", "train.log_every=3")


@pytest.fixture(scope="session")
def fsdp_chat_run(tmp_path_factory):
    """FSDP2 from a tiny Hugging Face folder (tokenizer, chat template) on a .jsonl with a held-out split,
    4 steps, a checkpoint every 2, all kept (steps 2 and 4, the final save): test_export_model's FSDP
    export and the console's chat step chooser (test_tryout_console). `model`: the folder it started
    from; `cache`: the token cache it ran with."""
    from tests.hf_fixtures import CORPUS, make_hf_model
    root = tmp_path_factory.mktemp("fsdp-chat-model")
    model = make_hf_model(root / "model", chat_template=True)
    corpus = root / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": f"{i}: {t}"}) + "\n" for i, t in enumerate(CORPUS[:60])))
    run = _finished_run(tmp_path_factory, "fsdp-chat-run", "train.save_final=true", f"model.name={model}",
                        "data.source=auto", f"data.path={corpus}", "data.seq_len=32", "data.eval_fraction=0.2",
                        "train.eval_every=2", "train.steps=4", "train.checkpoint_every=2",
                        "train.keep_checkpoints=0", "train.micro_batch=2")
    assert run.res.returncode == 0, run.res.stdout[-3000:] + run.res.stderr[-3000:]
    run.model, run.cache = model, tmp_path_factory.getbasetemp() / "token-cache"
    return run


ZERO3_TINY_STEPS = 10


@pytest.fixture(scope="session")
def zero3_tiny_run(tmp_path_factory):
    """DeepSpeed ZeRO-3, 2 ranks, 10 steps, a step line every 2, the final save: test_deepspeed_run's
    clean end, test_plan_saves' ZeRO-3 checkpoint size and test_export_model's ZeRO-3 export."""
    return _finished_run(tmp_path_factory, "zero3-tiny-run", "parallel.backend=deepspeed", "deepspeed.stage=3",
                         f"train.steps={ZERO3_TINY_STEPS}", "train.log_every=2")


def messages(run_dir: Path) -> list:
    """Every message of a run's stream (a bad line fails the test): metrics.jsonl, and on a run of
    several nodes the other nodes' files merged in as the front ends read them."""
    out = [decode(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    nodes = node_metrics_files(run_dir / "metrics.jsonl")
    if not nodes:
        return out
    return list(heapq.merge(out, *([decode(line) for line in p.read_text().splitlines()] for p in nodes),
                            key=lambda m: m.t))


def of_kind(msgs, kind):
    return [m for m in msgs if m.kind == kind]


def pids_alive(pids) -> list[int]:
    alive = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as fh:
                if fh.read().rsplit(")", 1)[1].split()[0] != "Z":
                    alive.append(pid)
        except (FileNotFoundError, ProcessLookupError):
            pass
    return alive


def assert_nothing_left(run_dir: Path, msgs) -> None:
    """No process of the launcher's group, and no rank by its own pid (torchrun gives each its session)."""
    pgid = json.loads((run_dir / "job.json").read_text())["pgid"]
    assert _group_pids(pgid) == []
    assert pids_alive(h.pid for h in of_kind(msgs, "hello")) == []


@contextlib.contextmanager
def live_tiny_run(run_dir: Path, *sets: str, timeout: float = 300,
                  stderr: int = subprocess.DEVNULL) -> Iterator[subprocess.Popen]:
    """A tiny-cpu run started by the headless front end, training (train.steps=100000) until the test is
    done with it: yields the front end once the first step line is in; after, Ctrl-C to it (a stop) unless
    it has ended, SIGKILL if that takes over 120 s."""
    front = subprocess.Popen([sys.executable, "-m", "shardconsole", "--preset", "tiny-cpu", "--headless",
                              "--run-dir", str(run_dir), "--set", "train.steps=100000",
                              *[a for s in sets for a in ("--set", s)]],
                             stdout=subprocess.DEVNULL, stderr=stderr, text=True)
    try:
        wait_for_steps(run_dir, 1, timeout, front)
        yield front
    finally:
        if front.poll() is None:
            front.send_signal(signal.SIGINT)
        try:
            front.wait(120)
        except subprocess.TimeoutExpired:
            front.kill()
            front.wait()


def wait_for_steps(run_dir: Path, n: int, timeout: float, proc: subprocess.Popen | None = None) -> None:
    """Until the run's stream holds n step lines; fails the test if the run ends or time runs out."""
    path = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and path.read_text().count('"kind":"step"') >= n:
            return
        if proc is not None and proc.poll() is not None:
            pytest.fail(f"run ended before step {n}: {(proc.communicate()[1] or '')[-2000:]}")
        time.sleep(0.1)
    if proc is not None:
        proc.kill()
    pytest.fail(f"fewer than {n} step lines within {timeout:.0f} s")


def wait_until(condition, timeout: float, what: str, every_s: float = 0.05):
    """Poll condition() until it returns something true (returned) or the deadline fails the test."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(every_s)
    pytest.fail(f"timed out after {timeout:.0f}s waiting for {what}")
