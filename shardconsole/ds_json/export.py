"""Settings -> ds_config: to_ds_config, the exact dict the DeepSpeed rank passes to deepspeed.initialize,
and the zero_optimization keys and DeepSpeed defaults that the import (importer.py) shares.

The choices that shape the JSON are in the package docstring (shardconsole/ds_json/__init__.py).
"""

from __future__ import annotations

from typing import Any

from shardconsole.settings import config as C

ADAM_EPS = 1e-8   # torch's and DeepSpeed's AdamW default; shardconsole has no eps setting

# DeepSpeed's zero_optimization keys that are shardconsole settings of the same name and meaning.
ZERO_KEYS = ("overlap_comm", "contiguous_gradients", "reduce_scatter", "allgather_partitions",
             "reduce_bucket_size", "allgather_bucket_size", "stage3_prefetch_bucket_size",
             "stage3_param_persistence_threshold", "stage3_max_live_parameters", "stage3_max_reuse_distance")
ZERO_BOOL_KEYS = {"overlap_comm", "contiguous_gradients", "reduce_scatter", "allgather_partitions"}

# DeepSpeed 0.19's defaults for those keys, used when an imported file leaves a key out (the import
# describes what DeepSpeed would run with that file). overlap_comm: None = "true for stage 3 only".
DS_ZERO_DEFAULTS: dict[str, Any] = {
    "stage": 0, "overlap_comm": None, "contiguous_gradients": True, "reduce_scatter": True,
    "allgather_partitions": True, "reduce_bucket_size": 500_000_000, "allgather_bucket_size": 500_000_000,
    "stage3_prefetch_bucket_size": 50_000_000, "stage3_param_persistence_threshold": 100_000,
    "stage3_max_live_parameters": 1_000_000_000, "stage3_max_reuse_distance": 1_000_000_000,
}
DS_OFFLOAD_PIN_DEFAULT = True


# ---------------------------------------------------------------------------------------------------
# Settings -> ds_config

def device_type(cfg: C.RunConfig) -> str:
    """'cpu' or 'cuda' as the ranks would decide it when the machine is unknown (auto = a GPU box)."""
    return "cpu" if cfg.parallel.device == "cpu" else "cuda"


def uses_torch_adam(cfg: C.RunConfig, device: str | None = None) -> bool:
    """torch's AdamW instead of DeepSpeed's FusedAdam / CPUAdam (see the module docstring)."""
    d = cfg.deepspeed
    device = device or device_type(cfg)
    return d.torch_adam or (device == "cpu" and d.offload_optimizer == "none")


def _offload_block(d: C.DeepspeedSettings, where: str) -> dict[str, Any]:
    block: dict[str, Any] = {"device": where}
    if where == "nvme":
        block["nvme_path"] = d.nvme_path
    block["pin_memory"] = d.pin_memory
    return block


def to_ds_config(cfg: C.RunConfig, *, device: str | None = None) -> dict[str, Any]:
    """The ds_config of a run. `device`: 'cpu' or 'cuda' as resolved by the ranks (None: from the
    settings, with device = "auto" counted as a GPU)."""
    t, d, prec = cfg.train, cfg.deepspeed, cfg.precision
    device = device or device_type(cfg)
    params: dict[str, Any] = {"lr": t.lr, "betas": [t.beta1, t.beta2], "eps": ADAM_EPS,
                              "weight_decay": t.weight_decay}
    torch_adam = uses_torch_adam(cfg, device)
    if torch_adam:
        params["torch_adam"] = True
    out: dict[str, Any] = {
        "train_batch_size": t.micro_batch * t.grad_accum * cfg.world_size,
        "train_micro_batch_size_per_gpu": t.micro_batch,
        "gradient_accumulation_steps": t.grad_accum,
        "gradient_clipping": t.clip_grad_norm,
        "optimizer": {"type": "AdamW", "params": params},
    }
    if prec.dtype == "fp16":
        fp16: dict[str, Any] = {"enabled": True}
        for key in prec.FP16_KEYS:
            if getattr(prec, key) is not None:
                fp16[key] = getattr(prec, key)
        out["fp16"] = fp16
    elif prec.dtype == "bf16":
        out["bf16"] = {"enabled": True}
        if prec.master_dtype == "bf16":
            # bf16 master weights, gradients and Adam moments (DeepSpeed >= 0.18); with offload the
            # engine builds CPUAdam with fp32_optimizer_states=False to match.
            out["bf16"].update({"bf16_master_weights_and_grads": True, "bf16_optimizer_states": True})
    if prec.reduce_dtype is not None:
        out["communication_data_type"] = prec.reduce_dtype
    zero: dict[str, Any] = {"stage": d.stage}
    if d.offload_optimizer != "none":
        zero["offload_optimizer"] = _offload_block(d, d.offload_optimizer)
    if d.offload_param != "none":
        zero["offload_param"] = _offload_block(d, d.offload_param)
    for key in ZERO_KEYS:
        zero[key] = getattr(d, key)
    out["zero_optimization"] = zero
    if torch_adam and d.offload_optimizer != "none":
        # DeepSpeed refuses a non-DeepSpeed optimizer with offload unless told that this is intended.
        out["zero_force_ds_cpu_optimizer"] = False
    return out
