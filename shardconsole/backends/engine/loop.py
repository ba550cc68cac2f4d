"""What both engines do after each optimizer step and after the last one, written once.

An engine's loop owns its step (forward, backward, the optimizer) and its step line (the figures
differ: FSDP2's clip and scaler, DeepSpeed's engine); the tail is the same for both:
    empty the CUDA cache when due -> evaluate when due -> a stop agreed by every rank saves and ends
    -> a periodic checkpoint when due -> the next stop round
and after the last step the final save. `save(step)` is the engine's checkpoint writer.
`ending` is how both engines' train end, however they end (torchtitan's main closes in a finally).
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
import torch.distributed as dist

from shardconsole.backends.checkpoint import checkpoints
from shardconsole.backends.rank import common
from shardconsole.backends.observe import failures, stream_health
from shardconsole.backends.engine import trainstate
from shardconsole.backends.rank.common import Rank

# A teardown after a failure gets this long; then the rank ends as __main__ would have (its report is out).
TEARDOWN_S = 10.0


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
        stream_health.check(self.r, self.stop)       # a stream that cannot be written asks the run to stop
        if self.stop.agreed():
            with stream_health.verdict(self.r):     # ... and that rank ends with the verdict, after the save
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


@contextlib.contextmanager
def ending(r: Rank) -> Iterator[list[Callable[[], None]]]:
    """An engine's train inside it appends what to release (DeepSpeed's engine.destroy, ...); it is
    released however train ends, the last appended first. After a failure: the `failed` line first
    (the earliest line names the root cause, and a peer that sees this rank's group go raises too;
    under gloo it sees that only when this process exits, NCCL's teardown can be sooner),
    then the release and the process group destroyed without a barrier (the peers may be gone), bounded
    by TEARDOWN_S. After success __main__'s common.shutdown destroys the group, after a barrier."""
    held: list[Callable[[], None]] = []
    try:
        yield held
    except BaseException as exc:
        failed = not (isinstance(exc, SystemExit) and not exc.code)     # as __main__ counts it
        if failed:
            failures.report_failure(r, exc, r.run_dir, r.run_id)
        guard = threading.Timer(TEARDOWN_S, common.exit_rank, (int(failed),))
        guard.daemon = True
        guard.start()
        for release in [*reversed(held), _destroy_group]:
            try:
                release()
            except Exception as e:       # noqa: BLE001 - the failure already reported is the one that counts
                r.log(f"teardown after the failure: {type(e).__name__}: {e}")
        guard.cancel()
        raise
    for release in reversed(held):
        release()


def _destroy_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
