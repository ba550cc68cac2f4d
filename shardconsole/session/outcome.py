"""How a run ended: the exit code of each failure class and the paragraph that explains it.

The stream comes first: a rank's `failed` line names the cause; torchrun's report and the launcher's
exit code are read only when no rank could say (a rank killed from outside writes nothing). A run is
"stopped" only when someone asked (a stop_requested line); a rank's death by a signal is named by that
signal, and a SIGKILL is an OOM kill only when the kernel recorded one (its log, the memory cgroup).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import signal
from pathlib import Path

from shardconsole.launch import process_identity as PI
from shardconsole.settings import config as C
from shardconsole.runlog import protocol as P
from shardconsole.runlog.runfolder import RunFolder
from shardconsole.runlog.runstate import RunState
from shardconsole.session.network import who_hosts
from shardconsole.session.rundir import stream_stopped_cause, stream_stopped_note
from shardconsole.session.faults import lost as lost_ranks, stream_gone

# Exit codes of `shardconsole --headless` and `attach`, by how the run (or the watching) ended.
# docs/EXIT_CODES.md lists the same.
EXIT_CODES = {
    "ok": 0,
    "crash": 1,
    "config_error": 2,
    "gpu_oom": 3,
    "host_oom": 4,
    "nccl_timeout": 5,
    "hang": 5,
    "rendezvous": 5,     # the nodes never met: torchrun's agent gave up on a rendezvous nobody hosts
    "nan_loss": 6,
    "loss_scale_floor": 7,
    "disk_full": 9,      # ENOSPC / EDQUOT where the run writes (its folder, a checkpoint, an export)
    "run_folder_gone": 10,   # the run folder deleted while the run went on: the ranks stopped (stream_health)
    "node_lost": 11,     # every rank of a node vanished without an end line (killed, rebooted, cut off)
    "run_folder_moved": 12,   # renamed while the run went on: the ranks stopped, saving at its new path
    "detached": 8,       # the front end went away (closed pipe, closed terminal, Ctrl-C in attach); the run goes on
    "stopped": 130,
}

# An Event of this name is written to the stream by whoever stops a run (a front end, `shardconsole stop`),
# before any signal: every other front end on that run then reports "stopped", not a crash.
STOP_REQUESTED = "stop_requested"
# A folder whose preset.toml cannot be read waits what a run of the default settings would: one number
# for the console, headless, RunSession and `shardconsole stop` alike (they held 120 s and 300 s apart).
DEFAULT_STOP_SAVE_TIMEOUT_S = C.TrainSettings().stop_save_timeout_s


def stop_save_timeout(run_dir) -> float:
    """train.stop_save_timeout_s of the run in run_dir (its preset.toml), or the default's."""
    try:
        return float(getattr(C.load(RunFolder(run_dir).preset).train, "stop_save_timeout_s",
                             DEFAULT_STOP_SAVE_TIMEOUT_S))
    except (C.ConfigError, OSError):
        return DEFAULT_STOP_SAVE_TIMEOUT_S


DETACHED = "detached"


def _tail(path: Path, lines: int = 15) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.rstrip().splitlines()[-lines:])


_FAILED_RANK = re.compile(r"rank\s*:\s*(\d+)[^\n]*\n\s*exitcode\s*:\s*(-?\d+)(?:\s*\(pid:\s*(\d+)\))?")
# torchrun's own SIGKILL of a worker that outlived its shutdown timeout after a SIGTERM
_FORCED = re.compile(r"Unable to shutdown process (\d+) via")


def killed_rank(run_dir: Path) -> tuple[int, int] | None:
    """(rank, signal) when torchrun's failure report lists a rank killed by a signal from outside. Such a
    rank is the cause whatever torchrun calls the "root cause": when one rank is killed its peers fail
    within the same second with connection errors, and torchrun's ordering of the two is a race. A rank
    torchrun itself SIGKILLed (it outlived the shutdown timeout after another rank failed) is not."""
    log = _tail(RunFolder(run_dir).launcher_log, 400)
    forced = {int(p) for p in _FORCED.findall(log)}
    for m in _FAILED_RANK.finditer(log):
        code = int(m.group(2))
        pid = int(m.group(3)) if m.group(3) else None
        if code < 0 and -code != signal.SIGTERM and pid not in forced:   # SIGTERM is torchrun ending the others
            return int(m.group(1)), -code
    return None


