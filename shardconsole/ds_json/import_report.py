"""What an import reports: the ds_config keys that have no shardconsole setting (and why), and ImportReport,
which collects the overrides, the lines that say what mapped, and typed reads whose errors name the key."""

from __future__ import annotations

import difflib
from typing import Any

from shardconsole.settings import config as C

# Keys we read but that have no shardconsole setting, with the reason shown to the user.
KNOWN_UNMAPPED = {
    "steps_per_print": "shardconsole prints its own step lines (train.log_every)",
    "wall_clock_breakdown": "shardconsole streams its own timings",
    "flops_profiler": "not used; the step line carries MFU",
    "tensorboard": "shardconsole streams metrics to runs/<id>/metrics.jsonl",
    "wandb": "shardconsole streams metrics to runs/<id>/metrics.jsonl",
    "csv_monitor": "shardconsole streams metrics to runs/<id>/metrics.jsonl",
    "comms_logger": "not a shardconsole setting",
    "activation_checkpointing": "configures DeepSpeed's own checkpointing API, which the model does not "
                                "call; use memory.activation_checkpointing",
    "zero_allow_untested_optimizer": "shardconsole always uses AdamW",
    "zero_force_ds_cpu_optimizer": "follows from deepspeed.torch_adam and the offload settings",
    "aio": "NVMe I/O tuning is not a shardconsole setting; DeepSpeed's defaults apply",
    "amp": "NVIDIA apex AMP is not supported; use precision.dtype",
    "prescale_gradients": "not a shardconsole setting",
    "gradient_predivide_factor": "not a shardconsole setting",
    "sparse_gradients": "not a shardconsole setting",
    "dump_state": "not a shardconsole setting",
    "memory_breakdown": "not a shardconsole setting",
    "data_types": "not a shardconsole setting",
    "compile": "use train.compile",
}
ZERO_UNMAPPED = {
    "sub_group_size": "not a shardconsole setting; DeepSpeed's default (1e9) applies",
    "stage3_gather_16bit_weights_on_model_save": "checkpoints are DeepSpeed's sharded ones (turn one into a "
                                                 "full model with the zero_to_fp32.py saved next to it)",
    "stage3_gather_fp16_weights_on_model_save": "checkpoints are DeepSpeed's sharded ones (turn one into a "
                                                "full model with the zero_to_fp32.py saved next to it)",
    "round_robin_gradients": "not a shardconsole setting",
    "load_from_fp32_weights": "not a shardconsole setting",
    "elastic_checkpoint": "not a shardconsole setting",
    "ignore_unused_parameters": "not a shardconsole setting",
    "zero_hpz_partition_size": "ZeRO++ hpZ is not a shardconsole setting",
    "zero_quantized_weights": "ZeRO++ quantization is not a shardconsole setting",
    "zero_quantized_gradients": "ZeRO++ quantization is not a shardconsole setting",
    "memory_efficient_linear": "not a shardconsole setting",
}
OFFLOAD_UNMAPPED = ("buffer_count", "buffer_size", "max_in_cpu", "pipeline_read", "pipeline_write",
                     "fast_init", "ratio", "pipeline")


class ImportReport:
    """Collects overrides and the report of one import."""

    def __init__(self, source: str) -> None:
        self.source = source
        self.out: dict[str, dict[str, Any]] = {}
        self.mapped: list[str] = []
        self.unmapped: list[tuple[str, str]] = []
        self.defaults: list[str] = []

    def set(self, table: str, key: str, value: Any, from_key: str, note: str = "") -> None:
        self.out.setdefault(table, {})[key] = value
        self.mapped.append(f"{from_key} -> {table}.{key} = {value!r}" + (f" ({note})" if note else ""))

    def default(self, table: str, key: str, value: Any, why: str = "") -> None:
        """A key the file leaves out: DeepSpeed's default is what runs, so it is what the preset gets."""
        self.out.setdefault(table, {})[key] = value
        self.defaults = [line for line in self.defaults if not line.startswith(f"{table}.{key} = ")]
        self.defaults.append(f"{table}.{key} = {value!r}" + (f" ({why})" if why else ""))

    def skip(self, key: str, why: str) -> None:
        self.unmapped.append((key, why))

    def error(self, key: str, msg: str) -> C.ConfigError:
        return C.ConfigError(f"{key}: {msg}", source=self.source)

    # --- typed reads: None for "auto" (reported), a ConfigError for a wrong type --------------
    def auto(self, key: str, value: Any, kept: str) -> bool:
        if isinstance(value, str) and value.strip().lower() == "auto":
            self.skip(key, f"\"auto\" (filled in by the Hugging Face Trainer at run time); keeps {kept}")
            return True
        return False

    def number(self, key: str, value: Any, *, integer: bool = False, lo: float | None = 0) -> float | int:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        if ok and integer and isinstance(value, float) and not value.is_integer():
            ok = False
        if not ok:
            kind = "an integer" if integer else "a number"
            raise self.error(key, f"expected {kind}, got {value!r}")
        if lo is not None and value < lo:
            raise self.error(key, f"{value!r} is below {lo}")
        return int(value) if integer else float(value)

    def boolean(self, key: str, value: Any) -> bool:
        if not isinstance(value, bool):
            raise self.error(key, f"expected true or false, got {value!r}")
        return value


def known_hint(key: str, options: list[str]) -> str:
    m = difflib.get_close_matches(key, options, n=1, cutoff=0.75)
    return f"unknown key (did you mean {m[0]!r}?)" if m else "not a shardconsole setting"
