"""A form never loses a keystroke: keys that arrive in one burst (a fast typist on a loaded machine, a
terminal's single read, tmux send-keys) land in the order typed.

Textual's pilot.press waits for the app to go idle after every key, which hides the race; burst() hands
the keys to the driver back to back, as a terminal read does.
"""

from __future__ import annotations

from typing import Any

from textual import events
from textual.widgets import Input

from test_console import make_app, show_table, wait_for

from shardconsole.console.widgets.setting_field import SettingField


def burst(app: Any, keys: list[str]) -> None:
    """Keys as one read from the terminal delivers them: no wait for the app between them."""
    for key in keys:
        event = events.Key(key, key if len(key) == 1 else None)
        event.set_sender(app)
        app._driver.send_message(event)


async def test_fields_typed_in_a_burst_keep_every_key(tmp_path):
    app = make_app(tmp_path)
    async with app.run_test(size=(120, 40)) as pilot:
        setup = app.setup_screen
        await show_table(pilot, setup, "train")
        # (field, how it is cleared, what is typed, the config value): integers and floats, cleared with
        # backspaces (more than it holds) or ctrl+u, the digits right behind.
        cases = [("steps", ["end"] + ["backspace"] * 4, "7123", 7123),
                 ("lr", ["ctrl+u"], "0.1", 0.1),
                 ("warmup_steps", ["end", "backspace", "backspace"], "3000", 3000),
                 ("min_lr_ratio", ["home", "delete", "delete", "delete", "delete"], "0.25", 0.25)]
        for key, clear, typed, value in cases:
            field = setup.query_one(f"#field-train-{key}", SettingField)
            control = field.query_one(".setting--control", Input)
            control.focus()
            await wait_for(pilot, lambda: app.focused is control, what=f"the focus in train.{key}")
            burst(app, clear + list(typed))
            await wait_for(pilot, lambda: getattr(setup.cfg.train, key) == value,
                           timeout=10, what=f"train.{key} = {value} (shows {control.value!r})")
            assert control.value == typed and field.text == typed
        await pilot.pause()
        assert [getattr(setup.cfg.train, k) for k, *_ in cases] == [7123, 0.1, 3000, 0.25]


async def test_the_model_folder_field_keeps_a_burst(tmp_path):
    from shardconsole.console.screens.setup import PickInput
    app = make_app(tmp_path)
    async with app.run_test(size=(120, 40)) as pilot:
        field = app.setup_screen.query_one("#model-dir", PickInput)
        field.focus()
        await wait_for(pilot, lambda: app.focused is field, what="the focus in the model folder")
        burst(app, list("/tmp/xy") + ["backspace", "backspace"] + list("my-model"))
        await wait_for(pilot, lambda: field.value == "/tmp/my-model", timeout=10,
                       what=f"the folder typed (shows {field.value!r})")
