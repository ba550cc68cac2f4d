"""The engine contract: what the loop (loop.run) asks of FSDP2 and DeepSpeed alike, typed so that mypy
holds both engines to it (tests/test_types.py). An engine owns what it builds (model, optimizer, host
arena, DeepSpeed's engine); the Rank it is given never changes after start.

The order the loop calls it in, once per session:
    start -> build(data) -> load() (on resume) -> ready() -> step(...) x steps (figures/after_line on
    log steps; save/evaluate when due) -> save(final) -> export(final) -> release()
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from shardconsole.backends.checkpoint.checkpoints import SaveKind  # noqa: F401  (part of the contract)
from shardconsole.backends.engine.trainstate import Data
from shardconsole.backends.objective.base import Forward, Objective
from shardconsole.backends.observe.metrics import StepMeter


@dataclass(frozen=True)
class LineFigures:
    """An engine's part of a step line, read only on log steps (reading may sync the device)."""
    grad_norm: float | torch.Tensor | None = None
    loss_scale: float | None = None       # None unless fp16
    skipped: int = 0                      # fp16 overflow steps skipped (since the last line or in all)


class Engine(Protocol):
    objective: Objective

    @property
    def module(self) -> torch.nn.Module:
        """The trained module (for the FLOPs a token): FSDP2's root, DeepSpeed's engine.module."""
        ...

    @property
    def forward(self) -> Forward:
        """What a forward calls, inside the engine's hooks: FSDP2's root module, DeepSpeed's engine."""
        ...

    def start(self) -> None:
        """The process group, and what must come before the model (DeepSpeed's op builds)."""

    def build(self, data: Data) -> None:
        """Model, optimizer and offload; `data` is the batches the steps read and the saves record."""

    def load(self) -> int:
        """Resume from the newest complete checkpoint: its step, 0 when there is none."""
        ...

    def ready(self) -> None:
        """After the load, before the first step: clip, hooks, the offload view, test faults."""

    def step(self, step: int, lr: float, meter: StepMeter) -> None:
        """One optimizer step: train.grad_accum micro-batches (each loss to meter.add), then the update."""

    def figures(self) -> LineFigures:
        ...

    def after_line(self, step: int, figures: LineFigures) -> None:
        """An engine's own lines and checks after the step line (loss-scale floor, offload view)."""

    def evaluate(self, step: int) -> None:
        """The held-out loss when due (train.eval_every, the last step)."""

    def save(self, step: int, kind: SaveKind) -> None:
        ...

    def export(self, step: int) -> None:
        """train.export_dir from the trained state: a Hugging Face folder (merged, or peft's adapters)."""

    def release(self) -> None:
        """What the engine holds beyond its objects' lifetimes (DeepSpeed's engine.destroy, the arena)."""
