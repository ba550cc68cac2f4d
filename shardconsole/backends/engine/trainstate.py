"""What a rank keeps beside the model for an exact resume, and the stop request.

- `rng_state` / `set_rng_state`: torch (CPU and the rank's CUDA device), numpy and Python's RNGs as
  JSON, so a checkpoint's rank state is read without unpickling anything.
- `Data`: the training batches and their position (global samples consumed), built before resume and
  moved to the checkpoint's position, so a resumed run reads the batches the stopped one would have.
- `StopRequest`: SIGTERM / SIGINT (a console stop, Ctrl-C, torchrun forwarding either) asks for a
  save at the next step boundary; every rank agrees on that boundary through a one-int all-reduce on
  a gloo group, started at one step boundary and read at the next (no device sync, no wait). A
  second signal, later than the launcher's copy of the first, ends the rank without the save.
"""

from __future__ import annotations

import base64
import os
import random
import signal
import threading
import time
from typing import Any, Callable

import numpy as np
import torch
import torch.distributed as dist

from shardconsole.backends.data import sources as data_mod
from shardconsole.backends.rank.errors import Stopped  # noqa: F401  (raised here; re-exported)
from shardconsole.backends.data import preference as pair_data
from shardconsole.backends.data import prompts as prompt_data
from shardconsole.backends.objective.base import Objective
from shardconsole.runlog.runfolder import read_stop_request
from shardconsole.backends.checkpoint.checkpoints import SaveKind
from shardconsole.backends.rank.common import Rank


# ---------------------------------------------------------------------------------------------------
# RNG states

def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.numpy().tobytes()).decode("ascii")


def _unb64(s: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8).clone()


def rng_state(device: torch.device) -> dict:
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    version, state, gauss_next = random.getstate()
    out = {"torch": _b64(torch.get_rng_state()),
           "numpy": [kind, keys.tolist(), pos, has_gauss, gauss],
           "python": [version, list(state), gauss_next]}
    if device.type == "cuda":
        out["cuda"] = _b64(torch.cuda.get_rng_state(device))
    return out


def set_rng_state(state: dict, device: torch.device) -> None:
    torch.set_rng_state(_unb64(state["torch"]))
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, gauss))
    version, st, gauss_next = state["python"]
    random.setstate((version, tuple(st), gauss_next))
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(_unb64(state["cuda"]), device)


# ---------------------------------------------------------------------------------------------------
# Data and its position

class Data:
    """The rank's training batches and the global count of samples consumed (all ranks together)."""

    def __init__(self, r) -> None:
        self.r = r
        t = r.cfg.train
        self.micro_batch = t.micro_batch
        self.samples_per_step = t.micro_batch * t.grad_accum * r.world
        # A preference objective's sample is a pair (two rows), served by data/preference.py
        self.source = _source_module(r).make_source(r)
        self.samples = 0
        self.counted = (0, 0)       # (samples, their real tokens) counted so far: real_tokens adds the rest

    def seek(self, samples: int) -> None:
        if self.r.data_state.changed:      # resumed on other data (data.allow_changed)
            samples = data_mod.epoch_start(self.source, samples)
        self.samples = samples
        self.source.seek(samples)
        if hasattr(self.source, "positions") and samples and self.r.rank == 0:     # a mix: each source's place
            at = ", ".join(f"{name} sample {i} (epoch {i // n + 1})" for name, i, n in
                           zip(self.r.data_state.entry.names, self.source.positions(samples), self.source.sizes))
            self.r.event("info", f"data: resumed each source at {at}")

    def real_tokens(self) -> int | None:
        """The real (not padding) tokens of every sample consumed, all ranks, for a preference objective
        (pairs are padded rows); None for SFT, whose windows are all real (step * tokens_per_step)."""
        if not isinstance(self.source, pair_data.PairSource):
            return None
        if self.samples < self.counted[0]:          # a seek back (not done today): count from the start
            self.counted = (0, 0)
        lo, tokens = self.counted
        self.counted = (self.samples, tokens + self.source.real_tokens(lo, self.samples))
        return self.counted[1]

    def next(self) -> data_mod.Batch:
        """The next Batch (inputs, labels, positions or None) on the rank's device."""
        self.samples += self.micro_batch * self.r.world
        return data_mod.next_batch(self.source, self.micro_batch, self.r.device)


