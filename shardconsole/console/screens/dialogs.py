"""Modal screens: confirm, a report to read, save a preset, pick a run folder to attach to, pick the
checkpoint step of a run to chat with.

Each returns its answer through dismiss(), so the caller reads it in a callback or with push_screen_wait.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from rich.text import Text
from textual import on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.message import Message
from textual.screen import ModalScreen
from textual.widgets import Button, Input, Label, OptionList, Static
from textual.widgets.option_list import Option

from shardconsole.settings import config as C
from shardconsole.settings import preset_store
from shardconsole.settings.values import format_size
from shardconsole.console.services import RunListing
from shardconsole.console.widgets.form_input import FormInput

HERE = Path(__file__).parent


class ConfirmScreen(ModalScreen[bool]):
    """A yes/no question; `y` and `n` answer it from the keyboard."""

    CSS_PATH = HERE / "confirm.tcss"
    BINDINGS = [
        Binding("y", "answer(True)", "Yes"),
        Binding("n,escape", "answer(False)", "No"),
    ]

    def __init__(self, title: str, body: str, *, yes: str = "Yes", no: str = "No") -> None:
        super().__init__()
        self.title_text, self.body, self.yes, self.no = title, body, yes, no

    def compose(self) -> ComposeResult:
        with Vertical(id="dialog"):
            yield Label(self.title_text, id="title")
            yield Static(self.body, id="body", markup=False)
            with Horizontal(id="buttons"):
                yield Button(f"{self.yes} (y)", id="yes", variant="error")
                yield Button(f"{self.no} (n)", id="no", variant="primary")

    def on_mount(self) -> None:
        self.query_one("#no", Button).focus()   # the safe answer has the focus

    @on(Button.Pressed)
    def _pressed(self, event: Button.Pressed) -> None:
        self.dismiss(event.button.id == "yes")

    def action_answer(self, yes: bool) -> None:
        self.dismiss(yes)


class ReportScreen(ModalScreen[None]):
    """A few lines to read (a stop report, a failure); enter or escape closes it."""

    CSS_PATH = HERE / "report.tcss"
    BINDINGS = [Binding("enter,escape", "close", "Close")]
    # Focused by Textual when the screen is shown; a query in on_mount raised NoMatches when the
    # screen was dismissed (app closing) before its children mounted.
    AUTO_FOCUS = "#close"

    def __init__(self, title: str, body: Text | str, *, error: bool = False) -> None:
        super().__init__()
        self.title_text, self.body, self.error = title, body, error

    def compose(self) -> ComposeResult:
        with Vertical(id="dialog", classes="-error" if self.error else ""):
            yield Label(self.title_text, id="title")
            yield Static(self.body, id="body", markup=False)
            with Horizontal(id="buttons"):
                yield Button("Close (enter)", id="close", variant="primary")

    @on(Button.Pressed)
    def _pressed(self) -> None:
        self.dismiss(None)

    def action_close(self) -> None:
        self.dismiss(None)


@dataclass(frozen=True)
class SaveRequest:
    name: str
    description: str


class SavePresetScreen(ModalScreen[SaveRequest | None]):
    """Name and description of a preset to save into the user's folder."""

    CSS_PATH = HERE / "save_preset.tcss"
    BINDINGS = [Binding("escape", "cancel", "Cancel")]

    def __init__(self, name: str, description: str, folder: Path) -> None:
        super().__init__()
        self.preset_name, self.description, self.folder = name, description, folder

    def compose(self) -> ComposeResult:
        with Vertical(id="dialog"):
            yield Label("Save the current settings as a preset", id="title")
            yield Label("Name (letters, digits, - and _)")
            yield FormInput(self.preset_name, id="name")
            yield Label("Description (shown in the preset list)")
            yield FormInput(self.description, id="description")
            yield Static(self._where(self.preset_name), id="where", markup=False)
            with Horizontal(id="buttons"):
                yield Button("Save (enter)", id="save", variant="primary")
                yield Button("Cancel (esc)", id="cancel")

    def _where(self, name: str) -> str:
        return f"→ {self.folder / (name.strip() + '.toml')}"

    def on_mount(self) -> None:
        self._check(self.preset_name)

    @staticmethod
    def name_problem(name: str) -> str:
        """What is wrong with a name, in preset_store's words ('' when it can be saved under)."""
        if not name.strip():
            return "A preset needs a name"
        try:
            preset_store.check_name(name.strip())
        except C.ConfigError as e:
            return e.reason
        return ""

    def _check(self, name: str) -> None:
        """Judge the name as it is typed: the rule the label states, said before Save is pressed."""
        problem = self.name_problem(name)
        where = self.query_one("#where", Static)
        if problem:
            where.update(Text("✗ " + problem, "red"))
        else:
            exists = (self.folder / f"{name.strip()}.toml").is_file()
            where.update(self._where(name) + ("  (exists: saving asks before replacing it)" if exists else ""))
        self.query_one("#name", Input).set_class(bool(problem), "-invalid")
        self.query_one("#save", Button).disabled = bool(problem)

    @on(Input.Changed, "#name")
    def _name_changed(self, event: Input.Changed) -> None:
        self._check(event.value)

    @on(Input.Submitted)
    @on(Button.Pressed, "#save")
    def _save(self, _event: Message | None = None) -> None:
        name = self.query_one("#name", Input).value.strip()
        problem = self.name_problem(name)   # the rule save_user_preset enforces, before the dialog closes
        if problem:
            self.query_one("#name", Input).focus()
            self.notify(problem, title="Not a preset name", severity="error")
            return
        self.dismiss(SaveRequest(name, self.query_one("#description", Input).value.strip()))

    @on(Button.Pressed, "#cancel")
    def _cancel(self) -> None:
        self.dismiss(None)

    def action_cancel(self) -> None:
        self.dismiss(None)


