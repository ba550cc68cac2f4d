"""What leaves the setup screen: launch (after --headless's preflight), save a preset, attach to a run.

A part of SetupScreen (setup.py), kept apart so that each file reads as one concern: setup.py shows and
edits the settings, this one acts on what it resolved.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

from textual import on, work
from textual.reactive import reactive
from textual.screen import Screen
from textual.widgets import OptionList, Select, TabbedContent

from shardconsole.settings import config as C
from shardconsole.settings import preset_store, resolve as settings
from shardconsole.session import preflight
from shardconsole.session.gpu_checks import FORCE, gpu_overrun

from shardconsole.console import fields as F
from shardconsole.console.card_plan import THIS_MACHINE, with_card
from shardconsole.console.screens.dialogs import AttachScreen, ConfirmScreen, ReportScreen, SavePresetScreen, SaveRequest
from shardconsole.console.screens.setup_summary import preset_options
from shardconsole.console.widgets.setting_field import SettingField
from shardconsole.console.services import Launcher, Machine, OpenRun, PlannedRun, Planner, Probes, RunListing
from shardconsole.user_folders import presets_dir


class SetupActions(Screen[None]):
    """Launch, save and attach: SetupScreen's base, whose state it reads (declared here, set by
    SetupScreen) and whose methods it calls (declared here, written in setup.py)."""

    cfg: reactive[C.RunConfig] = reactive(C.RunConfig, always_update=True, init=False)
    """The settings in force: resolved.cfg, the preset with the accepted overrides (SetupScreen._derive)."""

    launcher: Launcher
    probes: Probes
    machine: Machine
    plan: Planner | None
    resolved: settings.Resolved
    planned: PlannedRun | None
    preset_name: str
    preset_path: Path | None
    attach: Callable[[Path | None], None]       # the app's: a run screen for a folder
    open_run: OpenRun                            # the app's: a run screen for a session started here

    card = THIS_MACHINE      # the Plan for list's choice: a card to plan for instead of this machine's GPUs

    @on(Select.Changed, "#card")
    def _card_chosen(self, event: Select.Changed) -> None:
        self.card = str(event.value)
        self._refresh()

    def planning_machine(self) -> Machine:
        """What the estimate and the speed are of: this machine, or this host with the card chosen."""
        if self.card == THIS_MACHINE or self.machine.plan_hardware is None:
            return self.machine
        return dataclasses.replace(self.machine, card=self.card,
                                   plan_hardware=with_card(self.machine.plan_hardware, self.card, self.cfg))

    def _problems(self, data: bool = True) -> list[tuple[str, str]]:
        raise NotImplementedError

    async def _ensure_form(self, table: str) -> None:
        raise NotImplementedError

    async def _go_to(self, path: str) -> None:
        """Show the field at `path` (table.key) with the focus in it."""
        table, _, key = path.partition(".")
        if path in F.PICKED or table not in C.TABLES:      # chosen on the pick tab
            self.query_one(TabbedContent).active = "tab-pick"
            return
        self.query_one(TabbedContent).active = f"tab-{table}"
        await self._ensure_form(table)
        setting = self.query_one(f"#field-{table}-{key}", SettingField)
        setting.query_one(".setting--control").focus()
        setting.scroll_visible()

    def _load(self, preset: str | None, overrides: list[settings.Override]) -> None:
        raise NotImplementedError

    def _refresh(self) -> None:
        raise NotImplementedError

    def _show_picks(self) -> None:
        raise NotImplementedError

    async def _refuse_if_invalid(self, doing: str) -> bool:
        """With a problem left: say it, take the user to its field, and return True."""
        # A data file missing here does not stop a save: the preset may be meant for another machine.
        problems = self._problems(data=doing != "saving")
        if not problems:
            return False
        path, detail = problems[0]
        self.notify(f"{path}: {detail}", title=f"Fix this setting before {doing}", severity="error")
        await self._go_to(path)
        return True

    async def action_launch(self) -> None:
        if await self._refuse_if_invalid("launching"):
            return
        # The checks `--headless` makes before a launch (model folder, data files, GPUs of this machine),
        # on the settings resolved here, so that the console never starts what it would refuse.
        resolved = self.resolved
        try:
            warnings = preflight.check_launch(resolved, gpu_count=self.machine.gpu_count)
        except C.ConfigError as e:
            self.notify(str(e), title="Cannot launch", severity="error", timeout=10)
            if e.path:
                await self._go_to(e.path)
            return
        for warning in warnings:
            self.notify(warning, severity="warning", timeout=8)
        if self.plan is not None and self.machine.plan_hardware is not None:
            # a micro-batch nobody chose that fills the GPU is lowered, as --headless lowers it
            resolved, fitted = preflight.fit_micro_batch(resolved, self.machine.gpu_count,
                                                         hardware=self.machine.plan_hardware, planner=self.plan)
            if fitted:
                self.notify(fitted, severity="warning", timeout=10)
            unneeded = preflight.offload_not_needed(resolved, self.machine.gpu_count,
                                                    hardware=self.machine.plan_hardware, planner=self.plan)
            if unneeded:
                self.notify(unneeded, title="Offload", timeout=12)
        # The free disk for the checkpoints and the export, as --headless checks it (refused there
        # unless --force): here a question.
        planned = self.planned or self.launcher.plan(resolved.cfg, self.preset_name)
        short = (preflight.disk_shortfall(resolved.cfg, planned.run_dir, planner=self.plan)
                 if self.plan is not None else None)
        if short is not None:
            def disk_answered(yes: bool | None) -> None:
                if yes:
                    self._launch_past_gpu_check(resolved)
            self.app.push_screen(ConfirmScreen(
                "Launch without room for its saves?",
                f"{short.text.removesuffix(' (--force launches anyway)')}. A save that finds the disk full fails "
                f"the run at its last step. `shardconsole --headless` refuses this launch unless given --force.",
                yes="Launch anyway", no="Back"), disk_answered)
            return
        self._launch_past_gpu_check(resolved)

    def _launch_past_gpu_check(self, resolved: settings.Resolved) -> None:
        """The run's own plan against the GPU memory it knows (a GPU here, or memory.gpu_memory_limit), as
        --headless refuses it unless --force: here a question, then the host RAM check."""
        over = (gpu_overrun(resolved, hardware=self.machine.plan_hardware, planner=self.plan)
                if self.plan is not None and self.machine.plan_hardware is not None else None)
        if over is not None:
            def answered(yes: bool | None) -> None:
                if yes:
                    self._launch_past_host_check(resolved)
            self.app.push_screen(ConfirmScreen(
                "Launch past the plan's GPU memory?",
                f"{str(over).removesuffix(FORCE)}. A GPU out of memory stops the run after the model is built "
                f"(minutes on a big model). `shardconsole --headless` refuses this launch unless given --force.",
                yes="Launch anyway", no="Back"), answered)
            return
        self._launch_past_host_check(resolved)

    def _launch_past_host_check(self, resolved: settings.Resolved) -> None:
        """The host RAM check (asked, not refused), then the start."""
        over = (preflight.host_overrun(resolved, hardware=self.machine.plan_hardware, planner=self.plan)
                if self.plan is not None and self.machine.plan_hardware is not None else None)
        if over is not None:
            def answered(yes: bool | None) -> None:
                if yes:
                    self._start(resolved)
            peak, budget = (C.format_size(b) for b in over)
            self.app.push_screen(ConfirmScreen(
                "Launch past this machine's RAM?",
                f"The planner puts this run at {peak} of host RAM, over the {budget} usable here. A host out "
                f"of memory is not a clean failure: the kernel may kill any process, this console included. "
                f"`shardconsole --headless` refuses this launch unless given --force.",
                yes="Launch anyway", no="Back"), answered)
            return
        self._start(resolved)

    def _start(self, resolved: settings.Resolved) -> None:
        """Start exactly the settings that were checked."""
        planned = self.planned or self.launcher.plan(resolved.cfg, self.preset_name)
        try:
            session = self.launcher.start(resolved, planned)
        except OSError as e:
            self.notify(f"{planned.run_dir}: {e}", title="Launch failed", severity="error", timeout=10)
            return
        except C.ConfigError as e:     # the launcher's checks (port, writable folders, the folder's claim)
            self.notify(str(e), title="Launch refused", severity="error", timeout=10)
            return
        self.open_run(session, attached=False, closed=self._refresh)   # then a new folder name for the next

    async def action_save_preset(self) -> None:
        if await self._refuse_if_invalid("saving"):
            return
        name = self.preset_name if self.preset_path and self.preset_path.parent == presets_dir() \
            else f"{self.preset_name}-tuned"
        # The description starts empty: the base preset's would describe another preset.
        self.app.push_screen(SavePresetScreen(name, "", presets_dir()), self._save_answered)

    def _save_answered(self, request: SaveRequest | None) -> None:
        if request is None:
            return
        cfg = C.copy(self.cfg)
        cfg.description = request.description
        try:
            self._save(cfg, request.name, overwrite=False)
        except FileExistsError as e:
            def overwrite(yes: bool | None) -> None:
                if yes:
                    self._save(cfg, request.name, overwrite=True)

            self.app.push_screen(ConfirmScreen("Overwrite this preset?", f"{e.args[0]} exists. Replace it with the "
                                               "current settings?", yes="Overwrite", no="Keep it"), overwrite)

    def _save(self, cfg: C.RunConfig, name: str, *, overwrite: bool) -> None:
        try:
            path = preset_store.save_user_preset(cfg, name, overwrite=overwrite)
        except C.ConfigError as e:
            self.notify(str(e), title="Not saved", severity="error")
            return
        except OSError as e:
            if isinstance(e, FileExistsError):
                raise
            self.notify(f"{e.filename}: {e.strerror}", title="Not saved", severity="error")
            return
        self._load(str(path), [])
        presets = self.query_one("#presets", OptionList)
        presets.set_options(preset_options())
        self._refresh()
        self._show_picks()
        self.notify(f"Saved {path}", title="Preset saved")

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        """The data preview's key in the footer on the data tab only; ctrl+d works on every tab (its
        hidden binding)."""
        if action == "preview" and parameters:
            tabs = self.query(TabbedContent)
            return bool(tabs) and tabs.first().active == "tab-data"
        return True

    async def action_preview(self, _shown: str = "") -> None:
        """The first records as the model will see them (console/tryout.py), in a worker: it tokenizes."""
        if await self._refuse_if_invalid("previewing the data"):
            return
        self.notify("tokenizing the first records ...", title="Data preview")
        cfg = C.copy(self.cfg)

        def work() -> None:
            from shardconsole.console.tryout import preview
            title, body = preview(cfg)
            self.app.call_from_thread(self.app.push_screen, ReportScreen(title, body))
        self.run_worker(work, thread=True, exclusive=True, group="preview")

    async def action_tune(self) -> None:
        """Probe the settings that fit and save the fastest (console/screens/tune.py, tune/engine.py)."""
        if await self._refuse_if_invalid("tuning"):
            return
        from shardconsole.console.screens.tune import TuneScreen
        self.app.push_screen(TuneScreen(self.resolved, self.preset_name, self.machine.plan_hardware))

    def action_attach(self) -> None:
        """The attach dialog over the newest runs, listed in a worker (each run's stream tail is read:
        no file reads on the UI thread); the folder chosen goes to the app's attach (given to this screen)."""
        self.list_runs_to_attach()

    @work(thread=True, exclusive=True, group="attach-list")
    def list_runs_to_attach(self) -> None:
        self.app.call_from_thread(self._show_attach, self.launcher.recent_runs())

    def _show_attach(self, runs: list[RunListing]) -> None:
        self.app.push_screen(AttachScreen(runs, self.launcher.runs_root), self.attach)
