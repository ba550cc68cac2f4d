"""The runs screen: every run under the runs root, newest first, with its status (running, finished,
stopped, failed with its cause) and figures; marked runs open side by side in the compare view.

The list is read in a worker (history/index reads each run's whole stream); nothing here writes.
"""

from __future__ import annotations

import math
from pathlib import Path

from rich.cells import cell_len
from rich.text import Text
from textual import work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical, VerticalScroll
from textual.screen import Screen
from textual.widgets import DataTable, Footer, Label, Static

from shardconsole.console.screens.dialogs import SavedStep, StepPickScreen
from shardconsole.console.widgets.line_plot import LinePlot, PlotSeries
from shardconsole.history import compare as CMP
from shardconsole.history.index import RunSummary, list_runs, roots
from shardconsole.user_folders import runs_root as default_runs_root
from shardconsole.runlog.checkpoint_files import MANIFEST, listed_bytes
from shardconsole.runlog.runfolder import RunFolder
from shardconsole.session.resume import complete_checkpoints
from shardconsole.tryout.base import no_tokenizer

HERE = Path(__file__).parent
# What tells runs apart first: at 80 columns the table scrolls sideways from the preset on, and the
# status and steps stay in view next to the id.
# The figures first, what the run was after them: a long run id ate the 120 columns before peak host and
# the losses (they went off the right edge); the detail line under the table names preset and model too.
COLUMNS = ("", "id", "status", "steps", "tokens/s", "MFU", "peak GPU", "peak host", "last loss", "eval loss",
           "preset", "backend", "model")
STATUS_STYLE = {"running": "green", "finished": "cyan", "stopped": "yellow", "failed": "red", "unknown": "dim",
                "prepared": "dim"}
FIXED = 3       # the mark, the id and the status stay put while the table scrolls sideways (80 columns)
ID_WIDTH = 30   # a longer run id ends in "…" (the detail line has its folder): 120 columns hold the figures
CHATTABLE = ("finished", "stopped")     # a live run's checkpoints are still being written
COLORS = ("#5fd7d7", "#ffaf5f", "#af87ff", "#87d75f", "#ff5f87", "#d7d75f")


def _plain(cell: str | Text) -> str:
    return cell.plain if isinstance(cell, Text) else cell


def _short(path: Path) -> str:
    """A folder under the current directory as the user typed it (runs, not /home/.../runs)."""
    try:
        return str(Path(path).resolve().relative_to(Path.cwd().resolve())) or "."
    except ValueError:
        return str(path)


def _name(value: str) -> str:
    """A model folder or preset file as the table shows it: its name (the detail line under the table
    shows the whole path). A full path pushed the figures after it off a 120-column screen."""
    return Path(value).name.removesuffix(".toml") if "/" in value else value


def chat_steps(r: RunSummary) -> tuple[list[SavedStep], str]:
    """The run's complete checkpoints (resume's and export-model's test of a folder: a .partial or cut-short
    one is never offered), or none and the one line that says why."""
    if r.settings is None:
        return [], f"{r.run_id}: its preset.toml cannot be read, so neither can where its checkpoints are"
    folder = RunFolder(r.path).checkpoints(r.settings.train.checkpoint_dir)
    try:
        found = complete_checkpoints(folder, r.settings.parallel.backend)
        saves = [SavedStep(step, _mtime(path), listed_bytes(path)) for step, path in found]
    except OSError as e:
        return [], f"{r.run_id}: cannot read its checkpoints: {e}"
    if not saves:
        return [], (f"{r.run_id}: no complete checkpoint left in {_short(folder)} (none saved, or pruned or "
                    f"deleted since): nothing to chat with")
    return saves, ""


def _mtime(path: Path) -> float:
    manifest = path / MANIFEST
    return (manifest if manifest.is_file() else path).stat().st_mtime


