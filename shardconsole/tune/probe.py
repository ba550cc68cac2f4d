"""One probe: a short real run of one candidate through the normal launch path (session/rundir, then a
session/run.RunSession with its one watcher and stop, as headless runs it), measured: tokens/s of the steady steps,
the GPU peak (NVML's used bytes of the devices, the allocator's peak reserved bytes), the host peak
(the ranks' RSS), and how it ended. A probe that fails (OOM, a candidate that cannot start) is a result,
never an exception; a probe that outlives its time is stopped by the normal stop path."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from shardconsole.settings import config as C
from shardconsole.runlog import protocol as P
from shardconsole.plan.speed.book import steady_tokens_per_s

POLL_S = 0.2

# A probe trains for a few steps and keeps nothing: no checkpoint, no eval, no resume.
PROBE_SETTINGS = [("train", "log_every", 1), ("train", "save_final", "none"), ("train", "checkpoint_every", 0),
                  ("train", "eval_every", 0), ("train", "save_on_stop", False), ("train", "resume", False)]


@dataclass
class ProbeResult:
    status: str                         # "ok", "gpu_oom", "host_oom", "over cap", "timeout", "stopped", a cause
    message: str = ""
    tokens_per_s: float = 0.0
    steps: int = 0
    gpu_peak_bytes: int = 0             # NVML: the largest used bytes of a device while it ran (0: no GPU)
    gpu_idle_bytes: int = 0             # NVML: the device's used bytes at the first sample (before the ranks)
    gpu_reserved_peak_bytes: int = 0    # the allocator's peak reserved bytes, largest rank
    host_peak_bytes: int = 0            # the ranks' RSS, summed, at its largest
    seconds: float = 0.0
    run_dir: str = ""
    samples: list[tuple[int, float]] = field(default_factory=list)
    interrupted: bool = False           # Ctrl-C: the probe was stopped and the tune should end

    @property
    def ok(self) -> bool:
        return self.status == "ok"


def probe_config(cfg: C.RunConfig, steps: int) -> C.RunConfig:
    from shardconsole.plan.estimator import replace_cfg
    out = replace_cfg(cfg, ("train", "steps", steps), *PROBE_SETTINGS)
    out = replace_cfg(out, ("train", "warmup_steps", min(out.train.warmup_steps, max(steps - 1, 0))))
    C.validate(out, "tune probe")
    return out


def run_probe(cfg: C.RunConfig, run_dir: Path, *, timeout_s: float, should_stop: Callable[[], bool] = lambda: False,
              on_step: Callable[[ProbeResult], None] | None = None) -> ProbeResult:
    """Launch cfg in run_dir (created here), follow it to its end or timeout_s, measure it."""
    from shardconsole.session import rundir
    from shardconsole.session.run import RunSession
    from shardconsole.session.watcher import MachineProbes

    t0 = time.monotonic()
    res = ProbeResult(status="starting", run_dir=str(run_dir))
    try:
        rundir.check_port_free(cfg)
        run_dir = rundir.create_run_dir(cfg, run_dir)
        session = RunSession.launch(rundir.anchor_paths(cfg), run_dir, run_dir.resolve().name)
    except (C.ConfigError, OSError, ValueError) as e:
        res.status, res.message = "cannot start", str(e).splitlines()[0] if str(e) else type(e).__name__
        return res
    # a probe of a few steps: no hang watch, no TensorBoard events, no rank logs to follow
    watcher = session.watch(MachineProbes(), logs=False, record=False)
    gpu_base: dict[int, int] = {}
    stopped_why = ""
    try:
        while True:
            tick = session.tick()
            changed = False
            for msg in tick.messages:
                if isinstance(msg, P.Step):
                    res.samples.append((msg.step, msg.tokens_per_s))
                    res.steps = max(res.steps, msg.step)
                    changed = True
                elif isinstance(msg, P.Memory):
                    res.gpu_reserved_peak_bytes = max(res.gpu_reserved_peak_bytes, msg.peak_reserved_bytes or 0)
                elif isinstance(msg, P.GpuSample):
                    gpu_base.setdefault(msg.index, msg.used_bytes)
                    res.gpu_idle_bytes = min(gpu_base.values())
                    res.gpu_peak_bytes = max(res.gpu_peak_bytes, msg.used_bytes)
                elif isinstance(msg, P.HostSample):
                    res.host_peak_bytes = max(res.host_peak_bytes, msg.ranks_rss_bytes)
            rss = sum(m.host_rss_bytes for m in watcher.state.memory.values())
            res.host_peak_bytes = max(res.host_peak_bytes, rss)
            if changed and on_step is not None:
                res.tokens_per_s = steady_tokens_per_s(res.samples)
                on_step(res)
            if tick.ended:
                break
            if time.monotonic() - t0 > timeout_s or should_stop():
                stopped_why = "timeout" if not should_stop() else "stopped"
                session.stop(f"tune: probe {stopped_why}", grace_s=10.0)
                session.tick()
                break
            try:
                time.sleep(POLL_S)
            except KeyboardInterrupt:
                # The ranks run in a session of their own (launch.Job): Ctrl-C reaches only this process,
                # so the probe is stopped here through the normal stop path before the tune ends.
                stopped_why, res.interrupted = "stopped", True
                session.stop("tune: Ctrl-C", grace_s=10.0)
                session.tick()
                break
        cause, message = session.outcome()
    finally:
        session.close()
    res.seconds = time.monotonic() - t0
    res.tokens_per_s = steady_tokens_per_s(res.samples)
    if stopped_why:
        res.status = stopped_why
        res.message = f"{stopped_why} after {res.steps} step(s)"
    else:
        res.status = "ok" if cause == "ok" else cause
        res.message = message.splitlines()[0] if message else ""
    return res
