"""The setup screen: pick a model, a preset and a backend; edit the settings; see the command; launch.

The state is what the command line takes: a preset and `table.key=value` overrides (those given on
the command line, then one per edited field, each with its source). The settings shown are the settings
pipeline's (settings.resolve, lenient: a bad override is set aside and marked at its field instead of
stopping at the first). Launching runs the same preflight as `--headless` (session/preflight) on that
Resolved and starts exactly its settings (setup_actions.py: launch, save, attach); the words shown of
the settings are setup_summary.py's.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from textual import on, work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.events import DescendantFocus
from textual.reactive import reactive
from textual.widgets import (Footer, Header, Input, Label, OptionList, RadioButton, RadioSet, Static, TabbedContent,
                             TabPane)

from shardconsole.settings import config as C
from shardconsole.settings import preset_store, resolve as settings
from shardconsole.settings.models import CATALOG, ModelError, resolve

from shardconsole.console import fields as F
from shardconsole.console.card_plan import THIS_MACHINE, card_choices
from shardconsole.console.data_field import DataCheck
from shardconsole.console.messages import MachineDetected
from shardconsole.console.screens.setup_actions import SetupActions
from shardconsole.console.screens.setup_summary import (changes_text, command_text, estimate_text, field_help,
                                                        machine_text, model_info, model_options, preset_options,
                                                        problems_text)
from shardconsole.console.services import (Launcher, Machine, OpenRun, PlannedRun, Planner, Probes, load_plan,
                                           plan_hardware)
from shardconsole.console.widgets.form_input import FormInput
from shardconsole.console.widgets.setting_field import FieldSelect, SettingField

HERE = Path(__file__).parent
BACKENDS = {"fsdp": "FSDP2 (PyTorch)", "deepspeed": "DeepSpeed ZeRO"}
MODEL_SPEC = F.spec_for("model", "name")
BACKEND_SPEC = F.spec_for("parallel", "backend")
METHODS = {"full": "Full fine-tuning", "lora": "LoRA (adapters)", "qlora": "QLoRA (4-bit base, CUDA)"}
METHOD_SPEC = F.spec_for("train", "method")


class PickInput(FormInput):
    """The model folder field: up and down go to the model list above and the backend below, as Tab does."""
    BINDINGS = [Binding("up", "app.focus_previous", show=False), Binding("down", "app.focus_next", show=False)]


class SetupScreen(SetupActions):
    CSS_PATH = HERE / "setup.tcss"
    BINDINGS = [
        Binding("ctrl+r", "launch", "Launch"),
        Binding("ctrl+s", "save_preset", "Save preset"),
        Binding("ctrl+o", "attach", "Attach"),
        Binding("ctrl+t", "tune", "Tune"),
        # ctrl+d previews from any tab; the footer names it on the data tab (setup_actions.check_action).
        # priority: a text field (data.path, seq_len) binds ctrl+d to delete-right and would swallow it
        # (the Delete key still deletes there).
        Binding("ctrl+d", "preview('shown')", "Preview", priority=True),
        Binding("ctrl+d", "preview", "Data preview", show=False, priority=True),
        # Nine tabs: back one too. One footer entry for both (a second pushed Quit off 80 columns).
        Binding("ctrl+n", "next_tab", "Tabs", key_display="^n/^p", tooltip="ctrl+n: the next tab; ctrl+p: the previous"),
        Binding("ctrl+p", "previous_tab", "Previous tab", show=False),
    ]

    def __init__(self, launcher: Launcher, probes: Probes, *, preset: str = settings.DEFAULT_PRESET,
                 overrides: list[str] | None = None, resolved: settings.Resolved | None = None,
                 planner: Callable[[], Planner | None] = load_plan,
                 attach: Callable[[Path | None], None], open_run: OpenRun) -> None:
        """resolved: the command line's settings, already resolved (`shardconsole --preset ... --set ...`);
        otherwise preset and overrides are resolved here. attach, open_run: the app's (the run screen
        for a folder the attach dialog chose; for a session this screen launched)."""
        super().__init__()
        self.launcher = launcher
        self.probes = probes
        self.planner = planner
        self.attach = attach
        self.open_run = open_run
        self.machine = Machine()
        self.plan: Planner | None = None
        self.overrides: dict[str, settings.Override] = {}   # "table.key" -> the last override of it
        self.resolved = settings.Resolved(C.RunConfig(), "defaults", None)
        self.model_error = ""                      # a model folder typed but not (yet) usable
        self.data_check = DataCheck(on_done=self._data_checked)   # data.path at its field, as the launch checks it
        self.planned: PlannedRun | None = None
        self._startup_error = ""
        try:
            if resolved is not None:
                self._load(str(resolved.path) if resolved.path else None, resolved.overrides)
            else:
                self._load(preset, settings.from_cli(overrides or []))
        except C.ConfigError as e:     # the CLI checked it; a file changed since is still no crash
            self._startup_error = str(e)
            self._load(None, [])

    def _load(self, preset: str | None, overrides: list[settings.Override]) -> None:
        """A preset as the base (None: the defaults), with overrides (from the command line) on top."""
        path = preset_store.find(preset) if preset is not None else None
        raw = C.load_toml(path) if path is not None else {}
        name = path.stem if path is not None else "defaults"
        self.base = settings.resolve_doc(raw, name, path).cfg     # what the preset alone runs with
        self.preset_name, self.preset_path, self.raw = name, path, raw
        self.overrides = {o.path: o for o in overrides}
        self._derive(notify=False)

    def _derive(self, *, notify: bool = True) -> None:
        """The settings from the preset and the overrides, through the one pipeline (lenient: refused
        overrides and the impossible combination come back as data for the fields)."""
        self.resolved = settings.resolve_doc(self.raw, self.preset_name, self.preset_path, self.overrides.values(),
                                             gpu_count=self.machine.gpu_count, lenient=True)
        if notify:
            self.cfg = self.resolved.cfg
        else:
            self.set_reactive(SetupScreen.cfg, self.resolved.cfg)

    @property
    def notes(self) -> list[str]:
        """deepspeed settings filled from the fsdp table, as the CLI says them."""
        return self.resolved.notes

    # --- layout ------------------------------------------------------------------------------------
    def compose(self) -> ComposeResult:
        yield Header()
        with TabbedContent(id="tabs", initial="tab-pick"):
            with TabPane("Pick", id="tab-pick"):
                with Horizontal(id="pickers"):
                    # Scrolls: at 80x24 the backend choice is below the fold, and the focus (tab, down)
                    # brings it into view instead of moving to a control nobody sees.
                    with VerticalScroll(id="model-picker", can_focus=False):
                        yield Label("Model", classes="picker-title")
                        yield OptionList(*model_options(), id="models")
                        yield PickInput(placeholder="or a local model folder…", id="model-dir", compact=True)
                        yield Static(id="model-info", markup=False)
                        yield Label("Backend", classes="picker-title")
                        with RadioSet(id="backend"):
                            for key, label in BACKENDS.items():
                                yield RadioButton(label, value=self.cfg.parallel.backend == key, id=f"backend-{key}")
                        yield Label("Method", classes="picker-title")
                        with RadioSet(id="method"):
                            for key, label in METHODS.items():
                                yield RadioButton(label, value=self.cfg.train.method == key, id=f"method-{key}")
                        yield Label("Plan for", classes="picker-title")   # the cards once the planner loaded
                        yield FieldSelect([("this machine", THIS_MACHINE)], value=THIS_MACHINE, allow_blank=False,
                                          compact=True, id="card")
                    with Vertical(id="preset-picker"):
                        yield Label("Preset", classes="picker-title")
                        yield OptionList(*preset_options(), id="presets")
            for table in C.TABLES:
                with TabPane(table, id=f"tab-{table}"):
                    # Filled when first shown (_ensure_form): ninety rows of widgets at start would
                    # double the time to the first paint.
                    yield VerticalScroll(classes="form", id=f"form-{table}")
        yield Static(id="help", markup=False)
        with Vertical(id="summary"):
            yield Static(id="problems", markup=False)
            yield Static(id="changes", markup=False)
            yield Static(id="command", markup=False)
            yield Static(id="estimate", markup=False)
            yield Static(id="machine", markup=False)
        yield Footer()

    def on_mount(self) -> None:
        self.sub_title = "set up a run"
        if self._startup_error:
            self.notify(self._startup_error, title="Preset not loaded", severity="error", timeout=15)
        self._show_picks()
        self._refresh()
        self.query_one("#models", OptionList).focus()   # the first thing to pick
        # After the first paint: NVML, psutil and the planner's import would otherwise compete with it.
        self.call_after_refresh(self.detect_machine)

    # --- the machine and the planner (in a thread: NVML can take a moment to start) ----------------
    @work(thread=True, exclusive=True, group="machine")
    def detect_machine(self) -> None:
        unavailable = self.probes.gpu_unavailable()
        gpus = [] if unavailable else self.probes.gpus()
        host = self.probes.host()
        plan = self.planner()
        machine = Machine(gpus, host, unavailable, plan_hardware(plan, gpus, host), detected=True)
        self.plan = plan
        self.post_message(MachineDetected(machine))

    @on(MachineDetected)
    def _machine_detected(self, event: MachineDetected) -> None:
        self.machine = event.machine
        if self.plan is not None:
            self.query_one("#card", FieldSelect).set_options(card_choices())
        self._derive()     # now checked against this machine's GPU count

    # --- picking -----------------------------------------------------------------------------------
    def _show_picks(self, presets: bool = True) -> None:
        """Point the pickers at cfg (a preset loaded); presets=False: that list keeps the arrows typed since."""
        models = self.query_one("#models", OptionList)
        name = self.cfg.model.name
        if name in CATALOG:
            models.highlighted = list(CATALOG).index(name)
            self.query_one("#model-dir", Input).value = ""
        else:
            models.highlighted = None
            with self.prevent(Input.Changed):
                self.query_one("#model-dir", Input).value = name
        if presets:
            listed = self.query_one("#presets", OptionList)
            try:
                listed.highlighted = listed.get_option_index(self.preset_name)
            except Exception:   # OptionDoesNotExist: loaded from a path outside the preset folders
                listed.highlighted = None
        with self.prevent(RadioSet.Changed):
            self.query_one(f"#backend-{self.cfg.parallel.backend}", RadioButton).value = True
            self.query_one(f"#method-{self.cfg.train.method}", RadioButton).value = True
        self._show_model_info()

    def _show_model_info(self, error: str = "") -> None:
        self.query_one("#model-info", Static).update(model_info(self.cfg.model.name, error))

    @on(OptionList.OptionSelected, "#models")
    def _model_selected(self, event: OptionList.OptionSelected) -> None:
        with self.prevent(Input.Changed):
            self.query_one("#model-dir", Input).value = ""
        self.model_error = ""
        self._set(MODEL_SPEC, event.option.id or "tiny")
        self._show_model_info()

    @on(Input.Changed, "#model-dir")
    def _model_dir_changed(self, event: Input.Changed) -> None:
        """A local model folder: used once models.resolve accepts it; until then its error shows."""
        path = event.value.strip()
        self.model_error = ""
        if path:
            try:
                resolve(path)
            except ModelError as e:
                self.model_error = str(e)   # models.resolve's words, as the CLI gives them
                self._show_model_info(str(e))
                self._refresh()
                return
            self.query_one("#models", OptionList).highlighted = None
            self._set(MODEL_SPEC, path)
        elif self.cfg.model.name not in CATALOG:
            self.overrides.pop(MODEL_SPEC.path, None)      # emptied: back to the preset's model
            self._derive()
            self._show_picks()
        self._show_model_info()

    @on(OptionList.OptionSelected, "#presets")
    def _preset_selected(self, event: OptionList.OptionSelected) -> None:
        name = event.option.id or ""
        try:
            self._load(name, [])
        except C.ConfigError as e:
            self.notify(str(e), title=f"Preset {name} not loaded", severity="error", timeout=10)
            return
        self._show_picks(presets=False)
        self._refresh()
        self.notify(f"Loaded preset {name}", timeout=3)

    @on(RadioSet.Changed, "#backend")
    def _backend_changed(self, event: RadioSet.Changed) -> None:
        key = (event.pressed.id or "").removeprefix("backend-")
        self._set(BACKEND_SPEC, key)

    @on(RadioSet.Changed, "#method")
    def _method_changed(self, event: RadioSet.Changed) -> None:
        self._set(METHOD_SPEC, (event.pressed.id or "").removeprefix("method-"))

    # --- editing -----------------------------------------------------------------------------------
    async def _ensure_form(self, table: str) -> None:
        """Mount the rows of a table's form, once, showing the current values."""
        form = self.query_one(f"#form-{table}", VerticalScroll)
        if form.children:
            return
        await form.mount_all(SettingField(spec, F.to_text(spec, F.value_of(self.cfg, spec)),
                                          id=f"field-{table}-{spec.key}") for spec in F.table_specs(table))
        self._refresh()

    @on(TabbedContent.TabActivated)
    async def _tab_activated(self, event: TabbedContent.TabActivated) -> None:
        pane = event.pane.id or ""
        self.refresh_bindings()
        focused = self.app.focused
        if focused is None or event.pane not in focused.ancestors:
            self.query_one("#help", Static).display = False   # the last tab's field's; the next focus sets it
        if pane.startswith("tab-") and pane != "tab-pick":
            await self._ensure_form(pane.removeprefix("tab-"))

    @on(SettingField.Edited)
    def _field_edited(self, event: SettingField.Edited) -> None:
        self._set(event.setting.spec, event.text)

    def _set(self, spec: F.FieldSpec, text: str) -> None:
        self.overrides[spec.path] = F.override(spec, text)
        self._derive()

    def watch_cfg(self) -> None:
        self._refresh()

    def _data_checked(self) -> None:
        """From the data check's thread: its answer came after the keystroke stopped waiting."""
        self.app.call_from_thread(self._refresh)

    def _problems(self, data: bool = True) -> list[tuple[str, str]]:
        """(table.key, what is wrong): refused edits first, then the first impossible combination, then
        the data files (data=False leaves them out); from the ConfigErrors' own fields."""
        out = [(e.path or "", e.reason) for e in self.resolved.problems]
        if self.model_error:
            out.insert(len(self.resolved.refused), (MODEL_SPEC.path, self.model_error))
        if data and not out:
            problem = self.data_check.problem(self.resolved)
            if problem is not None:
                out.append(problem)
        return out

    def _refresh(self) -> None:
        """Everything derived from cfg: marks at the fields, tabs, changes, command, estimate."""
        cfg = self.cfg
        problems = self._problems()
        by_path = dict(problems)
        for setting in self.query(SettingField):
            spec = setting.spec
            value = F.value_of(cfg, spec)
            if spec.path not in self.overrides:
                # Not typed by the user: show the value in force (a preset loaded, an FSDP setting
                # carried over to DeepSpeed). A typed value stays as typed, even when refused.
                text = F.to_text(spec, value)
                if setting.text != text:
                    setting.set_text(text)
            setting.error = by_path.get(spec.path, "")
            setting.changed = value != F.value_of(self.base, spec)
            setting.hint = F.hint(spec, value)
        tabs = self.query_one(TabbedContent)
        diff = cfg.diff(self.base)
        visible = F.visible_tables(cfg.parallel.backend, cfg.train.method, cfg.train.objective)
        for table in C.TABLES:
            pane = f"tab-{table}"
            tab = tabs.get_tab(pane)
            if (table in visible) == tab.has_class("-hidden"):
                (tabs.show_tab if table in visible else tabs.hide_tab)(pane)
            bad = any(p.startswith(table + ".") for p in by_path)
            changed = any(p.startswith(table + ".") for p, _, _ in diff)
            label = table + (" ✗" if bad else " •" if changed else "")
            if str(tab.label) != label:
                tab.label = label
        self._draw_summary(problems, diff)

    def _draw_summary(self, problems: list[tuple[str, str]], diff: list[tuple[str, object, object]]) -> None:
        cfg = self.cfg
        bad = problems_text(problems, cfg, self.machine)
        self.query_one("#problems", Static).update(bad)
        self.query_one("#problems").display = bool(bad)
        changes = F.diff_entries(diff)
        self.query_one("#changes", Static).update(changes_text(self.preset_name, changes, self.notes))
        self.query_one("#changes").set_class(not (changes or self.notes), "-none")   # hidden at 80 columns
        self.planned = self.launcher.plan(cfg, self.preset_name)
        self.query_one("#command", Static).update(command_text(self.planned))
        self.query_one("#estimate", Static).update(
            estimate_text(self.plan, cfg, self.planning_machine(), self.planned, valid=not problems))
        self.query_one("#machine", Static).update(machine_text(self.machine))

    @on(DescendantFocus)
    def _focus_moved(self, event: DescendantFocus) -> None:
        setting = next((w for w in event.widget.ancestors_with_self if isinstance(w, SettingField)), None)
        help_line = self.query_one("#help", Static)
        help_line.display = setting is not None
        if setting is None:
            return
        help_line.update(field_help(setting.spec))

    # --- actions -----------------------------------------------------------------------------------
    async def action_next_tab(self) -> None:
        await self._step_tab(1)

    async def action_previous_tab(self) -> None:
        await self._step_tab(-1)

    async def _step_tab(self, offset: int) -> None:
        """The next (+1) or previous (-1) table, with the focus in its first field (the pick tab: in the
        model list)."""
        tabs = self.query_one(TabbedContent)
        panes = ["tab-pick"] + [f"tab-{t}" for t in F.visible_tables(self.cfg.parallel.backend, self.cfg.train.method,
                                                              self.cfg.train.objective)]
        current = tabs.active if tabs.active in panes else panes[0]
        pane = panes[(panes.index(current) + offset) % len(panes)]
        tabs.active = pane
        if pane == "tab-pick":
            self.query_one("#models", OptionList).focus()
            return
        await self._ensure_form(pane.removeprefix("tab-"))
        control = self.query_one(f"#form-{pane.removeprefix('tab-')}").query(".setting--control").first()
        # After the switch is drawn: a control in a pane still hidden refuses the focus, which then stayed
        # in the previous tab (its help line too, and the keys went to a field nobody saw).
        self.call_after_refresh(control.focus)