class RunsScreen(Screen[Path | None]):
    """Returns a run folder to attach to (enter), or None (escape)."""

    CSS_PATH = HERE / "runs.tcss"
    BINDINGS = [
        Binding("escape", "close", "Back"),
        Binding("space", "mark", "Mark"),
        Binding("c", "compare", "Compare"),     # the marked runs; short: 80 columns hold every key
        Binding("t", "chat", "Chat"),
        Binding("enter", "attach", "Attach", show=True, priority=True),
        Binding("r", "refresh", "Refresh"),
    ]

    def __init__(self, runs_root: Path | None = None) -> None:
        """runs_root: the console's runs folder (None: the default, with an old ./runs too)."""
        super().__init__()
        self.runs_root = runs_root
        self.runs: list[RunSummary] = []
        self.marked: list[Path] = []

    def compose(self) -> ComposeResult:
        with Vertical(id="runs-body"):
            where = " and ".join(_short(r) for r in roots(self._root()))
            yield Label(f"Runs in {where} (newest first): space marks, c compares, enter attaches", id="title")
            table: DataTable[str] = DataTable(id="runs-table", cursor_type="row", zebra_stripes=True,
                                              fixed_columns=FIXED)
            table.add_columns(*COLUMNS)
            yield table
            yield Static("reading the runs…", id="detail", markup=False)
        yield Footer()

    def on_mount(self) -> None:
        self.load()

    @work(thread=True, exclusive=True, group="runs")
    def load(self) -> None:
        try:
            runs = list_runs(self._root())
        except OSError as e:        # a runs root that cannot be read: said, not raised
            self.app.call_from_thread(self._show_error, f"cannot read the runs: {e}")
            return
        self.app.call_from_thread(self._show, runs)

    def _root(self) -> Path | None:
        """The default runs root is listed with an old ./runs beside it (None), as `shardconsole runs` and
        the attach dialog list it: README's `--run-dir runs/my-chat` lands there."""
        if self.runs_root is None or Path(self.runs_root).resolve() == default_runs_root().resolve():
            return None
        return self.runs_root

    def _show_error(self, text: str) -> None:
        self.query_one("#detail", Static).update(text)

    def _show(self, runs: list[RunSummary]) -> None:
        self.runs = runs
        table = self.query_one("#runs-table", DataTable)
        rows = [self._row(r) for r in runs]
        # Widths set with the rows: an auto width is measured only when the table next idles, and a
        # screen drawn before that (once, after ctrl+l from an attach) squeezed every column to its
        # label ("20" for the id, "runnin").
        table.clear(columns=True)
        for i, label in enumerate(COLUMNS):
            table.add_column(label, key=label or "mark",
                             width=max([cell_len(label), *(cell_len(_plain(row[i])) for row in rows)]))
        for r, row in zip(runs, rows):
            table.add_row(*row, key=str(r.path))
        if not runs:
            self.query_one("#detail", Static).update(f"No runs in {self.runs_root or 'the runs root'} yet")
        else:
            table.focus()
            self._describe(0)

    def _row(self, r: RunSummary) -> list[str | Text]:
        f = CMP.figures(r)
        run_id = Text(r.run_id if len(r.run_id) <= ID_WIDTH else r.run_id[:ID_WIDTH - 1] + "…")
        return ["✓" if r.path in self.marked else " ", run_id, Text(f["status"], STATUS_STYLE.get(r.status, "")),
                f["steps"], f["tokens/s"], f["MFU"], f["peak GPU"], f["peak host"], f["last loss"], f["eval loss"],
                _name(f["preset"]), f["backend"], _name(f["model"])]

    def _current(self) -> RunSummary | None:
        table = self.query_one("#runs-table", DataTable)
        row = table.cursor_row
        return self.runs[row] if 0 <= row < len(self.runs) else None

    def _describe(self, row: int) -> None:
        if not 0 <= row < len(self.runs):
            return
        r = self.runs[row]
        lines = [_short(r.path), r.detail or r.status_text]
        lines[0] += f" · {r.preset or '-'} · {r.backend or '-'} · model {r.model or '-'}"
        if r.description:
            lines.append(r.description)
        self.query_one("#detail", Static).update("\n".join(lines))

    def on_data_table_row_highlighted(self, event: DataTable.RowHighlighted) -> None:
        self._describe(event.cursor_row)

    def action_mark(self) -> None:
        r = self._current()
        if r is None:
            return
        if r.path in self.marked:
            self.marked.remove(r.path)
        else:
            self.marked.append(r.path)
        table = self.query_one("#runs-table", DataTable)
        table.update_cell(str(r.path), table.ordered_columns[0].key, "✓" if r.path in self.marked else " ")

    def action_compare(self) -> None:
        chosen = [r for p in self.marked for r in self.runs if r.path == p]
        if len(chosen) < 2:
            self.notify("Mark two or more runs with space, then press c", severity="warning")
            return
        self.app.push_screen(CompareScreen(chosen))

    def action_attach(self) -> None:
        r = self._current()
        if r is not None:
            self.dismiss(r.path)

    def action_chat(self) -> None:
        """Talk to the model a finished or stopped run trained: its one complete checkpoint at once, or
        the one picked from a list when it kept several (exported on the way, as `chat RUN --step N`)."""
        r = self._current()
        if r is None:
            return
        if r.status not in CHATTABLE:
            self.notify(f"{r.run_id} is {r.status}: chat with a finished or stopped run (it has its checkpoints)",
                        severity="warning")
            return
        saves, why = chat_steps(r)
        why = why if not saves else no_tokenizer(r.path)    # before a step is picked and any export
        if why:
            self.notify(why, severity="warning")
        elif len(saves) == 1:
            self._open_chat(r, saves[0].step)
        else:
            self.app.push_screen(StepPickScreen(r.run_id, saves),
                                 lambda step: None if step is None else self._open_chat(r, step))

    def _open_chat(self, r: RunSummary, step: int) -> None:
        from shardconsole.console.screens.chat import ChatScreen
        self.app.push_screen(ChatScreen(r.path, r.run_id, step=step))

    def action_refresh(self) -> None:
        self.load()

    def action_close(self) -> None:
        self.dismiss(None)


