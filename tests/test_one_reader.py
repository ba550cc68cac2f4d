"""Issue 50 item 3: one reader of a run's stream per front end. The watcher's reader feeds the panels (its
ticks) and the TensorBoard recorder alike; a recorder that takes the run's file over late reads the history
once, up to where the watcher's reader is, then follows what the watcher reads. Real files: a stream
written line by line (a torn line among them), TensorBoard's own reader for the event file."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from shardconsole.launch.job import Job
from shardconsole.runlog import protocol as P
from shardconsole.runlog.tbevents import event_files
from shardconsole.session.watcher import Watcher


class _Running:
    """The run's launcher as the watcher sees it: still running (the ranks write the stream)."""
    external = False
    rc_known = False
    pid = 0
    run_dir = None

    def poll(self) -> int | None:
        return None

    def alive(self) -> bool:
        return True

    def heard(self, hellos: list[P.Hello]) -> None:
        pass


def _step(i: int) -> P.Step:
    return P.Step(run="r", rank=0, t=1000.0 + i, step=i, steps=100, loss=10.0 / i, lr=1e-3, tokens_per_s=100.0,
                  step_s=0.1)


def _descriptors_on(path: Path) -> int:
    """How many descriptors this process holds open on the file (a reader's, the recorder's lock)."""
    fds = Path("/proc/self/fd")
    n = 0
    for fd in os.listdir(fds):
        try:
            if os.path.samefile(os.readlink(fds / fd), path):
                n += 1
        except OSError:
            continue
    return n


def test_the_recorder_follows_the_watchers_reader_and_holds_every_step(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    run = tmp_path / "r"
    run.mkdir()
    (run / "preset.toml").write_text('[model]\nname = "tiny"\n')
    metrics = run / "metrics.jsonl"
    with open(metrics, "w") as fh:
        fh.write(P.encode(P.Hello(run="r", rank=0, t=1000.0)) + "\n")
        fh.write("".join(P.encode(_step(i)) + "\n" for i in range(1, 4)))     # history before the watcher
    w = Watcher(_Running(), run, "r", None, logs=False, record=True)
    try:
        ticks = [w.poll()]
        line = P.encode(_step(4)) + "\n"
        with open(metrics, "a") as fh:
            fh.write(line[:20])                  # a torn write: half a line
        ticks.append(w.poll())
        with open(metrics, "a") as fh:
            fh.write(line[20:] + "".join(P.encode(_step(i)) + "\n" for i in range(5, 8)))
        ticks.append(w.poll())
        # One descriptor reads the stream (the watcher's); the other is the recorder's lock on it.
        assert w.recorder is not None and w.recorder.writing
        assert _descriptors_on(metrics) == 2
    finally:
        w.close()
    seen = [m.step for t in ticks for m in t.messages if isinstance(m, P.Step)]
    assert seen == list(range(1, 8))             # the panels' lines: every step once, in order
    assert len(event_files(run)) == 1
    acc = EventAccumulator(str(run))
    acc.Reload()
    assert [(e.step, round(e.value, 4)) for e in acc.Scalars("loss/train")] == [(i, round(10.0 / i, 4))
                                                                                for i in range(1, 8)]


_OPENS: list[str] = []


def _count_opens(event: str, args: tuple) -> None:
    if event == "open" and args and isinstance(args[0], (str, bytes, os.PathLike)):
        _OPENS.append(os.fsdecode(args[0]))


sys.addaudithook(_count_opens)      # audit hooks stay for the process: it only appends the paths opened


def test_an_attached_job_reads_no_stream_of_its_own(tmp_path):
    """A run started by this machine, attached to after its launcher went (job.json names a process that
    has ended; ranks may be orphans): what a stop and the watcher ask of the job (its ranks, alive) opens
    metrics.jsonl no more: the job's hello lines come from the watcher's reader."""
    run = tmp_path / "r"
    run.mkdir()
    (run / "preset.toml").write_text('[model]\nname = "tiny"\n')
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    pid = int(gone.stdout)
    (run / "job.json").write_text(json.dumps({"pid": pid, "pgid": pid, "argv": ["python"]}))
    metrics = run / "metrics.jsonl"
    metrics.write_text(P.encode(P.Hello(run="r", rank=0, t=1000.0, pid=pid, host="elsewhere")) + "\n"
                       + "".join(P.encode(_step(i)) + "\n" for i in range(1, 4)))
    job = Job.from_run_dir(run)
    w = Watcher(job, run, "r", None, logs=False, record=False, look_every_s=0.0)
    try:
        w.poll()
        _OPENS.clear()
        with open(metrics, "a") as fh:        # (this open is before the count below)
            fh.write(P.encode(_step(4)) + "\n")
        _OPENS.clear()
        tick = w.poll()
        job.rank_pids()
        job.alive()
        job.processes()
        opened = [p for p in _OPENS if Path(p).name == "metrics.jsonl"]
    finally:
        w.close()
    assert [m.step for m in tick.messages if isinstance(m, P.Step)] == [4]
    assert opened == []
