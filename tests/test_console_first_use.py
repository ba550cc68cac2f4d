"""Issue 49 in the console: what a new user trips on there (attach to a finished run, the data preview
from every data field, the stop dialog's words, the Logs panel's library noise). Real run folders where
it is about runs; the pilot at 120x40 and 80x24 where it is about the screen."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import pytest

from shardconsole.runlog import protocol as P
from tests.test_console import make_app, text_of, wait_for


def _run_span(run: Path) -> float:
    """How long the run took by its ranks' own first and last lines."""
    ts = [m.t for m in (P.decode(ln) for ln in (run / "metrics.jsonl").read_text().splitlines()) if m.rank >= 0]
    return max(ts) - min(ts)


def _files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("size", [(120, 40), (80, 24)])
async def test_attach_to_a_finished_run_writes_nothing_and_says_how_long_it_took(fsdp_tiny_run, tmp_path, size):
    from shardconsole.console.screens.run import RunScreen
    from shardconsole.console.services import TorchrunLauncher
    from shardconsole.console.widgets.run_panels import duration
    from shardconsole.session.watcher import MachineProbes
    run = tmp_path / fsdp_tiny_run.run.name
    shutil.copytree(fsdp_tiny_run.run, run)
    # A host sample an earlier attach appended after the finished line, twenty minutes on: the duration
    # is the run's own still.
    with open(run / "metrics.jsonl", "a") as fh:
        fh.write(P.encode(P.HostSample(run=run.name, t=time.time() + 1200, used_bytes=1, total_bytes=2)) + "\n")
    before = _files(run)
    app = make_app(tmp_path, attach=run, launcher=TorchrunLauncher(tmp_path / "runs"), probes=MachineProbes())
    async with app.run_test(size=size) as pilot:
        screen = await wait_for(pilot, lambda: isinstance(app.screen, RunScreen) and app.screen)
        await wait_for(pilot, lambda: screen.status == "finished", what="the end of the replay")
        note = str(screen.note)
        assert f"finished: 12 steps in {duration(_run_span(run))};" in note, note
    assert _files(run) == before


# --- item 3: the data preview from every field of the data tab -------------------------------------

def _footer_keys(app) -> list[str]:
    from textual.widgets._footer import FooterKey
    return [k.description for k in app.screen.query(FooterKey)]


@pytest.mark.parametrize("size", [(120, 40), (80, 24)])
@pytest.mark.parametrize("key,text", [("path", "typed.jsonl"), ("seq_len", "48"), ("source", None)])
async def test_ctrl_d_previews_from_every_data_field(tmp_path, monkeypatch, size, key, text):
    """The footer names ^d Preview wherever the focus is on the data tab, and ctrl+d previews the values
    as just typed (a text field's own ctrl+d, delete-right, swallowed the key)."""
    from textual.widgets import Input
    from shardconsole.console import tryout
    from shardconsole.console.screens.dialogs import ReportScreen
    from rich.text import Text
    from tests.test_console import show_table
    asked = []
    monkeypatch.setattr(tryout, "preview", lambda cfg, records=3: (asked.append(cfg), ("Data preview", Text("ok")))[1])
    data = tmp_path / "typed.jsonl"
    data.write_text('{"text": "hello there"}\n' * 4)
    monkeypatch.chdir(tmp_path)
    app = make_app(tmp_path, overrides=["data.source=auto", f"data.path={tmp_path / 'first.jsonl'}"])
    (tmp_path / "first.jsonl").write_text('{"text": "first"}\n' * 4)
    async with app.run_test(size=size) as pilot:
        setup = app.setup_screen
        await wait_for(pilot, lambda: setup.machine.detected)
        await show_table(pilot, setup, "data")
        field = setup.query_one(f"#field-data-{key}")
        control = field.query_one(".setting--control")
        control.focus()
        await wait_for(pilot, lambda: app.focused is control, what="the focus in the field")
        if text is not None:
            assert isinstance(control, Input)
            control.value = ""
            await pilot.press(*text)
            await wait_for(pilot, lambda: field.text == text)
        await pilot.pause()
        assert "Preview" in _footer_keys(app), _footer_keys(app)
        await pilot.press("ctrl+d")
        await wait_for(pilot, lambda: isinstance(app.screen, ReportScreen), what="the preview")
    assert len(asked) == 1
    if key == "path":
        assert asked[0].data.path == "typed.jsonl"
    elif key == "seq_len":
        assert asked[0].data.seq_len == 48


