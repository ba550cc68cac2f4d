"""The front end without a UI: start (or attach to) a run, print one line per log step, stop on Ctrl-C.

A thin renderer of the run session (session/run.RunSession): its watcher reads the stream and samples
the machine, its outcome names how the run ended, its stop ends it. What is printed is decided here.

Its own death never takes the run with it: a closed stdout pipe (`| head`) or a closed terminal
(SIGHUP) detaches (exit code 8, an event line in the stream says so, `attach` resumes); Ctrl-C and
SIGTERM to the front end that started the run stop it (130), as its first line says. Ctrl-C and SIGTERM
to `attach` detach (8) and say how to stop the run (`shardconsole stop`): a follower is never the way
a run ends by accident.
"""

from __future__ import annotations

import errno
import shutil
import sys
import time
from typing import TYPE_CHECKING, TextIO

from shardconsole.machine import offload_verdict
from shardconsole.settings import config as C
from shardconsole.runlog import protocol as P
from shardconsole.runlog.runstate import (RunState, count, eval_unit, fmt_eta, fmt_rate, kto_records, preference_text,
                                       reward_text, save_line)
from shardconsole.session.outcome import EXIT_CODES
from shardconsole.session.resume import EarlierPart
from shardconsole.session.signals import Detach, quiet_stdout
from shardconsole.session.run import Hang, RunSession
from shardconsole.session.stop import HANG_GRACE_S, Hurry, describe_stop, interrupts_hurry
from shardconsole.session.watcher import MachineProbes, Tick

if TYPE_CHECKING:
    from shardconsole.plan.machine import Hardware

__all__ = ["EXIT_CODES", "follow", "step_line", "progress_bar", "fmt_rate"]

POLL_S = 0.2
SAVE_LINE_EVERY_S = 10.0    # a save's line without a terminal: at its start, this often, at its end


def _num(x: float | None, fmt: str) -> str:
    return "n/a" if x is None else format(x, fmt)


def step_line(state: RunState) -> str:
    s = state.last_step
    assert s is not None
    parts = [f"step {s.step}/{s.steps}", f"loss {_num(s.loss, '.4f')}", f"lr {s.lr:.2e}",
             f"{fmt_rate(s.tokens_per_s)} tok/s" + ("" if s.padding is None else f" ({100 * s.padding:.0f}% padding not counted)"),
             f"{s.step_s:.3f} s/step"]
    if s.mfu is not None:
        parts.append(f"mfu {100 * s.mfu:.1f}%")
    if s.fp8:
        parts.append(f"fp8 {s.fp8}")
    eta = state.eta_s()
    if eta is not None and s.step < s.steps:
        parts.append(f"eta {fmt_eta(eta)}")
    if s.grad_norm is not None:
        parts.append(f"gnorm {s.grad_norm:.2f}")
    if s.loss_scale is not None:
        parts.append(f"scale {s.loss_scale:g}" + (f" skipped {s.skipped_steps}" if s.skipped_steps else ""))
    if preference_text(s):
        parts.insert(2, preference_text(s))
    if reward_text(s):
        parts.insert(2, reward_text(s))
    mem = []
    for rank in sorted(state.memory):
        m = state.memory[rank]
        if m.reserved_bytes is not None:
            mem.append(f"r{rank} {m.reserved_bytes / 2**30:.1f}/{(m.peak_reserved_bytes or 0) / 2**30:.1f}G")
        else:
            mem.append(f"r{rank} rss {m.host_rss_bytes / 2**30:.2f}G")
    if mem:
        parts.append("mem " + " ".join(mem))
    if state.host is not None:
        parts.append(f"host {state.host.used_bytes / 2**30:.1f}/{state.host.total_bytes / 2**30:.0f}G")
    return " | ".join(parts)


def predicted_line(cfg: C.RunConfig | None, measured: float, hw: "Hardware | None" = None) -> str:
    """The speed model's prediction for this run's settings on this machine against what it measured
    (the last step line's tokens/s, after the warm-up): `speed: predicted 8.2k tok/s (GPU bound, ...),
    measured 8.0k (-2%)`. "" where the model says nothing (CPU ranks, a card it does not know) or the
    settings are gone."""
    if cfg is None or measured <= 0:
        return ""
    from shardconsole.plan.machine import detect_hardware
    from shardconsole.plan.speed.model import against_measured, predict
    from shardconsole.settings.models import resolve
    try:
        p = predict(cfg, resolve(cfg.model.name), hw or detect_hardware())
    except (C.ConfigError, ValueError, OSError):
        return ""
    return f"speed: {against_measured(p, measured)}; `shardconsole plan` shows its parts" if p else ""


