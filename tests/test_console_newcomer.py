"""What a new user tripped on in the console (issue 36 items 7, 8, 9, 11): pilot tests at the sizes the
README promises (80x24 and 120x40), with the fakes of test_console (the launcher, the probes, a frozen
stream with the vitals the fake NVML of test_gpu_truth gives)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from textual.widgets import DataTable, Footer, Input, RadioSet

from shardconsole.runlog import protocol as P
from shardconsole.console.services import RunOptions
from tests.conftest import shardconsole
from tests.test_console import (FakeLauncher, FakeProbes, NO_GPU, gpu_sample, make_app, text_of, wait_for,
                                write_run)


def _visible(app, widget) -> bool:
    """Drawn on the screen: inside the screen and inside every scrolling parent's window."""
    region = widget.region
    if not region or not app.screen.region.contains_region(region):
        return False
    return all(p.region.contains_region(region) for p in widget.ancestors if getattr(p, "region", None)
               and p.is_scrollable and p.region)


async def test_at_80x24_tab_brings_the_backend_choice_into_view(tmp_path):
    app = make_app(tmp_path)
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.pause()
        backend = app.setup_screen.query_one("#backend", RadioSet)
        await pilot.press("tab", "tab")      # the model list, the model folder field, the backend
        await wait_for(pilot, lambda: app.focused is backend, what="the focus on the backend choice")
        await wait_for(pilot, lambda: _visible(app, backend), what="the backend choice in view")


async def test_next_tab_moves_the_help_line_and_the_footer_names_the_runs_screen(tmp_path):
    app = make_app(tmp_path)
    async with app.run_test(size=(80, 24)) as pilot:
        setup = app.setup_screen
        await pilot.pause()
        for table in ("model", "data", "train"):
            await pilot.press("ctrl+n")
            await wait_for(pilot, lambda: text_of(setup.query_one("#help")).startswith(f"{table}."),
                           what=f"the help line of the {table} tab")
            assert app.focused is not None and f"form-{table}" in {a.id for a in app.focused.ancestors}
            if table == "data":          # a path field has room for a path
                assert setup.query_one("#field-data-path").query_one(Input).region.width >= 34
        footer = " ".join(str(w.render()) for w in app.screen.query(Footer).first().query("*"))
        assert "Runs" in footer


async def test_the_runs_screen_lists_the_runs_root_and_dot_runs_with_status_in_80_columns(
        tmp_path, monkeypatch):
    root = tmp_path / "root"
    monkeypatch.setenv("SHARDCONSOLE_RUNS_ROOT", str(root))
    monkeypatch.chdir(tmp_path)
    write_run(root / "20260101-000001-tiny-cpu", gpus=0, device="cpu", steps=3, total_steps=3, finished=True)
    write_run(Path("runs/my-chat"), gpus=0, device="cpu", steps=2, total_steps=2, finished=True)   # README's
    app = make_app(tmp_path, launcher=FakeLauncher(root))
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.pause()
        await pilot.press("ctrl+l")
        table = await wait_for(pilot, lambda: type(app.screen).__name__ == "RunsScreen" and
                               app.screen.query_one(DataTable), what="the runs screen")
        await wait_for(pilot, lambda: table.row_count == 2, what="both runs")
        assert {r.run_id for r in app.screen.runs} == {"20260101-000001-tiny-cpu", "my-chat"}
        # status and steps are drawn whole within the 80 columns, without scrolling sideways
        widths = [c.get_render_width(table) for c in table.ordered_columns]
        labels = [str(c.label) for c in table.ordered_columns]
        end_of_steps = sum(widths[:labels.index("steps") + 1])
        assert labels.index("status") < labels.index("steps") and end_of_steps <= table.region.width


def test_the_data_line_counts_what_there_is():
    from shardconsole.console.runview import log_line
    synthetic = P.DataSummary(rank=0, format="synthetic", source="synthetic")
    assert log_line(synthetic).endswith("│ data: synthetic tokens (no data set, no tokenizer): each sequence follows "
                                        "one fixed random order of the vocabulary, a pattern the model memorises, "
                                        "so the loss falls towards 0; that shows the training works, nothing real "
                                        "is learned")
    one = P.DataSummary(rank=0, format="text", source="a.txt", records=1, tokens=2048, samples=8, loss_share=1.0)
    assert log_line(one).endswith("│ data: text from a.txt, 1 record, 8 samples, 100% under loss")


VITALS = dict(temp_c=63.0, power_w=610.0, power_limit_w=700.0, sm_clock_mhz=1830.0, sm_clock_max_mhz=1980.0,
              pcie_rx_bps=12.3e9, pcie_tx_bps=0.4e9)


@pytest.mark.parametrize("size", [(120, 40), (80, 24)])
async def test_gpu_vitals_fit_one_line_and_each_chart_plots_one_quantity(tmp_path, monkeypatch, size):
    """The vitals as the fake NVML gives them (test_gpu_truth), one line a card; the throttle reasons on
    their own; the host chart plots host RAM only, the fullest GPU has its own chart (both in GiB)."""
    from tests import test_console as TC
    plain = TC.gpu_sample
    monkeypatch.setattr(TC, "gpu_sample", lambda i, used, t=TC.T0, pids=(): replace(
        plain(i, used, t, pids), **VITALS, throttle=("sw_power_cap",) if i == 1 else ()))
    run_dir = tmp_path / "runs" / "20260101-000000-h200"
    write_run(run_dir, gpus=2, steps=6)
    with open(run_dir / "metrics.jsonl", "a") as fh:       # a synthetic-data run: nothing to count
        fh.write(P.encode(P.DataSummary(run=run_dir.name, rank=0, format="synthetic", source="synthetic")) + "\n")
    app = TC.ShardConsoleApp(FakeLauncher(tmp_path / "runs"), FakeProbes.like(run_dir), attach=run_dir,
                             planner=lambda: None, run_options=RunOptions(sample=False))
    async with app.run_test(size=size) as pilot:
        screen = await wait_for(pilot, lambda: type(app.screen).__name__ == "RunScreen" and app.screen)
        await wait_for(pilot, lambda: screen.view.state.last_step and screen.view.state.last_step.step == 6)
        await pilot.pause(0.2)
        gpu_text = screen.query_one("#gpu-text")
        drawn = [line.text.rstrip() for line in gpu_text.render_lines(gpu_text.region.reset_offset)]
        vitals = [line for line in drawn if "°C" in line]
        assert len(vitals) == 2 and all(line.strip().startswith("63°C") for line in vitals), drawn
        if size[0] >= 120:
            assert all(line.endswith("GB/s") for line in vitals), drawn    # all of it, on one line
        assert [line.strip() for line in drawn if "throttled" in line] == ["throttled: sw_power_cap"]
        assert "data synthetic tokens (no data set): a fixed pattern, learned to a loss near 0" in \
            text_of(screen.query_one("#loss-text"))
        host = screen.query_one("#memory-plot")
        assert [s.label for s in host.series] == ["host"] and host.fmt(42.0) == "42.0 GiB"
        gpu = screen.query_one("#gpu-plot")
        assert [s.label for s in gpu.series] == ["fullest GPU"] and gpu.fmt(23.0) == "23.0 GiB"
