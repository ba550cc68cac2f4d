"""The checks that span several settings (config.validate): impossible combinations, each blamed on the
key it names, with the source that set it. Imports no table class: it reads a RunConfig's attributes."""

from __future__ import annotations

import importlib.util
import re
from typing import TYPE_CHECKING

from shardconsole.settings import data_mix, grpo_rules
from shardconsole.settings.values import FP8_GPUS, ConfigError, fp8_emulated, parse_size

if TYPE_CHECKING:  # pragma: no cover
    from shardconsole.settings.tables import RunConfig


def validate(cfg: RunConfig, source: str = "preset", *, gpu_count: int | None = None,
             origins: dict[str, str] | None = None, rendezvous_from_launcher: bool = False) -> None:
    """Impossible combinations. gpu_count: GPUs on this machine when known (None: do not check).
    origins: "table.key" -> the source that set it (an override); the error blames the key it names
    with that source, `source` (the preset) otherwise. rendezvous_from_launcher: the job's launcher
    names node 0 (a Slurm script takes the job's first node), so nnodes > 1 needs no rdzv_endpoint."""
    def err(table: str, key: str, msg: str) -> ConfigError:
        return ConfigError(msg, source=(origins or {}).get(f"{table}.{key}", source), table=table, key=key)

    p = cfg.parallel
    _check_precision(cfg, err)
    _check_fsdp(cfg, err)
    _check_export(cfg, err)
    _check_deepspeed(cfg, err)
    _check_nodes(cfg, err, source, origins, gpu_count, rendezvous_from_launcher)
    if cfg.memory.gpu_memory_limit:
        try:
            limit = parse_size(cfg.memory.gpu_memory_limit)
        except ValueError as e:
            raise err("memory", "gpu_memory_limit", str(e)) from None
        if limit < 256 * 2**20:
            raise err("memory", "gpu_memory_limit", "is below 256 MiB; a CUDA context alone needs more")
    if cfg.memory.activation_offload and not cfg.memory.activation_checkpointing:
        raise err("memory", "activation_offload", "offloads the checkpointed layers' inputs: it needs "
                  "memory.activation_checkpointing = true")
    if cfg.memory.mlp_tile_tokens and cfg.parallel.backend == "deepspeed":
        raise err("memory", "mlp_tile_tokens", "tiles the MLP's backward, which ZeRO's gradient hooks would reduce "
                  "once per tile: FSDP2 only (parallel.backend = \"fsdp\")")
    if cfg.memory.host_memory_limit:
        try:
            host = parse_size(cfg.memory.host_memory_limit)
        except ValueError as e:
            raise err("memory", "host_memory_limit", str(e)) from None
        if host < 2**30:
            raise err("memory", "host_memory_limit", "is below 1 GiB; a rank's Python, torch and data alone need more")
    if cfg.data.source in ("text", "tokens") and not cfg.data.path:
        raise err("data", "path", f"source = {cfg.data.source!r} needs a file path")
    if cfg.data.source == "synthetic" and cfg.data.path:
        raise err("data", "source", f"is \"synthetic\" but [data] path is set ({cfg.data.path!r}): "
                  "remove the path, or set source = \"auto\" to train on the file")
    if cfg.data.eval_path and cfg.data.eval_fraction:
        raise err("data", "eval_path", "and eval_fraction are both set: hold out a fraction of "
                  "data.path or read eval_path, not both")
    if (cfg.data.eval_path or cfg.data.eval_fraction) and cfg.data.source in ("synthetic", "tokens"):
        raise err("data", "eval_path" if cfg.data.eval_path else "eval_fraction",
                  f"needs records (source = \"auto\" with a path), not source = {cfg.data.source!r}")
    if (cfg.data.eval_path or cfg.data.eval_fraction) and not cfg.data.path:
        raise err("data", "eval_path" if cfg.data.eval_path else "eval_fraction",
                  "needs training records too: set data.path")
    data_mix.check(cfg.data, source, origins, getattr(cfg.train, "objective", "sft"))
    _check_method(cfg, err)
    _check_preference(cfg, err)
    grpo_rules.check(cfg, err)
    _check_optim(cfg, err)
    _check_step_in_backward(cfg, err)
    if cfg.train.compile and p.device == "cpu":
        raise err("train", "compile", "torch.compile of the layers is for GPUs; set it to false on CPU")


def _check_precision(cfg: RunConfig, err) -> None:
    p, d, prec = cfg.parallel, cfg.deepspeed, cfg.precision
    if prec.master_dtype == "bf16" and prec.dtype != "bf16":
        raise err("precision", "master_dtype", f"\"bf16\" needs dtype = \"bf16\" (dtype is {prec.dtype!r})")
    if prec.master_dtype == "bf16" and p.backend == "deepspeed" and d.stage == 0:
        raise err("precision", "master_dtype", "\"bf16\" needs ZeRO stage 1, 2 or 3 with DeepSpeed (stage is 0)")
    _check_fp8(cfg, err)
    if prec.dtype != "fp16":
        for key in prec.FP16_KEYS:
            if getattr(prec, key) is not None:
                raise err("precision", key, f"is an fp16 loss-scale setting but dtype is {prec.dtype!r}; "
                          "remove it or set precision.dtype = \"fp16\"")


