"""What the console is given to work with: a launcher and the machine's probes.

ShardConsoleApp receives one of each (harlequin's injected backend), so tests pass fakes and the UI
code never reaches for launch/ or NVML directly. The real ones here are thin: the launcher begins
session/run.RunSession's (as `--headless` does), the probes are session/watcher's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from shardconsole.settings import config as C
from shardconsole.settings import resolve as settings
from shardconsole.launch.job import build_argv, new_run_dir
from shardconsole.user_folders import runs_root as default_runs_root
from shardconsole.runlog.protocol import GpuSample, HostSample
from shardconsole.session.planner import Planner, load_planner as load_plan
from shardconsole.session.run import RunSession
from shardconsole.session.watcher import MachineProbes, Probes  # noqa: F401  (the console's probes)


class AttachError(ValueError):
    """A folder that is not a run folder; str() is the one line shown to the user."""


@dataclass(frozen=True)
class PlannedRun:
    """The folder and the exact command a launch would use now."""
    run_dir: Path
    run_id: str
    argv: list[str]
    named: bool = False      # the folder the user named (--run-dir): one holding a run is refused, not suffixed


@dataclass(frozen=True)
class RunOptions:
    """How run screens behave; tests freeze the screen with sample=False (the stream alone is shown)."""
    stop_grace_s: float = 10.0     # SIGTERM, then SIGKILL after this long
    sample: bool = True            # sample NVML/psutil once a second into the run's stream


@dataclass(frozen=True)
class RunListing:
    run_dir: Path
    description: str
    alive: bool
    status: str = ""          # history/index: running, finished, stopped, failed (cause), unknown


class Launcher(Protocol):
    """Begins run sessions (session/run.RunSession) for the run screen, which renders their ticks."""
    runs_root: Path

    def plan(self, cfg: C.RunConfig, preset_name: str) -> PlannedRun: ...
    def start(self, resolved: settings.Resolved, planned: PlannedRun) -> RunSession: ...
    def attach(self, run_dir: Path) -> RunSession: ...
    def recent_runs(self, limit: int = 30) -> list[RunListing]: ...

    @property
    def resume(self) -> "Callable[[Path], RunSession] | None":
        """Continues an ended run in its folder; None for a launcher that cannot (the run screen then
        offers no resume)."""


class OpenRun(Protocol):
    """The app's: show a run session on a run screen; closed() when that screen goes."""
    def __call__(self, session: RunSession, *, attached: bool, closed: Callable[[], None] | None = None) -> None: ...


# ---------------------------------------------------------------------------------------------------
# The real ones

class TorchrunLauncher:
    """Starts runs as `--headless` does: a thin wrapper over session/run.RunSession."""

    def __init__(self, runs_root: str | Path | None = None, run_dir: Path | None = None) -> None:
        """runs_root: where run folders go (None: launch_command.runs_root(), the same as the CLI's).
        run_dir: `--run-dir`, the folder of the first run launched here; later ones go under runs_root."""
        self.runs_root = default_runs_root(runs_root)
        self.named_run_dir = None if run_dir is None else Path(run_dir).expanduser().absolute()

    def plan(self, cfg: C.RunConfig, preset_name: str) -> PlannedRun:
        if self.named_run_dir is not None:
            run_dir = self.named_run_dir
            return PlannedRun(run_dir, run_dir.name, build_argv(cfg, run_dir, run_dir.name), named=True)
        run_dir = new_run_dir(preset_name, self.runs_root)
        return PlannedRun(run_dir, run_dir.name, build_argv(cfg, run_dir, run_dir.name))

    def start(self, resolved: settings.Resolved, planned: PlannedRun) -> RunSession:
        """The CLI's start (RunSession.start): the port and writability checks, the run folder made
        and claimed by session/rundir.create_run_dir (a name taken since it was planned gets the next
        suffix; every relative path in preset.toml made absolute, so resume and export-model work from
        any folder). ConfigError (one line) when a check refuses."""
        session = RunSession.start(resolved, planned.run_dir, explicit=planned.named)
        if planned.named:
            self.named_run_dir = None      # it holds this run now: the next launch gets a folder of its own
        return session

    def attach(self, run_dir: Path) -> RunSession:
        try:
            return RunSession.attach(run_dir)
        except ValueError as e:
            raise AttachError(str(e)) from None

    def resume(self, run_dir: Path) -> RunSession:
        """Continue an ended run in its own folder (RunSession.resume: newest complete checkpoint), the
        free disk checked first. ConfigError with one line when it cannot."""
        from shardconsole.session import preflight
        return RunSession.resume(run_dir, [], who="the console's resume",
                                 check=lambda c, source: preflight.check_disk_of(c, Path(run_dir), source))

    def recent_runs(self, limit: int = 30) -> list[RunListing]:
        """The newest runs with their status (history/index); a picker needs only the end of each
        stream, which is where a run's end is written."""
        from shardconsole.history.index import list_runs
        root = None if self.runs_root == default_runs_root() else self.runs_root   # the default: old ./runs too
        return [RunListing(r.path, r.description, r.status == "running", r.status_text)
                for r in list_runs(root, limit, tail_bytes=256 << 10)]


