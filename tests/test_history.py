"""Every run kept (issue 18): TensorBoard event files read back with TensorBoard's own reader, `runs` and
`compare` on a finished, a stopped and a failed run, and the console's runs screen. Three real 2-rank
tiny-cpu runs, made once for the module."""

from __future__ import annotations

import json
import os
import statistics
import struct
import subprocess
import sys
import time

import pytest

from tests.conftest import messages, of_kind, shardconsole, wait_for_steps

pytestmark = pytest.mark.slow

TINY = ("--preset", "tiny-cpu", "--headless", "--set", "train.log_every=1")


def writer_pid(name: str) -> int:
    """The writing process of an event file, from TensorBoard's writer's name for it:
    events.out.tfevents.<time>.<host>.<pid>.<n> with our suffix .shardconsole (a host name may hold dots)."""
    return int(name.split(".")[-3])


def f32(x: float) -> float:
    """A value as TensorBoard stores a scalar (float32)."""
    return struct.unpack("<f", struct.pack("<f", x))[0]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A runs root with a finished run (eval on a held-out share of a text file), a failed one (NaN loss)
    and a stopped one, started in that order."""
    root = tmp_path_factory.mktemp("runs-root")
    data = root.parent / "corpus.txt"
    words = "the quick brown fox jumps over a lazy dog and runs far away from home".split()
    data.write_text("\n\n".join(" ".join(words[(i * 7 + j) % len(words)] for j in range(60)) for i in range(200)))
    env = {"SHARDCONSOLE_RUNS_ROOT": str(root)}
    res = shardconsole(*TINY, "--run-dir", str(root / "20260101-000001-finished"), "--set", "train.steps=6",
                       "--set", f"data.path={data}", "--set", "data.eval_fraction=0.2", "--set", "train.eval_every=3",
                       env=env)
    assert res.returncode == 0, res.stderr
    res = shardconsole(*TINY, "--run-dir", str(root / "20260101-000002-failed"), "--set", "train.steps=6",
                       env={**env, "SHARDCONSOLE_FAULT": "nan@step=3"})
    assert res.returncode == 6, res.stderr            # nan_loss
    stopped = root / "20260101-000003-stopped"
    proc = subprocess.Popen([sys.executable, "-m", "shardconsole", *TINY, "--run-dir", str(stopped),
                             "--set", "train.steps=100000"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, **env})
    follower, stopped_it = None, False
    try:
        wait_for_steps(stopped, 2, timeout=120, proc=proc)
        # A second front end follows; the first is killed (-9, it writes nothing): the follower takes over
        # the run's TensorBoard file and writes it whole.
        out = root.parent / "follower.out"
        with open(out, "w") as fh:
            follower = subprocess.Popen([sys.executable, "-m", "shardconsole", "attach", str(stopped), "--headless"],
                                        stdout=fh, stderr=subprocess.DEVNULL, env={**os.environ, **env})
        deadline = time.monotonic() + 60
        while "step " not in out.read_text():      # it has read the history: the file was taken then
            assert time.monotonic() < deadline and follower.poll() is None, "the follower did not start"
            time.sleep(0.1)
        assert not any(writer_pid(p.name) == follower.pid for p in stopped.iterdir() if "tfevents" in p.name)
        proc.kill()
        proc.wait(timeout=30)
        deadline = time.monotonic() + 60
        while not any(writer_pid(p.name) == follower.pid for p in stopped.iterdir() if "tfevents" in p.name):
            assert time.monotonic() < deadline and follower.poll() is None, "the follower never took over"
            time.sleep(0.1)
        res = shardconsole("stop", "000003-stop", env=env, timeout=90)     # a part of the id names the run
        stopped_it = True
        assert res.returncode == 0, res.stderr
        follower.wait(timeout=60)
    finally:
        for p in (proc, follower):
            if p is not None and p.poll() is None:
                p.kill()
        if not stopped_it and (stopped / "job.json").is_file():
            # Its front ends are gone but the ranks run in sessions of their own: never leave them going.
            shardconsole("stop", str(stopped), timeout=90)
    return root


def test_event_file_holds_the_stream(runs):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    run = runs / "20260101-000001-finished"
    files = [p for p in run.iterdir() if "tfevents" in p.name]
    assert len(files) == 1, files              # one writer: the front end that ran it
    msgs = messages(run)
    acc = EventAccumulator(str(run))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"loss/train", "loss/eval", "optim/lr", "optim/grad_norm", "throughput/tokens_per_s", "time/step_s",
            "memory/rank0_host_rss_GiB", "memory/rank1_host_rss_GiB", "host/ram_used_GiB",
            "host/ranks_rss_GiB"} <= tags, tags
    assert not any("mfu" in t or "loss_scale" in t for t in tags)     # CPU, fp32: none sent, none written

    def scalars(tag):
        return [(e.step, e.value) for e in acc.Scalars(tag)]
    steps = of_kind(msgs, "step")
    assert [s.step for s in steps] == [1, 2, 3, 4, 5, 6]
    assert scalars("loss/train") == [(s.step, f32(s.loss)) for s in steps]
    assert scalars("optim/lr") == [(s.step, f32(s.lr)) for s in steps]
    assert scalars("optim/grad_norm") == [(s.step, f32(s.grad_norm)) for s in steps]
    assert scalars("throughput/tokens_per_s") == [(s.step, f32(s.tokens_per_s)) for s in steps]
    evals = of_kind(msgs, "eval")
    assert len(evals) == 2 and scalars("loss/eval") == [(e.step, f32(e.loss)) for e in evals]
    rank1 = [m for m in of_kind(msgs, "memory") if m.rank == 1]
    assert scalars("memory/rank1_host_rss_GiB") == [(m.step, f32(m.host_rss_bytes / 2**30)) for m in rank1]
    hosts = of_kind(msgs, "host")
    assert [v for _, v in scalars("host/ram_used_GiB")] == [f32(h.used_bytes / 2**30) for h in hosts]

    # Rebuilt from metrics.jsonl (a run that had no front end): the same values, still one file of ours; a
    # user's own event file in the folder is not ours to replace.
    users = run / "events.out.tfevents.1700000000.elsewhere"
    users.write_bytes(b"")
    res = shardconsole("runs", "--tensorboard", str(run))
    assert res.returncode == 0, res.stderr
    assert users.exists()
    users.unlink()
    again = [p for p in run.iterdir() if "tfevents" in p.name]
    assert len(again) == 1 and again != files and again[0].name.endswith(".shardconsole")
    rebuilt = EventAccumulator(str(run))
    rebuilt.Reload()
    assert set(rebuilt.Tags()["scalars"]) == tags
    for tag in ("loss/train", "loss/eval", "host/ram_used_GiB", "memory/rank1_host_rss_GiB"):
        assert [(e.step, e.value) for e in rebuilt.Scalars(tag)] == scalars(tag)


def test_follower_takes_over_the_event_file(runs):
    """The first front end was killed mid-run; the attached one wrote the file, whole, in its place."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    run = runs / "20260101-000003-stopped"
    files = [p.name for p in run.iterdir() if "tfevents" in p.name]
    assert len(files) == 1, files
    acc = EventAccumulator(str(run))
    acc.Reload()
    steps = of_kind(messages(run), "step")
    assert len(steps) >= 2
    assert [(e.step, e.value) for e in acc.Scalars("loss/train")] == [(s.step, f32(s.loss)) for s in steps]


