"""The run screen on the session layer (pilot tests with a fake launcher writing frozen streams): a stop
by another front end, the hang watch, the data summary and eval loss, and resuming an ended run."""

from __future__ import annotations

from pathlib import Path

from shardconsole import config as C
from shardconsole import protocol as P
from shardconsole.launch import METRICS_FILE
from shardconsole.stream import MetricsWriter
from tests.test_console import T0, FakeJob, FakeLauncher, make_app, text_of, wait_for, write_run


async def _run_screen(pilot, app):
    from shardconsole.console.screens.run import RunScreen
    return await wait_for(pilot, lambda: isinstance(app.screen, RunScreen) and app.screen)


def _emit(run_dir: Path, *msgs: P.Message) -> None:
    w = MetricsWriter(run_dir / METRICS_FILE, run_dir.name, 0)
    for m in msgs:
        w.emit(m)
    w.close()


async def test_a_run_stopped_by_another_front_end_reads_stopped_not_failed(tmp_path):
    run_dir = tmp_path / "runs" / "shared"
    write_run(run_dir, gpus=0, device="cpu", steps=3)
    launcher = FakeLauncher(tmp_path / "runs")
    app = make_app(tmp_path, attach=run_dir, launcher=launcher)
    async with app.run_test(size=(120, 40)) as pilot:
        screen = await _run_screen(pilot, app)
        await wait_for(pilot, lambda: (s := screen.view.state.last_step) is not None and s.step == 3)
        # `shardconsole stop` elsewhere: it says so in the stream, then the ranks are gone
        _emit(run_dir, P.Event(run="shared", rank=-1, t=T0 + 1, name="stop_requested",
                               detail="`shardconsole stop` (pid 4242)"))
        launcher.jobs[0]._alive = False
        await wait_for(pilot, lambda: screen.status == "stopped", what="the stopped status")
        assert screen.outcome == "stopped" and "shardconsole stop" in text_of(screen.query_one("#status"))
        assert type(app.screen).__name__ != "ReportScreen"          # no failure report


async def test_the_console_watches_for_hangs_and_stops_a_hung_run(tmp_path):
    run_dir = tmp_path / "runs" / "hung"
    cfg = C.build({"parallel": {"device": "cpu"}, "train": {"hang_timeout_s": 2.0}})
    write_run(run_dir, gpus=0, device="cpu", steps=3, cfg=cfg)
    launcher = FakeLauncher(tmp_path / "runs", write=lambda d: None)
    app = make_app(tmp_path, attach=run_dir, launcher=launcher)
    async with app.run_test(size=(120, 40)) as pilot:
        screen = await _run_screen(pilot, app)
        screen.attached = False       # as if started here: a hung run it started, it stops
        await wait_for(pilot, lambda: screen.status == "stopped", timeout=30, what="the hang stop")
        assert screen.outcome == "hang" and launcher.jobs[0].stops == 1
        assert launcher.jobs[0].stopped_by.startswith("the console: hang, no step for")


async def test_the_data_summary_and_the_eval_loss_are_shown(tmp_path):
    run_dir = tmp_path / "runs" / "evals"
    write_run(run_dir, gpus=0, device="cpu", steps=3)
    _emit(run_dir, P.DataSummary(run="evals", rank=0, t=T0, source="chat.jsonl", format="chat", tokenizer="my-llama",
                                 records=120, tokens=30_000, samples=58, loss_share=0.42, epochs=1.5),
          P.Eval(run="evals", rank=0, t=T0, step=2, loss=7.25, tokens=4096),
          P.Eval(run="evals", rank=0, t=T0, step=3, loss=6.5, tokens=4096))
    app = make_app(tmp_path, attach=run_dir)
    async with app.run_test(size=(120, 40)) as pilot:
        screen = await _run_screen(pilot, app)
        await wait_for(pilot, lambda: len(screen.view.eval_loss) == 2, what="the eval points")
        await wait_for(pilot, lambda: "eval 6.5000 at step 3" in text_of(screen.query_one("#loss-text")))
        text = text_of(screen.query_one("#loss-text"))
        assert "data chat: 120 records, 30000 tokens, 58 samples, 42% under loss, 1.50 epochs" in text
        assert "tokenizer my-llama" in text
        assert screen.view.eval_loss.ys == [7.25, 6.5]


class ResumingLauncher(FakeLauncher):
    def __init__(self, *a, **k) -> None:
        super().__init__(*a, **k)
        self.resumed: list[Path] = []

    def resume(self, run_dir: Path):
        self.resumed.append(run_dir)
        run_id = f"{run_dir.name}-resume-1"
        _emit(run_dir, P.Hello(run=run_id, rank=0, t=T0 + 10, world=1, pid=7000, host="node-b"),
              P.Step(run=run_id, rank=0, t=T0 + 11, step=4, steps=5, loss=1.0, lr=1e-4))
        self.jobs.append(FakeJob(run_dir, alive=True))
        return self.jobs[-1], run_id


async def test_an_ended_run_resumes_in_its_folder(tmp_path):
    run_dir = tmp_path / "runs" / "done"
    write_run(run_dir, gpus=0, device="cpu", steps=3, total_steps=5)
    _emit(run_dir, P.Failed(run="done", rank=0, t=T0 + 1, cause="stopped", message="stopped at step 3; saved it"))
    launcher = ResumingLauncher(tmp_path / "runs", alive=False)
    app = make_app(tmp_path, attach=run_dir, launcher=launcher)
    async with app.run_test(size=(120, 40)) as pilot:
        screen = await _run_screen(pilot, app)
        await wait_for(pilot, lambda: screen.status == "stopped", what="the earlier stop")
        assert screen.check_action("resume", ()) is True
        await pilot.press("r")
        await wait_for(pilot, lambda: screen.status == "running" and screen.run_id == "done-resume-1",
                       what="the resumed session")
        await wait_for(pilot, lambda: (s := screen.view.state.last_step) is not None and s.step == 4)
        assert launcher.resumed == [run_dir] and screen.check_action("resume", ()) is False
        _emit(run_dir, P.Finished(run="done-resume-1", rank=0, t=T0 + 12, steps=5))
        launcher.jobs[-1]._alive = False
        await wait_for(pilot, lambda: screen.status == "finished", what="the resumed run's end")