# --- item 6: the stop dialog's words, and the step a save on stop reached ---------------------------

@pytest.mark.parametrize("size", [(120, 40), (80, 24)])
@pytest.mark.parametrize("save_on_stop", [True, False])
async def test_the_stop_dialog_says_what_the_runs_save_on_stop_does(tmp_path, size, save_on_stop):
    from shardconsole.console.screens.run import RunScreen
    from shardconsole.runlog.stream import MetricsWriter
    from shardconsole.settings import config as C
    from tests.test_console import FakeLauncher, write_run
    run_dir = tmp_path / "runs" / "live"
    cfg = C.build({"parallel": {"nproc_per_node": 2, "device": "cpu"},
                   "train": {"save_on_stop": save_on_stop, "stop_save_timeout_s": 120}})
    write_run(run_dir, gpus=0, device="cpu", steps=12, total_steps=30, cfg=cfg)
    # the ranks saved on stop at step 13, between two step lines (log_every 3: the last step line is 12)
    w = MetricsWriter(run_dir / "metrics.jsonl", "live", 0)
    w.emit(P.Event(run="live", rank=0, name="phase", detail="saving checkpoint", step=13))
    w.emit(P.Event(run="live", rank=0, name="checkpoint_saved", detail=str(run_dir / "checkpoints" / "step_00000013"),
                   step=13))
    w.close()
    app = make_app(tmp_path, attach=run_dir, launcher=FakeLauncher(tmp_path / "runs", alive=True))
    async with app.run_test(size=size) as pilot:
        screen = await wait_for(pilot, lambda: isinstance(app.screen, RunScreen) and app.screen)
        await wait_for(pilot, lambda: (s := screen.view.state.last_step) is not None and s.step == 12)
        await wait_for(pilot, lambda: "step 13/30" in text_of(screen.query_one("#status")), what="step 13 shown")
        await pilot.press("s")
        ask = await wait_for(pilot, lambda: type(app.screen).__name__ == "ConfirmScreen" and app.screen)
        body = text_of(ask.query_one("#body"))
        if save_on_stop:
            assert "are lost" not in body and "save a checkpoint at the next step boundary" in body, body
            assert "120 s" in body and "resume" in body, body
        else:
            assert "Steps since the last checkpoint are lost (train.save_on_stop is off)" in body, body
        await pilot.press("n")


# --- item 7: known-harmless library noise left out of the Logs panel, kept in the rank log ----------

@pytest.mark.parametrize("size", [(120, 40), (80, 24)])
async def test_library_noise_is_left_out_of_the_logs_panel_and_kept_in_the_rank_log(tmp_path, size):
    """What `import peft` prints (torchao's optional kernels a CPU build lacks, torch's _pytree
    deprecations) is what every LoRA rank's log starts with: real output of the real import here."""
    import subprocess
    import sys
    from textual.widgets import Log
    from shardconsole.console.screens.run import RunScreen
    from tests.test_console import FakeLauncher, write_run
    noise = subprocess.run([sys.executable, "-c", "import peft"], capture_output=True, text=True, timeout=120).stderr
    assert "_C_mxfp8" in noise and "_pytree" in noise, noise     # the library still says it: the test means something
    run_dir = tmp_path / "runs" / "lora"
    write_run(run_dir, gpus=0, device="cpu", steps=3, total_steps=30)
    log = run_dir / "logs" / "rank0.log"
    log.write_text(noise + "[rank 0] a line of the run's own\n" + log.read_text())
    before = log.read_bytes()
    app = make_app(tmp_path, attach=run_dir, launcher=FakeLauncher(tmp_path / "runs", alive=True))
    async with app.run_test(size=size) as pilot:
        screen = await wait_for(pilot, lambda: isinstance(app.screen, RunScreen) and app.screen)
        logs = screen.query_one("#logs", Log)
        await wait_for(pilot, lambda: any("a line of the run's own" in ln for ln in logs.lines), what="the log")
        shown = "\n".join(logs.lines)
        assert "_C_mxfp8" not in shown and "_C_cutlass" not in shown and "Enum subclass" not in shown, shown
        assert "[rank 0] step 1 done" in shown
        assert "library notice(s) left out" in str(logs.border_subtitle)
    assert log.read_bytes() == before