def computed_rate(s: P.Step) -> float:
    """The tokens a second the ranks computed: a preference step line counts only the real ones (Step.padding
    says the share of padding left out), the speed model predicts the rows, padding included."""
    return s.tokens_per_s / (1 - s.padding) if s.padding is not None and s.padding < 1 else s.tokens_per_s


def data_line(d: P.DataSummary) -> str:
    """What the ranks train on, once at start (issue 15)."""
    if d.format == "synthetic":
        # a learnable pattern, not noise (backends/data/batches.SyntheticTokens): the loss goes to about 0
        return ("data: synthetic tokens (no data set, no tokenizer): each sequence follows one fixed random order "
                "of the vocabulary, a pattern the model memorises, so the loss falls towards 0; that shows the "
                "training works, nothing real is learned") + (f"; {d.note}" if d.note else "")
    text = (f"data: {d.source} ({d.format}), tokenizer {d.tokenizer or 'n/a'}"
            + (f", template {d.template}" if d.template else "")
            + (f": {kto_records(d)}, {count(d.tokens, 'token')}, " if d.format == "kto" else
               f": {count(d.records, 'record')}, {count(d.tokens, 'token')}, "
               f"{count(d.samples, 'pair' if d.format == 'preference' else 'packed sample')}, ")
            + f"{100 * d.loss_share:.0f}% of tokens under loss, {d.epochs:.2f} epochs")
    if d.eval_records or d.eval_samples:
        text += f"; eval {count(d.eval_records, 'record')}, {count(d.eval_samples, 'sample')}"
    for name, share, epochs, tokens in zip(d.sources, d.source_shares, d.source_epochs, d.source_tokens):
        text += f"\n  source {name}: {100 * share:.1f}% of the rows, {count(tokens, 'token')}, {epochs:.2f} epochs"
    return text + (f"\n  note: {d.note}" if d.note else "")


def eval_line(e: P.Eval) -> str:
    if preference_text(e):
        tokens = f", {count(e.tokens, 'answer token')}" if e.tokens else ""     # 0: a stream of before issue 65
        return f"eval step {e.step}: loss {_num(e.loss, '.4f')} {preference_text(e)} over {count(e.pairs, eval_unit(e))}" \
               f"{tokens} ({e.seconds:.1f} s)"
    each = "".join(f"; {name} {_num(lo, '.4f')}" for name, lo in zip(e.sources, e.source_losses))
    return f"eval step {e.step}: loss {_num(e.loss, '.4f')} over {e.tokens} tokens ({e.seconds:.1f} s){each}"


def offload_line(state: RunState, o: P.OffloadTiming) -> str:
    """Rank 0's offload view at a log step, with the PCIe rates its copies made (else its card's, NVML, by
    UUID)."""
    text = offload_verdict.line(o.verdict, o.hint, o.gpu_s, o.host_step_s, o.h2d_s, o.d2h_s, o.step_s,
                                offload_verdict.pcie_of(o, state.gpu_of(o.rank)), o.pinned_bytes)
    overlap = offload_verdict.overlap_text(o.overlap, o.gpu_s, o.host_step_s, o.h2d_s, o.d2h_s, o.step_s,
                                           o.host_hidden_s)
    return text + (f" · {overlap}" if overlap else "")


def progress_bar(state: RunState, width: int) -> str:
    if state.saving is not None:       # a save of tens of GB takes tens of seconds: its bytes
        return save_line(state.saving)[:width]
    s = state.last_step
    done, total = (s.step, s.steps) if s else (0, 0)
    label = f" {state.phase} "
    if not total:
        return label.strip()[:width]
    frac = min(1.0, done / total)
    bar_w = max(10, width - 30)
    filled = int(bar_w * frac)
    left = state.eta_s()
    eta = f" eta {fmt_eta(left)}" if left is not None else ""
    return f"[{'#' * filled}{'.' * (bar_w - filled)}] {done}/{total}{eta}"[:width]


