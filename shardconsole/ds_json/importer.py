"""ds_config -> settings: from_ds_config, the preset overrides that describe what DeepSpeed would run
with a ds_config, with the report of which keys mapped and which did not (and why)."""

from __future__ import annotations

import copy

from typing import Any, cast

from shardconsole.settings import config as C
from shardconsole.ds_json.export import ADAM_EPS
from shardconsole.ds_json.import_report import KNOWN_UNMAPPED, ImportReport, known_hint
from shardconsole.ds_json.import_zero import read_zero

# ---------------------------------------------------------------------------------------------------
# ds_config -> settings


_TOP_KEYS = ["train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
             "gradient_clipping", "optimizer", "scheduler", "fp16", "bf16", "bfloat16", "communication_data_type",
             "zero_optimization", *KNOWN_UNMAPPED]


def from_ds_config(d: dict[str, Any], source: str = "ds_config.json", *, world_size: int = 1,
                   base: C.RunConfig | None = None, defaults: list[str] | None = None,
                   infer_ranks: bool = False
                   ) -> tuple[dict[str, dict[str, Any]], list[str], list[tuple[str, str]]]:
    """Preset overrides ({table: {key: value}}) describing what DeepSpeed would run with `d`, the lines
    that say what was mapped (one a key of the file), and (key, why) for what was not. `world_size`: ranks
    the file is run on (it turns train_batch_size into a micro-batch). `base`: the settings that "auto"
    keys keep (only used in the report). `defaults`: a list that receives one line for each setting the
    file leaves out and DeepSpeed's default decides. Raises ConfigError, naming the file and key, for
    values DeepSpeed would reject. infer_ranks (no --nproc-per-node given): a file whose three batch
    keys fit another rank count on one node sets parallel.nproc_per_node to it."""
    if not isinstance(d, dict):
        raise C.ConfigError(f"{source}: expected a JSON object at the top level")
    base = base or C.RunConfig()
    im = ImportReport(source)
    im.out["parallel"] = {"backend": "deepspeed"}
    _batch(im, d, world_size, base, infer_ranks)
    if "gradient_clipping" in d and not im.auto("gradient_clipping", d["gradient_clipping"],
                                                f"train.clip_grad_norm = {base.train.clip_grad_norm}"):
        im.set("train", "clip_grad_norm", im.number("gradient_clipping", d["gradient_clipping"]),
               "gradient_clipping")
    elif "gradient_clipping" not in d:
        im.default("train", "clip_grad_norm", 0.0, "no gradient_clipping: DeepSpeed does not clip")
    _optimizer(im, d.get("optimizer"), base)
    _scheduler(im, d.get("scheduler"), base)
    _precision(im, d, base)
    read_zero(im, d.get("zero_optimization"), base)
    for key, value in d.items():
        if key == "zero_force_ds_cpu_optimizer" and value is False and im.out.get("deepspeed", {}).get("torch_adam"):
            im.mapped.append("zero_force_ds_cpu_optimizer = false (what lets deepspeed.torch_adam run offloaded)")
        elif key in KNOWN_UNMAPPED:
            im.skip(key, KNOWN_UNMAPPED[key])
        elif key not in _TOP_KEYS:
            im.skip(key, known_hint(key, _TOP_KEYS))
    if defaults is not None:
        defaults.extend(im.defaults)
    return im.out, im.mapped, im.unmapped


