"""Issue 45: the ETA from the measured steps (the first, compile-bound ones left out), and the end's line of
predicted against measured tokens/s."""

from __future__ import annotations

import pytest

from shardconsole.headless import computed_rate, predicted_line, step_line
from shardconsole.plan.machine import Hardware
from shardconsole.runlog import protocol as P
from shardconsole.runlog.runstate import RunState, fmt_eta
from shardconsole.settings.resolve import resolve
from tests.conftest import messages, of_kind, shardconsole


def _state(lines: list[tuple[int, float]], steps: int = 100) -> RunState:
    state = RunState()
    for step, t in lines:
        state.apply(P.Step(run="r", rank=0, step=step, steps=steps, t=t, step_s=0.01, tokens_per_s=1.0))
    return state


def test_the_eta_leaves_out_what_came_before_the_first_lines():
    # the first line at 100 s (start, build, compile), then 2 s a step
    assert _state([(10, 100.0)]).eta_s() is None                       # one line: nothing measured yet
    assert _state([(10, 100.0), (20, 120.0)]).eta_s() == pytest.approx(80 * 2.0)
    # from 4 lines on the first interval (warm-up: 3 s a step) is left out too
    state = _state([(10, 100.0), (20, 130.0), (30, 150.0), (40, 170.0)])
    assert state.eta_s() == pytest.approx(60 * 2.0)
    assert "eta 2m00s" in step_line(state)
    state.apply(P.Finished(run="r", rank=0, steps=100))
    assert state.eta_s() is None
    assert (fmt_eta(45), fmt_eta(750), fmt_eta(11100)) == ("45s", "12m30s", "3h05m")


def test_a_resumed_session_measures_its_own_steps_again():
    state = _state([(10, 100.0), (20, 120.0)])
    state.new_session()
    state.apply(P.Step(run="r2", rank=0, step=21, steps=100, t=500.0))
    assert state.eta_s() is None


def test_the_end_says_predicted_against_measured():
    cfg = resolve("3090-7b-lora").cfg
    h200 = Hardware(1, 141 * 10**9, 125 * 2**30, "NVIDIA H200", cpus=16)
    line = predicted_line(cfg, 8000.0, h200)
    assert line.startswith("speed: predicted ") and "measured 8.0k" in line and "GPU bound" in line
    assert predicted_line(resolve("tiny-cpu").cfg, 8000.0, h200) == ""      # CPU ranks: no prediction
    # a DPO step line counts real tokens (issue 65); the prediction is of the rows computed, padding included
    dpo = P.Step(run="r", rank=0, step=5, tokens_per_s=800.0, padding=0.9)
    assert computed_rate(dpo) == pytest.approx(8000.0) and computed_rate(P.Step(tokens_per_s=800.0)) == 800.0


@pytest.mark.slow
def test_the_eta_after_a_few_steps_of_a_steady_run_is_within_a_quarter_of_the_real_end(tmp_path):
    """A real 2-rank run. The ETA the front ends show after the 4th step line, against the wall clock of the
    run's own lines: the time from that line to the last step line. Steady: rank 0 paces each step 500 ms
    longer (a test fault), so that the other work of a loaded machine moves the step time little."""
    run = tmp_path / "run"
    sets = ["train.steps=60", "train.log_every=5", "data.seq_len=256", "train.micro_batch=8",
            "train.save_final=none"]
    res = shardconsole("--preset", "tiny-cpu", "--headless", "--run-dir", str(run),
                       *[a for s in sets for a in ("--set", s)], timeout=600,
                       env={"SHARDCONSOLE_FAULT": "pace@rank=0,ms=500"})
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert " eta " in res.stdout
    msgs = messages(run)
    steps = of_kind(msgs, "step")
    assert [s.step for s in steps] == list(range(5, 61, 5))
    state = RunState()
    for m in msgs:
        state.apply(m)
        if isinstance(m, P.Step) and m.step == 20:
            eta = state.eta_s()
            break
    real = steps[-1].t - next(s.t for s in steps if s.step == 20)
    assert eta is not None and abs(eta - real) <= 0.25 * real, (eta, real)


async def test_the_console_says_predicted_against_measured_when_a_gpu_run_finishes(tmp_path):
    """A finished run on the fake probes' H200: the run screen's last line has the speed model's word."""
    from shardconsole.console.screens.run import RunScreen
    from tests.test_console_snapshots import attached_app
    from tests.test_console import wait_for, text_of, write_run
    run_dir = tmp_path / "runs" / "20260101-000000-gpu"
    write_run(run_dir, gpus=1, steps=5, total_steps=5, finished=True)
    app = attached_app(run_dir, alive=False)
    async with app.run_test(size=(200, 40)) as pilot:
        screen = await wait_for(pilot, lambda: isinstance(app.screen, RunScreen) and app.screen)
        await wait_for(pilot, lambda: screen.status == "finished")
        status = text_of(screen.query_one("#status"))
        assert "finished: 5 steps" in status and "; predicted " in status and "measured 62.1k" in status, status