def test_runs_lists_each_status_newest_first(runs):
    res = shardconsole("runs", "--runs-root", str(runs), "--json")
    assert res.returncode == 0, res.stderr
    rows = [json.loads(line) for line in res.stdout.splitlines()]
    assert [r["id"] for r in rows] == ["20260101-000003-stopped", "20260101-000002-failed",
                                       "20260101-000001-finished"]
    stopped, failed, finished = rows
    assert (finished["status"], finished["cause"]) == ("finished", "")
    assert (failed["status"], failed["cause"]) == ("failed", "nan_loss")
    assert (stopped["status"], stopped["cause"]) == ("stopped", "")
    assert "shardconsole stop" in stopped["detail"]

    steps = of_kind(messages(runs / finished["id"]), "step")
    evals = of_kind(messages(runs / finished["id"]), "eval")
    assert (finished["step"], finished["steps"]) == (6, 6)
    assert finished["last_loss"] == steps[-1].loss and finished["eval_loss"] == evals[-1].loss
    assert finished["tokens_per_s"] == statistics.median(s.tokens_per_s for s in steps[1:])
    assert finished["mfu"] is None and finished["peak_gpu_bytes"] is None
    ranks_rss = [h.ranks_rss_bytes for h in of_kind(messages(runs / finished["id"]), "host")]
    assert finished["peak_host_bytes"] >= max(ranks_rss) > 0
    assert failed["step"] < 6 and finished["backend"] == "fsdp" and finished["model"] == "tiny"

    table = shardconsole("runs", "--runs-root", str(runs))
    assert table.returncode == 0, table.stderr
    lines = table.stdout.splitlines()
    assert lines[0].split()[:7] == ["id", "preset", "backend", "training", "model", "status", "steps"]
    assert finished["training"] == "full/sft" and "full/sft" in lines[4]
    assert "failed (nan_loss)" in lines[3] and "stopped" in lines[2] and "finished" in lines[4]
    assert any("NanLossError" in line or "nan" in line.lower() for line in lines[5:])   # the cause, said