def _batch(im: ImportReport, d: dict, world: int, base: C.RunConfig, infer_ranks: bool = False) -> None:
    """DeepSpeed's rule: train_batch_size = micro x accumulation x data-parallel ranks; any two give the
    third, one alone gives accumulation 1."""
    names = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
    kept = {"train_batch_size": "the preset's batch", "train_micro_batch_size_per_gpu":
            f"train.micro_batch = {base.train.micro_batch}", "gradient_accumulation_steps":
            f"train.grad_accum = {base.train.grad_accum}"}
    vals: dict[str, int | None] = {}
    for n in names:
        v = d.get(n)
        if v is None or im.auto(n, v, kept[n]):
            vals[n] = None
        else:
            vals[n] = cast(int, im.number(n, v, integer=True, lo=1))     # integer=True: an int
    tbs, micro, accum = (vals[n] for n in names)
    how = f"for {world} rank{'s' if world != 1 else ''}; --nproc-per-node changes it"
    if micro is not None and accum is not None:
        if (tbs is not None and tbs != micro * accum * world and infer_ranks and base.parallel.nnodes == 1
                and tbs % (micro * accum) == 0):
            # All three given: the file names the ranks it was written for (an exported preset's file).
            world = tbs // (micro * accum)
            im.set("parallel", "nproc_per_node", world, "train_batch_size / (micro x accumulation)",
                   "the ranks the file was written for; --nproc-per-node overrides")
        if tbs is not None and tbs != micro * accum * world:
            raise im.error("train_batch_size", f"{tbs} but train_micro_batch_size_per_gpu ({micro}) x "
                           f"gradient_accumulation_steps ({accum}) x {world} rank(s) = {micro * accum * world}; "
                           "pass --nproc-per-node for the machine the file was written for")
        im.set("train", "micro_batch", micro, "train_micro_batch_size_per_gpu")
        im.set("train", "grad_accum", accum, "gradient_accumulation_steps")
    elif micro is not None:
        if tbs is not None:
            if tbs % (micro * world):
                raise im.error("train_batch_size", f"{tbs} is not a multiple of train_micro_batch_size_per_gpu "
                               f"({micro}) x {world} rank(s); pass --nproc-per-node")
            accum = tbs // (micro * world)
            im.set("train", "micro_batch", micro, "train_micro_batch_size_per_gpu")
            im.set("train", "grad_accum", accum, "train_batch_size / (micro x ranks)", how)
        else:
            im.set("train", "micro_batch", micro, "train_micro_batch_size_per_gpu")
            if "gradient_accumulation_steps" not in d:
                im.default("train", "grad_accum", 1)
    elif tbs is not None:
        accum = accum or 1
        if tbs % (accum * world):
            raise im.error("train_batch_size", f"{tbs} is not a multiple of gradient_accumulation_steps "
                           f"({accum}) x {world} rank(s) = {accum * world}; pass --nproc-per-node for the "
                           "machine the file was written for")
        im.set("train", "micro_batch", tbs // (accum * world),
               "train_batch_size / (gradient_accumulation_steps x ranks)", how)
        if vals["gradient_accumulation_steps"] is not None:
            im.set("train", "grad_accum", accum, "gradient_accumulation_steps")
        elif "gradient_accumulation_steps" not in d:
            im.default("train", "grad_accum", 1)
    elif accum is not None:
        im.set("train", "grad_accum", accum, "gradient_accumulation_steps")


def _optimizer(im: ImportReport, opt: Any, base: C.RunConfig) -> None:
    if opt is None:
        im.skip("optimizer", "no optimizer block (the training script brings one); shardconsole trains with "
                f"AdamW at train.lr = {base.train.lr}")
        return
    if not isinstance(opt, dict):
        raise im.error("optimizer", f"expected an object, got {opt!r}")
    kind = opt.get("type")
    params = opt.get("params", {}) or {}
    if not isinstance(params, dict):
        raise im.error("optimizer.params", f"expected an object, got {params!r}")
    if not isinstance(kind, str) or kind.lower() not in ("adam", "adamw"):
        im.skip("optimizer", f"type {kind!r}: shardconsole trains with AdamW, so none of its params carry over")
        return
    adam_w = kind.lower() == "adamw" or params.get("adam_w_mode", True) is not False
    if not adam_w:
        im.skip("optimizer.params.adam_w_mode", "false (L2-regularised Adam); shardconsole trains with "
                "AdamW (decoupled weight decay)")
    t = base.train
    # What the file leaves out runs at the optimizer's own defaults: lr 1e-3 and betas (0.9, 0.999) for
    # all of DeepSpeed's Adams; weight decay 0 for FusedAdam / CPUAdam, 0.01 for torch's AdamW.
    torch_adam = params.get("torch_adam") is True
    if "torch_adam" not in params:
        im.default("deepspeed", "torch_adam", False)
    if "lr" not in params:
        im.default("train", "lr", 1e-3)
    if "betas" not in params:
        im.default("train", "beta1", 0.9)
        im.default("train", "beta2", 0.999)
    if "weight_decay" not in params:
        im.default("train", "weight_decay", 0.01 if torch_adam else 0.0)
    for key, value in params.items():
        where = f"optimizer.params.{key}"
        if key == "lr":
            if not im.auto(where, value, f"train.lr = {t.lr}"):
                im.set("train", "lr", im.number(where, value), where)
        elif key == "betas":
            if im.auto(where, value, f"train.beta1/beta2 = {t.beta1}, {t.beta2}"):
                continue
            if not (isinstance(value, list) and len(value) == 2):
                raise im.error(where, f"expected [beta1, beta2], got {value!r}")
            im.set("train", "beta1", im.number(where, value[0]), where + "[0]")
            im.set("train", "beta2", im.number(where, value[1]), where + "[1]")
        elif key == "weight_decay":
            if not im.auto(where, value, f"train.weight_decay = {t.weight_decay}"):
                im.set("train", "weight_decay", im.number(where, value), where)
        elif key == "eps":
            if im.auto(where, value, f"eps = {ADAM_EPS}"):
                continue
            if im.number(where, value) != ADAM_EPS:
                im.skip(where, f"{value}: shardconsole's AdamW uses eps = {ADAM_EPS}")
            else:
                im.mapped.append(f"{where} = {value} (shardconsole's AdamW eps)")
        elif key == "torch_adam":
            im.set("deepspeed", "torch_adam", im.boolean(where, value), where)
        elif key == "adam_w_mode":
            continue   # handled above
        elif key == "max_grad_norm":
            im.skip(where, "DeepSpeed rejects it; gradient clipping is the top-level gradient_clipping")
        else:
            im.skip(where, "not a shardconsole setting")


