"""The run screen on the session layer (pilot tests with a fake launcher writing frozen streams): a stop
by another front end, the hang watch, the data summary and eval loss, and resuming an ended run."""

from __future__ import annotations

from pathlib import Path

from shardconsole.settings import config as C
from shardconsole.runlog import protocol as P
from shardconsole.launch.job import METRICS_FILE
from shardconsole.runlog.stream import MetricsWriter
from tests.test_console import T0, FakeJob, FakeLauncher, fake_session, make_app, text_of, wait_for, write_run


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
        return fake_session(self.jobs[-1], run_id, started_here=True)


async def test_an_ended_run_resumes_in_its_folder(tmp_path):
    run_dir = tmp_path / "runs" / "done"
    write_run(run_dir, gpus=0, device="cpu", steps=3, total_steps=5)
    # a stop as every stop path writes it: who asked (session/stop.announce), then the rank's own line
    _emit(run_dir, P.Event(run="done", rank=-1, t=T0 + 0.5, name="stop_requested", detail="`shardconsole stop` (pid 1)"),
          P.Failed(run="done", rank=0, t=T0 + 1, cause="stopped", message="stopped at step 3; saved it"))
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


async def test_at_80x24_the_panels_wrap_instead_of_cutting(tmp_path):
    """lr, samples/s and 'skipped' are drawn at 80 columns (packed into more lines, not cut off)."""
    run_dir = tmp_path / "runs" / "narrow"
    write_run(run_dir, gpus=0, device="cpu", steps=3)
    app = make_app(tmp_path, attach=run_dir)
    async with app.run_test(size=(80, 24)) as pilot:
        screen = await _run_screen(pilot, app)
        await wait_for(pilot, lambda: (s := screen.view.state.last_step) is not None and s.step == 3)
        await pilot.pause(0.2)
        for wid, words in (("#throughput-text", ("samples/s", "lr 3.00e-04", "tokens")),
                           ("#loss-text", ("loss scale n/a", "0 skipped")), ("#status", ("elapsed",))):
            widget = screen.query_one(wid)
            drawn = "\n".join(line.text for line in widget.render_lines(widget.region.reset_offset))
            for word in words:
                assert word in drawn, (wid, word, drawn)
        # The Logs panel (4 rows here) shows its newest lines, and stays where the user scrolled to.
        logs = screen.query_one("#logs")
        await wait_for(pilot, lambda: logs.max_scroll_y > 0 and logs.scroll_offset.y == logs.max_scroll_y,
                       what="the logs at their end")
        logs.scroll_to(y=0, animate=False)
        await pilot.pause()
        _emit(run_dir, P.Event(run="narrow", rank=0, t=T0 + 1, name="warning", detail="late"))
        await wait_for(pilot, lambda: any("warning: late" in line for line in logs.lines), what="the warning")
        await pilot.pause(0.2)
        assert logs.scroll_offset.y == 0
        logs.scroll_end(animate=False)
        await pilot.pause()
        _emit(run_dir, P.Event(run="narrow", rank=0, t=T0 + 2, name="warning", detail="later"))
        await wait_for(pilot, lambda: logs.scroll_offset.y == logs.max_scroll_y and "later" in logs.lines[-1],
                       what="following again")


async def test_an_op_build_shows_its_time_and_what_it_builds(tmp_path):
    """DeepSpeed's first op build takes minutes and says nothing while it runs: the status line counts
    the time from the phase's start and names the op and its folder; the Logs panel says it too."""
    import re
    import time
    from textual.widgets import Log
    run_dir = tmp_path / "runs" / "ops"
    write_run(run_dir, gpus=1, steps=0, cfg=C.build({"parallel": {"device": "cuda"}, "train": {"compile": True}}))
    now = time.time()
    detail = "CPUAdam (DeepSpeed JIT, ninja) in /cache/py311_cpu/cpu_adam: no build there yet, compiling"
    _emit(run_dir, P.Event(run="ops", rank=0, t=now - 95, name="phase", detail="building ops"),
          P.Event(run="ops", rank=0, t=now - 94, name="op_build", detail=detail))
    app = make_app(tmp_path, attach=run_dir)
    async with app.run_test(size=(120, 40)) as pilot:
        screen = await _run_screen(pilot, app)
        await wait_for(pilot, lambda: screen.view.building == detail, what="the op build")
        def shown() -> int:
            m = re.search(r"building ops (\d+)m(\d\d)s", text_of(screen.query_one("#status")))
            return 60 * int(m.group(1)) + int(m.group(2)) if m else -1
        await wait_for(pilot, lambda: shown() >= 95, what="the time since the phase began")
        assert detail in text_of(screen.query_one("#status"))
        lines = screen.query_one("#logs", Log).lines
        assert "    r0│ ▸ building ops" in lines and f"    r0│ ▸ building ops: {detail}" in lines
        assert "    r0│ ▸ training" in lines                # the phases of write_run, in order
        assert any("torch.compile (train.compile): the first steps compile" in line for line in lines)
        first = shown()
        await wait_for(pilot, lambda: shown() >= first + 2, timeout=15, what="the clock moving")


