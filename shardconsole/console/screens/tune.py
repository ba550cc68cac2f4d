"""The tune screen (ctrl+t on the setup screen): `shardconsole tune` on the settings being edited, with
its table live: each probe's plan, measured peaks and speed, the next options the planner would probe.
The same loop as the command (tune/engine.py) runs in a worker thread; Stop ends the probe in flight
through the normal stop path; the winner is written as a user preset named in the name field."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from rich.text import Text
from textual import on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import Screen
from textual.widgets import Button, DataTable, Footer, Input, Label, Static

from shardconsole.settings import config as C
from shardconsole.settings import resolve as settings
from shardconsole.tune.setup import make_tune, output_name, parse_duration
from shardconsole.tune.engine import Tune
from shardconsole.tune.report import COLUMNS, machine_text, numerics_note, table, write_preset
from shardconsole.console.widgets.form_input import FormInput

T = TypeVar("T")

HERE = Path(__file__).parent
# The two columns of free length wrap at these widths: sized to their text, the option names and the
# statuses pushed tok/s, "vs baseline" and the status off a 120-column screen.
WRAPPED = {"settings": 26, "status": 18}


class TuneScreen(Screen[None]):
    CSS_PATH = HERE / "tune.tcss"
    BINDINGS = [Binding("escape", "close", "Back"), Binding("ctrl+g", "start", "Start"),
                Binding("ctrl+x", "stop", "Stop")]

    def __init__(self, resolved: settings.Resolved, preset_name: str, hardware=None) -> None:
        super().__init__()
        self.resolved = resolved
        self.preset_name = preset_name
        self.hardware = hardware
        self.tune: Tune | None = None
        self.running = False
        self.numerics_line = ""         # report.numerics_note of the last tune

    def compose(self) -> ComposeResult:
        with Vertical(id="tune"):
            yield Static(f"Tune {self.preset_name}: probe the settings that fit, save the fastest", id="title")
            with Horizontal(id="knobs"):
                yield Label("budget")
                yield FormInput("10m", id="budget")
                yield Label("probes")
                yield FormInput("6", id="probes")
                yield Label("steps")
                yield FormInput("6", id="steps")
                yield Label("save as")
                yield FormInput(f"{Path(self.preset_name).stem}-tuned", id="name")
            yield Static("", id="status")
            yield DataTable(id="table", zebra_stripes=True, cursor_type="row")
            with Horizontal(id="buttons"):
                yield Button("Start", id="start", variant="primary")
                yield Button("Stop", id="stop", variant="warning", disabled=True)
                yield Button("Back", id="close")
        yield Footer()

    def on_mount(self) -> None:
        dt = self.query_one(DataTable)
        for name in COLUMNS:
            dt.add_column(name, width=WRAPPED.get(name), key=name)
        self._say("Start runs the settings as given first, then the best predicted; a key you set is kept.")

    def _say(self, text: str) -> None:
        self.query_one("#status", Static).update(text)

    def _field(self, fid: str, check: Callable[[str], T]) -> T | None:
        widget = self.query_one(f"#{fid}", Input)
        try:
            value = check(widget.value)
        except (C.ConfigError, ValueError) as e:
            widget.add_class("-invalid")
            self.notify(f"{fid}: {e}", title="Cannot start", severity="error")
            return None
        widget.remove_class("-invalid")
        return value

    @on(Button.Pressed, "#start")
    def action_start(self) -> None:
        if self.running:
            return
        budget = self._field("budget", lambda v: parse_duration("budget", v))
        probes = self._field("probes", lambda v: _positive_int("probes", v))
        steps = self._field("steps", lambda v: _positive_int("steps", v))
        name = self._field("name", lambda v: output_name(v.strip(), self.preset_name))
        if budget is None or probes is None or steps is None or name is None:
            return
        try:
            self.tune = make_tune(self.resolved, budget_s=budget, max_probes=probes, probe_steps=steps, name=name,
                                  hardware=self.hardware)
        except C.ConfigError as e:
            self.notify(str(e), title="Cannot tune", severity="error", timeout=10)
            return
        self.out_name = name
        self.tune.on_change = lambda t: self.app.call_from_thread(self._refresh)
        self.running = True
        self.query_one("#start", Button).disabled = True
        self.query_one("#stop", Button).disabled = False
        stale = self.tune.book.stale_note()      # speeds of the old step meter: ignored, said once
        self._say(f"planning on {machine_text(self.tune)} ..." + (f"\nnote: {stale}" if stale else ""))
        self.run_worker(self._work, thread=True, exclusive=True, name="tune")

    def _work(self) -> None:
        tune = self.tune
        assert tune is not None
        try:
            winner = tune.run()
            path = write_preset(tune, winner, self.out_name, self.resolved.preset) if winner else None
            msg = (f"winner: {winner.option.name}, {winner.result.tokens_per_s if winner.result else 0.0:,.0f} tokens/s; saved as preset "
                   f"{self.out_name} ({path})" if winner else
                   "no probe finished under the caps: nothing saved (the rows say why)")
            # planned, not probed: a winner that changed the numerics would be another training
            self.numerics_line = numerics_note(tune)
        except (C.ConfigError, OSError) as e:
            msg = f"tune stopped: {e}"
        self.app.call_from_thread(self._done, msg)

    def _refresh(self) -> None:
        if self.tune is None:
            return
        dt = self.query_one(DataTable)
        dt.clear()
        for row in table(self.tune):
            dt.add_row(*(Text(cell) for cell in row), height=None)   # None: as many lines as a wrapped cell takes
        running = [r for r in self.tune.rows if r.state == "running"]
        if running:
            r = running[-1]
            steps = r.result.steps if r.result else 0
            self._say(f"probe {len(self.tune.rows)}/{self.tune.limits.max_probes}: {r.label} (step {steps})")

    def _done(self, msg: str) -> None:
        self.running = False
        self._refresh()
        self._say(msg + (f" ({self.tune.note})" if self.tune and self.tune.note else "")
                  + (f"\n{self.numerics_line}" if self.numerics_line else ""))
        self.query_one("#start", Button).disabled = False
        self.query_one("#stop", Button).disabled = True
        self.notify(msg, title="Tune", timeout=10)

    @on(Button.Pressed, "#stop")
    def action_stop(self) -> None:
        if self.tune is not None and self.running:
            self.tune.stop = True
            self._say("stopping the probe in flight ...")

    @on(Button.Pressed, "#close")
    def action_close(self) -> None:
        if self.running:
            self.action_stop()
            self.notify("stopping the tune first; Back again once it has stopped", severity="warning")
            return
        self.dismiss(None)


def _positive_int(what: str, text: str) -> int:
    try:
        n = int(text.strip())
    except ValueError:
        raise C.ConfigError(f"{text!r} is not a whole number") from None
    if n < 1:
        raise C.ConfigError(f"{n} is below 1")
    return n
