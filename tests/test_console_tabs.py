"""Moving about the setup screen (issue 65 item 8): back a tab as well as forward, and the arrows typed
while a preset loads."""

from __future__ import annotations

from textual.widgets import Footer, OptionList, TabbedContent
from textual.widgets._footer import FooterKey

from test_console import make_app, wait_for
from test_console_typing import burst


async def test_ctrl_p_goes_back_a_tab_and_the_footer_names_it(tmp_path):
    app = make_app(tmp_path)
    async with app.run_test(size=(120, 40)) as pilot:
        setup = app.setup_screen
        tabs = setup.query_one(TabbedContent)
        await pilot.pause()
        footer = "  ".join(str(key.render()) for key in setup.query_one(Footer).query(FooterKey))
        assert "^n/^p Tabs" in footer and "^q Quit" in footer, footer
        await pilot.press("ctrl+n", "ctrl+n")
        await wait_for(pilot, lambda: tabs.active == "tab-data", what="the data tab")
        await pilot.press("ctrl+p")
        await wait_for(pilot, lambda: tabs.active == "tab-model", what="back to the model tab")
        first = setup.query_one("#form-model").query(".setting--control").first()
        await wait_for(pilot, lambda: app.focused is first, what="the focus in the model form")
        await pilot.press("ctrl+p")
        await wait_for(pilot, lambda: tabs.active == "tab-pick", what="back to the pick tab")
        await pilot.press("ctrl+p")            # from the first tab round to the last
        await wait_for(pilot, lambda: tabs.active == "tab-optim", what="round to the last tab")


async def test_arrows_typed_while_a_preset_loads_are_kept(tmp_path):
    app = make_app(tmp_path)
    async with app.run_test(size=(120, 40)) as pilot:
        setup = app.setup_screen
        presets = setup.query_one("#presets", OptionList)
        presets.focus()
        at = presets.get_option_index("3090-7b-lora")
        presets.highlighted = at
        await wait_for(pilot, lambda: app.focused is presets, what="the focus in the preset list")
        burst(app, ["enter", "down", "down"])      # load it, and on to the next one down the list
        await wait_for(pilot, lambda: setup.preset_name == "3090-7b-lora", what="the preset loaded")
        await pilot.pause()
        assert presets.highlighted == at + 2


async def test_the_attach_dialog_names_every_folder_it_lists(tmp_path):
    from test_console import FakeLauncher, text_of
    from shardconsole.console.services import RunListing

    class TwoRoots(FakeLauncher):
        def recent_runs(self, limit: int = 30) -> list[RunListing]:
            return [RunListing(tmp_path / "runs" / "new-run", "", False),
                    RunListing(tmp_path / "old" / "runs" / "old-run", "", False)]

    app = make_app(tmp_path, launcher=TwoRoots(tmp_path / "runs"))
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.press("ctrl+o")
        await wait_for(pilot, lambda: type(app.screen).__name__ == "AttachScreen", what="the attach dialog")
        where = text_of(app.screen.query_one("#where"))
        assert where.startswith(f"Runs in {tmp_path}/runs/ and {tmp_path}/old/runs/ (newest first"), where
