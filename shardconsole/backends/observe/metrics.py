"""What a rank measures and reports: step lines (rank 0), memory lines (every rank), and the checks on
the loss and the fp16 loss scale that end a run which stopped learning."""

from __future__ import annotations

import math
import os
import time
from typing import Any, Callable

import psutil
import torch
import torch.distributed as dist

from shardconsole.settings import config as C
from shardconsole.runlog import protocol as P
from shardconsole.backends.model.adapters import SAVED
from shardconsole.backends.rank.common import Rank
from shardconsole.backends.rank.errors import LossScaleFloorError, NanLossError  # noqa: F401  (re-exported)
from shardconsole.machine.hardware import peak_tflops


# NanLossError and LossScaleFloorError live in rank/errors.py, with their cause and hint.


# Metrics

class StepMeter:
    """Accumulates on the device between log steps; reads (one sync) only when a line is due."""

    def __init__(self, r: Rank, model: torch.nn.Module, real_tokens: Callable[[], int | None] | None = None) -> None:
        self.r = r
        cfg = r.cfg
        self.tokens_per_step = cfg.tokens_per_step      # the rows computed, padding included
        # Preference pairs are padded rows: their real tokens so far come from the data (trainstate.Data),
        # so tokens and tokens/s compare with SFT's packed windows, whose tokens are all real.
        self.real_tokens = real_tokens or (lambda: None)
        self.tokens_before = self.real_tokens()
        self.samples_per_step = cfg.train.micro_batch * cfg.train.grad_accum * r.world
        self.flops_per_token = flops_per_token(r, model)
        rate = cfg.train.peak_tflops or (peak_tflops(torch.cuda.get_device_name(r.device)) if r.is_cuda else None)
        self.peak_flops = rate * 1e12 if rate else None
        self.loss_sum = torch.zeros((), device=r.device, dtype=torch.float32)
        self.n = 0                 # micro-batches since the last line: the loss is their mean
        self.steps = 0             # optimizer steps since the last line: the figures are per step
        self.counted_step: int | None = None
        self.t_last = time.perf_counter()
        self.proc = psutil.Process()

    def add(self, loss: torch.Tensor) -> None:
        """Once per micro-batch. With train.grad_accum = k an optimizer step is k micro-batches: the step
        time, tokens/s and MFU are per optimizer step (r.step tells a new one from the same)."""
        self.loss_sum += loss.detach().float()   # stays on the device: no sync
        self.n += 1
        if self.counted_step != self.r.step:
            self.counted_step = self.r.step
            self.steps += 1

    def due(self, step: int) -> bool:
        return step % self.r.cfg.train.log_every == 0 or step == self.r.cfg.train.steps

    def report(self, step: int, lr: float, grad_norm: torch.Tensor | float | None,
               loss_scale: float | None = None, skipped: int = 0, figures: dict[str, Any] | None = None) -> float:
        """Emit the step line (rank 0) and a memory line (every rank). Returns the mean loss. `figures`: the
        objective's (Objective.figures(), called on every rank: a collective), Step fields by name."""
        r = self.r
        if r.is_cuda:
            torch.cuda.synchronize(r.device)   # host-device sync: only on log steps
        now = time.perf_counter()
        loss = self.loss_sum.clone()
        dist.all_reduce(loss, op=dist.ReduceOp.SUM)
        mean_loss = loss.item() / max(1, self.n) / r.world
        dt = (now - self.t_last) / max(1, self.steps)      # the wall time of one optimizer step
        computed = self.tokens_per_step / dt if dt > 0 else 0.0      # rows computed a second, padding included
        tps, tokens, padding = computed, step * self.tokens_per_step, None
        total = self.real_tokens()
        if total is not None and self.tokens_before is not None:
            real = total - self.tokens_before
            padding = 1 - real / (self.tokens_per_step * max(1, self.steps))
            tps, tokens = computed * (1 - padding), total
            self.tokens_before = r.progress.tokens = total
        # the MFU is of the work the device did, padding included, as the planner predicts it
        mfu = (computed / r.world) * self.flops_per_token / self.peak_flops if self.peak_flops else None
        gn = float(grad_norm) if grad_norm is not None else None
        r.emit(memory_message(r, step, self.proc))   # before the step line, which readers print on
        if r.rank == 0:
            r.emit(P.Step(run=r.run_id, rank=0, step=step, steps=r.cfg.train.steps, loss=mean_loss, lr=lr,
                          grad_norm=gn, tokens_per_s=tps,
                          samples_per_s=self.samples_per_step / dt if dt > 0 else 0.0, step_s=dt, mfu=mfu,
                          loss_scale=loss_scale, skipped_steps=skipped, tokens=tokens, padding=padding,
                          meter=P.METER_VERSION, fp8="" if r.cfg.precision.fp8 == "none" else r.cfg.precision.fp8,
                          **(figures or {})))
        self.loss_sum.zero_()
        self.n = self.steps = 0
        self.t_last = time.perf_counter()
        return mean_loss


