"""FSDP2's optimizer update, behind one seam: the engine's step tells its Update the last micro-batch's
backward is coming (`arm`) and asks for the update after it (`apply`, the gradient norm or None). Which of
the three ways a run updates is chosen once, at the engine's ready():

- Plain: unscale (fp16's scaler), clip (fsdp_step.Clip: folded into fused AdamW where it can be), step.
- InBackward (optim.step_in_backward): each parameter was stepped as FSDP2 reduced its gradient (no clip,
  no scaler); apply only checks that every one was.
- Overlapped (fsdp.offload_overlap): each unit's host step started as its gradients landed on the host;
  apply waits for the last. A step the overlap cannot take (arm said no: a cold first step, a fault that
  changes the gradients) is updated by the run's other way instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Protocol

import torch

from shardconsole.backends.engine.fsdp_step import LossScaling
from shardconsole.backends.observe.metrics import PhaseTimes
from shardconsole.backends.observe.step_timing import StepTiming
from shardconsole.backends.offload.overlap import Overlap
from shardconsole.backends.optim.step_in_backward import StepInBackward


class Update(Protocol):
    def arm(self, step: int) -> None:
        """Before the last micro-batch's backward of `step`."""

    def apply(self) -> Any:
        """After it: the update done; the gradient norm where one was computed, else None."""


@dataclass
class Plain:
    optim: torch.optim.Optimizer
    scaling: LossScaling
    clip: Callable[[], Any]
    phases: PhaseTimes
    refresh: Callable[[], None]       # the compute copy of the updated weights (offloaded runs)

    def arm(self, step: int) -> None:
        pass

    def apply(self) -> Any:
        self.scaling.unscale(self.optim)
        norm = self.clip()
        self.phases.mark("clip")
        self.scaling.step(self.optim)
        self.phases.mark("step")
        self.refresh()
        return norm


@dataclass
class InBackward:
    stepper: StepInBackward
    refresh: Callable[[], None]

    def arm(self, step: int) -> None:
        pass

    def apply(self) -> Any:
        self.stepper.check_stepped()
        self.refresh()
        return None


@dataclass
class Overlapped:
    overlap: Overlap
    timing: StepTiming
    otherwise: Update                  # a step the overlap did not arm for

    def arm(self, step: int) -> None:
        self.overlap.arm(step)         # each unit's host step starts as its gradients land

    def apply(self) -> Any:
        if not self.overlap.armed:
            return self.otherwise.apply()
        # no clip, no scaler (offload_overlap.why_not); the overlap refreshes each unit's copy after its step
        self.timing.overlapped(self.overlap.finish())
        return None


def choose(plain: Plain, stepper: StepInBackward | None, overlap: Overlap | None, timing: StepTiming) -> Update:
    """The run's update: the overlap where it is on (else the step in the backward, else the plain one)."""
    base: Update = plain if stepper is None else InBackward(stepper, plain.refresh)
    return base if overlap is None else Overlapped(overlap, timing, base)
