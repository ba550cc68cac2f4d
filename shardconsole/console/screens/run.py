"""The run screen: a started or attached run, live; stop it, leave it running, resume it, or start another.

The screen renders a run session (session/run.RunSession, the one the headless front end renders): a
thread worker ticks the session's one watcher and posts what it finds; the screen folds that into its
RunView and redraws the panels. Stopping runs in its own worker through the session's stop, since it
waits for the ranks. The words of the status line and of a stop's report are run_status.py's.
"""

from __future__ import annotations

import asyncio
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

from rich.text import Text
from textual import on, work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.reactive import reactive
from textual.screen import Screen
from textual.widgets import Footer, Header, Log, Static
from textual.worker import get_current_worker

from shardconsole.settings import config as C
from shardconsole.runlog import protocol as P
from shardconsole.session.outcome import EXIT_CODES
from shardconsole.session.run import RunSession
from shardconsole.session.stop import HANG_GRACE_S, Hurry, describe_stop

from shardconsole.console.messages import (MachineSampled, RunEnded, RunHung, RunPlanned, RunResumed, RunUpdate,
                                          StopFinished)
from shardconsole.console.runview import RunView, library_noise, log_line
from shardconsole.console.screens.dialogs import ConfirmScreen, ReportScreen
from shardconsole.console.screens.run_status import short_stop, status_text, stop_details, stop_question
from shardconsole.console.services import Probes, RunOptions, method_line, planned_peaks, predicted_speed
from shardconsole.console.widgets.following_log import FollowingLog
from shardconsole.console.widgets.run_panels import GpuPanel, HostPanel, LossPanel, ThroughputPanel, duration

HERE = Path(__file__).parent
POLL_S = 0.5           # how often the follower looks at the stream (and the panels redraw); samples: 1 Hz
LOG_LINES = 500

# Lifecycle of the run as this screen sees it; the phase inside a live run comes from the stream.
LIVE = ("running", "stopping")