class CompareScreen(Screen[None]):
    """Marked runs side by side: the settings that differ, the figures, loss and tokens/s overlaid."""

    CSS_PATH = HERE / "runs.tcss"
    BINDINGS = [Binding("escape,q", "close", "Back")]

    def __init__(self, runs: list[RunSummary]) -> None:
        super().__init__()
        self.runs = runs

    def compose(self) -> ComposeResult:
        ids = [r.run_id for r in self.runs]
        diff = CMP.settings_diff(self.runs)
        figs = [CMP.figures(r) for r in self.runs]
        legend = Text()
        for i, r in enumerate(self.runs):
            legend.append(f"━━ {r.run_id}  ", COLORS[i % len(COLORS)])
        with VerticalScroll(id="compare-body"):
            yield Label("Compare runs", id="title")
            yield Static(legend, id="legend")
            yield Label("Loss (train)", classes="section")
            yield LinePlot(id="loss-plot", empty="no loss values")
            yield Label("Tokens/s", classes="section")
            yield LinePlot(id="rate-plot", empty="no throughput values", fmt=CMP.fmt_rate, y_min=0)
            yield Label("Settings that differ", classes="section")
            text = CMP.table(["setting", *ids], [[k, *v] for k, v in diff]) if diff else ["none: the same settings"]
            yield Static("\n".join(text), markup=False, classes="block")
            yield Label("Figures", classes="section")
            rows = [[name, *(f[name] for f in figs)] for name in figs[0]]
            yield Static("\n".join(CMP.table(["", *ids], rows)), markup=False, classes="block")
            notes = [f"{r.run_id}: {r.detail}" for r in self.runs if r.status != "finished" and r.detail]
            if notes:
                yield Static("\n".join(notes), markup=False, classes="block")
        yield Footer()

    def on_mount(self) -> None:
        loss, rate = [], []
        for i, r in enumerate(self.runs):
            color = COLORS[i % len(COLORS)]
            points = [p for p in r.loss if math.isfinite(p[1])]      # a NaN loss has no place on a scale
            if points:
                loss.append(PlotSeries(r.run_id, [p[0] for p in points], [p[1] for p in points], color))
            if r.throughput:
                rate.append(PlotSeries(r.run_id, [p[0] for p in r.throughput], [p[1] for p in r.throughput], color))
        self.query_one("#loss-plot", LinePlot).series = tuple(loss)
        self.query_one("#rate-plot", LinePlot).series = tuple(rate)

    def action_close(self) -> None:
        self.dismiss(None)