def flops_per_token(r: Rank, model: torch.nn.Module) -> float:
    """The MFU's FLOPs a token for what this run trains (ModelSpec.flops_per_token): under adapters,
    the trained parameters counted from the model (whole counts: DTensor's global shape, ZeRO-3's
    ds_numel), the fully trained copies of lora.modules_to_save among them."""
    seq = r.cfg.data.seq_len
    if not r.cfg.adapters:
        return r.spec.flops_per_token(seq)
    trained = saved = 0
    for name, p in model.named_parameters():
        if p.requires_grad:
            n = p.ds_numel if hasattr(p, "ds_numel") else p.numel()
            trained += n
            saved += n if SAVED + "." in name else 0
    return r.spec.flops_per_token(seq, trained=trained, saved=saved)


def memory_message(r: Rank, step: int, proc: psutil.Process | None = None) -> P.Memory:
    rss = (proc or psutil.Process()).memory_info().rss
    if r.is_cuda:
        return P.Memory(run=r.run_id, rank=r.rank, step=step,
                        allocated_bytes=torch.cuda.memory_allocated(r.device),
                        reserved_bytes=torch.cuda.memory_reserved(r.device),
                        peak_reserved_bytes=torch.cuda.max_memory_reserved(r.device),
                        peak_allocated_bytes=torch.cuda.max_memory_allocated(r.device),
                        host_rss_bytes=rss, device_index=r.device.index)
    return P.Memory(run=r.run_id, rank=r.rank, step=step, host_rss_bytes=rss)


def check_loss(r: Rank, loss: float, step: int) -> None:
    if not math.isfinite(loss):
        raise NanLossError(f"loss is {loss} at step {step}")


class ScaleFloorWatch:
    """fp16: the loss scale sitting at its minimum while every step overflows means training has
    stopped (each step is skipped). Raise after `patience` such steps in a row instead of burning hours."""

    def __init__(self, cfg: C.RunConfig, patience: int = 8) -> None:
        self.min_scale = float(cfg.precision.fp16_value("min_loss_scale"))
        self.patience = patience
        self.streak = 0
        self.last_step = 0
        self.last_skipped = 0

    def check(self, step: int, scale: float | None, skipped: int) -> None:
        if scale is None:
            return
        interval = step - self.last_step
        new_skips = skipped - self.last_skipped
        self.last_step, self.last_skipped = step, skipped
        if scale <= self.min_scale and new_skips >= interval:
            self.streak += new_skips
        else:
            self.streak = 0
        if self.streak >= self.patience:
            raise LossScaleFloorError(f"fp16 loss scale stuck at its minimum {self.min_scale:g}: "
                                      f"the last {self.streak} steps all overflowed and were skipped")


class PhaseTimes:
    """SHARDCONSOLE_PHASE_TIMES=1 (benchmarks): synchronize the device at each phase boundary of a step
    and print the mean seconds of each phase to rank 0's log at every log step. Off: no syncs, no cost.
    Synchronizing removes the overlap between phases, so the step is slower while this is on."""

    def __init__(self, r: Rank) -> None:
        self.on = r.knobs.phase_times and r.rank == 0
        self.r = r
        self.sums: dict[str, float] = {}
        self.count = 0
        self.t = 0.0

    def _now(self) -> float:
        if self.r.is_cuda:
            torch.cuda.synchronize(self.r.device)
        return time.perf_counter()

    def start(self) -> None:
        if self.on:
            self.t = self._now()
            self.count += 1

    def mark(self, name: str) -> None:
        if self.on:
            now = self._now()
            self.sums[name] = self.sums.get(name, 0.0) + now - self.t
            self.t = now

    def report(self, step: int) -> None:
        if self.on and self.count:
            parts = " ".join(f"{k} {v / self.count:.3f}" for k, v in self.sums.items())
            self.r.log(f"phase times (s, mean of {self.count} steps to step {step}): {parts}")
            self.sums, self.count = {}, 0
