"""Room at 120 columns (issue 65 item 8): the setup screen's changes and estimate wrap instead of being
cut at the edge, and the tune table's free-length columns wrap so tok/s and the status stay on screen."""

from __future__ import annotations

from types import SimpleNamespace

from textual.widgets import DataTable

from test_console import make_app, real_planner, text_of, wait_for


async def test_a_long_list_of_changes_and_the_estimate_wrap_at_120_columns(tmp_path):
    many = ["train.steps=1234", "train.lr=0.0001", "train.warmup_steps=7", "train.micro_batch=2",
            "train.grad_accum=3", "data.seq_len=64", "train.log_every=1", "train.min_lr_ratio=0.2",
            "train.weight_decay=0.05", "train.seed=7"]
    app = make_app(tmp_path, preset="3090-7b-lora", overrides=many, planner=real_planner)
    async with app.run_test(size=(120, 40)) as pilot:
        setup = app.setup_screen
        changes, estimate = setup.query_one("#changes"), setup.query_one("#estimate")
        await wait_for(pilot, lambda: "Estimate" in text_of(estimate), what="the estimate")
        await pilot.pause()
        assert len(text_of(changes)) > 2 * 118 and changes.size.height == 3   # cut at the third line
        needed = -(-len(text_of(estimate)) // estimate.size.width)
        assert needed > 1 and estimate.size.height >= needed, (text_of(estimate), estimate.size)


async def test_the_tune_tables_long_cells_wrap_and_its_last_columns_stay_on_screen(tmp_path, monkeypatch):
    from shardconsole.console.screens import tune as tune_screen
    long_name = "micro_batch=8 grad_accum=2 activation_checkpointing=selective optimizer_offload=cpu"
    rows = [("1", "baseline: " + long_name, "21.3G", "30.1G", "22.0G", "28.7G", "1.23k", "1.00x",
             "done (measured, fastest kept so far)")]
    monkeypatch.setattr(tune_screen, "table", lambda tune: rows)
    app = make_app(tmp_path)
    async with app.run_test(size=(120, 40)) as pilot:
        screen = tune_screen.TuneScreen(app.setup_screen.resolved, "tiny-cpu")
        app.push_screen(screen)
        await wait_for(pilot, lambda: app.screen is screen and screen.query(DataTable), what="the tune screen")
        screen.tune = SimpleNamespace(rows=[])       # _refresh draws table(tune), monkeypatched above
        screen._refresh()
        dt = screen.query_one(DataTable)
        await wait_for(pilot, lambda: dt.row_count == 1, what="the row")
        await pilot.pause()
        assert dt.virtual_size.width <= dt.scrollable_content_region.width, (dt.virtual_size, dt.size)
        assert dt.rows[next(iter(dt.rows))].height > 1          # the long name wrapped, whole
