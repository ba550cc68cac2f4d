"""The headless front end and the session layer under it, without ranks: the step line, the outcome (OOM
advice, torchrun's report, the stream first), the watcher on odd streams, detaching."""

from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path

from shardconsole.settings import config as C
from shardconsole import headless, plan
from shardconsole.settings import preset_store
from shardconsole.runlog import protocol as P
from shardconsole.launch.job import ExternalJob, Job
from shardconsole.settings.models import resolve
from shardconsole.runlog.runstate import RunState
from shardconsole.session import outcome
from shardconsole.session.run import RunSession
from shardconsole.session.watcher import MachineProbes, Watcher
from shardconsole.runlog.stream import MetricsWriter

HERE = Path(__file__).resolve().parent


def test_step_line_has_every_figure():
    st = RunState()
    st.apply(P.Memory(rank=0, reserved_bytes=3 * 2**30, peak_reserved_bytes=4 * 2**30, host_rss_bytes=1))
    st.apply(P.Memory(rank=1, host_rss_bytes=2**30))
    st.apply(P.HostSample(used_bytes=5 * 2**30, total_bytes=64 * 2**30))
    st.apply(P.Step(step=3, steps=10, loss=2.5, lr=1e-4, tokens_per_s=12345, step_s=0.25, mfu=0.5,
                    grad_norm=1.0, loss_scale=1024.0, skipped_steps=2))
    line = headless.step_line(st)
    for part in ("step 3/10", "loss 2.5000", "12.3k tok/s", "0.250 s/step", "mfu 50.0%", "scale 1024 skipped 2",
                 "r0 3.0/4.0G", "r1 rss 1.00G", "host 5.0/64G"):
        assert part in line, line


def test_gpu_oom_advice_comes_from_the_planner(tmp_path, monkeypatch):
    cfg = preset_store.load("3090-fsdp", ["train.micro_batch=32"])
    C.save(cfg, tmp_path / "preset.toml")
    monkeypatch.setattr(plan, "detect_hardware",
                        lambda: plan.Hardware(gpus=1, gpu_memory_bytes=80 * 2**30, host_memory_bytes=128 * 2**30))
    text = outcome.fitting_settings(tmp_path)
    assert "24.0 GiB a GPU" in text                 # the run's cap, not the card
    first = text.splitlines()[2]
    sets = [s.split("=", 1) for s in first.split("--set ")[1:]]
    assert sets, text
    fixed = preset_store.load("3090-fsdp", [f"{k}={v.strip()}" for k, v in sets])
    assert plan.estimate(fixed, resolve("1b"),
                         plan.Hardware(gpus=1, gpu_memory_bytes=24 * 2**30, host_memory_bytes=128 * 2**30)).fits


def test_killed_rank_read_from_torchruns_report(tmp_path):
    (tmp_path / "launcher.log").write_text("""Failures:
[1]:
  rank      : 0 (local_rank: 0)
  exitcode  : 1 (pid: 10774)
Root Cause (first observed failure):
[0]:
  rank      : 1 (local_rank: 1)
  exitcode  : -9 (pid: 10775)  (SIGKILL)
""")
    assert outcome.killed_rank(tmp_path) == (1, 9)
    (tmp_path / "launcher.log").write_text("rank      : 0 (local_rank: 0)\n  exitcode  : -15 (pid: 1)\n")
    assert outcome.killed_rank(tmp_path) is None


def test_watcher_of_a_read_only_run_folder_shows_samples_without_writing(tmp_path, monkeypatch):
    """attach on someone else's run (a folder it cannot write) follows the stream; the machine samples it
    would have appended are kept in memory (the host figure in the step lines) instead of written."""
    run = tmp_path / "run"
    w = MetricsWriter(run / "metrics.jsonl", "run", 0)
    w.emit(P.Step(run="run", rank=0, step=1, steps=2, loss=3.0, lr=1e-4, tokens_per_s=1.0, step_s=1.0))
    w.close()

    def refuse(*a, **k):
        raise PermissionError(13, "Permission denied")
    from shardconsole.runlog import stream
    monkeypatch.setattr(stream, "MetricsWriter", refuse)
    watcher = Watcher(ExternalJob(run), run, "run", MachineProbes(), logs=False)
    tick = watcher.poll()
    assert not watcher.samples.writable and any(isinstance(m, P.Step) for m in tick.messages)
    assert watcher.state.host is not None      # sampled, kept in memory
    assert len((run / "metrics.jsonl").read_text().splitlines()) == 1     # nothing appended