def _check_fp8(cfg: RunConfig, err) -> None:
    """precision.fp8: torchao's float8 linears under FSDP2, full fine-tuning in bf16, on a GPU. The GPU's
    generation is checked by session/gpu_checks.check_fp8 (this machine) and by the ranks (theirs)."""
    prec = cfg.precision
    if prec.fp8 == "none":
        return
    what = f"\"{prec.fp8}\" (float8 linears)"
    if cfg.parallel.device == "cpu" and not fp8_emulated():
        raise err("precision", "fp8", f"{what} needs a CUDA GPU with FP8 tensor cores ({FP8_GPUS}) and "
                  "parallel.device is \"cpu\": set fp8 = \"none\"")
    if cfg.train.method != "full":
        raise err("precision", "fp8", f"{what} is for full fine-tuning; a {cfg.train.method} base is frozen "
                  f"({'4-bit' if cfg.train.method == 'qlora' else 'bf16'}) and its adapters are too small to gain: "
                  "set train.method = \"full\" or fp8 = \"none\"")
    if prec.dtype != "bf16":
        raise err("precision", "fp8", f"{what} computes beside bf16 and precision.dtype is \"{prec.dtype}\": "
                  "set dtype = \"bf16\"")
    if importlib.util.find_spec("torchao") is None:
        raise err("precision", "fp8", f"{what} needs torchao, which is not installed: "
                  "pip install 'shardconsole[lowbit]' (or torchao)")


def _check_fsdp(cfg: RunConfig, err) -> None:
    p, f = cfg.parallel, cfg.fsdp
    if p.backend == "fsdp":
        if f.cpu_offload and f.sharding == "no_shard":
            raise err("fsdp", "cpu_offload", "needs sharded parameters; with sharding = \"no_shard\" "
                      "nothing is offloaded: use full_shard or shard_grad_op")
        if f.sharding == "hybrid_shard" and p.nnodes < 2 and p.nproc_per_node < 2:
            raise err("fsdp", "sharding", "hybrid_shard needs more than one rank")
        if p.launcher == "deepspeed":
            raise err("parallel", "launcher", "the deepspeed launcher starts DeepSpeed runs; "
                      "FSDP runs use \"torchrun\"")


def _check_export(cfg: RunConfig, err) -> None:
    """train.export_dir: the live state, on both engines, full or LoRA (merged, or peft's adapters)."""
    t = cfg.train
    if t.export_adapter and t.method != "lora":
        raise err("train", "export_adapter", f"writes a LoRA run's adapters; train.method is \"{t.method}\""
                  + (" (QLoRA: run `shardconsole export-model RUN -o DIR --adapter`)" if t.method == "qlora" else ""))
    if t.export_gguf and not t.export_dir:
        raise err("train", "export_gguf", "is written into train.export_dir, which is empty; set it (a new folder)")
    if t.export_gguf and t.export_adapter:
        raise err("train", "export_gguf", "holds the merged model; train.export_adapter writes the adapters alone "
                  "(leave one of them out)")
    if t.export_dir and t.method == "qlora":
        # The live base is bitsandbytes' 4-bit NF4: export-model merges into the model folder's own weights.
        raise err("train", "export_dir", "is not written from a QLoRA run's 4-bit base; leave it empty and run "
                  "`shardconsole export-model RUN -o DIR` (merged into the model folder's weights, or --adapter)")


def _check_deepspeed(cfg: RunConfig, err) -> None:
    p, d = cfg.parallel, cfg.deepspeed
    if p.backend == "deepspeed":
        if d.offload_param != "none" and d.stage != 3:
            raise err("deepspeed", "offload_param", f"needs stage = 3 (stage is {d.stage}); "
                      "parameters are partitioned only in stage 3")
        if d.offload_optimizer != "none" and d.stage == 0:
            raise err("deepspeed", "offload_optimizer", "needs stage 1, 2 or 3 (stage is 0)")
        for key in ("offload_optimizer", "offload_param"):
            if getattr(d, key) == "nvme" and not d.nvme_path:
                raise err("deepspeed", "nvme_path", f"{key} = \"nvme\" needs nvme_path, a folder on a fast disk")
        if d.offload_param == "nvme" and d.offload_optimizer == "none":
            pass  # allowed by DeepSpeed
        if d.offload_optimizer == "nvme" and d.stage != 3:
            # Stages 1-2 have no NVMe swapper: DeepSpeed would quietly keep the states in host memory.
            raise err("deepspeed", "offload_optimizer", f"\"nvme\" needs stage = 3 (ZeRO-Infinity; stage is "
                      f"{d.stage}); stages 1 and 2 offload to \"cpu\" only")
        if p.launcher == "deepspeed" and p.nnodes > 1:
            # The deepspeed runner reaches other nodes through a hostfile and ssh/pdsh; torchrun's c10d
            # rendezvous starts DeepSpeed ranks on every node from the same command.
            raise err("parallel", "launcher", f"the deepspeed launcher needs a hostfile and ssh for nnodes = "
                      f"{p.nnodes}; use launcher = \"torchrun\" (it runs DeepSpeed ranks on every node)")


