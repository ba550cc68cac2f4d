"""How a run ended: the exit code of each failure class and the paragraph that explains it.

The stream comes first: a rank's `failed` line names the cause; torchrun's report and the launcher's
exit code are read only when no rank could say (a rank killed from outside writes nothing).
"""

from __future__ import annotations

import dataclasses
import re
import signal
from pathlib import Path

from shardconsole.settings import config as C
from shardconsole.runlog.runfolder import RunFolder
from shardconsole.runlog.runstate import RunState
from shardconsole.session.rundir import stream_stopped_note

# Exit codes of `shardconsole --headless` and `attach`, by how the run (or the watching) ended.
# README.md's exit-code table lists the same.
EXIT_CODES = {
    "ok": 0,
    "crash": 1,
    "config_error": 2,
    "gpu_oom": 3,
    "host_oom": 4,
    "nccl_timeout": 5,
    "hang": 5,
    "nan_loss": 6,
    "loss_scale_floor": 7,
    "disk_full": 9,      # ENOSPC / EDQUOT where the run writes (its folder, a checkpoint, an export)
    "detached": 8,       # the front end went away (closed pipe, closed terminal, Ctrl-C while attaching); the run goes on
    "stopped": 130,
}

# An Event of this name is written to the stream by whoever stops a run (a front end, `shardconsole stop`),
# before any signal: every other front end on that run then reports "stopped", not a crash.
STOP_REQUESTED = "stop_requested"
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


def fitting_settings(run_dir: Path, top: int = 2) -> str:
    """After a GPU OOM: the planner's fastest settings that fit this machine (or the run's cap)."""
    try:
        from shardconsole import plan
        from shardconsole.settings.models import resolve
        cfg = C.load(RunFolder(run_dir).preset)
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
        # ranked as `tune` ranks (plan/speeds.py): the speeds measured on this machine first
        speed = f" ({cand.speed:,.0f} tokens/s {cand.speed_source})" if cand.speed_unit == "tokens/s" else ""
        lines.append(f"    {cand.name}{speed}: " + " ".join(f"--set {o}" for o in cand.overrides))
    return "\n".join(lines) if found else ""


def stop_requested(state: RunState) -> str:
    """Who stopped the run, when the stream says someone did ("" otherwise)."""
    for e in reversed(state.events):
        if e.name == STOP_REQUESTED:
            return e.detail or "stopped"
    return ""


def explain_exit(state: RunState, rc: int | None, run_dir: Path) -> tuple[str, str]:
    """(cause, one-paragraph message) for a run that ended without a `finished` line."""
    folder = RunFolder(run_dir)
    f = state.first_failure()
    who = stop_requested(state)
    if (f is None and who) or (f is not None and f.cause == "stopped"):
        # Asked to stop (the ranks then say "stopped", perhaps after saving): not a failure.
        msg = "run stopped" + (f" by {who}" if who else "")
        if f is not None:
            msg += f": {f.message}" + (f"\n  {f.hint}" if f.hint else "")
        return "stopped", msg + f"\n  run folder: {run_dir}"
    killed = killed_rank(run_dir)
    if killed and killed[1] == signal.SIGKILL:
        # The killed rank could not report; the others' "connection reset" errors are consequences.
        rank = killed[0]
        host = state.host
        mem = f" (host memory at the last sample: {host.used_bytes / 2**30:.1f} of {host.total_bytes / 2**30:.1f} GiB)" \
            if host else ""
        return "host_oom", (f"run failed (host_oom): rank {rank} was killed with SIGKILL, most often by the "
                            f"kernel's OOM killer{mem}\n  try: offload less, fewer ranks per node, or a smaller "
                            f"micro_batch; `dmesg` shows the OOM killer's report\n  log: {folder.rank_log(rank)}")
    if f is not None:
        where = f"rank {f.rank}" + (f" at step {f.step}" if f.step else "")
        msg = f"run failed ({f.cause}) on {where}: {f.exc_type + ': ' if f.exc_type else ''}{f.message}"
        if f.hint:
            msg += f"\n  try: {f.hint}"
        if f.cause == "gpu_oom":
            msg += fitting_settings(run_dir)
        msg += f"\n  log: {folder.rank_log(f.rank)}"
        return f.cause, msg
    if rc is not None and rc < 0 and -rc == signal.SIGKILL:
        return "host_oom", (f"the launcher was killed (SIGKILL): most often the kernel's OOM killer; "
                            f"lower host memory use (offload less, fewer ranks)\n  log: {folder.launcher_log}")
    lost = stream_stopped_note(run_dir)
    if lost:
        # The ranks could not write their lines (a full disk): what they did after that is unknown here.
        return "crash", (f"run ended (launcher exit code {rc}) but {lost}: no report of its end could be "
                         f"written; check the last checkpoint in {folder.path} before trusting it")
    # A rank killed from outside leaves no `failed` line: torchrun's log says which and how.
    log = _tail(folder.launcher_log)
    outside_kill = killed_rank(run_dir)
    cause = "host_oom" if outside_kill and outside_kill[1] == signal.SIGKILL else "crash"
    hint = ("a rank was killed with SIGKILL, most often by the kernel's OOM killer: check `dmesg`, "
            "offload less or lower micro_batch" if cause == "host_oom" else "")
    return cause, (f"run ended with exit code {rc} and no report from the ranks ({cause})"
                   + (f"\n  try: {hint}" if hint else "") + f"\n  launcher log ({folder.launcher_log}):\n{log}")


def classify(state: RunState, rc: int | None, run_dir: Path) -> tuple[str, str]:
    """(cause, message) for any ended run: "ok" with a summary when it finished."""
    if state.finished is not None and not state.failed and rc in (0, None):
        s = state.last_step
        summary = f"finished: {state.finished.steps} steps"
        if s is not None and s.loss is not None:
            summary += f", last loss {s.loss:.4f}"
        return "ok", summary + f"; run folder {run_dir}"
    return explain_exit(state, rc, run_dir)
