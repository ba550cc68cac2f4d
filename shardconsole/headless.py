"""The front end without a UI: start (or attach to) a run, print one line per log step, stop on Ctrl-C.

It samples NVML and psutil about once a second and appends those samples to the run's metrics.jsonl
(kind gpu / host), so the file holds the whole story of the run.
"""

from __future__ import annotations

import dataclasses
import re
import shutil
import signal
import sys
import time
from pathlib import Path
from typing import TextIO

from shardconsole import config as C
from shardconsole import protocol as P
from shardconsole.launch import LAUNCHER_LOG, METRICS_FILE, Job, StopReport
from shardconsole.probes import GpuProbe, host_sample, wait_gpu_released
from shardconsole.diagnose import Watch, hang_message, where_ranks_are
from shardconsole.runstate import RunState
from shardconsole.stream import MetricsReader, SampleAppender

# Exit codes of `shardconsole --headless`, by failure class (documented in README.md).
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
    "stopped": 130,
}


def fmt_rate(x: float) -> str:
    return f"{x / 1000:.1f}k" if x >= 1000 else f"{x:.0f}"


def step_line(state: RunState) -> str:
    s = state.last_step
    assert s is not None
    parts = [f"step {s.step}/{s.steps}", f"loss {s.loss:.4f}" if s.loss is not None else "loss n/a",
             f"lr {s.lr:.2e}", f"{fmt_rate(s.tokens_per_s)} tok/s", f"{s.step_s:.3f} s/step"]
    if s.mfu is not None:
        parts.append(f"mfu {100 * s.mfu:.1f}%")
    if s.grad_norm is not None:
        parts.append(f"gnorm {s.grad_norm:.2f}")
    if s.loss_scale is not None:
        parts.append(f"scale {s.loss_scale:g}" + (f" skipped {s.skipped_steps}" if s.skipped_steps else ""))
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


def progress_bar(state: RunState, width: int) -> str:
    s = state.last_step
    done, total = (s.step, s.steps) if s else (0, 0)
    label = f" {state.phase} "
    if not total:
        return label.strip()[:width]
    frac = min(1.0, done / total)
    bar_w = max(10, width - 30)
    filled = int(bar_w * frac)
    eta = ""
    if s and s.step_s:
        eta = f" eta {int((total - done) * s.step_s)}s"
    return f"[{'#' * filled}{'.' * (bar_w - filled)}] {done}/{total}{eta}"[:width]


class Follower:
    """Reads a run's stream and samples the machine; shared by `--headless` and `attach --headless`."""

    def __init__(self, run_dir: Path, run_id: str, out: TextIO, sample: bool = True) -> None:
        self.run_dir, self.run_id, self.out = run_dir, run_id, out
        self.reader = MetricsReader(run_dir / METRICS_FILE)
        self.samples = SampleAppender(run_dir / METRICS_FILE, run_id) if sample else None
        self.gpu = GpuProbe() if sample else None
        self.state = RunState()
        self.tty = out.isatty()
        self._last_sample = 0.0
        self._bar_shown = False

    def pump(self, quiet: bool = False) -> None:
        for msg in self.reader.poll():
            self.state.apply(msg)
            if quiet:
                continue
            if isinstance(msg, P.Step):
                self.print(step_line(self.state))
            elif isinstance(msg, P.Event) and msg.name != "phase":
                self.print(f"[{msg.name}] {msg.detail}")
            elif isinstance(msg, P.Event) and msg.name == "phase" and msg.detail != "training":
                self.print(f"-- {msg.detail}")
        now = time.monotonic()
        if self.samples is not None and now - self._last_sample >= 1.0:
            self._last_sample = now
            taken = [*self.gpu.sample(self.run_id), host_sample(self.state.rank_pids, self.run_id)]
            for msg in self.samples.append(taken):    # a read-only run folder: shown, not written
                self.state.apply(msg)
        if self.tty and not quiet:
            self._draw_bar()

    def print(self, line: str) -> None:
        if self.tty and self._bar_shown:
            self.out.write("\r\x1b[2K")
            self._bar_shown = False
        self.out.write(line + "\n")
        self.out.flush()

    def _draw_bar(self) -> None:
        width = shutil.get_terminal_size((100, 20)).columns - 1
        self.out.write("\r\x1b[2K" + progress_bar(self.state, width))
        self.out.flush()
        self._bar_shown = True

    def clear_bar(self) -> None:
        if self.tty and self._bar_shown:
            self.out.write("\r\x1b[2K")
            self.out.flush()
            self._bar_shown = False


