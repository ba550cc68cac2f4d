"""The run folder's layout, in one place: the ranks, the launcher and the front ends read every name
from here. Standard library only (the ranks import it before torch).

    runs/<id>/
      preset.toml        the fully resolved settings (itself a preset); the ranks read only this
      metrics.jsonl      the stream: every step, memory, GPU and host sample, event, eval line
      job.json           who started the run here: launcher pid/pgid, host, start time, argv
      launcher.log       torchrun's / the deepspeed launcher's own output
      logs/rank<N>.log   each rank's stdout and stderr (C-level output too)
      checkpoints/       step_<N>/ folders (step_<N>.partial while being written)
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

PRESET_FILE = "preset.toml"
METRICS_FILE = "metrics.jsonl"
JOB_FILE = "job.json"
LAUNCHER_LOG = "launcher.log"
LOGS_DIR = "logs"
CHECKPOINTS_DIR = "checkpoints"


@dataclass(frozen=True)
class RunFolder:
    path: Path

    @property
    def preset(self) -> Path:
        return self.path / PRESET_FILE

    @property
    def metrics(self) -> Path:
        return self.path / METRICS_FILE

    @property
    def job(self) -> Path:
        return self.path / JOB_FILE

    @property
    def launcher_log(self) -> Path:
        return self.path / LAUNCHER_LOG

    @property
    def logs(self) -> Path:
        return self.path / LOGS_DIR

    def rank_log(self, rank: int) -> Path:
        return self.path / LOGS_DIR / f"rank{rank}.log"

    def checkpoints(self, configured: str = "") -> Path:
        """Where checkpoints go: train.checkpoint_dir when set, else checkpoints/ in the run folder."""
        return Path(configured).expanduser() if configured else self.path / CHECKPOINTS_DIR

    @property
    def run_id(self) -> str:
        return self.path.resolve().name
