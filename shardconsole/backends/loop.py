"""What both engines do after each optimizer step and after the last one, written once.

An engine's loop owns its step (forward, backward, the optimizer) and its step line (the figures
differ: FSDP2's clip and scaler, DeepSpeed's engine); the tail is the same for both:
    empty the CUDA cache when due -> evaluate when due -> a stop agreed by every rank saves and ends
    -> a periodic checkpoint when due -> the next stop round
and after the last step the final save. `save(step)` is the engine's checkpoint writer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from shardconsole.backends import checkpoints, trainstate
from shardconsole.backends.common import Rank


@dataclass
class Tail:
    r: Rank
    stop: trainstate.StopRequest
    evaluator: trainstate.Evaluator
    evaluated: object                       # what the evaluator runs: the model, or DeepSpeed's engine
    save: Callable[..., None]               # save(step[, what]): writes the checkpoint of a step
    export: Callable[[int], None] | None = None     # writes train.export_dir from the trained state

    def after_step(self, step: int) -> None:
        cfg = self.r.cfg
        every = cfg.memory.empty_cache_every
        if every and self.r.is_cuda and step % every == 0:
            torch.cuda.empty_cache()
        if self.evaluator.due(step):
            self.evaluator.run(self.evaluated, step)
        if self.stop.agreed():
            trainstate.stop_with_save(self.r, self.stop,
                                      lambda what: self.save(step) if what == "checkpoint" else self.save(step, what))
        if checkpoints.save_due(self.r, step):
            self.save(step)
        self.stop.start_round()

    def after_last_step(self, start_step: int) -> None:
        """The final save, unless this session trained no step (a resume of a finished run)."""
        steps = self.r.cfg.train.steps
        if checkpoints.final_save_due(self.r) and start_step < steps:
            what = checkpoints.final_what(self.r)
            self.save(steps, what) if what != "checkpoint" else self.save(steps)
        if self.export is not None and self.r.cfg.train.export_dir and start_step < steps:
            self.export(steps)