class Evaluator:
    """Held-out loss every train.eval_every steps and after the last step, when there is eval data."""

    def __init__(self, r, objective: Objective) -> None:
        self.r, self.objective = r, objective
        self.every = int(getattr(r.cfg.train, "eval_every", 0) or 0)
        self.source = _source_module(r).make_eval_source(r)

    def due(self, step: int) -> bool:
        if self.source is None:
            return False
        return (self.every and step % self.every == 0) or step == self.r.cfg.train.steps

    def run(self, model, step: int) -> None:
        """The objective's held-out figures (objective/base.Objective.evaluate), one eval line from rank 0."""
        from shardconsole.runlog import protocol as P
        r = self.r
        r.phase("evaluating")      # a long eval is not a hang: the hang watch counts only "training"
        t0 = time.perf_counter()
        f = self.objective.evaluate(model, self.source, r.cfg.train.micro_batch, r.device)
        if r.rank == 0 and f:
            r.emit(P.Eval(run=r.run_id, rank=0, step=step, seconds=time.perf_counter() - t0, **f))
        r.phase("training")


def _source_module(r):
    """Where the objective's samples come from: windows (sft), pairs (dpo / orpo), prompts (grpo)."""
    objective = getattr(r.cfg.train, "objective", "sft")
    return prompt_data if objective == "grpo" else data_mod if objective == "sft" else pair_data


# ---------------------------------------------------------------------------------------------------
# Stop requests

class StopRequest:
    """Signals become a flag read at step boundaries. A watcher thread reads them from the wakeup fd,
    so a second signal ends the rank even while the main thread sits in a collective or a write."""

    DEBOUNCE_S = 2.0     # the front end signals the ranks and the launcher forwards its own copy
    LOOK_EVERY_S = 1.0

    def __init__(self, r) -> None:
        self.r = r
        self.local = False
        self.armed = False       # in the training loop: a stop waits for the next step boundary
        self.first_at: float | None = None
        self.skip_save = False
        self.by_signal = False   # the first stop came as a signal (Slurm's KillWait may then apply)
        self.group = None
        self.work = None
        self.buf = torch.zeros(1, dtype=torch.int32)
        self.looked_at = float("-inf")
        if threading.current_thread() is not threading.main_thread():
            return
        rfd, wfd = os.pipe()
        os.set_blocking(wfd, False)
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: None)     # the watcher thread acts on it
        signal.set_wakeup_fd(wfd, warn_on_full_buffer=False)
        threading.Thread(target=self._watch, args=(rfd,), daemon=True, name="stop-watch").start()

    def _watch(self, rfd: int) -> None:
        while True:
            try:
                data = os.read(rfd, 64)
            except OSError:
                return
            for sig in data:
                if sig not in (signal.SIGTERM, signal.SIGINT):
                    continue
                now = time.monotonic()
                if not self.armed:
                    # Loading, building ops: nothing to save yet, and a rank blocked in a collective
                    # whose peer failed must end now, not when the launcher SIGKILLs it.
                    end_now(self.r, "a stop signal before training began")
                if self.first_at is None:
                    self.first_at = now
                    self.local = self.by_signal = True
                elif now - self.first_at > self.DEBOUNCE_S:
                    self.skip_save = True
                    end_now(self.r, "a second stop signal: ended without saving")

    def _asked_by_file(self) -> bool:
        """A stop asked through the run folder (runfolder.write_stop_request) for this session: the way a
        stop reaches the ranks of every node. One stat a second at most (NFS round trips)."""
        now = time.monotonic()
        if now - self.looked_at < self.LOOK_EVERY_S:
            return False
        self.looked_at = now
        found = read_stop_request(self.r.run_dir)
        return found is not None and found.get("session") in (self.r.run_id, "")

    def start_round(self) -> None:
        """At a step boundary: share this rank's flag; the answer is read at the next boundary."""
        self.armed = True
        if not self.local and self._asked_by_file():
            self.first_at, self.local = time.monotonic(), True
        if self.group is None:
            # A gloo group of its own: no device sync under NCCL, and never queued among the training's
            # collectives on the default group.
            self.group = dist.new_group(backend="gloo")
        self.buf.fill_(1 if self.local else 0)
        self.work = dist.all_reduce(self.buf, op=dist.ReduceOp.MAX, group=self.group, async_op=True)

    def agreed(self) -> bool:
        """Whether any rank had been asked to stop at the previous boundary (the same answer everywhere)."""
        if self.work is None:
            return False
        self.work.wait()
        self.work = None
        return bool(int(self.buf.item()))


# Stopped (the run was asked to stop: cause "stopped") lives in rank/errors.py.