# ---------------------------------------------------------------------------------------------------
# The memory planner, written elsewhere: used when it exists, a placeholder otherwise.

@dataclass
class Machine:
    """What the setup screen knows of this machine (one sample, taken in a worker at start)."""
    gpus: list[GpuSample] = field(default_factory=list)
    host: HostSample | None = None
    gpu_unavailable: str = ""
    plan_hardware: Any = None     # plan's own hardware description, when plan exists
    detected: bool = False
    card: str = ""                # planned for this card instead (the setup screen's Plan for; card_plan.py)

    @property
    def gpu_count(self) -> int | None:
        """For config.validate, as the CLI passes it: 0 without a driver; None until detected (no check)."""
        return len(self.gpus) if self.detected else None


def plan_hardware(plan: Planner | None, gpus: list[GpuSample], host: HostSample | None) -> Any:
    """plan's description of this machine, built from the injected probes' samples (so tests with fake
    GPUs get estimates for those GPUs); None without a planner."""
    if plan is None:
        return None
    try:
        return plan.Hardware(gpus=len(gpus), gpu_memory_bytes=min((g.total_bytes for g in gpus), default=0),
                        host_memory_bytes=host.total_bytes if host else 0,
                        gpu_name=gpus[0].name if gpus else "", source="detected")
    except Exception:   # a planner whose Hardware changed shape must not stop the console
        return None


def run_estimate(plan: Planner | None, cfg: C.RunConfig, machine: Machine) -> Any:
    """plan.estimate(cfg, spec, hardware) for these settings; None without a planner or hardware.
    Raises what the planner raises (the caller shows it)."""
    if plan is None or machine.plan_hardware is None:
        return None
    from shardconsole.settings.models import resolve
    return plan.estimate(cfg, resolve(cfg.model.name), machine.plan_hardware)


def describe_machine(machine: Machine) -> str:
    """One line: the GPUs found (or why none) and the host's memory."""
    if not machine.detected:
        return "This machine: looking…"
    if machine.gpus:
        names = sorted({g.name for g in machine.gpus})
        total = max(g.total_bytes for g in machine.gpus)
        gpus = f"{len(machine.gpus)}× {' / '.join(names)} ({C.format_size(total)})"
    else:
        gpus = f"no GPU ({machine.gpu_unavailable or 'NVML found none'})"
    host = f"host RAM {C.format_size(machine.host.total_bytes)}" if machine.host else "host RAM unknown"
    return f"This machine: {gpus} · {host}"