def _tail(path: Path, lines: int = 15) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.rstrip().splitlines()[-lines:])


_FAILED_RANK = re.compile(r"rank\s*:\s*(\d+)[^\n]*\n\s*exitcode\s*:\s*(-?\d+)")


def killed_rank(run_dir: Path) -> tuple[int, int] | None:
    """(rank, signal) when torchrun's failure report lists a rank killed by a signal. Such a rank is the
    cause whatever torchrun calls the "root cause": when one rank is killed its peers fail within the
    same second with connection errors, and torchrun's ordering of the two is a race."""
    for m in _FAILED_RANK.finditer(_tail(run_dir / LAUNCHER_LOG, 80)):
        code = int(m.group(2))
        if code < 0 and -code != signal.SIGTERM:   # SIGTERM is torchrun ending the others
            return int(m.group(1)), -code
    return None


def fitting_settings(run_dir: Path, top: int = 2) -> str:
    """After a GPU OOM: the planner's fastest settings that fit this machine (or the run's cap)."""
    try:
        from shardconsole import plan
        from shardconsole.models import resolve
        cfg = C.load(run_dir / "preset.toml")
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
        lines.append(f"    {cand.name}: " + " ".join(f"--set {o}" for o in cand.overrides))
    return "\n".join(lines) if found else ""


def explain_exit(state: RunState, rc: int | None, run_dir: Path) -> tuple[str, str]:
    """(cause, one-paragraph message) for a run that ended without a `finished` line."""
    killed = killed_rank(run_dir)
    if killed and killed[1] == signal.SIGKILL:
        # The killed rank could not report; the others' "connection reset" errors are consequences.
        rank = killed[0]
        host = state.host
        mem = f" (host memory at the last sample: {host.used_bytes / 2**30:.1f} of {host.total_bytes / 2**30:.1f} GiB)" \
            if host else ""
        return "host_oom", (f"run failed (host_oom): rank {rank} was killed with SIGKILL, most often by the "
                            f"kernel's OOM killer{mem}\n  try: offload less, fewer ranks per node, or a smaller "
                            f"micro_batch; `dmesg` shows the OOM killer's report\n  log: {run_dir / 'logs' / f'rank{rank}.log'}")
    f = state.first_failure()
    if f is not None:
        where = f"rank {f.rank}" + (f" at step {f.step}" if f.step else "")
        msg = f"run failed ({f.cause}) on {where}: {f.exc_type + ': ' if f.exc_type else ''}{f.message}"
        if f.hint:
            msg += f"\n  try: {f.hint}"
        if f.cause == "gpu_oom":
            msg += fitting_settings(run_dir)
        msg += f"\n  log: {run_dir / 'logs' / f'rank{f.rank}.log'}"
        return f.cause, msg
    if rc is not None and rc < 0 and -rc == signal.SIGKILL:
        return "host_oom", (f"the launcher was killed (SIGKILL): most often the kernel's OOM killer; "
                            f"lower host memory use (offload less, fewer ranks)\n  log: {run_dir / LAUNCHER_LOG}")
    # A rank killed from outside leaves no `failed` line: torchrun's log says which and how.
    log = _tail(run_dir / LAUNCHER_LOG)
    cause = "host_oom" if "Signals.SIGKILL" in log or "exitcode: -9" in log else "crash"
    hint = ("a rank was killed with SIGKILL, most often by the kernel's OOM killer: check `dmesg`, "
            "offload less or lower micro_batch" if cause == "host_oom" else "")
    return cause, (f"run ended with exit code {rc} and no report from the ranks ({cause})"
                   + (f"\n  try: {hint}" if hint else "") + f"\n  launcher log ({run_dir / LAUNCHER_LOG}):\n{log}")


