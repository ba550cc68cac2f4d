"""The one stop path: Ctrl-C and SIGTERM to the headless front end that started the run (in attach they
detach), the console's `s`, the hang stop and `shardconsole stop RUN_DIR` all come here.

A stop first writes who asked into the stream (so every front end on the run reports "stopped", not a
crash), then SIGTERMs every process of the run, the ranks by their own pids too (a launcher killed
earlier no longer leads to them). Ranks that start a checkpoint save on SIGTERM say so (Event
"stop_save"): the stop then waits for them up to train.stop_save_timeout_s before SIGKILL; `hurry`
(a second Ctrl-C, `s` again) skips that wait. Last, it waits for the GPUs to let go of the ranks.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from shardconsole.settings import config as C
from shardconsole.runlog import protocol as P
from shardconsole.launch.job import Job, StopReport
from shardconsole.launch.process_identity import live as _live
from shardconsole.runlog.runfolder import RunFolder
from shardconsole.session.outcome import STOP_REQUESTED, stop_save_timeout
from shardconsole.runlog.stream import MetricsReader, MetricsWriter

STOP_SAVE = "stop_save"


class Hurry:
    """Set to skip the wait: a plain flag, safe to set from a signal handler (an Event's lock is not)."""

    def __init__(self) -> None:
        self.flag = False

    def set(self) -> None:
        self.flag = True

    def is_set(self) -> bool:
        return self.flag


def announce(run_dir, run_id: str, who: str) -> None:
    """Say in the stream who stops the run, before any signal; a read-only folder just goes without."""
    try:
        w = MetricsWriter(RunFolder(run_dir).metrics, run_id, -1, make_folder=False)   # never a half folder
    except OSError:
        return
    w.emit(P.Event(run=run_id, rank=-1, name=STOP_REQUESTED, detail=who))
    w.close()


@dataclass
class StopOutcome(StopReport):
    """A StopReport that knows which signalled pid was the launcher and which were ranks, so the report
    names them ("the launcher and 2 ranks") instead of a bare count that matches nothing on screen; and,
    when it had to kill before a save, what that cost (`lost`: "7 step(s) lost since step_00000008")."""
    launcher_pid: int = 0
    rank_pids: tuple[int, ...] = ()
    lost: str = ""
    note: str = ""      # what the stop waited for, or why it killed after the ranks were done


class _Seen:
    """What the stream says that a stop needs: the step time, the last save's time, the last step reached
    and the last checkpoint saved, and whether a rank announced its save on stop."""

    def __init__(self, asked_at: float) -> None:
        self.asked_at = asked_at
        self.step_s = 0.0
        self.save_s = 0.0
        self.step = 0
        self.saved: tuple[int, str] | None = None      # (step, folder) of the newest checkpoint_saved
        self.saving = False
        self.saved_on_stop = False
        self.phase = ""                                 # rank 0's last phase event ("saving checkpoint", ...)
        self.phase_step = 0

    def busy(self) -> str:
        """What the ranks are in the middle of that a stop waits out ('' when nothing): a periodic save
        or a held-out eval, which they finish before the step boundary where they act on the SIGTERM."""
        return BUSY.get(self.phase, "")

    def add(self, msgs: list) -> None:
        for m in msgs:
            if isinstance(m, P.Event) and m.name == "phase":
                self.phase, self.phase_step = m.detail, m.step or 0
            if isinstance(m, P.Step):
                self.step = max(self.step, m.step)
                self.step_s = m.step_s or self.step_s
            elif isinstance(m, P.SaveProgress) and m.done:
                self.save_s = max(self.save_s, m.elapsed_s)
            elif isinstance(m, P.Event) and m.name == "checkpoint_saved":
                self.saved = (m.step or 0, m.detail)
                self.saved_on_stop = self.saved_on_stop or (self.saving and m.t >= self.asked_at - 1.0)
            elif isinstance(m, P.Event) and m.name == STOP_SAVE and m.t >= self.asked_at - 1.0:
                self.saving = True

    def grace(self, grace_s: float, save_timeout_s: float) -> float:
        """A rank acts on SIGTERM at its next step boundary, then saves: the grace covers a step and a
        save as this run measured them (with a margin), capped by train.stop_save_timeout_s. A grace of
        HANG_GRACE_S or less is a hang's: its ranks are not stepping, waiting a step's time is waste."""
        if grace_s <= HANG_GRACE_S:
            return grace_s
        need = STEP_MARGIN * self.step_s + self.save_s + 2.0
        return max(grace_s, min(need, save_timeout_s))

    def lost(self) -> str:
        """After a kill that no save on stop preceded: the steps trained since the last checkpoint."""
        if self.saved_on_stop or self.step == 0:
            return ""
        if self.saved is None:
            return f"{self.step} step(s) lost: no checkpoint was saved (train.checkpoint_every, train.save_on_stop)"
        n = self.step - self.saved[0]
        return f"{n} step(s) lost since the checkpoint of step {self.saved[0]} ({self.saved[1]})" if n > 0 else ""


STEP_MARGIN = 1.5           # a step's time varies (data, a log step's sync): a stop waits half as long again

# The phases a stop waits out, in words: a rank acts on SIGTERM only at the next step boundary, so a save or
# an eval under way when the stop came must end first; killing it lost the save and every step since the
# last one. Bounded by train.stop_save_timeout_s from the stop, then the stop's own grace and save follow.
BUSY = {"saving checkpoint": "the checkpoint save", "evaluating": "the held-out eval"}

# Once the ranks are done (all ended, or their save on stop is complete), what is left (a launcher that
# does not end: stopped with SIGSTOP, wedged) holds no work: it is given this long, then SIGKILL, instead
# of the rest of the save timeout.
DONE_GRACE_S = 5.0


# The grace of a stop for a hang (headless and the console): a hang is declared after train.hang_timeout_s
# without a step, so a rank that has not moved that long does not reach the step boundary where it would
# act on the SIGTERM in the next seconds, and a save on stop needs every rank. The full 10 s grace was
# waited out after every hang, then SIGKILL all the same; a rank that does reach it in these 3 s and says
# it saves still gets the save budget (stop_run's stop_save wait).
HANG_GRACE_S = 3.0


def stop_run(job: Job, rank_pids, *, who: str, grace_s: float = 10.0, save_timeout_s: float | None = None,
             hurry: Hurry | None = None, check_gpus: bool = True) -> StopReport:
    """SIGTERM every verified process of the run folder (the launcher when job.json's identity holds,
    every rank of the folder whatever session started it, their children), wait (grace_s, or the save
    timeout once a rank says it saves), then SIGKILL; report what is left and what the GPUs hold. A
    launcher that job.json names but that is not ours is left alone (report.refused)."""
    hurry = hurry or Hurry()
    run_dir = job.run_dir
    asked_at = time.time()
    announce(run_dir, RunFolder(run_dir).run_id, who)
    if save_timeout_s is None:
        save_timeout_s = stop_save_timeout(run_dir)
    stream = MetricsReader(RunFolder(run_dir).metrics)     # for the ranks' stop_save event
    seen = _Seen(asked_at)
    seen.add(stream.poll())
    grace_s = seen.grace(grace_s, save_timeout_s)
    t0 = time.monotonic()
    rank_pids = tuple(p for p in rank_pids if p > 0)
    state, why = job.launcher_state()
    targets = job.processes(rank_pids)
    ranks = job.rank_pids(rank_pids)
    report = StopOutcome(signalled=targets, refused=why if state == "stranger" else "",
                         launcher_pid=job.pid if job.pid in targets else 0,
                         rank_pids=tuple(p for p in ranks if p in targets))
    _signal_all(targets, signal.SIGTERM)
    wait = _Wait(t0 + grace_s, grace_s, save_timeout_s, t0)
    while True:
        job.reap()
        if not _live(targets):
            break
        seen.add(stream.poll())
        wait.follow(seen, done=bool(report.rank_pids) and not _live(report.rank_pids))
        if hurry.is_set() or time.monotonic() >= wait.deadline:
            report.killed = True
            targets = sorted(set(targets) | set(job.processes(rank_pids)))
            _signal_all(targets, signal.SIGKILL)
            end = time.monotonic() + 5.0
            while time.monotonic() < end and _live(targets):
                job.reap()
                time.sleep(0.05)
            break
        time.sleep(0.05)
    job.reap()
    seen.add(stream.poll())
    stream.close()
    if report.killed:
        report.lost = seen.lost()
    report.note = wait.said(seen, report.killed and not hurry.is_set())
    report.left = _live(set(targets) | set(job.processes(rank_pids)))
    report.seconds = time.monotonic() - t0
    if check_gpus:
        from shardconsole.machine.probes import GpuProbe, wait_gpu_released
        report.gpu_note = wait_gpu_released(GpuProbe(), report.signalled, rank_uuids=_rank_uuids(run_dir))
    return report


class _Wait:
    """How long a stop waits, as the ranks' stream goes: the grace, the whole of a save or eval that was
    under way (BUSY), a fresh grace after it, the save timeout from a rank's announced save on stop, and
    DONE_GRACE_S once the ranks are done."""

    def __init__(self, deadline: float, grace_s: float, save_timeout_s: float, t0: float) -> None:
        self.deadline, self.grace_s, self.save_timeout_s, self.t0 = deadline, grace_s, save_timeout_s, t0
        self.busy = ""                  # BUSY's words for what is under way now
        self.waited: list[str] = []     # what was waited out, in words
        self.busy_since = 0.0
        self.saving = self.done = False

    def follow(self, seen: _Seen, done: bool) -> None:
        now = time.monotonic()
        busy = "" if seen.saving else seen.busy()      # after a rank's stop_save, the save is the stop's own
        if busy and not self.busy:
            self.busy, self.busy_since = busy, now
        elif self.busy and not busy:
            self.waited.append(f"waited {now - self.busy_since:.1f}s for {self.busy} under way at step "
                               f"{seen.phase_step}")
            self.busy = ""
            self.deadline = max(self.deadline, now + self.grace_s)    # then a step boundary, and the save
        if self.busy:
            self.deadline = max(self.deadline, self.t0 + self.save_timeout_s)
        if seen.saving and not self.saving:
            self.saving = True
            self.deadline = max(self.deadline, now + self.save_timeout_s)
        if (done or seen.saved_on_stop) and not self.done:
            self.done = True
            self.deadline = min(self.deadline, now + DONE_GRACE_S)

    def said(self, seen: _Seen, timed_out: bool) -> str:
        """The report's words: what was waited for; what a kill at the deadline cut short, or that it
        only ended what was left after the ranks were done."""
        parts = list(self.waited)
        if timed_out and self.busy:
            parts.append(f"killed during {self.busy} of step {seen.phase_step} after "
                         f"{time.monotonic() - self.busy_since:.0f}s (train.stop_save_timeout_s = {self.save_timeout_s:.0f})")
        elif timed_out and self.done:
            parts.append(f"the ranks were done{' (their save on stop complete)' if seen.saved_on_stop else ''}; "
                         f"what was left did not end within {DONE_GRACE_S:.0f}s of them")
        return "; ".join(parts)


def _signal_all(pids: list[int], sig: int) -> None:
    """Each verified process by pid, and the process groups that verified processes lead (a group leader
    is the launcher or a worker in its own session); never a group we only joined. pids come from
    Job.processes only: that is where a process is verified as the run's."""
    own = os.getpgid(0)
    for pid in pids:
        try:
            if os.getpgid(pid) == pid and pid != own:
                os.killpg(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass
    for pid in pids:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def _rank_uuids(run_dir) -> dict[int, str]:
    """Each rank's GPU by UUID, from its hello line: the release check names the run's own cards."""
    reader = MetricsReader(RunFolder(run_dir).metrics)
    try:
        return {m.rank: m.gpu_uuid for m in reader.poll() if isinstance(m, P.Hello) and m.gpu_uuid}
    finally:
        reader.close()


@contextlib.contextmanager
def interrupts_hurry(hurry: Hurry) -> Iterator[None]:
    """While a stop runs in the main thread: Ctrl-C and SIGTERM do not abort it (that would leave ranks
    behind), they make it skip the wait for a checkpoint save and SIGKILL now; SIGHUP waits too."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = {s: signal.signal(s, lambda *_: hurry.set()) for s in (signal.SIGINT, signal.SIGTERM)}
    old[signal.SIGHUP] = signal.signal(signal.SIGHUP, signal.SIG_IGN)   # a closed terminal: finish the stop
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def describe_stop(report: StopReport) -> str:
    how = "SIGKILL after the grace period" if report.killed else "SIGTERM"
    if report.refused:
        return _describe(report, how) + f"\nnot signalled: {report.refused}"
    return _describe(report, how)


def _describe(report: StopReport, how: str) -> str:
    if report.clean:
        line = f"stopped: {_who(report)} ended by {how} in {report.seconds:.1f}s; none left"
        lost, note = getattr(report, "lost", ""), getattr(report, "note", "")
        line += f"; {note}" if note else ""
        line += f"; {lost}" if lost else ""
        return line + (f"\n{report.gpu_note}" if report.gpu_note else "")
    return f"stop incomplete: process(es) {report.left} still alive after SIGKILL"


def _who(report: StopReport) -> str:
    """'the launcher (torchrun, pid 12) and 2 ranks (pids 13, 14)': what was signalled, by role."""
    n = len(report.signalled)
    launcher = getattr(report, "launcher_pid", 0)
    ranks = [p for p in getattr(report, "rank_pids", ()) if p in report.signalled]
    if not launcher and not ranks:
        return f"{n} process(es)"
    parts = []
    if launcher:
        parts.append(f"the launcher (torchrun, pid {launcher})")
    if ranks:
        parts.append(f"{len(ranks)} rank(s) (pid {', '.join(map(str, sorted(ranks)))})")
    others = n - len(ranks) - (1 if launcher else 0)
    if others > 0:
        parts.append(f"{others} other process(es) of the run (the ranks' children)")
    return (", ".join(parts[:-1]) + " and " + parts[-1]) if len(parts) > 1 else parts[0]


def not_yours(pids, uid: int | None = None) -> str:
    """'' when this user may signal every live process of `pids` (its own, or root); else who owns them:
    a stop of another user's run signalled nothing and reported "still alive after SIGKILL"."""
    import psutil
    uid = os.geteuid() if uid is None else uid
    if uid == 0:
        return ""
    for pid in pids:
        try:
            proc = psutil.Process(pid)
            owner = proc.uids().real
            if owner != uid:
                return f"pid {pid} runs as user {proc.username()}"
        except (psutil.Error, ValueError):
            continue
    return ""


class StopRefused(Exception):
    """Not a run this shell can stop (not a run folder, started on another host): one line."""


def stop_folder(run_dir: Path, err: TextIO) -> int:
    """`shardconsole stop RUN_DIR`: the same stop as Ctrl-C in the front end that started the run, from
    any shell of this host. 0 once every process of the run has ended (or it had already ended)."""
    from shardconsole.launch.job import ExternalJob, open_run
    from shardconsole.session.outcome import classify
    from shardconsole.session.watcher import HOST, Watcher
    folder = RunFolder(Path(run_dir))
    try:
        job = open_run(folder.path)
    except ValueError as e:
        raise StopRefused(str(e)) from None
    from shardconsole.session import cluster
    if isinstance(job, ExternalJob) or cluster.stops_through_folder(folder.path):
        # Several nodes, or started by --print-command / --slurm: a signal reaches this host only; the
        # request file in the shared folder reaches every node's ranks.
        return cluster.stop_through_folder(folder.path, err, who=f"`shardconsole stop` (pid {os.getpid()})")
    try:
        host = json.loads(folder.job.read_text()).get("host", "")
    except (OSError, ValueError, AttributeError):
        host = ""
    if host and host != HOST:
        raise StopRefused(f"{folder.path}: this run was started on host {host}, not {HOST}: run "
                          f"`shardconsole stop {folder.path}` there")
    watcher = Watcher(job, folder.path, folder.run_id, None, logs=False, look_every_s=0.0)
    try:
        watcher.poll()          # the whole history: rank pids, whether it already ended
        facts = job.facts(tuple(watcher.rank_pids))
        if watcher.ended and facts.launcher == "stranger":
            # job.json names a process that is not this run's launcher (a stale folder after pid reuse, a
            # hand-edited file): say so rather than classify a run whose end this folder cannot tell.
            print(f"nothing to stop: no process of this run is running; {facts.note}: nothing was signalled",
                  file=err)
            return 0
        if watcher.ended:
            cause, message = classify(watcher.state, watcher.exit_code if job.rc_known else None, folder.path)
            print(f"nothing to stop: the run has already ended ({cause}): {message.splitlines()[0]}", file=err)
            return 0
        others = not_yours([job.pid, *watcher.rank_pids])
        if others:
            raise StopRefused(f"{folder.path}: not your run: {others}; only that user (or root) can stop it")
        print(f"stopping {folder.path}: SIGTERM to every rank ... (Ctrl-C: SIGKILL now)", file=err, flush=True)
        hurry = Hurry()
        with interrupts_hurry(hurry):
            report = stop_run(job, watcher.rank_pids, who=f"`shardconsole stop` (pid {os.getpid()})", hurry=hurry)
        print(describe_stop(report), file=err, flush=True)
        return 0 if report.clean else 1
    finally:
        watcher.close()