# --- item 12: an offload preset on a GPU where the model fits without it ---------------------------

def test_the_launch_says_when_a_presets_offload_is_not_needed():
    """The planner (real) on a 24 GiB card: 3090-offload's 1b fits without offload, 3090-7b-offload's 7b
    does not; an offload the user set is not questioned."""
    from shardconsole.plan.machine import Hardware
    from shardconsole.session import preflight
    from shardconsole.settings import resolve as S
    card = Hardware(gpus=1, gpu_memory_bytes=24 << 30, host_memory_bytes=256 << 30)
    line = preflight.offload_not_needed(S.resolve("3090-offload", []), 1, hardware=card)
    assert line is not None and "--set fsdp.cpu_offload=false" in line and "1b" in line, line
    assert len(line.splitlines()) == 1
    assert preflight.offload_not_needed(S.resolve("3090-7b-offload", []), 1, hardware=card) is None
    chosen = S.resolve("3090-offload", S.from_cli(["fsdp.cpu_offload=true"]))
    assert preflight.offload_not_needed(chosen, 1, hardware=card) is None
    two = Hardware(gpus=2, gpu_memory_bytes=24 << 30, host_memory_bytes=256 << 30)
    ds = preflight.offload_not_needed(S.resolve("4090x2-zero3", []), 2, hardware=two)
    assert ds is not None and "--set deepspeed.offload_optimizer=none" in ds, ds


async def test_the_consoles_launch_says_so_in_one_line(tmp_path):
    from shardconsole.console.screens.run import RunScreen
    from shardconsole.console.services import load_plan
    from tests.test_console import FakeLauncher, FakeProbes, gpu_sample
    probes = FakeProbes(gpus=[gpu_sample(0, 0.5)])
    app = make_app(tmp_path, preset="3090-offload", probes=probes, launcher=FakeLauncher(tmp_path / "runs"),
                   planner=load_plan)
    async with app.run_test(size=(120, 40)) as pilot:
        await wait_for(pilot, lambda: app.setup_screen.machine.detected)
        await pilot.press("ctrl+r")
        await wait_for(pilot, lambda: isinstance(app.screen, RunScreen), what="the launch")
        said = [str(n.message) for n in app._notifications]
        assert any("offload is not needed here" in m and "--set fsdp.cpu_offload=false" in m for m in said), said


# --- item 9 (part): the runs table keeps its figures on a 120-column screen --------------------------

async def test_the_runs_table_shows_every_figure_at_120_columns_for_a_run_of_a_model_folder(fsdp_chat_run, tmp_path):
    """A run of a local model folder: the table named the folder's whole path, and peak host and the
    losses went off the right edge. It names the folder; the detail line under it, the path."""
    from textual.widgets import DataTable
    from shardconsole.console.services import TorchrunLauncher
    root = tmp_path / "runs"
    root.mkdir()
    shutil.copytree(fsdp_chat_run.run, root / "20261204-181512-my-chat-lora")
    app = make_app(tmp_path, launcher=TorchrunLauncher(root))
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.press("ctrl+l")
        await wait_for(pilot, lambda: type(app.screen).__name__ == "RunsScreen")
        table = app.screen.query_one("#runs-table", DataTable)
        await wait_for(pilot, lambda: table.row_count == 1, what="the run listed")
        await pilot.pause()
        labels = [str(c.label) for c in table.ordered_columns]
        widths = [c.get_render_width(table) for c in table.ordered_columns]
        assert sum(widths[:labels.index("eval loss") + 1]) <= table.region.width, list(zip(labels, widths))
        assert table.get_row_at(0)[labels.index("model")] == "model"
        assert str(fsdp_chat_run.model) in text_of(app.screen.query_one("#detail"))
