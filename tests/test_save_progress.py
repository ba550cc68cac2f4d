"""A save of tens of GB takes tens of seconds (issue 30 item 6): the front ends show its bytes
(`saving step 3: 42.0 / 84.0 GB, 1 s`) and the hang watch counts them as progress, however short its
limit; a save whose bytes stop growing is a hang. Against a real process that saves as the ranks do
(tests/saving_rank.py: phase, protocol.SaveProgress about every SAVE_S / 20 s, done, finished)."""

from __future__ import annotations

import io
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shardconsole import headless
from shardconsole.launch.job import Job
from shardconsole.runlog import protocol as P
from shardconsole.runlog.runstate import RunState, save_line
from shardconsole.session.faults.hang import hang_message
from shardconsole.session.run import RunSession
from shardconsole.session.watcher import Watcher
from shardconsole.settings import config as C
from shardconsole.settings import preset_store
from tests.conftest import pids_alive

HERE = Path(__file__).resolve().parent


def _start(tmp_path: Path, save_s: float, mode: str) -> tuple[Path, subprocess.Popen, Job]:
    run = tmp_path / "run"
    run.mkdir()
    # a hang limit far shorter than the save: only the save's progress keeps the run from being judged hung
    C.save(preset_store.load("tiny-cpu", ["train.hang_timeout_s=0.3"]), run / "preset.toml")
    proc = subprocess.Popen([sys.executable, str(HERE / "saving_rank.py"), str(run), str(save_s), mode],
                            start_new_session=True)
    return run, proc, Job(run, proc.pid, proc.pid, [], proc)


@pytest.mark.parametrize("mode, what", [("progress", "step"), ("export", "the export of step")])
def test_a_slow_save_is_shown_and_is_not_a_hang(tmp_path, mode, what):
    """Also the export, which sends no phase line: the phase reads "training" and the steps have stopped."""
    run, proc, job = _start(tmp_path, save_s=3.0, mode=mode)
    out, err = io.StringIO(), io.StringIO()
    rc = headless.follow(RunSession(job, run, "run", started_here=True), out, err, grace_s=1.0)
    proc.wait(timeout=30)
    text = out.getvalue()
    assert rc == 0 and "hang" not in err.getvalue() + text, err.getvalue() + text
    lines = text.splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith(f"saving {what} 3: "))
    last = next(i for i, line in enumerate(lines) if line.startswith(f"saved {what} 3: 84.0 GB in "))
    step = next(i for i, line in enumerate(lines) if line.startswith("step 3/3"))
    assert step < first < last, text
    assert lines[first].endswith(" / 84.0 GB, 0 s") and " GB/s) to " in lines[last], text
    # without a terminal: the first line, then one each 10 s, then the end, not one a second
    assert sum(line.startswith(f"saving {what} 3") for line in lines) == 1, text


def test_a_save_whose_bytes_stop_growing_is_a_hang(tmp_path):
    run, proc, job = _start(tmp_path, save_s=1.0, mode="stall")
    w = Watcher(job, run, "run", logs=False, hang_timeout_s=0.3, save_stall_s=1.0)
    try:
        deadline, moved = time.monotonic() + 60, False
        while not w.hung():
            assert time.monotonic() < deadline, "a stalled save was never judged hung"
            w.poll()
            moved = moved or (w.state.saving is not None and w.state.saving.written_bytes > 0)
            time.sleep(0.05)
        assert moved and w.state.saving is not None and w.state.saving.written_bytes == 42_000_000_000
        message = hang_message(w.state, {}, w.stalled_for())
        assert message.startswith("no save progress for ") and "(saving step 3: 42.0 / 84.0 GB, " in message
    finally:
        proc.kill()
        proc.wait(timeout=30)
        w.close()
    assert pids_alive([proc.pid]) == []


def test_the_save_line_says_what_is_saved_and_how_fast():
    sp = P.SaveProgress(step=60, written_bytes=12_300_000_000, total_bytes=84_000_000_000, elapsed_s=9.2)
    assert save_line(sp) == "saving step 60: 12.3 / 84.0 GB, 9 s"
    done = P.SaveProgress(step=60, what="model", written_bytes=84_000_000_000, total_bytes=84_000_000_000,
                          elapsed_s=52.0, path="/ckpt/step_00000060", done=True)
    assert save_line(done) == "saved the model of step 60: 84.0 GB in 52 s (1.62 GB/s) to /ckpt/step_00000060"
    small = P.SaveProgress(rank=0, step=4, what="export", written_bytes=900_000, total_bytes=1_800_000, elapsed_s=0.4)
    assert save_line(small) == "saving the export of step 4: 0.9 / 1.8 MB, 0 s"
    state = RunState()
    state.apply(small)
    assert state.saving is small and headless.progress_bar(state, 100) == save_line(small)
    state.apply(P.SaveProgress(rank=0, step=4, what="export", written_bytes=1_800_000, done=True))
    assert state.saving is None