def test_a_closed_terminal_during_the_machine_sample_is_a_detach_not_a_probe_failure(tmp_path):
    """SIGHUP raises Detach wherever attach's main thread is, also inside the watcher's guard that keeps a
    failing probe from taking it down: the detach must go through it (it was swallowed there, and attach
    then followed a live run forever; seen under the full suite's load as a 60 s timeout)."""
    import pytest
    from shardconsole.session.signals import Detach
    run = tmp_path / "run"
    w = MetricsWriter(run / "metrics.jsonl", "run", 0)
    w.emit(P.Step(run="run", rank=0, step=1, steps=2, loss=3.0, lr=1e-4, tokens_per_s=1.0, step_s=1.0))
    w.close()

    class HungUpDuringTheSample(MachineProbes):
        def host(self, *a, **k):
            raise Detach("the terminal closed (SIGHUP)")
    watcher = Watcher(ExternalJob(run), run, "run", HungUpDuringTheSample(), logs=False)
    with pytest.raises(Detach):
        watcher.poll()


def _run_folder(tmp_path, run_id="run"):
    run = tmp_path / run_id
    run.mkdir()
    C.save(preset_store.load("tiny-cpu"), run / "preset.toml")
    return run


def test_attach_to_a_run_started_elsewhere_ends_only_on_rank_0s_finished_line_of_that_run(tmp_path):
    run = _run_folder(tmp_path)
    w = MetricsWriter(run / "metrics.jsonl", "run", 0)
    w.emit(P.Finished(run="run", rank=1, steps=3))          # a rank other than 0 does not end a run
    w.emit(P.Finished(run="other-run", rank=0, steps=3))    # nor another run's line in a shared folder
    watcher = Watcher(ExternalJob(run), run, "run", None, logs=False)
    assert not watcher.poll().ended and watcher.foreign_lines == 2
    w.emit(P.Finished(run="run", rank=0, steps=3))
    assert watcher.poll().ended and watcher.exit_code == 0
    w.close()


class _InterruptedOut(io.StringIO):
    """A terminal where the user presses Ctrl-C while the history is being printed."""

    def write(self, text):
        raise KeyboardInterrupt


