"""Issue 50 item 2: one answer to "what does Ctrl-C do". In `attach` (headless or the console) it leaves:
the run goes on and the front end says how to stop it (`s` in the console, `shardconsole stop`). The
front end that started the run stops it on Ctrl-C, and says so in its first line. Real runs: the tiny
model, 2 CPU ranks, started by the headless front end; the attach is a real process (headless) or the
console in Textual's pilot over the real launcher."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import assert_nothing_left, live_tiny_run, messages, of_kind, shardconsole, wait_for_steps
from tests.test_console import NO_GPU, FakeProbes, make_app, wait_for, write_run
from tests.test_runs import _read_until, _steps_in

@pytest.fixture
def live_run(tmp_path: Path) -> Iterator[tuple[Path, subprocess.Popen]]:
    """A run started by the headless front end, training for as long as the test wants."""
    run_dir = tmp_path / "run"
    with live_tiny_run(run_dir, "train.log_every=1", "train.save_on_stop=false", timeout=180,
                       stderr=subprocess.PIPE) as front:
        yield run_dir, front


def _goes_on_then_stop_ends_it(run_dir: Path, front: subprocess.Popen) -> None:
    """Nobody asked the run to stop; it trains on; `shardconsole stop` ends it, the front end that
    started it then reports "stopped" (130), and nothing is left."""
    assert not any(e.name == "stop_requested" for e in of_kind(messages(run_dir), "event"))
    n = _steps_in(run_dir)
    wait_for_steps(run_dir, n + 2, 60, front)          # the stream advances: the run went on
    assert front.poll() is None
    res = shardconsole("stop", str(run_dir), timeout=120)
    assert res.returncode == 0 and "none left" in res.stderr, res.stderr
    assert front.wait(60) == 130
    assert_nothing_left(run_dir, messages(run_dir))


@pytest.mark.slow
def test_ctrl_c_in_headless_attach_detaches_and_stop_ends_the_run(live_run):
    run_dir, front = live_run
    first = _read_until(front.stderr, lambda line: "Ctrl-C" in line, 30)[-1]
    assert first.startswith("run ") and "(Ctrl-C stops it;" in first, first      # the starter says so first
    attach = subprocess.Popen([sys.executable, "-m", "shardconsole", "attach", str(run_dir), "--headless"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    first = attach.stderr.readline()         # said before the history is replayed
    assert "Ctrl-C detaches" in first and f"shardconsole stop {run_dir}" in first, first
    n = _steps_in(run_dir)                   # the history ends at or before this step: a later one is live
    _read_until(attach.stdout, lambda line: line.startswith("step ") and int(line.split()[1].split("/")[0]) > n, 60)
    attach.send_signal(signal.SIGINT)
    _, err = attach.communicate(timeout=60)
    assert attach.returncode == 8, err
    assert "Traceback" not in err and "stopping" not in err, err
    assert "detached (Ctrl-C in attach): the run goes on" in err and f"`shardconsole stop {run_dir}` stops it" in err
    assert [e.detail.split(": ", 1)[1] for e in of_kind(messages(run_dir), "event")
            if e.name == "detached"] == ["Ctrl-C in attach; the run goes on"]
    _goes_on_then_stop_ends_it(run_dir, front)


@pytest.mark.slow
async def test_ctrl_c_in_the_console_attached_leaves_and_stop_ends_the_run(live_run, tmp_path):
    from shardconsole.console.screens.run import RunScreen
    from shardconsole.console.services import TorchrunLauncher
    run_dir, front = live_run
    app = make_app(tmp_path, attach=run_dir, launcher=TorchrunLauncher(tmp_path / "runs"),
                   probes=FakeProbes(unavailable=NO_GPU))
    async with app.run_test(size=(120, 40)) as pilot:
        screen = await wait_for(pilot, lambda: isinstance(app.screen, RunScreen) and app.screen)
        n = _steps_in(run_dir)
        await wait_for(pilot, lambda: (s := screen.view.state.last_step) is not None and s.step > n, what="a live step")
        assert screen.status == "running" and "ctrl+c leaves it running" in screen.sub_title, screen.sub_title
        # A key that ends the app never returns from pilot.press: it runs beside the test.
        press = asyncio.ensure_future(pilot.press("ctrl+c"))
        deadline = time.monotonic() + 30
        while app.return_value is None and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        press.cancel()
    assert app.return_value == run_dir and app.return_code == 8
    assert [e.detail.split(": ", 1)[1] for e in of_kind(messages(run_dir), "event")
            if e.name == "detached"] == ["Ctrl-C in the console (attach); the run goes on"]
    _goes_on_then_stop_ends_it(run_dir, front)


@pytest.mark.parametrize("how", ["key", "SIGINT"])
async def test_ctrl_c_in_the_console_that_started_the_run_asks_to_stop_it(tmp_path, how):
    """The console's own run: ctrl+c (a key in its terminal, or SIGINT to its process) is `s`: the stop
    question, which stops the run; the header says so from the start. Fake ranks: what is tested is the
    screen's answer."""
    from shardconsole.console.screens.run import RunScreen
    from tests.test_console import FakeLauncher
    launcher = FakeLauncher(tmp_path / "runs", write=lambda d: write_run(d, steps=3))
    app = make_app(tmp_path, launcher=launcher)
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.press("ctrl+r")
        screen = await wait_for(pilot, lambda: isinstance(app.screen, RunScreen) and app.screen)
        assert "ctrl+c stops it" in screen.sub_title, screen.sub_title
        if how == "key":
            await pilot.press("ctrl+c")
        else:
            signal.raise_signal(signal.SIGINT)      # the app's loop handles it (console/app.py)
        await wait_for(pilot, lambda: type(app.screen).__name__ == "ConfirmScreen", what="the stop question")
        await pilot.press("y")
        await wait_for(pilot, lambda: screen.status == "stopped", what="the stop")
    assert launcher.jobs[0].stops == 1 and launcher.jobs[0].stopped_by == "the console's s"