def run(cfg: C.RunConfig, run_dir: Path, run_id: str, out: TextIO = sys.stdout,
        err: TextIO = sys.stderr, grace_s: float = 10.0) -> int:
    """Start the run, follow it to the end, return the exit code (EXIT_CODES)."""
    job = Job.start(cfg, run_dir, run_id)
    print(f"run {run_id}: {run_dir}  (Ctrl-C stops it)", file=err, flush=True)
    return follow(job, run_dir, run_id, out, err, grace_s)


def follow(job: Job, run_dir: Path, run_id: str, out: TextIO = sys.stdout, err: TextIO = sys.stderr,
           grace_s: float = 10.0, quiet_history: bool = False) -> int:
    f = Follower(run_dir, run_id, out)
    watch = Watch(timeout_s=_hang_timeout(run_dir))
    if quiet_history:
        f.pump(quiet=False)
    try:
        while True:
            rc = job.poll()
            f.pump()
            if rc is not None:
                break
            if watch.hung(f.state, time.monotonic()):
                f.clear_bar()
                if job.external:
                    print(f"run hung: no step for {watch.stalled_for(time.monotonic()):.0f}s; it was not started "
                          f"here, so it is not stopped here (rank logs: {run_dir / 'logs'})", file=err, flush=True)
                    return EXIT_CODES["hang"]
                stacks = where_ranks_are(f.state, run_dir)
                message = hang_message(f.state, stacks, watch.stalled_for(time.monotonic()))
                print(f"run hung: {message}\n  stopping it; rank logs: {run_dir / 'logs'}", file=err, flush=True)
                print(describe_stop(_stop(job, grace_s, f.state.rank_pids)), file=err, flush=True)
                return EXIT_CODES["hang"]
            time.sleep(0.2)
    except KeyboardInterrupt:
        f.clear_bar()
        if job.external:
            print(f"detached from {run_dir}: the run goes on where it was started (a Slurm job stops with "
                  f"scancel)", file=err, flush=True)
            return EXIT_CODES["stopped"]
        print("stopping: SIGTERM to every rank ...", file=err, flush=True)
        report = _stop(job, grace_s, f.state.rank_pids)
        f.pump()
        f.clear_bar()      # pump redraws the bar on a terminal; the report goes on a line of its own
        print(describe_stop(report), file=err, flush=True)
        return EXIT_CODES["stopped"]
    time.sleep(0.05)
    f.pump()
    f.clear_bar()
    state = f.state
    if f.reader.bad_lines:
        print(f"warning: {f.reader.bad_lines} unreadable metrics line(s) skipped ({f.reader.last_error})",
              file=err)
    if state.finished is not None and rc == 0:
        s = state.last_step
        summary = f"finished: {state.finished.steps} steps"
        if s:
            summary += f", last loss {s.loss:.4f}, {fmt_rate(s.tokens_per_s)} tok/s"
        print(summary + f"; run folder {run_dir}", file=err)
        return EXIT_CODES["ok"]
    cause, message = explain_exit(state, rc, run_dir)
    print(message, file=err, flush=True)
    return EXIT_CODES.get(cause, 1)


def _hang_timeout(run_dir: Path) -> float:
    try:
        return C.load(run_dir / "preset.toml").train.hang_timeout_s
    except C.ConfigError:
        return 0.0


def _stop(job: Job, grace_s: float, rank_pids: list[int] = ()) -> StopReport:
    # A second Ctrl-C while stopping must not leave ranks behind: ignore it until the stop is done.
    old = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        report = job.stop(grace_s, tuple(rank_pids))
        report.gpu_note = wait_gpu_released(GpuProbe(), report.signalled)
        return report
    finally:
        signal.signal(signal.SIGINT, old)


def describe_stop(report: StopReport) -> str:
    how = "SIGKILL after the grace period" if report.killed else "SIGTERM"
    if report.clean:
        line = f"stopped: {len(report.signalled)} process(es) ended by {how} in {report.seconds:.1f}s; none left"
        return line + (f"\n{report.gpu_note}" if report.gpu_note else "")
    return f"stop incomplete: process(es) {report.left} still alive after SIGKILL"