def _check_nodes(cfg: RunConfig, err, source: str, origins: dict[str, str] | None, gpu_count: int | None,
                 rendezvous_from_launcher: bool) -> None:
    """The nodes, the rendezvous and the ranks against this machine's GPUs."""
    p = cfg.parallel
    if p.nnodes > 1 and not p.rdzv_endpoint and not rendezvous_from_launcher and p.rendezvous != "slurm":
        # Blamed on whatever set nnodes (`--set parallel.nnodes=4` on a one-node preset), at the
        # rendezvous field, which is what is missing.
        raise ConfigError(f"nnodes = {p.nnodes} needs the host:port of node 0: set parallel.rdzv_endpoint "
                          "(e.g. \"node0:29400\"), or use --slurm, whose script takes the job's first node",
                          source=(origins or {}).get("parallel.nnodes", (origins or {}).get(
                              "parallel.rdzv_endpoint", source)), table="parallel", key="rdzv_endpoint")
    if p.rdzv_endpoint and not re.match(r"^[A-Za-z0-9_.\-\[\]:]+:\d{1,5}$", p.rdzv_endpoint):
        raise err("parallel", "rdzv_endpoint", f"{p.rdzv_endpoint!r} is not host:port")
    if p.node_rank >= p.nnodes:
        raise err("parallel", "node_rank", f"{p.node_rank} but nnodes is {p.nnodes}: use 0..{p.nnodes - 1}")
    if p.device == "cuda" and gpu_count == 0:
        raise err("parallel", "device", "is \"cuda\" but this machine has no CUDA GPU; use \"cpu\" or \"auto\"")
    if gpu_count and p.device != "cpu" and p.nproc_per_node > gpu_count:
        raise err("parallel", "nproc_per_node", f"{p.nproc_per_node} ranks but this machine has "
                  f"{gpu_count} GPU(s): use at most {gpu_count}, or device = \"cpu\"")


def _check_method(cfg: RunConfig, err) -> None:
    """train.method and [lora]: what peft and bitsandbytes can run, known before launch."""
    t, lo, p = cfg.train, cfg.lora, cfg.parallel
    if t.method == "full":
        return
    if not lo.target_list():
        raise err("lora", "target_modules", "is empty: all-linear, or comma-separated module names such as "
                  "q_proj,v_proj")
    if t.method != "qlora":
        return
    if p.device == "cpu":
        raise err("train", "method", "\"qlora\" keeps the frozen base in 4-bit NF4 through bitsandbytes, which "
                  "needs CUDA; parallel.device is \"cpu\": use method = \"lora\" there")
    if p.backend == "deepspeed" and cfg.deepspeed.stage == 3:
        raise err("train", "method", "\"qlora\" with DeepSpeed needs stage 0, 1 or 2 (the 4-bit base is "
                  "replicated, only the adapters are partitioned); stage is 3")
    if cfg.precision.dtype != "bf16":
        raise err("train", "method", f"\"qlora\" computes in bf16 (bnb_4bit_compute_dtype); precision.dtype "
                  f"is {cfg.precision.dtype!r}")


def _check_preference(cfg: RunConfig, err) -> None:
    """train.objective dpo / orpo and [preference] (backends/objective/preference.py): pairs of records, and
    the keys each loss reads; a key the chosen loss would ignore is refused, not silently dropped."""
    t, pref = cfg.train, getattr(cfg, "preference", None)
    if pref is None:
        return
    objective = getattr(t, "objective", "sft")
    if objective in ("sft", "grpo"):
        return
    d = cfg.data
    if d.source in ("synthetic", "tokens") or not d.path:
        records = "prompt, completion and label" if objective == "kto" else "prompt, chosen and rejected"
        raise err("train", "objective", f"\"{objective}\" trains on rated answers: set data.path to records with "
                  f"{records} (strings or message lists); synthetic tokens and token files have none")
    if pref.label_smoothing and (objective in ("orpo", "kto") or (objective == "dpo" and pref.loss == "ipo")):
        what = {"orpo": "ORPO", "kto": "KTO"}.get(objective, "the ipo loss")
        # TRL's IPO and ORPO ignore it (trl 1.16, trainer/dpo_trainer.py, experimental/orpo): refused, not ignored
        raise err("preference", "label_smoothing", f"is for sigmoid DPO and SimPO; {what} has no label "
                  "smoothing: set it to 0")


