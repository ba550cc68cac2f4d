"""What the run screen says in words: its status line, and the account of a stop (run.py draws them).

Pure functions of the screen's RunView and the stop's report, so the screen's handlers stay about the
session and its messages.
"""

from __future__ import annotations

import time

from rich.text import Text

from shardconsole.launch.job import StopReport
from shardconsole.settings import config as C
from shardconsole.runlog import protocol as P
from shardconsole.runlog.runstate import save_line

from shardconsole.console.runview import RunView
from shardconsole.console.widgets.run_panels import duration, gib

_PHASE_OF = {"stopping": "stopping", "stopped": "stopped", "finished": "finished", "failed": "failed"}
_COLOR_OF = {"stopped": "yellow", "finished": "green", "failed": "red", "stopping": "yellow"}


def stop_question(run_id: str, settings: C.RunConfig | None, grace_s: float) -> str:
    """What the stop dialog says will happen, by the run's own train.save_on_stop (the default saves the
    steps since the last checkpoint first: saying they are lost would send a user to wait instead)."""
    text = f"Every process of run {run_id} gets SIGTERM, then SIGKILL after {grace_s:.0f} s. "
    if settings is None:
        return text + "The run's settings could not be read: whether it saves first is not known here."
    t = settings.train
    if t.save_on_stop:
        return text + (f"First the ranks save a checkpoint at the next step boundary (train.save_on_stop; up to "
                       f"{t.stop_save_timeout_s:.0f} s, s again skips it), so no finished step is lost and "
                       f"`shardconsole resume` goes on from there.")
    return text + ("Steps since the last checkpoint are lost (train.save_on_stop is off).")


def status_text(view: RunView, status: str, live: bool, note: Text, wide: bool) -> Text:
    """The line under the header: the phase (or how the run ended), the step bar or what it waits for,
    ranks and time; under it the note (how the run ended) or the op being built. wide: 100 columns or
    more (at 80 the bar is shorter, to leave room for the time elapsed)."""
    state = view.state
    s = state.last_step
    text = Text(no_wrap=True, overflow="ellipsis")
    color = _COLOR_OF.get(status, "cyan")
    text.append(f"● {_PHASE_OF.get(status, state.phase)}", f"bold {color}")
    if live and state.saving is not None:
        # a save of tens of GB takes tens of seconds: its bytes say it is alive (and the hang watch
        # counts them as progress); in the step bar's place, which reads 100% by then
        text.append(f"  {save_line(state.saving)}", "bold")
    elif s is not None and s.steps:
        step = max(s.step, view.step_now or 0)     # a save on stop at step 93 after the step line of 90
        frac = min(1.0, step / s.steps)
        width = 20 if wide else 8
        filled = int(frac * width)
        text.append(f"  step {step}/{s.steps} ")
        text.append("━" * filled, color)
        text.append("━" * (width - filled), "bright_black")
        text.append(f" {100 * frac:.0f}%")
        if view.eta_s is not None and live:
            text.append(f" · eta {duration(view.eta_s)}")
    elif live and state.phase == "building ops":
        # A first build takes minutes and sends nothing while it runs: the clock says it is alive.
        took = view.phase_elapsed_s(time.time())
        text.append(f" {duration(took or 0)}", "bold")
        text.append(" (a first JIT build takes minutes on a few cores; later runs load the cached build)"
                    if not view.building else "", "dim")
    elif live:
        text.append("  waiting for the first step", "dim")
    if state.world:
        text.append(f" · {state.world} rank(s)")
    text.append(f" · {duration(view.elapsed_s)} elapsed")
    if view.bad_lines:
        text.append(f" · {view.bad_lines} unreadable metrics line(s) skipped", "yellow")
    if note:
        text.append("\n")
        text.append_text(note)
    elif live and state.phase == "building ops" and view.building:
        text.append("\n" + view.building, "dim")
    return text


def short_stop(report: StopReport, ranks: int) -> str:
    """The status line's account of a clean stop, short enough for 80 columns (the report has it all)."""
    launcher = "the launcher and " if getattr(report, "launcher_pid", 0) else ""
    how = " (SIGKILL after the grace)" if report.killed else ""
    return f"stopped in {report.seconds:.1f}s{how}: {launcher}{ranks} rank(s) ended, none left"


def stop_details(report: StopReport, view: RunView, before: dict[int, P.GpuSample],
                 after: list[P.GpuSample], gpu_unavailable: str) -> list[tuple[str, bool]]:
    """(line, ok) for each rank (has it ended?) and each GPU (does any process of the run still hold
    memory there?), for the stop report."""
    out: list[tuple[str, bool]] = []
    left = set(report.left)
    launcher = getattr(report, "launcher_pid", 0)      # session/stop.StopOutcome
    if launcher:
        alive = launcher in left
        out.append((f"launcher (torchrun, pid {launcher}): {'still running' if alive else 'ended'}", not alive))
    for rank, hello in sorted(view.state.hellos.items()):
        alive = hello.pid in left
        out.append((f"rank {rank} (pid {hello.pid}): {'still running' if alive else 'ended'}", not alive))
    others = left - {h.pid for h in view.state.hellos.values()} - {launcher}
    if others:
        out.append((f"other process(es) of the run still alive: {sorted(others)}", False))
    if gpu_unavailable and not after:
        out.append((f"GPU memory: nothing to free, no GPU here ({gpu_unavailable})", True))
        return out
    ours = set(report.signalled) | {h.pid for h in view.state.hellos.values()}
    for g in after:
        holders = sorted(set(g.pids) & ours)
        was = before.get(g.index)
        change = f"{gib(was.used_bytes)} → {gib(g.used_bytes)} GiB" if was else f"{gib(g.used_bytes)} GiB used"
        if holders:
            out.append((f"gpu{g.index}: {change}; still held by pid {holders}", False))
        else:
            out.append((f"gpu{g.index}: {change}; no process of the run holds memory", True))
    return out
