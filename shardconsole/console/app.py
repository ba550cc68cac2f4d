"""ShardConsoleApp: the Textual console. `run_console()` is what `shardconsole` and `shardconsole attach` call.

The app is given its launcher and probes (console/services.py), so tests build it with fakes. It always
keeps the setup screen at the bottom of the stack; a run screen goes on top of it, for a launched run
or an attached one, and "new run" goes back down to the setup.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path

from textual.app import App
from textual.binding import Binding

from shardconsole.settings import resolve as settings
from shardconsole.console.screens.setup import SetupScreen
from shardconsole.console.services import (AttachError, Launcher, MachineProbes, Planner, Probes, RunOptions,
                                           TorchrunLauncher, load_plan)
from shardconsole.session.run import RunSession

class ShardConsoleApp(App[Path | None]):
    """Returns the run folder when the user left a run going (so the caller can say how to attach)."""

    TITLE = "shardconsole"
    ENABLE_COMMAND_PALETTE = False
    HORIZONTAL_BREAKPOINTS = [(0, "-narrow"), (100, "-wide")]
    VERTICAL_BREAKPOINTS = [(0, "-short"), (30, "-tall")]      # 24 rows: the setup's summary gives way
    # In every footer: the setup screen's six bindings and these two fit in 80 columns.
    BINDINGS = [Binding("ctrl+q", "quit", "Quit", priority=True), Binding("ctrl+l", "runs", "Runs")]

    def __init__(self, launcher: Launcher, probes: Probes, *, preset: str = settings.DEFAULT_PRESET,
                 overrides: list[str] | None = None, resolved: settings.Resolved | None = None,
                 attach: Path | None = None, planner: Callable[[], Planner | None] = load_plan,
                 run_options: RunOptions = RunOptions()) -> None:
        """planner: returns the memory planner (shardconsole.plan) or None; tests pass a fixed one.
        resolved: the command line's settings, resolved once by the CLI (else preset and overrides)."""
        super().__init__()
        self.launcher = launcher
        self.probes = probes
        self.run_options = run_options
        self.attach_dir = attach
        self.setup_screen = SetupScreen(launcher, probes, preset=preset, overrides=overrides, resolved=resolved,
                                        planner=planner, attach=self.attach, open_run=self.open_run)

    def on_mount(self) -> None:
        self.push_screen(self.setup_screen)
        if self.attach_dir is not None:
            self.attach(self.attach_dir)
        self._catch_sighup()

    def attach(self, run_dir: Path | None) -> None:
        """Follow a run folder on a run screen (the command line's, the attach dialog's, the runs list's);
        a folder that is not a run's is said in one line."""
        if run_dir is None:
            return
        try:
            session = self.launcher.attach(run_dir)
        except AttachError as e:
            self.notify(str(e), title="Cannot attach", severity="error", timeout=10)
            return
        self.open_run(session, attached=True)

    def open_run(self, session: RunSession, *, attached: bool, closed: Callable[[], None] | None = None) -> None:
        """A run screen over the setup screen, given what it calls: the probes, the launcher's resume."""
        # Imported here: the run screen and its panels are not needed for the first paint.
        from shardconsole.console.screens.run import RunScreen
        screen = RunScreen(session, self.probes, attached=attached, options=self.run_options,
                           resume=self.launcher.resume)
        self.push_screen(screen, (lambda _: closed()) if closed is not None else None)

    def _catch_sighup(self) -> None:
        """A closed terminal (SIGHUP: tmux kill-session, a closed window) detaches from a live run: the
        run goes on, a `detached` event in its stream says so, exit 8, as the headless front end."""
        try:
            asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, self._hang_up)
            asyncio.get_running_loop().add_signal_handler(signal.SIGINT, self._interrupt)
        except (RuntimeError, ValueError, NotImplementedError):   # not the main thread (some tests)
            pass

    def _interrupt(self) -> None:
        """SIGINT (`kill -INT`; a Ctrl-C typed in the console is a key, ctrl+c): what ctrl+c does on the
        run screen (stop what this console started, leave what it attached to); without a run, quit."""
        from shardconsole.console.screens.run import RunScreen
        run_screen = next((s for s in reversed(self.screen_stack) if isinstance(s, RunScreen)), None)
        if run_screen is None or not run_screen.live:
            self.exit(None, return_code=130)
        else:
            run_screen.action_interrupt()

    def _hang_up(self) -> None:
        from shardconsole.console.screens.run import RunScreen
        from shardconsole.session.outcome import EXIT_CODES
        run_screen = next((s for s in reversed(self.screen_stack) if isinstance(s, RunScreen)), None)
        if run_screen is None or not run_screen.live:
            self.exit(None, return_code=129)       # no run to leave going: as cli.main's SIGHUP
            return
        run_screen.session.detach("the terminal closed (SIGHUP)")
        self.exit(run_screen.session.run_dir, return_code=EXIT_CODES["detached"])
        # Nothing can be shown any more; should restoring a terminal that is gone block, leave anyway.
        leave = threading.Timer(10.0, os._exit, args=(EXIT_CODES["detached"],))
        leave.daemon = True     # a console that exits in time is not held up by it
        leave.start()

    def action_runs(self) -> None:
        """ctrl+l: every run kept (history/), their status, a compare view; enter attaches to one."""
        from shardconsole.console.screens.runs import RunsScreen
        if isinstance(self.screen, RunsScreen):
            return
        self.push_screen(RunsScreen(Path(self.launcher.runs_root)), self.attach)

    async def action_quit(self) -> None:
        """ctrl+q anywhere: a live run is left running (never stopped by quitting), with its folder."""
        from shardconsole.console.screens.run import RunScreen
        run_screen = next((s for s in reversed(self.screen_stack) if isinstance(s, RunScreen)), None)
        if run_screen is None:
            self.exit(None)
        elif run_screen.live:
            run_screen.action_leave()
        else:
            run_screen.action_close()


def run_console(resolved: settings.Resolved | None = None, attach: Path | None = None,
                runs_root: Path | None = None, run_dir: Path | None = None) -> int:
    """Open the console on settings the CLI resolved (None: the default preset); returns the exit code:
    0, or the headless code of a watched run that failed. runs_root: `--runs-root` (None: the default);
    run_dir: `--run-dir`, the first launch's folder."""
    app = ShardConsoleApp(TorchrunLauncher(runs_root, run_dir), MachineProbes(), resolved=resolved, attach=attach)
    left = app.run()
    if left is not None:
        try:        # the terminal may be gone (SIGHUP)
            print(f"The run goes on in its own session. Attach again with: shardconsole attach {left}; "
                  f"stop it with `s` there or: shardconsole stop {left}", file=sys.stderr)
        except (OSError, ValueError):
            pass
    return app.return_code or 0