async def test_a_save_shows_its_bytes_and_is_not_a_hang(tmp_path):
    """A save of tens of GB (issue 30): the status line shows its bytes while it runs, the logs its end;
    with a hang limit far under the save's length the console does not stop it."""
    run_dir = tmp_path / "runs" / "saving"
    cfg = C.build({"parallel": {"device": "cpu"}, "train": {"hang_timeout_s": 0.5}})
    write_run(run_dir, gpus=0, device="cpu", steps=3, cfg=cfg)
    path = str(run_dir / "checkpoints" / "step_00000003")

    def progress(i: int, done: bool = False) -> P.SaveProgress:
        return P.SaveProgress(run="saving", rank=0, t=T0 + 1 + i, step=3, written_bytes=min(i * 12_000_000_000, 84 * 10**9),
                              total_bytes=84_000_000_000, elapsed_s=float(i), path=path, done=done)

    _emit(run_dir, P.Event(run="saving", rank=0, t=T0 + 1, name="phase", detail="saving checkpoint"), progress(1))
    launcher = FakeLauncher(tmp_path / "runs")
    app = make_app(tmp_path, attach=run_dir, launcher=launcher)
    async with app.run_test(size=(120, 40)) as pilot:
        screen = await _run_screen(pilot, app)
        screen.attached = False       # as if started here: a hung run it started, it stops
        for i in range(1, 8):          # about a second between progress lines, as the ranks send them
            if i > 1:
                _emit(run_dir, progress(i))
            await wait_for(pilot, lambda: f"saving step 3: {12.0 * i:.1f} / 84.0 GB, {i} s" in text_of(
                screen.query_one("#status")), what=f"the save's bytes at {i} s")
            await pilot.pause(0.3)
            assert screen.status == "running" and launcher.jobs[0].stops == 0
        _emit(run_dir, progress(7, done=True))
        await wait_for(pilot, lambda: screen.view.state.saving is None)
        assert "saving step" not in text_of(screen.query_one("#status")) and launcher.jobs[0].stops == 0


async def test_the_session_reads_the_folders_settings_once_so_an_edit_mid_run_changes_nothing(tmp_path):
    """Issue 29 item 2: the run session reads preset.toml when it begins and carries the settings. The
    run screen used to read it again on every "training" phase line: a preset.toml damaged meanwhile
    (an editor's half-written save) then lost the screen its torch.compile note."""
    from textual.widgets import Log
    run_dir = tmp_path / "runs" / "edited"
    run_dir.mkdir(parents=True)
    C.save(C.build({"parallel": {"device": "cuda"}, "train": {"compile": True, "hang_timeout_s": 600.0}}),
           run_dir / "preset.toml")
    _emit(run_dir, P.Hello(run="edited", rank=0, t=T0, world=1, pid=5000, device="cuda:0"),
          P.Event(run="edited", rank=0, t=T0, name="phase", detail="starting"))
    app = make_app(tmp_path, attach=run_dir)
    async with app.run_test(size=(120, 40)) as pilot:
        screen = await _run_screen(pilot, app)
        await wait_for(pilot, lambda: screen.view.state.phase == "starting", what="the first phase")
        (run_dir / "preset.toml").write_text("[train\ncompile = ")
        _emit(run_dir, P.Event(run="edited", rank=0, t=T0 + 1, name="phase", detail="training"),
              P.Step(run="edited", rank=0, t=T0 + 2, step=1, steps=9, loss=2.0, lr=1e-4, step_s=0.5))
        await wait_for(pilot, lambda: screen.view.state.last_step is not None, what="the first step")
        lines = screen.query_one("#logs", Log).lines
        assert any("torch.compile (train.compile): the first steps compile" in line for line in lines), lines
        assert screen.status == "running" and screen.session.hang_timeout_s == 600.0