# history/index's statuses: a failure in red with its cause, a stop in yellow
_STATUS_STYLE = {"running": "green", "finished": "cyan", "stopped": "yellow", "failed": "red"}


class AttachScreen(ModalScreen[Path | None]):
    """A run folder: typed, or picked from the runs found under the runs folder (newest first)."""

    CSS_PATH = HERE / "attach.tcss"
    BINDINGS = [Binding("escape", "cancel", "Cancel")]

    def __init__(self, runs: list[RunListing], runs_root: Path) -> None:
        super().__init__()
        self.runs, self.runs_root = runs, runs_root

    def compose(self) -> ComposeResult:
        with Vertical(id="dialog"):
            yield Label("Attach to a run", id="title")
            yield FormInput(placeholder=f"run folder, e.g. {self.runs_root}/<id>", id="path")
            if self.runs:
                yield Label(f"Runs in {self._where()} (newest first; ctrl+l: every run, compare)", id="where")
                yield OptionList(*[self._option(r) for r in self.runs], id="runs")
            else:
                yield Label(f"No runs in {self.runs_root}/ yet", classes="dim")
            with Horizontal(id="buttons"):
                yield Button("Attach (enter)", id="attach", variant="primary")
                yield Button("Cancel (esc)", id="cancel")

    def _where(self) -> str:
        """Every folder the list holds runs of: the runs root, and the old ./runs when the listing took
        runs from there too (it named the runs root alone over runs of both)."""
        others = sorted({r.run_dir.parent for r in self.runs} - {self.runs_root})
        return " and ".join(f"{p}/" for p in [self.runs_root, *others])

    @staticmethod
    def _option(run: RunListing) -> Option:
        status = run.status or ("running" if run.alive else "ended")
        prompt = Text.assemble((run.run_dir.name, "bold"), "  ", (status, _STATUS_STYLE.get(status.split()[0], "dim")))
        if run.description:
            prompt.append(f"\n  {run.description}", "italic")
        return Option(prompt, id=str(run.run_dir))

    @on(OptionList.OptionHighlighted)
    def _highlighted(self, event: OptionList.OptionHighlighted) -> None:
        self.query_one("#path", Input).value = event.option.id or ""

    @on(OptionList.OptionSelected)
    def _selected(self, event: OptionList.OptionSelected) -> None:
        self.dismiss(Path(event.option.id or ""))

    @on(Input.Submitted)
    @on(Button.Pressed, "#attach")
    def _submit_path(self, _event: Message | None = None) -> None:
        path = self.query_one("#path", Input).value.strip()
        if path:
            self.dismiss(Path(path))
        else:
            self.notify("Type a run folder or pick one from the list", severity="warning")

    @on(Button.Pressed, "#cancel")
    def _cancel(self) -> None:
        self.dismiss(None)

    def action_cancel(self) -> None:
        self.dismiss(None)


@dataclass(frozen=True)
class SavedStep:
    """A complete checkpoint of a run, as the step chooser lists it."""
    step: int
    written: float              # the manifest's (else the folder's) mtime
    size: int | None = None     # the bytes its manifest lists; None when it has none


class StepPickScreen(ModalScreen[int | None]):
    """Which checkpoint of a run to chat with: newest first and highlighted; enter picks, escape goes back."""

    CSS_PATH = HERE / "pick_step.tcss"
    BINDINGS = [Binding("escape", "cancel", "Back")]
    AUTO_FOCUS = "#steps"

    def __init__(self, run_id: str, saves: list[SavedStep]) -> None:
        super().__init__()
        self.run_id, self.saves = run_id, sorted(saves, key=lambda s: s.step, reverse=True)

    def compose(self) -> ComposeResult:
        with Vertical(id="dialog"):
            # the count: a long list scrolls, and its end is then out of view
            yield Label(f"Chat with which of {self.run_id}'s {len(self.saves)} checkpoints?", id="title")
            yield OptionList(*[self._option(s) for s in self.saves], id="steps")
            yield Label("↑↓ choose · enter opens the chat · escape goes back", classes="dim")

    def _option(self, save: SavedStep) -> Option:
        width = len(str(self.saves[0].step))       # the steps' digits in one column
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(save.written))
        size = format_size(save.size) if save.size is not None else ""
        return Option(Text.assemble((f"step {save.step:>{width}}", "bold"), f"   {when}   ", (size, "dim")),
                      id=str(save.step))

    @on(OptionList.OptionSelected)
    def _selected(self, event: OptionList.OptionSelected) -> None:
        self.dismiss(int(event.option.id or 0))

    def action_cancel(self) -> None:
        self.dismiss(None)
