"""The one stop path (session/stop.py) against real processes that take their time on SIGTERM: a rank
that announces a checkpoint save is waited for past the grace period; a second Ctrl-C (hurry) skips the
wait; a rank that announces nothing gets SIGKILL after the grace period."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

from shardconsole.settings import config as C
from shardconsole.settings import preset_store
from shardconsole.launch.job import Job
from shardconsole.session.stop import Hurry, stop_run
from tests.conftest import messages, of_kind, pids_alive

HERE = Path(__file__).resolve().parent


def _start(tmp_path, save_s: float):
    run = tmp_path / "run"
    run.mkdir()
    C.save(preset_store.load("tiny-cpu"), run / "preset.toml")
    proc = subprocess.Popen([sys.executable, str(HERE / "saving_rank.py"), str(run), str(save_s)],
                            start_new_session=True)
    deadline = time.monotonic() + 60
    while not ((run / "metrics.jsonl").exists() and of_kind(messages(run), "hello")):
        assert time.monotonic() < deadline and proc.poll() is None, "the rank never said hello"
        time.sleep(0.02)
    return run, proc, Job(run, proc.pid, proc.pid, [], proc)


def test_a_rank_saving_on_stop_is_waited_for_past_the_grace_period(tmp_path):
    # A grace of seconds, not tenths: the rank must have said stop_save by its end, on a loaded machine too.
    run, proc, job = _start(tmp_path, save_s=4.0)
    report = stop_run(job, [proc.pid], who="test", grace_s=2.0, save_timeout_s=60, check_gpus=False)
    assert not report.killed and report.clean        # ended by itself, after its save
    assert 3.5 < report.seconds < 55, report.seconds
    assert any(e.name == "stop_requested" and e.detail == "test" for e in of_kind(messages(run), "event"))


def test_a_second_interrupt_skips_the_wait_for_the_save(tmp_path):
    run, proc, job = _start(tmp_path, save_s=600)
    hurry = Hurry()
    out = {}
    stopper = threading.Thread(target=lambda: out.update(r=stop_run(job, [proc.pid], who="test", grace_s=2.0,
                                                                    save_timeout_s=600, hurry=hurry,
                                                                    check_gpus=False)))
    stopper.start()
    deadline = time.monotonic() + 30      # the rank is saving: the stop waits (and would, for 600 s)
    while not any(e.name == "stop_save" for e in of_kind(messages(run), "event")):
        assert time.monotonic() < deadline, "no stop_save event"
        time.sleep(0.02)
    stopper.join(timeout=1.0)
    assert stopper.is_alive(), "the stop did not wait for the save"
    hurry.set()                            # Ctrl-C again / `s` again
    stopper.join(timeout=15)
    assert not stopper.is_alive() and out["r"].killed and out["r"].clean
    assert pids_alive([proc.pid]) == []


def test_a_rank_deaf_to_sigterm_is_killed_after_the_grace_period(tmp_path):
    run, proc, job = _start(tmp_path, save_s=-1)
    report = stop_run(job, [proc.pid], who="test", grace_s=0.5, save_timeout_s=600, check_gpus=False)
    assert report.killed and report.clean and report.seconds < 10


def test_a_folder_whose_settings_cannot_be_read_waits_the_default_stop_save(tmp_path):
    """The console, headless, RunSession and `shardconsole stop` fall back to one budget for a folder whose
    preset.toml is unreadable: the default settings' (they held 120 s and 300 s apart)."""
    from shardconsole.session.outcome import stop_save_timeout
    from shardconsole.settings import config as C
    (tmp_path / "preset.toml").write_text("[train\nsteps = ")
    assert stop_save_timeout(tmp_path) == C.TrainSettings().stop_save_timeout_s
    cfg = C.RunConfig()
    cfg.train.stop_save_timeout_s = 42.0
    C.save(cfg, tmp_path / "preset.toml")
    assert stop_save_timeout(tmp_path) == 42.0
