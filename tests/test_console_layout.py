"""Issue 49 item 9: what the console's tables and forms give up on a small terminal. The runs table after
ctrl+l from an attach (real tiny-cpu run folders), and the setup screen's Pick tab against its summary;
through the pilot at 80x24 and 120x40, reading what is drawn."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest

from shardconsole.console.screens.runs import COLUMNS
from tests.test_console import make_app, real_planner, show_table, wait_for

SIZES = [(80, 24), (120, 40)]
ID = "20261204-181512-tiny-cpu"
LONG_ID = "20261204-181512-llama-8b-chat-lora-r64-sweep"     # a --run-dir name; over the 30 the table gives


def drawn(widget: Any) -> list[str]:
    """The rows of a widget as they are on the screen (its scroll position and its region)."""
    return [strip.text for strip in widget.render_lines(widget.region.reset_offset)]


async def _attach_then_runs(pilot: Any, app: Any) -> Any:
    from textual.widgets import DataTable
    from shardconsole.console.screens.run import RunScreen
    await wait_for(pilot, lambda: isinstance(app.screen, RunScreen), what="the attach")
    await pilot.press("ctrl+l")
    await wait_for(pilot, lambda: type(app.screen).__name__ == "RunsScreen", what="the runs screen")
    table = app.screen.query_one("#runs-table", DataTable)
    await wait_for(pilot, lambda: table.row_count == 2, what="both runs listed")
    return table


@pytest.mark.parametrize("size", SIZES, ids=["80x24", "120x40"])
async def test_the_runs_table_after_an_attach_keeps_ids_and_status_readable(fsdp_tiny_run, tmp_path, size,
                                                                           monkeypatch):
    """ctrl+l from an attach: the columns are as wide as their cells from the first frame the rows are in
    (a table drawn before it measured showed "20" for the id and "runnin"); at 80 columns the table
    scrolls sideways with the id and the status in place; at 120 columns peak host and both losses are in
    view beside a long run id (cut to 30 with "…", its folder whole on the detail line)."""
    from textual.widgets import DataTable
    from shardconsole.console.screens.runs import RunsScreen
    from shardconsole.console.services import TorchrunLauncher
    from shardconsole.session.watcher import MachineProbes
    root = tmp_path / "runs"
    for name in (ID, LONG_ID):
        shutil.copytree(fsdp_tiny_run.run, root / name)
    first: list[dict[str, int]] = []
    show = RunsScreen._show

    def widths_as_the_rows_go_in(self: RunsScreen, runs: Any) -> None:
        show(self, runs)                 # the real method; the widths read before the table next idles
        table = self.query_one("#runs-table", DataTable)
        first.append({str(c.label): c.get_render_width(table) - 2 * table.cell_padding for c in table.ordered_columns})

    monkeypatch.setattr(RunsScreen, "_show", widths_as_the_rows_go_in)
    app = make_app(tmp_path, attach=root / ID, launcher=TorchrunLauncher(root), probes=MachineProbes())
    async with app.run_test(size=size) as pilot:
        table = await _attach_then_runs(pilot, app)
        assert first and first[0]["id"] >= len(ID) and first[0]["status"] >= len("finished"), first
        await pilot.pause()
        rows = drawn(table)
        header, lines = rows[0], "\n".join(rows)
        assert ID in lines and LONG_ID[:29] + "…" in lines and lines.count("finished") == 2, lines
        if size[0] >= 120:
            for label in ("peak host", "last loss", "eval loss"):
                assert label in header, header
            assert "MiB" in lines or "GiB" in lines, lines
        else:       # sideways, a column at a time: each label comes whole into view beside the id and status
            headers = [header]
            while table.scroll_x < table.max_scroll_x:
                await pilot.press("right")
                headers.append(drawn(table)[0])
                assert ID in "\n".join(drawn(table)), drawn(table)
            assert all("id" in h and "status" in h for h in headers), headers
            assert all(any(f"  {label}  " in h + "  " for h in headers) for label in COLUMNS if label), headers
        at = [r.run_id for r in app.screen.runs].index(LONG_ID)
        table.move_cursor(row=at)
        await wait_for(pilot, lambda: LONG_ID in str(app.screen.query_one("#detail").render()), what="its folder")


@pytest.mark.parametrize("size", SIZES, ids=["80x24", "120x40"])
async def test_the_pick_tab_shows_backend_and_method_and_the_summary_its_verdict(tmp_path, size):
    """80x24: the summary took 12 of the 20 rows (the Pick tab had 7: Backend and Method below its edge,
    a form 6 rows). Backend and Method are in view above the summary, a form has more rows than the
    summary, and the problem line and the estimate with its verdict ("fits") are drawn whole."""
    app = make_app(tmp_path, preset="3090-offload", planner=real_planner)
    async with app.run_test(size=size) as pilot:
        setup = app.setup_screen
        await wait_for(pilot, lambda: setup.machine.detected)
        await pilot.pause()
        summary = setup.query_one("#summary").region
        column = setup.query_one("#model-picker")
        assert column.scroll_y == 0
        buttons = list(setup.query("#backend RadioButton")) + list(setup.query("#method RadioButton"))
        assert len(buttons) == 5
        for button in buttons:              # each one whole on the screen, above the summary
            assert column.region.contains_region(button.region) and button.region.bottom <= summary.y, \
                (button.id, button.region, column.region, summary)
            assert str(button.label)[:8] in drawn(button)[0], (button.id, drawn(button))
        for wid in ("#problems", "#estimate"):
            text = " ".join(line.strip() for line in drawn(setup.query_one(wid)))
            assert "…" not in text, (wid, text)
        estimate = " ".join(line.strip() for line in drawn(setup.query_one("#estimate")))
        assert "fits: host" in estimate and estimate.endswith("usable"), estimate
        assert "no GPU here" in " ".join(drawn(setup.query_one("#problems"))) and "tiny)" in " ".join(
            drawn(setup.query_one("#problems")))
        await show_table(pilot, setup, "train")
        form = setup.query_one("#form-train").region
        assert form.height > summary.height, (form, summary)