# DeepSpeed 0.19's defaults for the scheduler params a file leaves out (deepspeed/runtime/lr_schedules.py).
_SCHED_DEFAULTS = {"warmup_num_steps": 1000, "warmup_max_lr": 0.001, "cos_min_ratio": 0.0001}


def _scheduler(im: ImportReport, sched: Any, base: C.RunConfig) -> None:
    if sched is None:
        # DeepSpeed steps no scheduler: the optimizer's lr stays where it is for the whole run.
        im.default("train", "schedule", "constant", "no scheduler block: DeepSpeed keeps the learning rate "
                   "at optimizer.params.lr for the whole run")
        im.default("train", "warmup_steps", 0)
        return
    if not isinstance(sched, dict):
        raise im.error("scheduler", f"expected an object, got {sched!r}")
    kind = sched.get("type")
    params = sched.get("params", {}) or {}
    t = base.train
    if kind not in ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR"):
        im.skip("scheduler", f"type {kind!r}: shardconsole's schedules are warm-up + cosine or constant")
        return
    for key, value in params.items():
        where = f"scheduler.params.{key}"
        if key == "warmup_num_steps":
            if not im.auto(where, value, f"train.warmup_steps = {t.warmup_steps}"):
                im.set("train", "warmup_steps", im.number(where, value, integer=True), where)
        elif key == "total_num_steps" and kind != "WarmupLR":
            if not im.auto(where, value, f"train.steps = {t.steps}"):
                im.set("train", "steps", im.number(where, value, integer=True, lo=1), where)
        elif key == "warmup_max_lr" and kind != "WarmupCosineLR":
            if not im.auto(where, value, f"train.lr = {t.lr}"):
                # The scheduler sets the optimizer's lr, so its peak wins over optimizer.params.lr.
                im.set("train", "lr", im.number(where, value), where, "the scheduler's peak")
        elif key in ("warmup_min_lr", "warmup_min_ratio"):
            if im.auto(where, value, "a warm-up from 0"):
                continue
            if im.number(where, value) != 0:
                im.skip(where, f"{value}: shardconsole's warm-up starts from 0")
        elif key == "cos_min_ratio":
            if not im.auto(where, value, f"train.min_lr_ratio = {t.min_lr_ratio}"):
                im.set("train", "min_lr_ratio", im.number(where, value), where)
        elif key == "warmup_type":
            if value != "linear":
                im.skip(where, f"{value!r}: shardconsole's warm-up is linear")
        else:
            im.skip(where, "not a shardconsole setting")
    if "warmup_num_steps" not in params:
        im.default("train", "warmup_steps", _SCHED_DEFAULTS["warmup_num_steps"])
    if "warmup_max_lr" not in params and kind != "WarmupCosineLR":
        im.default("train", "lr", _SCHED_DEFAULTS["warmup_max_lr"], "no warmup_max_lr: DeepSpeed's default "
                   "peak, which the scheduler sets over optimizer.params.lr")
    if "cos_min_ratio" not in params and kind == "WarmupCosineLR":
        im.default("train", "min_lr_ratio", _SCHED_DEFAULTS["cos_min_ratio"])
    if "total_num_steps" not in params and kind != "WarmupLR":
        im.skip("scheduler.params.total_num_steps", f"not given; the decay spans train.steps = {t.steps}")
    if "warmup_type" not in params and kind in ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR"):
        im.skip("scheduler.params.warmup_type", "not given, so DeepSpeed warms up on a log curve; "
                "shardconsole's warm-up is linear")
    if kind == "WarmupLR":
        im.set("train", "schedule", "constant", "scheduler.type = WarmupLR", "flat after warm-up")
    elif kind == "WarmupCosineLR":
        im.set("train", "schedule", "cosine", "scheduler.type = WarmupCosineLR")
    else:
        im.set("train", "schedule", "cosine", "scheduler.type = WarmupDecayLR",
               "approximation: DeepSpeed decays linearly to 0, shardconsole on a cosine")
        im.set("train", "min_lr_ratio", 0.0, "scheduler.type = WarmupDecayLR", "decays to 0")