def test_ctrl_c_during_the_history_replay_detaches_and_never_claims_a_stop(tmp_path):
    run = _run_folder(tmp_path)
    w = MetricsWriter(run / "metrics.jsonl", "run", 0)
    for i in range(1, 4):
        w.emit(P.Step(run="run", rank=0, step=i, steps=9, loss=3.0, lr=1e-4))
    w.close()
    err = io.StringIO()
    rc = headless.follow(RunSession(ExternalJob(run), run, "run"), out=_InterruptedOut(), err=err)
    assert rc == outcome.EXIT_CODES["detached"] == 8
    assert "detached (Ctrl-C during the history replay): the run goes on" in err.getvalue()
    assert "stopped" not in err.getvalue()
    events = [P.decode(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert any(isinstance(e, P.Event) and e.name == "detached" for e in events)


def test_malformed_lines_are_skipped_and_counted_never_crash(tmp_path):
    """Issue 22 item 4: each of these once crashed a front end (lr null in step_line, pid -1 in psutil)."""
    run = _run_folder(tmp_path)
    with open(run / "metrics.jsonl", "w") as fh:
        fh.write('{"v":1,"kind":"hello","run":"run","rank":0,"t":1.0,"pid":-1,"world":1}\n')
        fh.write('{"v":1,"kind":"step","run":"run","rank":0,"t":1.0,"step":1,"steps":2,"lr":null}\n')
        fh.write('{"v":1,"kind":"memory","run":"run","rank":0,"t":1.0,"host_rss_bytes":"big"}\n')
        fh.write(P.encode(P.Step(run="run", rank=0, step=2, steps=2, loss=1.5, lr=1e-4)) + "\n")
        fh.write(P.encode(P.Finished(run="run", rank=0, steps=2)) + "\n")
    out, err = io.StringIO(), io.StringIO()
    assert headless.follow(RunSession(ExternalJob(run), run, "run"), out=out, err=err) == 0
    assert "step 2/2 | loss 1.5000" in out.getvalue()
    assert "warning: 3 unreadable metrics line(s) skipped" in err.getvalue()


def test_the_outcome_waits_for_ranks_that_outlive_their_launcher(tmp_path):
    """Issue 14 item 6, made certain: the launcher exits 1 with torchrun's failure dump while its two
    ranks (real processes in sessions of their own, as torchrun starts them) write `failed nan_loss` a
    moment later. The front end classifies from those lines: exit 6, not 1."""
    run = _run_folder(tmp_path)
    proc = subprocess.Popen([sys.executable, str(HERE / "late_ranks.py"), str(run)], start_new_session=True)
    job = Job(run, proc.pid, proc.pid, [], proc)
    err = io.StringIO()
    rc = headless.follow(RunSession(job, run, "run"), out=io.StringIO(), err=err)
    assert rc == outcome.EXIT_CODES["nan_loss"] == 6, err.getvalue()
    assert "run failed (nan_loss) on rank" in err.getvalue()
    assert "ChildFailedError" in (run / "launcher.log").read_text()


def test_a_run_stopped_from_elsewhere_is_stopped_not_a_crash(tmp_path):
    """Two front ends on one run: the stop path writes who stopped it before any signal, so the other
    front end, seeing the ranks gone without a `finished` line, says "stopped"."""
    from shardconsole.session.stop import announce
    run = _run_folder(tmp_path)
    state = RunState()
    state.apply(P.Hello(run="run", rank=0, pid=os.getpid()))
    assert outcome.classify(state, -15, run)[0] == "crash"
    announce(run, "run", "`shardconsole stop` (pid 1)")
    state.apply(P.decode((run / "metrics.jsonl").read_text().splitlines()[-1]))
    cause, message = outcome.classify(state, -15, run)
    assert cause == "stopped" and "shardconsole stop" in message


def test_a_run_whose_folder_went_before_its_ranks_could_say_so_is_run_folder_gone(tmp_path):
    """The ranks' own run_folder_gone line can lose the race with `rm -rf` (they then exit 1, seen on a loaded
    CI box): the front end, finding no folder and no failed line, names the same class and no checkpoint to
    trust in a folder that is gone."""
    import shutil
    run = _run_folder(tmp_path)
    state = RunState()
    state.apply(P.Hello(run="run", rank=0, pid=os.getpid()))
    shutil.rmtree(run)
    cause, message = outcome.classify(state, 1, run)
    assert cause == "run_folder_gone"
    assert message.startswith("run failed (run_folder_gone): the run folder") and "launcher exit code 1" in message
    assert "check the last checkpoint" not in message


def test_the_data_summary_and_each_eval_get_a_line():
    """Issue 15's front-end part: what the ranks train on, once at start, and each eval as it comes."""
    from shardconsole.session.watcher import Tick
    state = RunState()
    msgs = [P.DataSummary(source="chat.jsonl", format="chat", tokenizer="my-llama", template="chatml", records=120,
                          tokens=30_000, samples=58, loss_share=0.42, epochs=1.5, eval_records=6, eval_samples=3),
            P.Eval(step=20, loss=2.125, tokens=4096, seconds=1.25)]
    for m in msgs:
        state.apply(m)
    out = io.StringIO()
    headless.Printer(out).render(Tick(messages=msgs), state)
    lines = out.getvalue().splitlines()
    assert lines == ["data: chat.jsonl (chat), tokenizer my-llama, template chatml: 120 records, 30000 tokens, "
                     "58 packed samples, 42% of tokens under loss, 1.50 epochs; eval 6 records, 3 samples",
                     "eval step 20: loss 2.1250 over 4096 tokens (1.2 s)"]
    assert state.data is msgs[0] and state.evals == [msgs[1]]


def test_the_data_line_counts_in_the_singular_where_one():
    """Issue 36 item 11: "1 records" in the headless data line."""
    from shardconsole.headless import data_line
    line = data_line(P.DataSummary(source="a.txt", format="text", tokenizer="bytes", records=1, tokens=20,
                                   samples=1, eval_records=1, eval_samples=3))
    assert ": 1 record, 20 tokens, 1 packed sample," in line and "eval 1 record, 3 samples" in line