class RunScreen(Screen[None]):
    CSS_PATH = HERE / "run.tcss"
    BINDINGS = [
        Binding("s", "stop", "Stop run"),
        Binding("l", "leave", "Leave (run goes on)"),
        Binding("r", "resume", "Resume"),
        Binding("n", "new_run", "New run"),
        Binding("q", "app.quit", "Quit", show=False),   # ctrl+q (shown) does the same
        # The one answer to Ctrl-C (issue 50): the console that started the run asks to stop it, as `s`;
        # attached, it leaves (the run goes on). Priority: over the app's "press ctrl+q" hint.
        Binding("ctrl+c", "interrupt", "Stop or leave", show=False, priority=True),
    ]

    status: reactive[str] = reactive("running")
    """running | stopping | stopped | finished | failed"""

    def __init__(self, session: RunSession, probes: Probes, *, attached: bool = False,
                 options: RunOptions = RunOptions(), resume: Callable[[Path], RunSession] | None = None) -> None:
        """resume: continues an ended run in its folder (the launcher's); None: no resume offered."""
        super().__init__()
        self.session = session
        self._resume = resume
        self._how = ""               # "attached · ", "resumed · ": the header's first word
        self.probes = probes
        self.run_id = session.run_id
        self.attached = attached
        self.sample = options.sample
        self.stop_grace_s = options.stop_grace_s
        self.view = RunView(self.run_id)
        self.gpu_unavailable = ""
        self.outcome = ""            # the cause, once ended ("ok", "stopped", "gpu_oom", ...)
        self.note: Text = Text()     # the line under the status: how the run ended
        self._gpu_before_stop: dict[int, P.GpuSample] = {}
        self._hurry = Hurry()
        # Set by the UI thread when a stop begins: the follower asks no hang diagnosis of a run being stopped
        # (it reads this, never the screen's reactive status, from its thread).
        self._stopping = threading.Event()
        self._exit_after_stop = False
        self._sigterm_before: Callable[[int, FrameType | None], Any] | int | None = None
        self._noise = 0              # library notices left out of the Logs panel (runview.library_noise)
        self._how = ""               # "attached · ", "resumed · ": the header's first words
        self._method = ""            # LoRA's trainable count, once the follower read the model's config

    # --- layout ------------------------------------------------------------------------------------
    def compose(self) -> ComposeResult:
        yield Header()
        yield Static(id="status", markup=False)
        with Horizontal(id="panels"):
            with Vertical(id="machine"):
                yield GpuPanel("GPUs", id="gpu")
                yield HostPanel("Host RAM", id="host")
            with Vertical(id="training"):
                yield ThroughputPanel("Throughput", id="throughput")
                yield LossPanel("Loss", id="loss")
        log = FollowingLog(id="logs", max_lines=LOG_LINES, auto_scroll=False)
        log.border_title = "Logs · launcher and ranks"
        yield log
        yield Footer()

    def on_mount(self) -> None:
        self._how = "attached · " if self.attached else ""
        self.sub_title = self._subtitle()
        self._draw_status()
        self.set_interval(1.0, self._tick_clock)
        self.follow()
        if not self.attached:
            self._catch_sigterm()

    def _subtitle(self) -> str:
        """The header's line: the run, and what Ctrl-C does to it here while it runs (stops what this console
        started, leaves what it attached to), how it ended once it has (Ctrl-C then only quits); LoRA's
        trainable count once the follower worked it out."""
        if self.status in ("running", "stopping"):
            what = "ctrl+c stops it" if self.session.started_here else "ctrl+c leaves it running"
        else:
            what = self.status
        return f"{self._how}{what} · run {self.run_id}{self._method}"   # first: a long id is cut

    def _catch_sigterm(self) -> None:
        """SIGTERM to the console that started this run stops the run, then quits (the terminal restored)."""
        try:
            before = signal.getsignal(signal.SIGTERM)
            asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, self._sigterm)
            self._sigterm_before = before
        except (RuntimeError, ValueError, NotImplementedError):   # not the main thread
            pass

    def on_unmount(self) -> None:
        if self._sigterm_before is not None:
            try:
                asyncio.get_running_loop().remove_signal_handler(signal.SIGTERM)
            except RuntimeError:
                pass
            signal.signal(signal.SIGTERM, self._sigterm_before)   # remove_signal_handler left SIG_DFL

    def _sigterm(self) -> None:
        if self.status == "running" and not self.session.external:
            self._exit_after_stop = True
            self._begin_stop("SIGTERM to the console")
        elif self.status == "stopping":
            self._exit_after_stop = True
            self._hurry.set()
        else:
            self.app.exit(return_code=EXIT_CODES["stopped"])

    def _tick_clock(self) -> None:
        """An op build sends nothing for minutes: its elapsed time is redrawn by the clock."""
        if self.live and self.view.state.phase == "building ops":
            self._draw_status()

    @property
    def live(self) -> bool:
        return self.status in LIVE

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        """Footer shows only what makes sense now: stop/leave while the run lives (stop again while
        stopping: SIGKILL now), new/resume/quit after."""
        if action == "stop":
            return self.live
        if action == "leave":
            return self.live
        if action == "new_run":
            return not self.live
        if action == "resume":
            return not self.live and not self.session.external and self._resume is not None
        return True

    def watch_status(self) -> None:
        self.refresh_bindings()
        self.sub_title = self._subtitle()       # ended: no "ctrl+c stops it" over a run that is no more
        self._draw_status()

    # --- the workers -------------------------------------------------------------------------------
    @work(thread=True, exclusive=True, group="follow")
    def follow(self) -> None:
        worker = get_current_worker()
        session, stopping = self.session, self._stopping     # this session's: a resume gives the next worker its own
        # The planner's peaks and NVML's first answer: here, never on the UI thread (NVML may take seconds).
        self.post_message(RunPlanned(*planned_peaks(session.settings, self.probes), method_line(session.settings)))
        session.watch(self.probes if self.sample else None, look_every_s=POLL_S)
        unavailable = self.probes.gpu_unavailable()
        self.post_message(MachineSampled([], gpu_unavailable=unavailable))
        try:
            while not worker.is_cancelled:
                tick = session.tick()
                stream = [m for m in tick.messages if not isinstance(m, (P.GpuSample, P.HostSample))]
                samples = [m for m in tick.messages if isinstance(m, (P.GpuSample, P.HostSample))]
                if stream or tick.log_lines or tick.notes or tick.bad_lines != self.view.bad_lines:
                    self.post_message(RunUpdate(stream, tick.log_lines, tick.bad_lines, tick.notes))
                if samples:
                    self.post_message(MachineSampled(samples, gpu_unavailable=unavailable))
                if tick.ended:
                    cause, message = session.outcome()
                    last = session.state.last_step
                    speed = predicted_speed(session.settings, self.probes, last.tokens_per_s) \
                        if cause == "ok" and last is not None else ""
                    self.post_message(RunEnded(tick.exit_code, cause, message, speed))
                    return
                hang = None if stopping.is_set() else session.hang()
                if hang is not None:
                    self.post_message(RunHung(hang.message, hang.stoppable))
                time.sleep(POLL_S)
        finally:
            session.close()

    @work(thread=True, exclusive=True, group="stop")
    def stop_run(self, who: str, grace_s: float | None = None) -> None:
        report = self.session.stop(who, grace_s=self.stop_grace_s if grace_s is None else grace_s, hurry=self._hurry)
        unavailable = self.probes.gpu_unavailable()
        gpus = [] if unavailable else self.probes.gpus(self.run_id)
        self.post_message(StopFinished(report, gpus, unavailable))

    @work(thread=True, exclusive=True, group="resume")
    def resume_run(self, resume: Callable[[Path], RunSession], run_dir: Path) -> None:
        try:
            session = resume(run_dir)
        except (C.ConfigError, OSError, ValueError) as e:
            self.app.call_from_thread(self.notify, str(e), title="Cannot resume", severity="error", timeout=10)
            return
        self.post_message(RunResumed(session))

    # --- what the workers found --------------------------------------------------------------------
    @on(RunUpdate)
    def _run_update(self, event: RunUpdate) -> None:
        said = []
        for msg in event.messages:
            self.view.apply(msg)
            line = log_line(msg)
            if line is not None:
                said.append(line)
            if isinstance(msg, P.Event) and msg.name == "phase" and msg.detail == "training" and \
                    self.session.settings is not None and self.session.settings.train.compile:
                # No rank says it: torch.compile runs inside the first steps, which then look stalled.
                said.append(f"{'r0':>6}│ torch.compile (train.compile): the first steps compile the model "
                            f"and take longer; the steps after them show the real speed")
        self.view.bad_lines = event.bad_lines
        log_lines = [line for line in event.log_lines if not library_noise(line)]
        logs = self.query_one("#logs", FollowingLog)
        if len(log_lines) < len(event.log_lines):
            self._noise += len(event.log_lines) - len(log_lines)
            logs.border_subtitle = f"{self._noise} library notice(s) left out: in the rank logs"
        if said or log_lines:
            logs.add(said + log_lines)
        for note in event.notes:
            self.notify(note, title="The run's stream", severity="warning", timeout=15)
        self._draw()

    @on(MachineSampled)
    def _machine_sampled(self, event: MachineSampled) -> None:
        self.gpu_unavailable = event.gpu_unavailable
        for msg in event.samples:
            self.view.apply(msg)
        self.query_one(GpuPanel).show(self.view, self.gpu_unavailable)
        self.query_one(HostPanel).show(self.view)
        self._draw_status()

    @on(RunEnded)
    def _run_ended(self, event: RunEnded) -> None:
        if self.status in ("stopping", "stopped") or (self.outcome == "hang" and event.cause != "ok"):
            self.outcome = self.outcome or "stopped"
            return   # StopFinished tells the rest
        self.outcome = event.cause
        if event.cause == "ok":
            steps = self.view.state.finished.steps if self.view.state.finished else 0
            speed = event.speed
            self.note = Text(f"■ finished: {steps} steps in {duration(self.view.elapsed_s)}; "
                             + (f"{speed}; " if speed else "") + f"run folder {self.session.run_dir}", "green")
            self.status = "finished"
        elif event.cause == "stopped":      # stopped from elsewhere: another front end, `shardconsole stop`
            self.note = Text(f"■ {event.message.splitlines()[0]}", "yellow")
            self.status = "stopped"
        else:
            self.note = Text(f"✖ {event.message.splitlines()[0]}", "red")
            self.status = "failed"
            self.app.push_screen(ReportScreen(f"The run failed: {event.cause}", event.message, error=True))
        self._draw_status()

    @on(RunPlanned)
    def _run_planned(self, event: RunPlanned) -> None:
        self.view.planned_gpu_bytes, self.view.planned_host_bytes = event.gpu_bytes, event.host_bytes
        if event.method:          # a model folder's config read: in the worker, said in the header now
            self._method = event.method
            self.sub_title = self._subtitle()
        if self.view.state.hellos:        # else the first lines draw them
            self._draw()

    @on(RunHung)
    def _run_hung(self, event: RunHung) -> None:
        if self.status != "running":      # asked while a stop began: that stop goes on
            return
        if not event.stoppable:
            self.note = Text(f"✖ run hung: {event.message}; it was not started here, so it is not stopped here",
                             "red")
            self._draw_status()
            return
        self.outcome = "hang"
        self.note = Text(f"✖ run hung: {event.message}; stopping it", "red")
        self._begin_stop("the console: hang, " + event.message.split(";")[0], min(self.stop_grace_s, HANG_GRACE_S))

    @on(RunResumed)
    def _run_resumed(self, event: RunResumed) -> None:
        """The same screen follows the new session: the whole stream again, the old curves included."""
        self.session, self.run_id = event.session, event.session.run_id
        self.view = RunView(self.run_id)
        self.outcome, self.note, self._hurry, self._stopping = "", Text(), Hurry(), threading.Event()
        self.query_one("#logs", Log).clear()
        self.status = "running"
        self._how = "resumed · "
        self.sub_title = self._subtitle()
        self.follow()

    @on(StopFinished)
    def _stop_finished(self, event: StopFinished) -> None:
        self.outcome = self.outcome or "stopped"
        for sample in event.gpus_after:    # the panel shows the memory given back
            self.view.apply(sample)
        self.query_one(GpuPanel).show(self.view, self.gpu_unavailable)
        lines = stop_details(event.report, self.view, self._gpu_before_stop, event.gpus_after,
                             event.gpu_unavailable)
        clean = event.report.clean and all(ok for _, ok in lines)
        self.note = Text(("■ " + short_stop(event.report, len(self.view.state.hellos)) if clean else
                          "✖ " + describe_stop(event.report)) +
                         (" · GPU memory freed" if clean and event.gpus_after else ""),
                         "green" if clean else "red")
        self.status = "stopped"
        body = Text(describe_stop(event.report) + "\n\n")
        for line, ok in lines:
            body.append(("✔ " if ok else "✖ ") + line + "\n", "green" if ok else "red")
        if self._exit_after_stop:
            self.app.exit(return_code=EXIT_CODES["stopped"])
            return
        self.app.push_screen(ReportScreen("Run stopped" if clean else "Run stopped, with processes left",
                                          body, error=not clean))

    # --- actions -----------------------------------------------------------------------------------
    def action_stop(self) -> None:
        if self.session.external:
            self.notify("This run was started on other machines (--print-command or --slurm): stop it where it "
                        "runs, e.g. scancel for a Slurm job. q leaves it running.", severity="warning")
            return
        if self.status == "stopping":
            self._hurry.set()
            self.notify("Not waiting for the ranks' checkpoint save: SIGKILL now.", severity="warning")
            return

        def answer(yes: bool | None) -> None:
            if yes and self.status == "running":
                self._begin_stop("the console's s")

        self.app.push_screen(ConfirmScreen("Stop the run?", stop_question(self.run_id, self.session.settings,
                                                                          self.stop_grace_s),
                                           yes="Stop", no="Keep running"), answer)

    def _begin_stop(self, who: str, grace_s: float | None = None) -> None:
        self._gpu_before_stop = dict(self.view.state.gpus)
        self._stopping.set()
        self.status = "stopping"
        self.stop_run(who, grace_s)

    def action_resume(self) -> None:
        if not self.live and self._resume is not None:
            self.resume_run(self._resume, self.session.run_dir)

    def action_interrupt(self) -> None:
        """ctrl+c (or SIGINT to the console): a run this console started is stopped after the question
        `s` asks; a run it attached to is left running, exit 8, and the console says how to stop it."""
        if not self.live:
            self.app.action_help_quit()
        elif self.session.started_here:
            self.action_stop()
        else:
            self.session.detach("Ctrl-C in the console (attach)")
            self.app.exit(result=self.session.run_dir, return_code=EXIT_CODES["detached"])

    def action_leave(self) -> None:
        """Quit the console; the run goes on in its own session and can be attached to again (said in
        its stream, as every front end that leaves a live run says it)."""
        self.session.detach("the console quit, leaving the run going")
        self.app.exit(result=self.session.run_dir, return_code=0)

    def action_new_run(self) -> None:
        """Back to the setup screen, which is always under this one."""
        self.dismiss(None)

    def action_close(self) -> None:
        self.app.exit(return_code=EXIT_CODES.get(self.outcome, 0))

    # --- drawing -----------------------------------------------------------------------------------
    def _draw(self) -> None:
        self.query_one(GpuPanel).show(self.view, self.gpu_unavailable)
        self.query_one(HostPanel).show(self.view)
        self.query_one(ThroughputPanel).show(self.view)
        self.query_one(LossPanel).show(self.view)
        self._draw_status()

    def _draw_status(self) -> None:
        if self.is_mounted:
            self.query_one("#status", Static).update(
                status_text(self.view, self.status, self.live, self.note, wide=self.size.width >= 100))
