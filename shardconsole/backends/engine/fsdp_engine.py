"""The FSDP2 engine (contract.Engine): builds with fsdp.py, steps, saves and resumes (fsdp_checkpoint.py:
the format), exports.
One optimizer step reads top to bottom in `step`."""

from __future__ import annotations

from typing import Any, Callable

import torch

from shardconsole.backends.checkpoint import hf_export, lora_export
from shardconsole.backends.checkpoint.checkpoints import SaveKind
from shardconsole.backends.engine import fsdp, fsdp_checkpoint, fsdp_step, fsdp_update, trainstate
from shardconsole.backends.engine.contract import LineFigures
from shardconsole.backends.model import activation_offload, adapters, float8, modeling
from shardconsole.backends.objective.base import Forward, Objective
from shardconsole.backends.observe import metrics, step_timing
from shardconsole.backends.observe.metrics import StepMeter
from shardconsole.backends.offload import overlap as offload_overlap
from shardconsole.backends.optim import adam_mini, lowbit_optim, step_in_backward
from shardconsole.backends.rank import common
from shardconsole.backends.rank.common import Rank


class FsdpEngine:
    # Everything the engine holds, declared here: build() sets the first group, ready() the second (the
    # loop calls them in that order, before any step, save or load); release() drops `built`.
    data: trainstate.Data
    model: modeling.CausalLMLoss             # built.model, sharded by FSDP2
    optim: torch.optim.Optimizer
    scaling: fsdp_step.LossScaling
    evaluator: trainstate.Evaluator
    clip: Callable[[], Any]                  # fsdp_step.Clip, or the test faults' wrapper of it
    in_backward: step_in_backward.StepInBackward | None    # optim.step_in_backward
    floor: metrics.ScaleFloorWatch
    phases: metrics.PhaseTimes
    timing: step_timing.StepTiming
    overlap: offload_overlap.Overlap | None  # the host step overlapped with the backward
    update: fsdp_update.Update               # plain, in the backward, or overlapped (fsdp_update.py)
    grad_norm: torch.Tensor | float | None   # the last step's, None where it was not computed

    def __init__(self, r: Rank, objective: Objective) -> None:
        self.r, self.objective = r, objective
        self.built: fsdp.Built | None = None

    # -- the contract's parts, in the loop's order --------------------------------------------------

    def start(self) -> None:
        common.init_process_group(self.r)

    def build(self, data: trainstate.Data) -> None:
        r = self.r
        self.data = data
        self.built = fsdp.build(r)
        self.model = self.built.model
        activation_offload.attach(r, self.model)
        self.optim = fsdp.make_optimizer(r, self.model)
        if self.built.arena is not None:
            self.built.arena.place_states(self.optim)    # Adam's states in the host arena before the first step
        self.scaling = fsdp_step.LossScaling(r)
        self.evaluator = trainstate.Evaluator(r, self.objective)

    @property
    def module(self) -> torch.nn.Module:
        return self.model

    @property
    def forward(self) -> Forward:
        return self.model

    def ready(self) -> None:
        r, cfg = self.r, self.r.cfg
        self.clip = fsdp_step.Clip(r, self.model, self.optim, self.scaling, fsdp.reduce_dtype(cfg))
        # optim.step_in_backward: each parameter steps as FSDP2 reduces its gradient (no clip, no scaler)
        self.in_backward = step_in_backward.attach(r, self.optim, adapters.trained_params(self.model))
        if r.faults.active:     # test faults, wrapped around the model, the unscale and the clip (faults.py)
            self.clip = r.faults.install_fsdp(r, self.model, self.scaling, self.clip)
        self.floor = metrics.ScaleFloorWatch(cfg)
        self.phases = metrics.PhaseTimes(r)
        # the offload view (offloaded runs); after Clip's hooks
        self.timing = step_timing.StepTiming(r, self.built.arena if self.built else None)
        step_timing.instrument_fsdp(self.model, self.timing)
        copy = self.built.compute_copy if self.built else None
        self.overlap, self.timing.overlap = offload_overlap.make(r, self.model, self.optim, self.scaling.scaler, copy)
        plain = fsdp_update.Plain(self.optim, self.scaling, self.clip, self.phases, self._refresh_compute_copy)
        self.update = fsdp_update.choose(plain, self.in_backward, self.overlap, self.timing)
        self.grad_norm = None

    def step(self, step: int, lr: float, meter: StepMeter) -> None:
        t = self.r.cfg.train
        model, optim, scaling, phases, timing = self.model, self.optim, self.scaling, self.phases, self.timing
        phases.start()
        timing.start()
        lowbit_optim.set_lr(optim, lr)
        batches = [self.data.next() for _ in range(t.grad_accum)]
        self.objective.start_step(model, batches)      # GRPO samples the window here (objective/base.py)
        for micro, batch in enumerate(batches):
            # Reduce-scatter gradients only on the last micro-batch (fewer collectives, more memory).
            model.set_requires_gradient_sync(micro == t.grad_accum - 1)
            loss = self.objective.micro_loss(model, batch)
            meter.add(loss)
            phases.mark("forward")
            if micro == t.grad_accum - 1:
                self.update.arm(step)      # an overlapped update starts each unit's host step as it lands
            scaling.backward(loss / t.grad_accum)
            phases.mark("backward")
        timing.compute_done()
        with timing.host_step():
            self.grad_norm = None
            self.grad_norm = self.update.apply()     # plain, in the backward or overlapped (fsdp_update.py)
            if self.built is not None and self.built.fp8_gather:
                float8.precompute_scales(model)      # the next all-gather's float8 scales, one all-reduce
        optim.zero_grad(set_to_none=True)
        phases.mark("copy+zero")
        timing.end()

    def figures(self) -> LineFigures:
        norm = self.grad_norm
        full = norm.full_tensor() if norm is not None and hasattr(norm, "full_tensor") else norm
        return LineFigures(grad_norm=full, loss_scale=self.scaling.value(),
                           skipped=self.scaling.skipped_since_last_line())

    def after_line(self, step: int, figures: LineFigures) -> None:
        self.floor.check(step, figures.loss_scale, figures.skipped)
        self.phases.report(step)
        self.timing.report(step)

    def evaluate(self, step: int) -> None:
        if self.evaluator.due(step):
            self.evaluator.run(self.model, step)

    def save(self, step: int, kind: SaveKind) -> None:
        fsdp_checkpoint.save(self.r, self.model, self.optim, self.scaling, self.data, step, kind)
        if step < self.r.cfg.train.steps:
            self.r.phase("training")

    def load(self) -> int:
        return fsdp_checkpoint.load(self.r, self.model, self.optim, self.scaling, self.data, self._placed)

    def _placed(self) -> None:
        """After a load: the optimizer's states where the host arena keeps them (where DCP's load left
        them, if not in place), and the compute copy of the loaded weights."""
        if self.built is not None and self.built.arena is not None:
            self.built.arena.place_states(self.optim)
        self._refresh_compute_copy()

    def export(self, step: int) -> None:
        state = self.model.state_dict()
        if self.r.cfg.split_masters and hf_export.export_dtype(self.r) == torch.float32:
            state = adam_mini.joined_state(self.model, self.optim, state)    # the fp32 masters, every bit
        src = hf_export.of_state_dict(state)
        if self.r.cfg.adapters:
            lora_export.export(self.r, src, step)
        else:
            hf_export.export(self.r, src, step)

    def release(self) -> None:
        """The host arena and the compute copy (the model and optimizer end with this object)."""
        self.built = None

    def _refresh_compute_copy(self) -> None:
        if self.built is not None and self.built.compute_copy is not None:
            self.built.compute_copy.refresh()