def describe_estimate(plan: Planner | None, cfg: C.RunConfig, machine: Machine,
                      run_dir: Path | None = None) -> tuple[str, bool | None]:
    """(the estimate line, fits) from the planner; a placeholder while shardconsole.plan does not exist.
    run_dir: the folder the launch would make; where the saves cannot fit its disk, the line says so
    as `--headless` refuses it (session/preflight.disk_shortfall)."""
    if plan is None:
        return "Memory estimate: not available (the planner, shardconsole.plan, is not in this version)", None
    if not machine.detected:
        return "Memory estimate: looking at this machine…", None
    # A GPU preset on a machine without one runs its ranks on the CPU (the launch says so): estimate
    # that run, everything in host RAM, not the GPU run the preset describes.
    on_cpu_here = cfg.parallel.device == "auto" and not machine.gpus and not machine.card
    if on_cpu_here:
        cfg = C.copy(cfg)
        cfg.parallel.device = "cpu"
    try:
        est = run_estimate(plan, cfg, machine)
    except Exception as e:   # the planner must not take the console down with it
        return f"Memory estimate failed: {type(e).__name__}: {e}", None
    if est is None:
        return "Memory estimate: the planner could not describe this machine", None
    head = ("Estimate on the CPU (no GPU here; rough): " if on_cpu_here else
            f"Estimate on {machine.plan_hardware.gpu_name} (Plan for): " if machine.card else "Estimate: ")
    method = f"{cfg.train.method}: {est.trainable_line} · " if cfg.adapters else ""
    if cfg.parallel.device == "cpu":
        line = f"{head}{method}host peak {C.format_size(est.host_peak_bytes)} · {est.verdict}"
    else:
        # The peak against the card as NVML shows it (issue 34); a verdict that fits says the rest itself.
        verdict = est.verdict if not est.fits else est.verdict.split(":", 1)[0] + (
            f" (allocator needs {C.format_size(est.gpu_required_bytes)} of {C.format_size(est.gpu_budget_bytes)})"
            if est.gpu_budget_bytes else "")
        card = est.gpu_device_bytes
        gpu = (f"GPU peak {C.format_size(est.gpu_peak_bytes)} of {C.format_size(card)} "
               f"({100 * est.gpu_peak_bytes / card:.0f}%, NVML, largest rank)" if card else
               f"GPU peak {C.format_size(est.gpu_peak_bytes)} (NVML, largest rank)")
        line = f"{head}{method}{gpu} · host peak {C.format_size(est.host_peak_bytes)} · {verdict}"
    if run_dir is not None:
        from shardconsole.session.preflight import disk_shortfall
        short = disk_shortfall(cfg, run_dir, planner=plan)
        if short is not None:
            return f"{line} · disk too small: {short.text.removesuffix(' (--force launches anyway)')}", False
    return line, bool(est.fits)


def method_line(cfg: C.RunConfig | None) -> str:
    """" · lora: 40.0M of 6.74B trainable, 0.59%" for a run of adapters (the planner's count, which is
    peft's), "" for full fine-tuning or when it cannot be said. cfg: the run session's settings."""
    try:
        if cfg is None or not cfg.adapters:
            return ""
        from shardconsole.plan.lora import trainable_line
        from shardconsole.plan.shapes import Shapes
        from shardconsole.settings.models import resolve
        return f" · {cfg.train.method}: {trainable_line(cfg, Shapes.of(resolve(cfg.model.name)))}"
    except Exception:   # a courtesy line: a model the planner cannot read is the run's to report
        return ""


def predicted_speed(cfg: C.RunConfig | None, probes: "Probes", measured: float) -> str:
    """The speed model's tokens/s for a run's settings on this machine against the measured ("predicted
    8.2k tok/s (GPU bound), measured 8.0k (-2%)"); "" when it cannot say. Never raises: a courtesy."""
    plan = load_plan()
    if plan is None or cfg is None or measured <= 0:
        return ""
    try:
        from shardconsole.plan.speed.model import against_measured, predict
        from shardconsole.settings.models import resolve
        hw = plan_hardware(plan, probes.gpus(), probes.host())
        p = predict(cfg, resolve(cfg.model.name), hw) if hw is not None else None
        return against_measured(p, measured) if p is not None else ""
    except Exception:
        return ""


def planned_peaks(cfg: C.RunConfig | None, probes: "Probes") -> tuple[int | None, int | None]:
    """(GPU peak of the largest rank, host peak) the planner predicts for a run's settings (its
    session's) on this machine; (None, None) when it cannot say. Never raises: a prediction is a courtesy."""
    plan = load_plan()
    if plan is None or cfg is None:
        return None, None
    try:
        gpus = probes.gpus()
        hw = plan_hardware(plan, gpus, probes.host())
        if hw is None:
            return None, None
        from shardconsole.settings.models import resolve
        est = plan.estimate(cfg, resolve(cfg.model.name), hw)
        return (est.gpu_peak_bytes if gpus else None), est.host_peak_bytes
    except Exception:
        return None, None