def test_compare_three_runs(runs):
    ids = ["000001-finished", "000002-failed", "000003-stopped"]
    res = shardconsole("compare", *ids, "--runs-root", str(runs), "--width", "80")
    assert res.returncode == 0, res.stderr
    out = res.stdout
    diff = out.split("Figures:")[0]
    steps_row = next(line for line in diff.splitlines() if line.strip().startswith("train.steps"))
    assert steps_row.split()[1:] == ["6", "6", "100000"]
    assert "data.path" in diff and "train.log_every" not in diff       # the same in all three: not shown
    status_row = next(line for line in out.splitlines() if line.strip().startswith("status"))
    assert status_row.split()[1:] == ["finished", "failed", "(nan_loss)", "stopped"]
    plot = out.split("loss (train)")[1].split("tokens/s")[0]
    assert "*" in plot and "o" in plot and "+ 20260101-000003-stopped" in plot   # each run's curve and legend
    assert "loss (eval)" in out and "tokens/s" in out

    one = shardconsole("compare", ids[0], "--runs-root", str(runs))
    assert one.returncode == 2 and one.stderr.count("\n") == 1 and "at least two" in one.stderr
    missing = shardconsole("compare", ids[0], "no-such-run", "--runs-root", str(runs))
    assert missing.returncode == 2 and "no run 'no-such-run'" in missing.stderr and "Traceback" not in missing.stderr


async def test_resume_and_export_model_take_a_run_id(runs, tmp_path):
    """Like attach and stop: a run id, or a part of one that names one run, under the runs root."""
    env = {"SHARDCONSOLE_RUNS_ROOT": str(runs)}
    finished = runs / "20260101-000001-finished"
    out = tmp_path / "hf"
    res = shardconsole("export-model", "000001-fin", "-o", str(out), env=env, timeout=300)
    assert res.returncode == 0, res.stderr
    assert f"from step 6 of {finished}" in res.stdout and (out / "config.json").is_file()

    # The finished run's newest checkpoint is its last step: resume reaches it by id and refuses in one line,
    # writing nothing (no new session: no real run here).
    res = shardconsole("resume", "000001-fin", env=env)
    assert res.returncode == 2 and res.stderr.count("\n") == 1, res.stderr
    assert f"{finished}: its newest checkpoint is step 6" in res.stderr
    assert not (finished / "preset.toml.prev").exists()
    several = shardconsole("resume", "20260101", env=env)
    assert several.returncode == 2 and "names 3 runs" in several.stderr and "Traceback" not in several.stderr
    none = shardconsole("export-model", "no-such-run", "-o", str(tmp_path / "none"), env=env)
    assert none.returncode == 2 and "no run 'no-such-run'" in none.stderr and not (tmp_path / "none").exists()


async def test_console_runs_screen(runs):
    from textual.app import App
    from textual.widgets import DataTable

    from shardconsole.console.screens.runs import CompareScreen, RunsScreen
    from shardconsole.console.widgets.line_plot import LinePlot

    class Host(App):
        def on_mount(self) -> None:
            self.push_screen(RunsScreen(runs))

    app = Host()
    async with app.run_test(size=(140, 30)) as pilot:
        table = app.screen.query_one(DataTable)
        for _ in range(200):
            if table.row_count:
                break
            await pilot.pause(0.05)
        assert table.row_count == 3
        from shardconsole.console.screens.runs import COLUMNS
        statuses = [str(table.get_row_at(i)[COLUMNS.index("status")]) for i in range(3)]
        assert statuses == ["stopped", "failed (nan_loss)", "finished"]
        await pilot.press("space", "down", "down", "space", "c")
        assert isinstance(app.screen, CompareScreen)
        ids = [r.run_id for r in app.screen.runs]
        assert ids == ["20260101-000003-stopped", "20260101-000001-finished"]
        loss = app.screen.query_one("#loss-plot", LinePlot)
        assert [s.label for s in loss.series] == ids
        assert list(loss.series[1].ys) == [s.loss for s in of_kind(messages(runs / ids[1]), "step")]


