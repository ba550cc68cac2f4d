"""The DeepSpeed ZeRO engine (contract.Engine): deepspeed.py builds the ops and the model, deepspeed.initialize
wraps them; this steps, saves (ds_checkpoint.py), resumes and exports. One optimizer step reads top to
bottom in `step`.

The ds_config comes from shardconsole.ds_json.to_ds_config, the same function behind `shardconsole export
--format deepspeed`, so the exported file is the config the run used. The loop owns the learning-rate
schedule and the engine sets the rate on the optimizer's param groups before each step.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from shardconsole import ds_json
from shardconsole.backends.checkpoint import hf_export, lora_export
from shardconsole.backends.checkpoint.checkpoints import SaveKind
from shardconsole.backends.checkpoint.hf_export import FullTensors
from shardconsole.backends.engine import deepspeed as ds, ds_checkpoint, trainstate
from shardconsole.backends.engine.contract import LineFigures
from shardconsole.backends.model import activation_offload, adapters, modeling
from shardconsole.backends.objective.base import Forward, Objective
from shardconsole.backends.observe import metrics, step_timing
from shardconsole.backends.observe.metrics import StepMeter
from shardconsole.backends.rank.common import Rank


class DeepSpeedEngine:
    # Everything the engine holds, declared here: start() sets ds_cfg, build() data, model, engine and
    # evaluator, ready() timing and fp16 (the loop calls them in that order, before any step, save or load).
    ds_cfg: dict
    data: trainstate.Data
    model: modeling.CausalLMLoss
    engine: Any                              # deepspeed.DeepSpeedEngine (None until build)
    evaluator: trainstate.Evaluator
    timing: step_timing.StepTiming
    fp16: bool                               # precision.dtype = "fp16": the engine's loss scaler runs

    def __init__(self, r: Rank, objective: Objective) -> None:
        self.r, self.objective = r, objective
        self.engine = None

    def start(self) -> None:
        r = self.r
        # DeepSpeed 0.19 calls these deprecated torch names on every ZeRO collective: one warning line per
        # step in each rank's log, with nothing for the user to do.
        warnings.filterwarnings("ignore", category=FutureWarning,
                                message=r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated")
        ds.prepare_env(r)
        self.ds_cfg = ds_json.to_ds_config(r.cfg, device=r.device.type)
        ds.build_ops(r, self.ds_cfg)        # the process group, then DeepSpeed's on it

    def build(self, data: trainstate.Data) -> None:
        import deepspeed
        r, cfg = self.r, self.r.cfg
        self.data = data
        if cfg.precision.dtype == "fp16" and not r.is_cuda:
            ds.allow_cpu_fp16(r)
        if cfg.precision.master_dtype == "bf16" and cfg.precision.master_rounding != "nearest" and r.rank == 0:
            r.event("warning", f"precision.master_rounding = {cfg.precision.master_rounding!r} is applied by the "
                    "FSDP2 backend's AdamW; DeepSpeed's bf16 masters round to nearest (updates below bf16's "
                    "resolution are lost)")
        hf_cfg = modeling.hf_config(r.spec, cfg)
        reference = modeling.Reference(hf_cfg)      # once: the random init's vectors and the buffers below
        self.model = ds.build(r, self.ds_cfg, hf_cfg, reference)
        activation_offload.attach(r, self.model)
        self.engine, _, _, _ = deepspeed.initialize(model=self.model, model_parameters=adapters.trained_params(self.model),
                                                    config=self.ds_cfg)
        # zero.Init (stage 3) and the engine's module.half()/bfloat16() (stages 0-2) cast the rotary
        # frequencies to the compute dtype; rebuilt in fp32 they match the FSDP backend's (and the model's).
        modeling.reset_buffers_(self.model, reference, r.device)
        if cfg.train.compile and not cfg.compiles_layers:
            # Stage 3 with hooks inside each layer: DeepSpeed's own torch.compile integration (docs/MEASURED.md
            # measured it slower than eager on one H200; kept because the setting asks for it).
            self.engine.compile()
            r.event("info", "train.compile with deepspeed.stage3_layer_gather = false: engine.compile() "
                            "(DeepSpeed's torch.compile integration, slower than compiling each layer)")
        self.evaluator = trainstate.Evaluator(r, self.objective)

    @property
    def module(self) -> torch.nn.Module:
        module: torch.nn.Module = self.engine.module
        return module

    @property
    def forward(self) -> Forward:
        forward: Forward = self.engine
        return forward

    def load(self) -> int:
        return ds_checkpoint.resume(self.r, self.engine, self.data)

    def ready(self) -> None:
        r = self.r
        self.fp16 = r.cfg.precision.dtype == "fp16"
        self.timing = step_timing.StepTiming(r)        # the offload view (offloaded runs)
        step_timing.instrument_deepspeed(self.engine, self.timing)
        if r.faults.active:         # test faults, hooked on the engine (faults.py)
            r.faults.install(r, self.engine, self.model)

    def step(self, step: int, lr: float, meter: StepMeter) -> None:
        r, engine, timing = self.r, self.engine, self.timing
        timing.start()
        for group in engine.optimizer.param_groups:
            group["lr"] = lr
        batches = [self.data.next() for _ in range(r.cfg.train.grad_accum)]
        self.objective.start_step(engine, batches)      # GRPO samples the window here (objective/base.py)
        for batch in batches:
            loss = self.objective.micro_loss(engine, batch)
            meter.add(loss)
            engine.backward(loss)        # DeepSpeed divides by grad_accum and applies the loss scale
            timing.compute_done()
            try:
                with timing.host_step():
                    engine.step()        # an optimizer step only at the accumulation boundary
            except Exception as e:
                if "loss scale already at minimum" in str(e):
                    raise metrics.LossScaleFloorError(
                        f"fp16 overflow at the minimum loss scale "
                        f"({r.cfg.precision.fp16_value('min_loss_scale')}) at step {step}") from e
                raise
        timing.end()
        if self.fp16 and not engine.was_step_applied():
            r.event("overflow", f"step {step} skipped: gradient overflow in fp16; loss scale now "
                                f"{ds.loss_scale(engine):g}")

    def figures(self) -> LineFigures:
        engine = self.engine
        return LineFigures(grad_norm=engine.get_global_grad_norm(),
                           loss_scale=ds.loss_scale(engine) if self.fp16 else None, skipped=engine.skipped_steps)

    def after_line(self, step: int, figures: LineFigures) -> None:
        self.timing.report(step)

    def evaluate(self, step: int) -> None:
        if self.evaluator.due(step):
            self.evaluator.run(self.engine, step)

    def save(self, step: int, kind: SaveKind) -> None:
        """Always a full checkpoint, SaveKind.MODEL too: DeepSpeed keeps the master weights in the
        optimizer's partitions, which export-model merges from these files (so the final save of
        train.save_final = "model" is a resumable checkpoint here)."""
        ds_checkpoint.save(self.r, self.engine, self.data, step)

    def export(self, step: int) -> None:
        src = full_tensors(self.engine.module)
        if self.r.cfg.adapters:
            lora_export.export(self.r, src, step)
        else:
            hf_export.export(self.r, src, step)

    def release(self) -> None:
        if self.engine is not None:
            self.engine.destroy()


def full_tensors(module: torch.nn.Module) -> FullTensors:
    """The module's tensors gathered whole: a trained parameter from its fp32 master (ZeRO's optimizer
    partitions, any stage; safe_get_full_fp32_param is a collective), a frozen one (or one DeepSpeed
    keeps no master of) from the parameter itself, gathered under ZeRO-3."""
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param
    state = module.state_dict(keep_vars=True)
    names = [k for k in state if k.startswith(hf_export.PREFIX)]

    def shape(t: torch.Tensor) -> tuple[int, ...]:
        return tuple(getattr(t, "ds_shape", t.shape))

    def full(name: str) -> torch.Tensor:
        p = state[hf_export.PREFIX + name]
        if isinstance(p, torch.nn.Parameter) and p.requires_grad:
            master = safe_get_full_fp32_param(p)
            if master is not None:
                return master
        with deepspeed.zero.GatheredParameters([p] if hasattr(p, "ds_id") else []):
            return p.detach().clone()

    entries = [(k[len(hf_export.PREFIX):], shape(state[k]), state[k].dtype) for k in names]
    return FullTensors(entries, full)