def fitting_settings(run_dir: Path, top: int = 2, settings: C.RunConfig | None = None) -> str:
    """After a GPU OOM: the planner's fastest settings that fit this machine (or the run's cap).
    settings: the run's, as its session read them (None: read from the folder)."""
    try:
        from shardconsole import plan
        from shardconsole.settings.models import resolve
        cfg = settings if settings is not None else C.load(RunFolder(run_dir).preset)
        hw = plan.detect_hardware()
        if cfg.gpu_memory_limit_bytes:
            hw = dataclasses.replace(hw, gpu_memory_bytes=cfg.gpu_memory_limit_bytes)
        if not hw.gpus:
            return ""
        found = plan.settings_that_fit(cfg, hw, resolve(cfg.model.name))[:top]
    except Exception:   # a suggestion must never hide the failure itself
        return ""
    lines = [f"\n  the planner's fastest settings that fit ({C.format_size(hw.gpu_memory_bytes)} a GPU):"]
    for cand in found:
        # ranked as `tune` ranks (plan/speed/book.py): the speeds measured on this machine first
        speed = f" ({cand.speed:,.0f} tokens/s {cand.speed_source})" if cand.speed_unit == "tokens/s" else ""
        lines.append(f"    {cand.name}{speed}: " + " ".join(f"--set {o}" for o in cand.overrides))
    return "\n".join(lines) if found else ""


def stop_requested(state: RunState) -> str:
    """Who stopped the run, when the stream says someone did ("" otherwise)."""
    for e in reversed(state.events):
        if e.name == STOP_REQUESTED:
            return e.detail or "stopped"
    return ""


def _signal_name(sig: int) -> str:
    try:
        return signal.Signals(sig).name
    except ValueError:
        return f"signal {sig}"


_OOM_LINE = re.compile(r"(?:Killed process|oom-kill:.*?\bpid=)\s*(\d+)")