def end_now(r, why: str) -> None:
    """From any thread: report the stop and end the process at once (no save, no teardown)."""
    from shardconsole.runlog import protocol as P
    r.writer.emit(P.Failed(run=r.run_id, rank=r.rank, cause="stopped", message=f"stopped at step {r.step}: {why}",
                           exc_type="Stopped", step=r.step))
    from shardconsole.backends.rank.common import exit_rank
    exit_rank(1)


def _launcher_grace_s(r) -> float:
    """Seconds the launcher waits after forwarding SIGTERM before it SIGKILLs the ranks: torchrun's
    --shutdown-timeout / TORCH_ELASTIC_SHUTDOWN_TIMEOUT (30 s by default); the deepspeed launcher's
    terminate_process_tree waits a fixed 30 s."""
    return r.knobs.launcher_grace_s if r.cfg.parallel.launcher == "torchrun" else 30.0


# Slurm's KillWait, which the batch script exports: Slurm's SIGTERM (scancel, the time limit, a requeue, a
# failed node) reaches every process, and its SIGKILL this long after, whatever torchrun's shutdown timeout says.
SAVE_MARGIN = 1.25          # a save's time varies from one to the next (the page cache, a shared disk)
MODEL_SHARE = 1 / 3         # FSDP2's weights alone against weights + AdamW's two moments (one dtype)
_WHAT = ("checkpoint", "model", "")


def _time_left(r, stop: StopRequest) -> tuple[float, str]:
    """(seconds before the SIGKILL, counted from the stop's first signal; what sets them)."""
    grace, source = _launcher_grace_s(r), "the launcher's shutdown timeout"
    kill_wait = float("nan") if r.knobs.kill_wait_s is None else r.knobs.kill_wait_s
    if stop.by_signal and kill_wait < grace:          # nan compares False: not under Slurm
        grace, source = kill_wait, f"Slurm's KillWait ({kill_wait:.0f}s after its SIGTERM)"
    elapsed = time.monotonic() - stop.first_at if stop.first_at is not None else 0.0
    return grace - elapsed - 2.0, source


def _what_fits(r, budget: float, source: str) -> tuple[str, str]:
    """The largest save this run's last one says fits the budget: "checkpoint", "model" (FSDP2's
    weights alone) or "" (none), and why it is not the checkpoint. Unmeasured: the checkpoint is tried."""
    full = r.progress.save_seconds.get("checkpoint")
    if full is None or full * SAVE_MARGIN <= budget:
        return "checkpoint", ""
    why = f"{source} leaves {max(0.0, budget):.0f}s and this run's last checkpoint took {full:.1f}s to save"
    if r.cfg.parallel.backend == "fsdp" and full * MODEL_SHARE * SAVE_MARGIN <= budget:
        return "model", why
    return "", why


def stop_with_save(r: Rank, stop: StopRequest, save: Callable[[SaveKind], None]) -> None:
    """Every rank at the same step boundary: save (unless train.save_on_stop is off), bounded by
    train.stop_save_timeout_s and by what the launcher (or Slurm's KillWait) allows, then raise Stopped.
    save(kind): a checkpoint, or the weights alone (SaveKind.MODEL) when the checkpoint would not fit;
    rank 0 decides, so that every rank writes the same save."""
    t = r.cfg.train
    if not t.save_on_stop or stop.skip_save:
        raise Stopped(f"stopped at step {r.step} without a save (train.save_on_stop = false)")
    budget, source = _time_left(r, stop)
    if t.stop_save_timeout_s < budget:
        budget, source = t.stop_save_timeout_s, "train.stop_save_timeout_s"
    what, why = _what_fits(r, budget, source)
    choice = torch.tensor([_WHAT.index(what)], dtype=torch.int32)
    dist.broadcast(choice, src=0, group=stop.group)
    what = _WHAT[int(choice.item())]
    resume = "resume continues from the newest complete checkpoint"
    if not what:
        raise Stopped(f"stopped at step {r.step} without a save: {why or 'rank 0 found no time to save'}; {resume}")
    r.event("stop_save", f"saving step {r.step} before stopping" + (" (the weights alone)" if what == "model" else ""))
    timer = threading.Timer(max(1.0, budget), end_now,
                            (r, f"the save of step {r.step} took longer than {max(1.0, budget):.0f}s ({source}); its "
                                f".partial folder is removed at the next save or resume"))
    timer.daemon = True
    timer.start()
    try:
        save(SaveKind(what))
    finally:
        timer.cancel()
    if what == "model":
        raise Stopped(f"stopped at step {r.step}; {why or 'rank 0 found too little time'}: saved the weights alone "
                      f"(export-model reads them; {resume})")
    raise Stopped(f"stopped at step {r.step}; saved it")
