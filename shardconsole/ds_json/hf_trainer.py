"""`shardconsole export --format hf-trainer`: the DeepSpeed config of a run for the Hugging Face Trainer,
with its "auto" placeholders where the Trainer fills a value from its TrainingArguments (batch sizes,
accumulation, clipping, AdamW's lr/betas/eps/weight decay, fp16/bf16), and the TrainingArguments that
give those values, so the Trainer's run trains with the preset's settings.

What stays exact is what only the ds_config says: the ZeRO stage, offload, buckets, the fp16 loss-scale
knobs and bf16 masters. There is no "scheduler" block: without one the Trainer builds its own schedule
from --lr_scheduler_type and --warmup_steps, which can say shardconsole's (linear warm-up from 0, then
cosine down to train.min_lr_ratio of the peak, or constant).
"""

from __future__ import annotations

import copy
import json
import shlex
from typing import Any

from shardconsole.settings import config as C
from shardconsole.ds_json.export import ADAM_EPS, to_ds_config

# The keys the Trainer fills (transformers' HfTrainerDeepSpeedConfig.trainer_config_process).
AUTO_TOP = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "gradient_clipping")
AUTO_OPTIMIZER = ("lr", "betas", "eps", "weight_decay")


def hf_trainer_config(cfg: C.RunConfig) -> dict[str, Any]:
    """The ds_config with "auto" where the Trainer fills it; for GPU machines (the Trainer's DeepSpeed
    runs on an accelerator), so DeepSpeed picks FusedAdam / CPUAdam unless deepspeed.torch_adam is set."""
    out = copy.deepcopy(to_ds_config(cfg, device="cuda"))
    for key in AUTO_TOP:
        out[key] = "auto"
    params = out["optimizer"]["params"]
    for key in AUTO_OPTIMIZER:
        params[key] = "auto"
    for block in ("fp16", "bf16"):
        if block in out:
            out[block]["enabled"] = "auto"
    return out


def _number(x: float) -> str:
    return repr(float(x))


def training_arguments(cfg: C.RunConfig, ds_file: str) -> list[str]:
    """The TrainingArguments flags (as `--flag value` for a script using HfArgumentParser) that fill the
    "auto" values with the preset's settings and give the Trainer shardconsole's schedule."""
    t, p = cfg.train, cfg.precision
    args = ["--deepspeed", ds_file,
            "--per_device_train_batch_size", str(t.micro_batch),
            "--gradient_accumulation_steps", str(t.grad_accum),
            "--learning_rate", _number(t.lr),
            "--adam_beta1", _number(t.beta1), "--adam_beta2", _number(t.beta2),
            "--adam_epsilon", _number(ADAM_EPS),
            "--weight_decay", _number(t.weight_decay),
            "--max_grad_norm", _number(t.clip_grad_norm),
            "--max_steps", str(t.steps),
            "--warmup_steps", str(t.warmup_steps),
            "--seed", str(t.seed),
            "--logging_steps", str(t.log_every)]
    if t.schedule == "cosine":
        args += ["--lr_scheduler_type", "cosine_with_min_lr",
                 "--lr_scheduler_kwargs", json.dumps({"min_lr_rate": t.min_lr_ratio})]
    else:
        args += ["--lr_scheduler_type", "constant_with_warmup" if t.warmup_steps else "constant"]
    if p.dtype in ("bf16", "fp16"):
        args.append(f"--{p.dtype}")
    if cfg.memory.activation_checkpointing:
        args.append("--gradient_checkpointing")
    if t.checkpoint_every:
        args += ["--save_steps", str(t.checkpoint_every)]
    return args


def training_arguments_line(cfg: C.RunConfig, ds_file: str) -> str:
    return " ".join(shlex.quote(a) for a in training_arguments(cfg, ds_file))
