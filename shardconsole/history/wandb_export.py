"""A run's stream as a Weights & Biases run: the same tags as the TensorBoard file, the settings as its
config. Optional (`pip install shardconsole[wandb]`); offline by default, so it works without network
and `wandb sync` uploads later (WANDB_MODE=online sends it now)."""

from __future__ import annotations

from pathlib import Path

from shardconsole.envvars import read
from shardconsole.settings import config as C
from shardconsole.runlog import protocol as P
from shardconsole.runlog.runfolder import RunFolder
from shardconsole.runlog.tbevents import scalars


def values_by_step(folder: RunFolder) -> list[tuple[int, dict[str, float]]]:
    """Each step's values, in order; a sample taken between steps is logged with the step before it,
    and a resumed run's replayed steps keep their newest values."""
    from shardconsole.runlog.stream import MetricsReader
    reader = MetricsReader(folder.metrics)
    by_step: dict[int, dict[str, float]] = {}
    step = 0
    try:
        while True:
            before = reader._pos
            for msg in reader.poll():
                if isinstance(msg, (P.Step, P.Eval, P.Memory)):
                    step = msg.step
                values = scalars(msg)
                if values:
                    by_step.setdefault(step, {}).update(values)
            if reader._pos == before:
                break
    finally:
        reader.close()
    return sorted(by_step.items())


def export(run_dir: Path, project: str = "shardconsole") -> str:
    """Write the run to W&B; returns one line saying where. ConfigError when wandb is not installed."""
    try:
        import wandb
    except ImportError:
        raise C.ConfigError("--wandb needs the wandb package: pip install 'shardconsole[wandb]'") from None
    folder = RunFolder(Path(run_dir))
    try:
        config = C.load(folder.preset).to_dict()
    except (C.ConfigError, OSError):
        config = {}
    mode = read("WANDB_MODE")
    run = wandb.init(project=read("WANDB_PROJECT") or project, name=folder.run_id, dir=str(folder.path),
                     mode=mode, config=config, reinit=True)
    try:
        for step, values in values_by_step(folder):
            run.log(values, step=step)
    finally:
        run.finish()
    files = getattr(run, "dir", "")       # <run folder>/wandb/offline-run-<time>-<id>/files: sync takes its parent
    where = str(Path(files).parent) if files else str(folder.path / "wandb")
    return f"{folder.run_id}: W&B run {mode} in {where}" + ("  (upload: `wandb sync` on that folder)"
                                                             if mode == "offline" else "")