def _precision(im: ImportReport, d: dict, base: C.RunConfig) -> None:
    fp16, bf16 = d.get("fp16"), d.get("bf16", d.get("bfloat16"))
    bf16_key = "bf16" if "bf16" in d else "bfloat16"

    def enabled(key: str, block: Any) -> bool | None:
        if block is None:
            return False
        if not isinstance(block, dict):
            raise im.error(key, f"expected an object, got {block!r}")
        value = block.get("enabled", False)
        if im.auto(f"{key}.enabled", value, f"precision.dtype = {base.precision.dtype!r}"):
            return None
        return im.boolean(f"{key}.enabled", value)

    on16, onbf = enabled("fp16", fp16), enabled(bf16_key, bf16)
    decided = on16 is not None and onbf is not None
    if on16 and onbf:
        raise im.error("fp16.enabled", "fp16 and bf16 are both enabled; DeepSpeed allows one")
    if on16:
        im.set("precision", "dtype", "fp16", "fp16.enabled")
    elif onbf:
        im.set("precision", "dtype", "bf16", f"{bf16_key}.enabled")
    elif on16 is False and onbf is False:
        im.set("precision", "dtype", "fp32", "(no fp16/bf16 enabled)", "DeepSpeed trains in fp32")
    prec = im.out.setdefault("precision", {})
    if decided:
        # The file decides the precision, so what it leaves out runs at DeepSpeed's defaults, which
        # are shardconsole's "not set" (None: removed from the preset).
        if "communication_data_type" not in d:
            prec["reduce_dtype"] = None
        for key in C.PrecisionSettings.FP16_KEYS:
            prec[key] = None
    dtype = im.out.get("precision", {}).get("dtype", base.precision.dtype)
    for key, value in (fp16 or {}).items():
        where = f"fp16.{key}"
        if key == "enabled":
            continue
        if key in C.PrecisionSettings.FP16_KEYS:
            if dtype != "fp16":
                im.skip(where, f"an fp16 loss-scale setting, but the run's dtype is {dtype!r}")
            elif not im.auto(where, value, "DeepSpeed's default"):
                integer = key in ("initial_scale_power", "loss_scale_window", "hysteresis")
                im.set("precision", key, im.number(where, value, integer=integer), where)
        elif key == "consecutive_hysteresis":
            im.skip(where, "not a shardconsole setting (DeepSpeed's default: false)")
        elif key == "auto_cast":
            im.skip(where, "not a shardconsole setting; the model's parameters are fp16 already")
        else:
            im.skip(where, "not a shardconsole setting")
    masters = {"bf16_master_weights_and_grads", "bf16_optimizer_states"}
    for key in (bf16 or {}):
        if key in masters:
            continue
        if key != "enabled":
            im.skip(f"{bf16_key}.{key}", "not a shardconsole setting")
    flags = {k: im.boolean(f"{bf16_key}.{k}", (bf16 or {})[k]) for k in masters if k in (bf16 or {})}
    if flags.get("bf16_master_weights_and_grads"):
        im.set("precision", "master_dtype", "bf16", f"{bf16_key}.bf16_master_weights_and_grads",
               "bf16 optimizer states too" if flags.get("bf16_optimizer_states") else
               "shardconsole keeps the moments in bf16 too (8 bytes a parameter)")
    elif flags.get("bf16_optimizer_states"):
        im.skip(f"{bf16_key}.bf16_optimizer_states", "needs bf16_master_weights_and_grads (DeepSpeed refuses it alone)")
    if "communication_data_type" in d:
        v = d["communication_data_type"]
        if v in ("fp32", "fp16", "bf16"):
            im.set("precision", "reduce_dtype", v, "communication_data_type")
        else:
            im.skip("communication_data_type", f"{v!r}: shardconsole reduces in fp32, fp16 or bf16")


def merge(base: dict[str, Any], over: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """A preset dict with `over` on top; a None in `over` removes the key (back to "not set")."""
    out = copy.deepcopy(base)
    for table, values in over.items():
        section = out.setdefault(table, {})
        for key, value in values.items():
            if value is None:
                section.pop(key, None)
            else:
                section[key] = value
    return out