def test_resumed_session_replaces_replayed_steps(tmp_path, monkeypatch):
    """A resumed run appends a session that restarts from its checkpoint: TensorBoard (through the
    SessionLog START the writer puts before its first step) and the run list keep the newest values."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from shardconsole.runlog import protocol as P
    from shardconsole.history.index import summarize
    from shardconsole.runlog.tbevents import rebuild

    monkeypatch.setenv("SHARDCONSOLE_CACHE_DIR", str(tmp_path / "cache"))
    run = tmp_path / "run"
    run.mkdir()
    (run / "preset.toml").write_text('[model]\nname = "tiny"\n')
    lines = [P.Hello(run="run", rank=0, t=1.0)]
    lines += [P.Step(run="run", rank=0, t=1.0 + s, step=s, steps=6, loss=10.0 + s) for s in range(1, 6)]
    lines += [P.Hello(run="run-resume-1", rank=0, t=20.0)]
    lines += [P.Step(run="run-resume-1", rank=0, t=20.0 + s, step=s, steps=6, loss=1.0 + s) for s in range(4, 7)]
    lines += [P.Finished(run="run-resume-1", rank=0, t=30.0, steps=6)]
    (run / "metrics.jsonl").write_text("".join(P.encode(m) + "\n" for m in lines))
    assert rebuild(run).path is not None
    acc = EventAccumulator(str(run))
    acc.Reload()
    expected = [(1, 11.0), (2, 12.0), (3, 13.0), (4, 5.0), (5, 6.0), (6, 7.0)]
    assert [(e.step, e.value) for e in acc.Scalars("loss/train")] == expected
    s = summarize(run)
    assert s.loss == expected and s.status == "finished" and s.last_loss == 7.0

    # An ended run's summary is kept in the user's cache, and read again once its stream grows.
    from shardconsole.user_folders import run_summaries_dir
    assert len(list(run_summaries_dir().iterdir())) == 1
    assert summarize(run) == s
    more = [P.Hello(run="run-resume-2", rank=0, t=40.0),
            P.Step(run="run-resume-2", rank=0, t=41.0, step=7, steps=7, loss=0.5)]
    with open(run / "metrics.jsonl", "a") as fh:
        fh.write("".join(P.encode(m) + "\n" for m in more))
    grown = summarize(run)
    assert grown.last_loss == 0.5 and grown.loss[-1] == (7, 0.5) and grown.status != "finished"


WRITER_LOSES_ITS_FOLDER = """
import shutil, sys
from pathlib import Path
from shardconsole.runlog import protocol as P
from shardconsole.runlog.stream import MetricsReader
from shardconsole.runlog.tbevents import Recorder
run = Path(sys.argv[1])
rec = Recorder(run)
rec.follow(MetricsReader(run / "metrics.jsonl"), [])
assert rec.path is not None, rec.why_not
shutil.rmtree(run)          # the folder goes under the writer (as a full disk would fail its file)
rec.write([P.Step(run="r", rank=0, t=2.0, step=1, steps=2, loss=1.0)])
rec.write([P.Step(run="r", rank=0, t=3.0, step=2, steps=2, loss=1.0)])
rec.close()
print(rec.gave_up, rec.why_not)
"""


def test_writer_failure_is_one_line_not_a_traceback(tmp_path):
    """TensorBoard's writer fails in its own thread: the recorder gives up with a reason the front end says
    once, and nothing is printed under the console's screen (the thread's traceback is not)."""
    from shardconsole.runlog import protocol as P
    run = tmp_path / "run"
    run.mkdir()
    (run / "preset.toml").write_text('[model]\nname = "tiny"\n')
    (run / "metrics.jsonl").write_text(P.encode(P.Hello(run="r", rank=0, t=1.0)) + "\n")
    res = subprocess.run([sys.executable, "-c", WRITER_LOSES_ITS_FOLDER, str(run)], capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "True TensorBoard events stopped: No such file or directory"
    assert res.stderr == ""


def test_attach_dialog_lists_status_not_just_ended(runs):
    """The console's run picker (TorchrunLauncher.recent_runs) tells finished, stopped and failed apart."""
    from shardconsole.console.services import TorchrunLauncher
    listed = TorchrunLauncher(runs).recent_runs()
    assert [(r.run_dir.name, r.status, r.alive) for r in listed] == [
        ("20260101-000003-stopped", "stopped", False), ("20260101-000002-failed", "failed (nan_loss)", False),
        ("20260101-000001-finished", "finished", False)]