def _check_optim(cfg: RunConfig, err) -> None:
    """optim.name: torchao's low-bit AdamW runs in the FSDP2 ranks only (DeepSpeed builds its own
    optimizer from the ds_config), and needs torchao installed (`pip install shardconsole[lowbit]`)."""
    name = getattr(getattr(cfg, "optim", None), "name", "adamw")
    if name == "adamw":
        return
    if name == "adam-mini":
        _check_adam_mini(cfg, err)
        return
    if cfg.parallel.backend == "deepspeed":
        raise err("optim", "name", f"{name!r} is torchao's optimizer, for the FSDP2 backend; DeepSpeed "
                  "builds its own Adam: use name = \"adamw\" or parallel.backend = \"fsdp\"")
    if cfg.fsdp.cpu_offload:
        # backends/offload/pinned_arena.py lays out fp32-shaped Adam states on the host; low-bit states are the
        # strategy for models that fit the GPU without offload.
        raise err("optim", "name", f"{name!r} is for runs without offload (fsdp.cpu_offload is true): use "
                  "name = \"adamw\" with offload, or cpu_offload = false")
    if cfg.precision.master_dtype == "bf16" and cfg.precision.master_rounding != "nearest":
        raise err("optim", "name", f"{name!r} rounds bf16 weights stochastically itself; "
                  f"precision.master_rounding = {cfg.precision.master_rounding!r} is for adamw: set it to \"nearest\"")
    if importlib.util.find_spec("torchao") is None:
        raise err("optim", "name", f"{name!r} needs torchao, which is not installed: "
                  "pip install 'shardconsole[lowbit]' (or torchao)")


def _check_adam_mini(cfg: RunConfig, err) -> None:
    """optim.name = "adam-mini" (backends/optim/adam_mini.py): FSDP2's ranks step it; its weights round
    themselves (a remainder for fp32 masters, stochastic for bf16 ones)."""
    if cfg.parallel.backend == "deepspeed":
        raise err("optim", "name", "'adam-mini' is for the FSDP2 backend (its ranks step it); DeepSpeed builds its "
                  "own Adam: use name = \"adamw\" or parallel.backend = \"fsdp\"")
    p = cfg.precision
    if p.master_dtype == "bf16" and p.master_rounding == "kahan":
        raise err("precision", "master_rounding", "'kahan' is for adamw; adam-mini keeps fp32 masters exactly "
                  "with master_dtype = \"fp32\" (6 bytes a parameter, against kahan's 10): set master_dtype = "
                  "\"fp32\", or master_rounding = \"stochastic\" for bf16 masters (4 bytes)")
    if p.master_dtype == "bf16" and p.master_rounding == "nearest":
        # named on optim.name: nearest is the default, so the rounding was usually never set by the user
        raise err("optim", "name", "'adam-mini' rounds bf16 masters stochastically (round to nearest loses "
                  "every update below half a bf16 step): set precision.master_rounding = \"stochastic\", or "
                  "precision.master_dtype = \"fp32\" (exact fp32 masters in 6 bytes a parameter)")


def _check_step_in_backward(cfg: RunConfig, err) -> None:
    """optim.step_in_backward (backends/optim/step_in_backward.py): each parameter steps as FSDP2 reduces its
    gradient, before the other gradients exist; what needs them all first cannot run."""
    if not getattr(getattr(cfg, "optim", None), "step_in_backward", False):
        return
    t, say = cfg.train, "optim.step_in_backward = true steps each parameter in the backward pass"
    if cfg.parallel.backend == "deepspeed":
        raise err("optim", "step_in_backward", f"is for the FSDP2 backend (DeepSpeed's engine steps itself): "
                  "set it to false or parallel.backend = \"fsdp\"")
    if cfg.fsdp.cpu_offload:
        raise err("optim", "step_in_backward", "is for runs without offload (fsdp.cpu_offload is true): "
                  "set it to false, or cpu_offload = false")
    if t.grad_accum > 1:
        raise err("optim", "step_in_backward", f"needs train.grad_accum = 1 (it is {t.grad_accum}): {say}, "
                  "once per micro-batch")
    if t.clip_grad_norm > 0:
        raise err("optim", "step_in_backward", f"needs train.clip_grad_norm = 0 (it is {t.clip_grad_norm:g}): "
                  f"{say}, before the global norm is known")
    if cfg.precision.dtype == "fp16":
        raise err("optim", "step_in_backward", "needs precision.dtype bf16 or fp32: fp16's loss scaler skips "
                  "a step on an overflow found after the parameters would have stepped")