def kernel_oom_pids() -> set[int] | None:
    """The pids the kernel log (/dev/kmsg) says the OOM killer killed; None where the log cannot be read."""
    try:
        fd = os.open("/dev/kmsg", os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return None
    found: set[int] = set()
    try:
        for _ in range(100_000):       # the ring buffer holds far fewer records
            try:
                record = os.read(fd, 8192)
            except BlockingIOError:
                break
            except BrokenPipeError:    # a record overwritten while read: the next one
                continue
            except OSError:
                break
            if not record:
                break
            found |= {int(p) for p in _OOM_LINE.findall(record.decode("utf-8", "replace"))}
    finally:
        os.close(fd)
    return found


def oom_recorded(run_dir: Path, pids: set[int]) -> str:
    """How the kernel recorded an OOM kill of one of pids (or in the run's cgroup since its launch), ""
    when it recorded none: SIGKILL is also `kill -9`, a scheduler, a stop's last resort."""
    named = kernel_oom_pids()
    if named and pids & named:
        return f"the kernel log records an OOM kill of pid {min(pids & named)}"
    try:
        before = json.loads(RunFolder(run_dir).job.read_text()).get("oom_kills")
    except (OSError, ValueError, AttributeError):
        before = None
    now = PI.oom_kills()
    if isinstance(before, int) and now is not None and now > before:
        return f"the memory cgroup counted {now - before} OOM kill(s) since the launch"
    return ""


def _rank_pid(run_dir: Path, rank: int, state: RunState) -> set[int]:
    """The pid of rank `rank`, from torchrun's report or the rank's hello line."""
    pids = {int(m.group(3)) for m in _FAILED_RANK.finditer(_tail(RunFolder(run_dir).launcher_log, 400))
            if m.group(3) and int(m.group(1)) == rank}
    hello = state.hellos.get(rank)
    return pids | ({hello.pid} if hello is not None and hello.pid > 0 else set())


def _died_of_signal(state: RunState, run_dir: Path, rank: int, sig: int) -> tuple[str, str]:
    """A rank killed by a signal could not report: the others' "connection reset" errors are consequences."""
    log = RunFolder(run_dir).rank_log(rank)
    name = _signal_name(sig)
    if sig != signal.SIGKILL:
        return "crash", (f"run failed (crash): rank {rank} died of {name} (signal {sig})"
                         + ("; a segmentation fault in native code (a library, a reader of the data), see the "
                            "rank's log for the stack" if sig == signal.SIGSEGV else "") + f"\n  log: {log}")
    oom = oom_recorded(run_dir, _rank_pid(run_dir, rank, state))
    if not oom:
        return "crash", (f"run failed: rank {rank} was killed (SIGKILL); the kernel recorded no OOM kill, so "
                         f"something sent it (`kill -9`, a scheduler, a watchdog)\n  log: {log}")
    host = state.host
    mem = f" (host memory at the last sample: {host.used_bytes / 2**30:.1f} of {host.total_bytes / 2**30:.1f} GiB)" \
        if host else ""
    return "host_oom", (f"run failed (host_oom): rank {rank} was killed with SIGKILL by the kernel's OOM killer "
                        f"({oom}){mem}\n  try: offload less, fewer ranks per node, or a smaller micro_batch; "
                        f"`dmesg` shows the OOM killer's report\n  log: {log}")


def _launcher_gone(rc: int | None, run_dir: Path) -> tuple[str, str] | None:
    """The launcher killed by a signal (its parent saw it), or gone without an exit code this shell can
    know (not its parent): said as such, never as 'exit code 0' or 'None'."""
    folder = RunFolder(run_dir)
    try:
        pid = int(json.loads(folder.job.read_text()).get("pid", 0))
    except (OSError, ValueError, AttributeError, TypeError):
        pid = 0
    if rc is not None and rc < 0:
        sig = -rc
        oom = oom_recorded(run_dir, {pid}) if sig == signal.SIGKILL else ""
        if oom:
            return "host_oom", (f"the launcher was killed (SIGKILL) by the kernel's OOM killer ({oom}); lower host "
                                f"memory use (offload less, fewer ranks)\n  log: {folder.launcher_log}")
        return "crash", (f"the launcher (pid {pid}) was killed ({_signal_name(sig)})"
                         + ("; the kernel recorded no OOM kill, so something sent it (`kill -9`, a scheduler)"
                            if sig == signal.SIGKILL else "")
                         + f" and no rank reported how the run ended\n  log: {folder.launcher_log}")
    if rc is None:
        oom = oom_recorded(run_dir, {pid}) if pid else ""
        how = (f"killed by the kernel's OOM killer ({oom})" if oom else
               "killed (`kill -9`, a scheduler) or crashed; its exit code went to the front end that started it")
        return ("host_oom" if oom else "crash"), (
            f"the launcher (pid {pid or '?'}) is gone without a report in its log and no rank reported how the "
            f"run ended: it was {how}\n  log: {folder.launcher_log}")
    return None


def explain_exit(state: RunState, rc: int | None, run_dir: Path,
                 settings: C.RunConfig | None = None) -> tuple[str, str]:
    """(cause, one-paragraph message) for a run that ended without a `finished` line. rc: the launcher's
    exit code, None where this process is not its parent. settings: the run's, as its session read
    them (None: read from the folder where needed)."""
    folder = RunFolder(run_dir)
    f = state.first_failure()
    if f is None and state.finished is None and not state.hellos and not folder.preset.is_file():
        # renamed or deleted before any rank started: the ranks refuse to write a half folder there
        return "run_folder_moved", (f"run not started: the run folder {run_dir} was moved or deleted before its "
                                    f"ranks started; nothing trained, nothing written there\n  try: `shardconsole "
                                    f"resume NEW_PATH` does not apply (no step was saved): launch again from the "
                                    f"folder's new place with --run-dir, or put it back")
    gone = stream_gone.verdict(run_dir) if f is None and state.finished is None else None
    if gone is not None:
        return gone      # metrics.jsonl deleted: the folder's other evidence ("ok" when it finished)
    who = stop_requested(state)
    if who and (f is None or f.cause == "stopped"):
        # Asked to stop (the ranks then say "stopped", perhaps after saving): not a failure.
        msg = "run stopped" + (f" by {who}" if who else "")
        if f is not None:
            msg += f": {f.message}" + (f"\n  {f.hint}" if f.hint else "")
        return "stopped", msg + f"\n  run folder: {run_dir}"
    killed = killed_rank(run_dir)
    if killed:
        return _died_of_signal(state, run_dir, *killed)
    vanished = _gone_ranks(state, f)
    if vanished and f is not None:      # (_gone_ranks says "" without a failure)
        # how it continues: a run of several nodes is refused by a plain resume (session/faults/lost.py)
        go_on = lost_ranks.continue_hint(run_dir, settings, len({h.host for h in state.hellos.values()}))
        # A node (or a rank) that vanished writes nothing; its peers' broken connections are the echo.
        cause = "node_lost" if _a_node_lost(state) else "crash" if f.cause == "stopped" else f.cause
        return cause, (f"run failed ({cause}): {vanished} gone, with no end line; rank {f.rank}'s "
                         f"{f.exc_type + ': ' if f.exc_type else ''}{f.message.splitlines()[0] if f.message else ''} "
                         f"follows from it\n  try: look at that node (dmesg; the Slurm job's state); "
                         f"{go_on} continues from the newest complete checkpoint\n"
                         f"  log: {folder.rank_log(f.rank)}")
    if f is not None and f.cause == "stopped":
        # Nobody asked (no stop_requested line): a signal from outside, or torchrun ending the ranks after
        # one of them died without a word.
        return "crash", (f"run ended by a signal nobody asked for through shardconsole (`kill`, a scheduler, "
                         f"torchrun ending the ranks after another failed): rank {f.rank}: {f.message}"
                         f"\n  launcher log: {folder.launcher_log}")
    if f is not None and f.cause == "run_folder_moved":
        # Stopped by its ranks, saved at the new path: no log under the old one to point at.
        return f.cause, f"run stopped (run_folder_moved) at step {f.step}: {f.message}" + (
            f"\n  then: {f.hint}" if f.hint else "")
    if f is not None and f.cause == "config_error" and state.last_step is None and not any(
            e.name == "checkpoint_saved" for e in state.events):
        # A refusal the ranks made while building (their checks of what only they read: a token cache, a
        # checkpoint, a tokenizer): nothing trained or saved, the message names the cause and the cure.
        return f.cause, (f"run refused on rank {f.rank} before its first step: "
                         f"{f.exc_type + ': ' if f.exc_type else ''}{f.message}" + (f"; try: {f.hint}" if f.hint else ""))
    if f is not None:
        where = f"rank {f.rank}" + (f" at step {f.step}" if f.step else "")
        msg = f"run failed ({f.cause}) on {where}: {f.exc_type + ': ' if f.exc_type else ''}{f.message}"
        if f.hint:
            msg += f"\n  try: {f.hint}"
        if f.cause == "gpu_oom":
            msg += fitting_settings(run_dir, settings=settings)
        msg += f"\n  log: {folder.rank_log(f.rank)}"
        return f.cause, msg
    lost = stream_stopped_note(run_dir)
    if lost:
        # The ranks could not write their lines (a full disk): what they did after that is unknown here.
        code = f"launcher exit code {rc}" if rc is not None else "the launcher gone"
        cause = stream_stopped_cause(run_dir)
        if cause == "run_folder_gone":
            # the ranks' own verdict (stream_health) lost in the race with the deletion: the same class
            return cause, (f"run failed (run_folder_gone): {lost} ({code}); its checkpoints went with it unless "
                           f"train.checkpoint_dir was elsewhere")
        return cause, (f"run ended ({code}) but {lost}: no report of its end could be "
                       f"written; check the last checkpoint in {folder.path} before trusting it")
    never_met = _rendezvous_failed(state, run_dir, settings)
    if never_met:
        return "rendezvous", never_met
    if state.hellos and not folder.job.is_file() and lost_ranks.gone(state.hellos, set(), run_dir, float("inf")):
        # started elsewhere (Slurm, --print-command) and every rank gone without a word (session/faults/lost.py)
        return lost_ranks.message(state.hellos, state.last_step.step if state.last_step else 0, run_dir, settings)
    gone = _launcher_gone(rc, run_dir)
    if gone is not None:
        return gone
    return "crash", (f"run ended with exit code {rc} and no report from the ranks (crash)"
                     f"\n  launcher log ({folder.launcher_log}):\n{_tail(folder.launcher_log)}")


_RDZV_ERROR = re.compile(r"^\S*(Rendezvous\w*Error|DistNetworkError|DistStoreError): (.*)$", re.M)


def _rendezvous_failed(state: RunState, run_dir: Path, settings: C.RunConfig | None = None) -> str:
    """The paragraph for a multi-node run whose agent gave up on the rendezvous before any rank started
    (torchrun's traceback ends in a Rendezvous*Error), naming the endpoint and who would host it; ''."""
    if state.hellos:
        return ""
    log = _tail(RunFolder(run_dir).launcher_log, 400)
    errors = _RDZV_ERROR.findall(log)
    if not any(kind.startswith("Rendezvous") for kind, _ in errors):
        return ""
    try:
        endpoint = (settings if settings is not None else C.load(RunFolder(run_dir).preset)).parallel.rdzv_endpoint
    except (C.ConfigError, OSError):
        endpoint = ""
    # torch's cause (the store it could not reach) comes before the Rendezvous*Error that wraps it
    kind, text = next(((k, t) for k, t in errors if not k.startswith("Rendezvous")), errors[-1])
    return (f"run failed (rendezvous): the nodes never met: torchrun's agent gave up on the rendezvous"
            + (f" at {endpoint}" if endpoint else "") + f" before any rank started ({kind}: {text.strip()[:240]})"
            + (f"\n  {who_hosts(endpoint)}" if endpoint else "")
            + f"\n  launcher log: {RunFolder(run_dir).launcher_log}")


_PEER_LOST = ("connection reset", "connection closed", "broken pipe", "connection refused", "timed out",
              "timeout", "peer")


def _gone_ranks(state: RunState, f: P.Failed | None) -> str:
    """'rank(s) 1 on node1 (last step seen 36)': the ranks of this session that said hello and never an
    end line, when the first failure is a broken connection to a peer or a stop nobody asked for (the
    launcher ending the survivors); "" otherwise."""
    if f is None or f.cause not in ("crash", "nccl_timeout", "stopped"):
        return ""
    # "stopped" here was asked by nobody: srun --kill-on-bad-exit or torchrun ending the survivors
    if f.cause != "stopped" and not any(w in f"{f.exc_type} {f.message}".lower() for w in _PEER_LOST):
        return ""
    ended = {x.rank for x in state.failed}
    by_host: dict[str, list[int]] = {}
    for rank, hello in sorted(state.hellos.items()):
        if rank not in ended:
            by_host.setdefault(hello.host or "?", []).append(rank)
    if not by_host:
        return ""
    step = state.last_step.step if state.last_step is not None else 0
    return "; ".join(f"rank(s) {', '.join(map(str, ranks))} on {host}" for host, ranks in by_host.items()) + \
        f" (last step seen {step})"


def _a_node_lost(state: RunState) -> bool:
    """Every rank of some host vanished without an end line while ranks of another host reported: a node
    lost (killed, rebooted, cut off), its own failure class rather than a crash of the code."""
    reported = {state.hellos[f.rank].host for f in state.failed if f.rank in state.hellos}
    hosts = {h.host for h in state.hellos.values()}
    return len(hosts) > 1 and bool(reported) and bool(hosts - reported)


def classify(state: RunState, rc: int | None, run_dir: Path,
             settings: C.RunConfig | None = None) -> tuple[str, str]:
    """(cause, message) for any ended run: "ok" with a summary when it finished."""
    if state.finished is not None and not state.failed and rc in (0, None):
        s = state.last_step
        summary = f"finished: {state.finished.steps} steps"
        if s is not None and s.loss is not None:
            summary += f", last loss {s.loss:.4f}"
        return "ok", summary + f"; run folder {run_dir}"
    return explain_exit(state, rc, run_dir, settings)