class Printer:
    """Step lines, events, data and eval lines on `out`; a progress bar under them on a terminal."""

    def __init__(self, out: TextIO, session: str = "", log_every: int | None = None) -> None:
        """session: only this run id's lines are printed (a resume: the earlier sessions' lines in the
        same stream are summed up in one line, not replayed). log_every: the run's train.log_every."""
        self.out = out
        self.session = session
        self.earlier: EarlierPart | None = EarlierPart(log_every)
        try:
            self.tty = out.isatty()
        except (ValueError, OSError):
            self.tty = False
        self._bar_shown = False
        self._save_said: dict[tuple[int, str], float] = {}     # (step, what) -> elapsed_s last printed

    def render(self, tick: Tick, state: RunState) -> None:
        for msg in tick.messages:
            if self.session and msg.run and msg.run != self.session:
                if self.earlier is not None:
                    self.earlier.add(msg)
                continue
            if self.earlier is not None:
                if self.earlier:
                    self.print(self.earlier.line())      # once, before this session's first line
                self.earlier = None
            if isinstance(msg, P.Step):
                self.print(step_line(_at(state, msg)))
            elif isinstance(msg, P.Event) and msg.name in P.RECORD_ONLY_EVENTS:
                continue
            elif isinstance(msg, P.Event) and msg.name != "phase":
                self.print(f"[{msg.name}] {msg.detail}")
            elif isinstance(msg, P.Event) and msg.detail not in ("training", "evaluating"):   # an eval has its own line
                self.print(f"-- {msg.detail}")
            elif isinstance(msg, P.DataSummary):
                self.print(data_line(msg))
            elif isinstance(msg, P.Eval):
                self.print(eval_line(msg))
            elif isinstance(msg, P.OffloadTiming) and msg.rank == 0:
                self.print(offload_line(state, msg))
            elif isinstance(msg, P.SaveProgress) and msg.rank == 0 and self._save_due(msg):
                self.print(save_line(msg))
        if self.tty:
            width = shutil.get_terminal_size((100, 20)).columns - 1
            self.out.write("\r\x1b[2K" + progress_bar(state, width))
            self.out.flush()
            self._bar_shown = True

    def _save_due(self, sp: P.SaveProgress) -> bool:
        """A save's first line, its end, and every SAVE_LINE_EVERY_S between (about one line a second
        comes; a terminal shows each in its progress bar instead)."""
        key = (sp.step, sp.what)
        if sp.done:
            self._save_said.pop(key, None)
            return True
        last = self._save_said.get(key)
        if last is not None and (self.tty or sp.elapsed_s - last < SAVE_LINE_EVERY_S):
            return False
        self._save_said[key] = sp.elapsed_s
        return True

    def print(self, line: str) -> None:
        self.clear_bar()
        self.out.write(line + "\n")
        self.out.flush()

    def clear_bar(self) -> None:
        if self.tty and self._bar_shown:
            self._bar_shown = False
            self.out.write("\r\x1b[2K")
            self.out.flush()


def _at(state: RunState, step: P.Step) -> RunState:
    """The state as a step line shows it: this step (a tick may carry several) with the latest memory."""
    if state.last_step is step:
        return state
    view = RunState(memory=state.memory, host=state.host)
    view.last_step = step
    return view


def _say(err: TextIO, text: str) -> None:
    """A line on stderr that may be gone too (a closed terminal): never raises."""
    try:
        print(text, file=err, flush=True)
    except (OSError, ValueError):
        pass


def follow(session: RunSession, out: TextIO = sys.stdout, err: TextIO = sys.stderr, grace_s: float = 10.0) -> int:
    """Follow a run session to its end (one attached to: its whole history first); return the exit code
    (EXIT_CODES). Never raises for what a run or its stream does: the job is always left in a known state."""
    session.watch(MachineProbes(), logs=False)
    printer = Printer(out, session=session.run_id if session.started_here else "",
                      log_every=session.settings.train.log_every if session.settings is not None else None)
    try:
        try:
            if session.started_here:
                _say(err, f"run {session.run_id}: {session.run_dir}  (Ctrl-C stops it; a closed terminal or pipe "
                          f"leaves it running: `shardconsole attach {session.run_dir}`)")
            else:
                _say(err, f"attached to {session.run_dir}  (Ctrl-C detaches: the run goes on; "
                          f"`shardconsole stop {session.run_dir}` stops it)")
                _replay(session, printer)
        except KeyboardInterrupt:
            return _detach(session, err, "Ctrl-C during the history replay")
        return _follow(session, printer, err, grace_s)
    except (BrokenPipeError, Detach) as e:
        why = "its output pipe closed" if isinstance(e, BrokenPipeError) else str(e)
        return _detach(session, err, why)
    except OSError as e:
        if e.errno != errno.EIO:
            raise
        # A write to a terminal already gone, before its SIGHUP arrived: the same closed terminal.
        return _detach(session, err, "the terminal closed (EIO)")
    finally:
        session.close()


def _replay(session: RunSession, printer: Printer) -> None:
    """The history of an attached run: every line the stream held when the attach began, however many
    polls that takes (a poll reads at most 8 MiB). Until its end, Ctrl-C detaches (follow)."""
    assert session.watcher is not None, "watch() first"
    reader = session.watcher.reader
    try:
        end = session.folder.metrics.stat().st_size
    except OSError:
        end = 0
    while True:
        before = reader.offset
        tick = session.tick()
        printer.render(tick, session.state)
        if tick.ended or reader.offset >= end or reader.offset == before:
            return


