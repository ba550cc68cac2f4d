"""The training loop of both engines, written once, and how it ends.

`run` drives an Engine (contract.py) from start to the last step: the engine owns its step (forward,
backward, the optimizer: the figures differ, FSDP2's clip and scaler, DeepSpeed's engine); the loop owns
the order, the step line and the tail of each step, the same for both:
    empty the CUDA cache when due -> evaluate when due -> a stop agreed by every rank saves and ends
    -> a periodic checkpoint when due -> the next stop round
and after the last step the final save and the export. `ending` is how a run ends however it ends
(torchtitan's main closes in a finally).
"""

from __future__ import annotations

import contextlib
import threading
from typing import Callable, Iterator

import torch
import torch.distributed as dist

from shardconsole.backends.checkpoint import checkpoints
from shardconsole.backends.engine import trainstate
from shardconsole.backends.checkpoint.checkpoints import SaveKind
from shardconsole.backends.engine.contract import Engine
from shardconsole.backends.model import adapters, fused_loss
from shardconsole.backends.observe import compiled, failures, host_limit, metrics, profile, stream_health
from shardconsole.backends.rank import common
from shardconsole.backends.rank.common import Rank

# A teardown after a failure gets this long; then the rank ends as __main__ would have (its report is out).
TEARDOWN_S = 10.0


def run(r: Rank, engine: Engine) -> None:
    """One session of a run, from the process group to the export; released however it ends."""
    t = r.cfg.train
    with ending(r) as held:
        engine.start()
        held.append(engine.release)
        # After the process group (its stop rounds are collectives), before the model: a stop while
        # the model loads ends the rank at once (trainstate.StopRequest).
        stop = trainstate.StopRequest(r)
        data = trainstate.Data(r)       # before the load: a resume moves it to the checkpoint's position
        engine.build(data)
        # Before the load: full DPO's reference log-probs are the starting weights' (cached after a first pass).
        engine.objective.prepare(engine.forward)
        start_step = engine.load() if t.resume else 0
        resume_tokens = getattr(engine.objective, "resume_tokens", None)
        if start_step and resume_tokens is not None:
            # GRPO's tokens trained on are sampled, not in the data: the checkpoint's count goes on
            resume_tokens(checkpoints.resumed_tokens(r, start_step))
        engine.ready()
        if r.cfg.adapters and r.rank == 0:
            # the rank log's count line, in the stream: the headless lines and the console then say what trains
            r.event("info", f"{t.method}: training adapters, {adapters.count_line(engine.module)}; "
                            f"objective {t.objective}")
        # the loss the engine built (CausalLMLoss.loss: memory.loss resolved for this device), and whose kernel
        r.log(f"loss: {fused_loss.describe(getattr(engine.module, 'loss', 'chunked'), r.device)}")
        # the real tokens: the pairs' (data), or what the objective trained on (GRPO's prompts and completions)
        meter = metrics.StepMeter(r, engine.module, getattr(engine.objective, "real_tokens", None) or data.real_tokens)
        tail = Tail(r, stop, engine)
        profiler = profile.StepProfiler(r)      # SHARDCONSOLE_PROFILE=A-B; does nothing without it
        r.phase("training")
        stop.start_round()
        for step in range(start_step + 1, t.steps + 1):
            r.progress.step = step
            lr = t.lr * common.lr_factor(r.cfg, step)
            profiler.before(step)
            engine.step(step, lr, meter)
            profiler.after(step)
            if step == start_step + 1 and t.compile:
                compiled.check(r)     # eager behind the settings' back would train on blind
            if meter.due(step):
                figures = engine.figures()
                mean = meter.report(step, lr, figures.grad_norm, figures.loss_scale, figures.skipped,
                                    figures=engine.objective.figures())
                metrics.check_loss(r, mean, step)
                engine.after_line(step, figures)
            tail.after_step(step)
        tail.after_last_step(start_step)


class Tail:
    """What follows each optimizer step and the last one, for every engine."""

    def __init__(self, r: Rank, stop: trainstate.StopRequest, engine: Engine) -> None:
        self.r, self.stop, self.engine = r, stop, engine

    def after_step(self, step: int) -> None:
        cfg = self.r.cfg
        every = cfg.memory.empty_cache_every
        if every and self.r.is_cuda and step % every == 0:
            torch.cuda.empty_cache()
        self.engine.evaluate(step)
        stream_health.check(self.r, self.stop)       # a stream that cannot be written asks the run to stop
        host_limit.check(self.r, self.stop)          # so does a node past memory.host_memory_limit
        if self.stop.agreed():
            # ... and the rank that found it ends with the verdict, after the save
            with stream_health.verdict(self.r), host_limit.verdict(self.r):
                trainstate.stop_with_save(self.r, self.stop, lambda kind: self._save(step, kind))
        if checkpoints.save_due(self.r, step):
            self._save(step, SaveKind.CHECKPOINT)
        self.stop.start_round()

    def _save(self, step: int, kind: SaveKind) -> None:
        """A save on every rank; an objective that counts its own tokens (GRPO) has them in the manifest, up to
        this step (the step lines' count lags by up to log_every steps)."""
        count = getattr(self.engine.objective, "real_tokens", None)
        if count is not None:
            self.r.progress.tokens = count()        # a collective: every rank saves
        self.engine.save(step, kind)

    def after_last_step(self, start_step: int) -> None:
        """The final save and the export, unless this session trained no step (a resume of a finished run)."""
        steps = self.r.cfg.train.steps
        if start_step >= steps:
            return
        if checkpoints.final_save_due(self.r):
            self._save(steps, checkpoints.final_what(self.r))
        if self.r.cfg.train.export_dir:
            self.engine.export(steps)


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
