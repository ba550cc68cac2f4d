"""How the console looks (pytest-textual-snapshot), at 120x40 and at 80x24, with frozen samples.

The app gets fake probes (two H200s, or no GPU), a fake launcher whose run folder name and command are
fixed, a fixed memory estimate, and a pre-written metrics.jsonl: nothing here depends on the clock or
on this machine. Update after a deliberate change of the look: pytest tests/test_console_snapshots.py
--snapshot-update, then look at the SVGs under tests/__snapshots__/.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from tests import test_console as TC
from tests.test_console import FakeLauncher, FakeProbes, gpu_sample, show_table, wait_for, write_run

# test_console's planner for frozen screens (being renamed fixed_planner -> real_planner by the settings work)
fixed_planner = getattr(TC, "real_planner", None) or TC.fixed_planner

from shardconsole.console.app import ShardConsoleApp
from shardconsole.console.services import RunOptions

WIDE, NARROW = (120, 40), (80, 24)
TWO_GPUS = [gpu_sample(0, 21.5, pids=(5000,)), gpu_sample(1, 22.9, pids=(5001,))]


@pytest.fixture
def in_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Run folders and the user's presets folder are relative (runs/..., my-presets/...), so the paths
    on screen are the same on every machine."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("SHARDCONSOLE_PRESETS_DIR", "my-presets")
    return tmp_path


def setup_app(preset: str = "tiny-cpu", probes: FakeProbes | None = None, **kw: Any) -> ShardConsoleApp:
    return ShardConsoleApp(FakeLauncher(Path("runs"), **kw), probes or FakeProbes(gpus=TWO_GPUS), preset=preset,
                           planner=fixed_planner)


async def machine_known(pilot: Any) -> None:
    await wait_for(pilot, lambda: pilot.app.setup_screen.machine.detected)
    await pilot.pause()


async def still(pilot: Any) -> None:
    """No blinking cursor and no tab underline on its way: a snapshot must not depend on when it is taken."""
    from textual.widgets import Input
    from textual.widgets import DataTable
    for screen in pilot.app.screen_stack:
        for widget in screen.query(Input):
            widget.cursor_blink = False
    await pilot.wait_for_scheduled_animations()
    await pilot.pause()
    # A DataTable measures its columns when the app is idle: on a loaded machine the picture could be
    # taken between the rows and their widths (CI once froze "20" for the run id). Wait for that idle.
    tables = [t for screen in pilot.app.screen_stack for t in screen.query(DataTable)]
    await wait_for(pilot, lambda: not any(t._require_update_dimensions or t._updated_cells for t in tables),
                   what="the tables' column widths")
    await pilot.pause()


def attached_app(run_dir: Path, alive: bool = True) -> ShardConsoleApp:
    """The run screen shows the frozen stream alone: the console takes no samples of its own (their
    timing would move the curves), except the look at the GPUs after a stop."""
    probes = FakeProbes.like(run_dir)
    return ShardConsoleApp(FakeLauncher(Path("runs"), alive=alive, on_stop=probes.free), probes, attach=run_dir,
                           planner=fixed_planner, run_options=RunOptions(sample=False))


def until_step(step: int) -> Any:
    async def run_before(pilot: Any) -> None:
        await wait_for(pilot, lambda: type(pilot.app.screen).__name__ == "RunScreen")
        screen = pilot.app.screen
        await wait_for(pilot, lambda: screen.view.state.last_step and screen.view.state.last_step.step == step)
        await wait_for(pilot, lambda: screen.view.state.host is not None)
        await pilot.pause(0.3)
    return run_before


# --- the setup screen ------------------------------------------------------------------------------

@pytest.mark.parametrize("size", [WIDE, NARROW], ids=["120x40", "80x24"])
def test_setup_pick(snap_compare, in_tmp, size):
    assert snap_compare(setup_app(), terminal_size=size, run_before=machine_known)


def test_setup_invalid_value_at_its_field(snap_compare, in_tmp):
    async def run_before(pilot: Any) -> None:
        await machine_known(pilot)
        for _ in range(3):
            await pilot.press("ctrl+n")
        await pilot.press("end", "backspace", "backspace", "0")
        await still(pilot)
    assert snap_compare(setup_app(), terminal_size=NARROW, run_before=run_before)


def test_setup_deepspeed_table(snap_compare, in_tmp):
    async def run_before(pilot: Any) -> None:
        await machine_known(pilot)
        await show_table(pilot, pilot.app.setup_screen, "deepspeed")
        await still(pilot)
    assert snap_compare(setup_app("4090x2-zero3"), terminal_size=WIDE, run_before=run_before)


def test_save_preset_dialog(snap_compare, in_tmp):
    async def run_before(pilot: Any) -> None:
        await machine_known(pilot)
        await pilot.press("ctrl+s")
        await wait_for(pilot, lambda: type(pilot.app.screen).__name__ == "SavePresetScreen")
        await still(pilot)
    assert snap_compare(setup_app(), terminal_size=NARROW, run_before=run_before)


# --- the run screen --------------------------------------------------------------------------------

@pytest.mark.parametrize("size", [WIDE, NARROW], ids=["120x40", "80x24"])
def test_run_two_gpus(snap_compare, in_tmp, size):
    run_dir = Path("runs/20260101-000000-h200")
    write_run(run_dir, gpus=2, steps=12)
    assert snap_compare(attached_app(run_dir), terminal_size=size, run_before=until_step(12))


def test_run_on_cpu_without_a_gpu(snap_compare, in_tmp):
    run_dir = Path("runs/20260101-000000-tiny-cpu")
    write_run(run_dir, gpus=0, device="cpu", steps=8, total_steps=8, finished=True)
    assert snap_compare(attached_app(run_dir, alive=False), terminal_size=WIDE, run_before=until_step(8))


def test_run_stopped_report(snap_compare, in_tmp):
    run_dir = Path("runs/20260101-000000-h200")
    write_run(run_dir, gpus=2, steps=5)

    async def run_before(pilot: Any) -> None:
        await until_step(5)(pilot)
        await pilot.press("s")
        await wait_for(pilot, lambda: type(pilot.app.screen).__name__ == "ConfirmScreen")
        await pilot.press("y")
        await wait_for(pilot, lambda: type(pilot.app.screen).__name__ == "ReportScreen")
        await pilot.pause()
    assert snap_compare(attached_app(run_dir), terminal_size=WIDE, run_before=run_before)


# --- 80x24, as README promises (issue 36 item 8) ---------------------------------------------------

def test_setup_backend_in_view_at_80x24(snap_compare, in_tmp):
    """Tab from the model list to the backend choice: it scrolls into view, focused."""
    async def run_before(pilot: Any) -> None:
        await machine_known(pilot)
        await pilot.press("tab", "tab")
        await wait_for(pilot, lambda: pilot.app.focused is pilot.app.setup_screen.query_one("#backend"))
        await still(pilot)
    assert snap_compare(setup_app(), terminal_size=NARROW, run_before=run_before)


def test_runs_screen_at_80x24(snap_compare, in_tmp, monkeypatch):
    """The runs root and ./runs (README's --run-dir runs/my-chat), status and steps next to the id."""
    monkeypatch.setenv("SHARDCONSOLE_RUNS_ROOT", "root")
    write_run(Path("root/20260101-000001-tiny-cpu"), gpus=0, device="cpu", steps=3, total_steps=3, finished=True)
    write_run(Path("runs/my-chat"), gpus=0, device="cpu", steps=2, total_steps=2, finished=True)
    for folder, t in (("root/20260101-000001-tiny-cpu", 2_000_000_000), ("runs/my-chat", 1_999_999_000)):
        os.utime(Path(folder) / "preset.toml", (t, t))       # the order (newest first) fixed

    async def run_before(pilot: Any) -> None:
        await machine_known(pilot)
        await pilot.press("ctrl+l")
        await wait_for(pilot, lambda: type(pilot.app.screen).__name__ == "RunsScreen"
                       and pilot.app.screen.query_one("DataTable").row_count == 2)
        # The ids measured into their column (CI twice pictured the table between its rows and their
        # widths: "20" for the id, every column at its label's width).
        table = pilot.app.screen.query_one("DataTable")
        await wait_for(pilot, lambda: max(c.content_width for c in table.columns.values())
                       >= len("20260101-000001-tiny-cpu"), what="the id column's width")
        await still(pilot)
    app = ShardConsoleApp(FakeLauncher(Path("root")), FakeProbes(gpus=TWO_GPUS), preset="tiny-cpu",
                          planner=fixed_planner)
    assert snap_compare(app, terminal_size=NARROW, run_before=run_before)