def _follow(session: RunSession, printer: Printer, err: TextIO, grace_s: float) -> int:
    try:
        while True:
            tick = session.tick()
            printer.render(tick, session.state)
            for note in tick.notes:
                printer.clear_bar()
                _say(err, f"note: {note}")
            if tick.ended:
                break
            hang = session.hang()
            if hang is not None:
                return _hung(session, hang, printer, err, grace_s)
            time.sleep(POLL_S)
    except KeyboardInterrupt:
        printer.clear_bar()
        if not session.started_here:        # attach: Ctrl-C leaves, it never stops (issue 50)
            return _detach(session, err, "Ctrl-C in attach")
        _stop(session, grace_s, "Ctrl-C in the front end", printer, err,
              announce="stopping: SIGTERM to every rank ... (Ctrl-C again: SIGKILL now)")
        return EXIT_CODES["stopped"]
    printer.clear_bar()
    assert session.watcher is not None, "watch() first"
    reader = session.watcher.reader
    if reader.bad_lines:
        _say(err, f"warning: {reader.bad_lines} unreadable metrics line(s) skipped ({reader.last_error})")
    cause, message = session.outcome()
    if cause == "config_error" and session.settings is not None and session.settings.train.resume:
        # refused by the ranks before a step: one line, and the folder keeps its earlier end (history/refused.py)
        from shardconsole.history.refused import put_back_settings, refusal_line
        refused = refusal_line(session.run_dir)
        if refused:
            put_back_settings(session.run_dir)
            message = refused
    s = session.state.last_step
    if cause == "ok" and s is not None:
        message = message.replace("; run folder", f", {fmt_rate(s.tokens_per_s)} tok/s; run folder", 1)
    _say(err, message)
    if cause == "ok" and s is not None:
        said = predicted_line(session.settings, computed_rate(s))
        if said:
            _say(err, said)
    last = session.state.offload.get(0)
    if last is not None and last.verdict:
        _say(err, f"offload verdict (mean of steps to {last.step}): {last.verdict}" +
             (f"; try {last.hint}" if last.hint else ""))
    return EXIT_CODES.get(cause, 1)


def _hung(session: RunSession, hang: Hang, printer: Printer, err: TextIO, grace_s: float) -> int:
    printer.clear_bar()
    logs = session.folder.logs
    if not hang.stoppable:
        # none of its ranks runs here to look at (session/faults/lost.py judges those that do): silent ranks
        # elsewhere are hung, or their nodes were lost together; only the scheduler knows which
        from shardconsole.launch.process_identity import this_host
        here = any(h.host == this_host() for h in session.state.hellos.values())
        _say(err, f"run hung: no step for {hang.stalled_s:.0f}s; it was not started here, so it is not "
                  f"stopped here (rank logs: {logs})" + ("" if here else "; no rank of it runs on this host to "
                  "check: if its nodes were lost at once, the Slurm job's state says so (sacct -j JOB)"))
        return EXIT_CODES["hang"]
    _say(err, f"run hung: {hang.message}\n  stopping it; rank logs: {logs}")
    _stop(session, min(grace_s, HANG_GRACE_S), "hang: " + hang.message.split(";")[0], printer, err)
    return EXIT_CODES["hang"]


def _stop(session: RunSession, grace_s: float, who: str, printer: Printer, err: TextIO, announce: str = "") -> None:
    hurry = Hurry()
    with interrupts_hurry(hurry):      # first: a second Ctrl-C from here on hurries, never aborts the stop
        if announce:
            _say(err, announce)
        report = session.stop(who, grace_s=grace_s, hurry=hurry)
        try:
            printer.render(session.tick(), session.state)
        except OSError:
            pass
        printer.clear_bar()      # the report goes on a line of its own
        _say(err, describe_stop(report))


def _detach(session: RunSession, err: TextIO, why: str) -> int:
    """The front end goes; the run does not. Said in the stream and, where it can still be read, on stderr:
    with how to follow it again and how to stop it (a run started elsewhere stops where it was started)."""
    session.detach(why)
    quiet_stdout()
    stop = (f"stop it where it was started (a Slurm job: scancel), or `shardconsole stop {session.run_dir}`"
            if session.external else f"`shardconsole stop {session.run_dir}` stops it")
    _say(err, f"detached ({why}): the run goes on; `shardconsole attach {session.run_dir}` follows it, {stop}")
    return EXIT_CODES["detached"]
