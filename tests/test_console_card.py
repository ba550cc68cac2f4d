"""Plan for a card (issue 65 item 8): on a machine without a GPU the setup screen showed the CPU run's
memory alone, no speed and no time, and nothing asked for a card's as `plan --card` does."""

from __future__ import annotations

from textual.widgets import Select

from test_console import make_app, real_planner, text_of, wait_for


async def test_plan_for_a_card_gives_its_estimate_speed_and_time(tmp_path):
    app = make_app(tmp_path, preset="3090-7b-lora", planner=real_planner)
    async with app.run_test(size=(120, 40)) as pilot:
        setup = app.setup_screen
        estimate = setup.query_one("#estimate")
        card = setup.query_one("#card", Select)
        await wait_for(pilot, lambda: len(card._options) > 2, what="the cards, once the planner loaded")
        assert text_of(estimate).startswith("Estimate on the CPU (no GPU here; rough)")
        assert "Speed" not in text_of(estimate)
        card.focus()
        await wait_for(pilot, lambda: app.focused is card, what="the focus in Plan for")
        await pilot.press("enter", *["down"] * 6, "enter")       # this machine, 3090, 4090, 5090, A100 x2, H100
        await wait_for(pilot, lambda: card.value == "h100", what="H100 chosen")
        shown = text_of(estimate)
        assert shown.startswith("Estimate on H100 SXM (Plan for): ") and "GPU peak" in shown, shown
        speed = shown.splitlines()[-1]
        assert speed.startswith("Speed (predicted, H100 SXM): ") and "tokens/s · 50 steps ~" in speed, shown
        # The launch is still this machine's: the preflight's GPU count is not the card's.
        assert setup.machine.gpus == [] and setup.machine.card == ""
