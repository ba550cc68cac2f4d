"""The values of settings, apart from the tables that hold them: ConfigError (bad input, as data),
byte sizes ("24GiB"), and checking one value against a field's type. Standard library only; config.py
re-exports every public name, so `config.ConfigError` and `config.parse_size` stay the names to use."""

from __future__ import annotations

import difflib
import math
import re
import sys
import types
import typing
from typing import Any, Literal, get_args, get_origin

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


# precision.fp8 through torchao's emulation (the float8 casts and scales, the matmuls in high precision):
# on any device, so the FP8 path trains, checkpoints and resumes in CI's CPU runs; slower than bf16.
FP8_EMULATE_ENV = "SHARDCONSOLE_FP8_EMULATE"
# The GPUs precision.fp8 runs on, for the checks before launch (settings.rules, session.gpu_checks) and the
# ranks' own (backends/model/float8.py): Ada, Hopper and Blackwell, the first with FP8 tensor cores.
FP8_MIN_CAPABILITY = (8, 9)
FP8_GPUS = "compute capability 8.9+: RTX 4090, L40S, H100"


def fp8_emulated(environ: Any = None) -> bool:
    from shardconsole.envvars import read
    return bool(read(FP8_EMULATE_ENV, environ))


class ConfigError(ValueError):
    """Bad input in a preset or an override. str() is the one line shown to the user.

    As data: `source` (where the value came from: a preset file, `--set table.key`, `console: [table]
    key`), `table` and `key` (None when the error is not about one setting) and `reason` (what is wrong
    and what is allowed). The console marks a field from table/key, never from the text."""

    def __init__(self, reason: str, *, source: str = "", table: str | None = None, key: str | None = None) -> None:
        self.reason, self.source, self.table, self.key = reason, source, table, key
        super().__init__(self._line())

    @property
    def path(self) -> str | None:
        """"table.key" of the setting at fault, or None."""
        return f"{self.table}.{self.key}" if self.table and self.key else None

    def _line(self) -> str:
        if not self.source:
            return self.reason
        if self.path is None or names_key(self.source):
            return f"{self.source}: {self.reason}"
        return f"{self.source}: [{self.table}] {self.key}: {self.reason}"

    def __reduce__(self) -> Any:   # keeps the fields across pickling (multiprocessing, pytest-xdist)
        return (_rebuild_error, (self.reason, self.source, self.table, self.key))


def _rebuild_error(reason: str, source: str, table: str | None, key: str | None) -> ConfigError:
    return ConfigError(reason, source=source, table=table, key=key)


def override_source(origin: str, table: str, key: str) -> str:
    """The source of one override: `--set table.key` from the command line, `console: [table] key` from a
    console field. Such a source names its key, so the error line does not repeat it."""
    return f"--set {table}.{key}" if origin == "--set" else f"{origin}: [{table}] {key}"


def names_key(source: str) -> bool:
    return source.startswith("--set ") or source.startswith("console: [")


# ---------------------------------------------------------------------------------------------------
# Names users bring from other tools (HF Trainer's TrainingArguments, DeepSpeed's ds_config, torchrun,
# Megatron / nanoGPT scripts), each with the shardconsole setting that means the same: an unknown key
# of one of these names gets "did you mean table.key" where spelling distance finds nothing.

FAMILIAR_NAMES: dict[str, str] = {
    # HF Trainer (TrainingArguments) and DeepSpeed's ds_config
    "gradient_accumulation_steps": "train.grad_accum", "accumulate_grad_batches": "train.grad_accum",
    "per_device_train_batch_size": "train.micro_batch", "train_micro_batch_size_per_gpu": "train.micro_batch",
    "micro_batch_size": "train.micro_batch", "batch_size": "train.micro_batch",
    "learning_rate": "train.lr", "max_lr": "train.lr", "warmup_max_lr": "train.lr",
    "max_grad_norm": "train.clip_grad_norm", "gradient_clipping": "train.clip_grad_norm",
    "grad_clip": "train.clip_grad_norm", "clip_grad": "train.clip_grad_norm",
    "max_steps": "train.steps", "total_num_steps": "train.steps", "train_iters": "train.steps",
    "max_iters": "train.steps", "num_steps": "train.steps",
    "warmup_num_steps": "train.warmup_steps", "lr_warmup_steps": "train.warmup_steps",
    "warmup_iters": "train.warmup_steps",
    "lr_scheduler_type": "train.schedule", "lr_scheduler": "train.schedule", "scheduler": "train.schedule",
    "lr_decay_style": "train.schedule", "cos_min_ratio": "train.min_lr_ratio", "min_lr_rate": "train.min_lr_ratio",
    "adam_beta1": "train.beta1", "adam_beta2": "train.beta2",
    "save_steps": "train.checkpoint_every", "save_interval": "train.checkpoint_every",
    "eval_steps": "train.eval_every", "eval_interval": "train.eval_every",
    "logging_steps": "train.log_every", "steps_per_print": "train.log_every", "log_interval": "train.log_every",
    "save_total_limit": "train.keep_checkpoints", "output_dir": "train.checkpoint_dir",
    "save_dir": "train.checkpoint_dir", "resume_from_checkpoint": "train.resume",
    "torch_compile": "train.compile", "data_seed": "train.seed",
    "gradient_checkpointing": "memory.activation_checkpointing",
    "activation_checkpointing": "memory.activation_checkpointing",
    "bf16": "precision.dtype", "fp16": "precision.dtype", "mixed_precision": "precision.dtype",
    "torch_dtype": "precision.dtype", "communication_data_type": "precision.reduce_dtype",
    "max_seq_length": "data.seq_len", "max_length": "data.seq_len", "seq_length": "data.seq_len",
    "block_size": "data.seq_len", "model_max_length": "data.seq_len", "max_position_embeddings": "data.seq_len",
    "model_name_or_path": "model.name", "model_path": "model.name", "model_name": "model.name",
    "dataset": "data.path", "dataset_name": "data.path", "train_file": "data.path", "data_path": "data.path",
    "dataset_text_field": "data.text_key", "validation_file": "data.eval_path",
    "eval_dataset": "data.eval_path", "validation_split_percentage": "data.eval_fraction",
    "packing": "data.cross_document_attention",
    # ZeRO, FSDP and the launchers
    "zero_stage": "deepspeed.stage", "zero_optimization": "deepspeed.stage",
    "sharding_strategy": "fsdp.sharding", "fsdp_sharding_strategy": "fsdp.sharding",
    "fsdp_offload_params": "fsdp.cpu_offload", "offload_params": "fsdp.cpu_offload",
    "fsdp_reshard_after_forward": "fsdp.reshard_after_forward",
    "nproc": "parallel.nproc_per_node", "num_gpus": "parallel.nproc_per_node",
    "num_processes": "parallel.nproc_per_node", "world_size": "parallel.nproc_per_node",
    "num_nodes": "parallel.nnodes", "num_machines": "parallel.nnodes",
    "master_addr": "parallel.rdzv_endpoint", "ddp_timeout": "parallel.timeout_s",
    "ddp_backend": "parallel.backend",
}


def familiar_name(key: str, *, known: dict[str, list[str]] | None = None) -> str | None:
    """The setting ("table.key") that `key`, a name from another tool or from another table, means.
    known: table -> its keys, so a key of another table (`train.seq_len`) finds `data.seq_len`."""
    k = key.strip().lower().replace("-", "_").lstrip("_")
    if k in FAMILIAR_NAMES:
        return FAMILIAR_NAMES[k]
    for table, names in (known or {}).items():
        if k in names:
            return f"{table}.{k}"
    return None


# ---------------------------------------------------------------------------------------------------
# Sizes: "24GiB", "512MB", "1.5e9", or a plain number of bytes.

_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str | int | float) -> int:
    """Bytes from "24GiB", "500MB", "1e9" or a number. Raises ValueError with the allowed forms."""
    if isinstance(text, bool):
        raise ValueError("expected a size such as 24GiB, 512MiB or a number of bytes")
    if isinstance(text, (int, float)):
        if text < 0:
            raise ValueError("a size cannot be negative")
        return _bytes(text, text)
    m = _SIZE_RE.match(text)
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"{text!r} is not a size: use a number with a unit such as 24GiB, 512MiB, 2GB")
    return _bytes(float(m.group(1)) * _UNITS[m.group(2).lower()], text)


MAX_SIZE = 2**60      # 1 EiB: past any machine's memory or disk, and far inside a 64-bit count of bytes


def _bytes(n: float, text: object) -> int:
    # 1e400GiB parses as inf (int() of it was an OverflowError traceback), nan compares false both ways
    if not math.isfinite(n) or n > MAX_SIZE:
        raise ValueError(f"{text!r} is not a size: it takes 0 up to 1 EiB, e.g. 24GiB, 512MiB, 2GB")
    return int(n)


def format_size(n: int | float | None) -> str:
    """Short human form with binary units: 23.8 GiB."""
    if n is None:
        return "n/a"
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"  # unreachable


def _describe(tp: Any) -> str:
    origin = get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in get_args(tp))
    if origin in (typing.Union, types.UnionType):
        parts = [_describe(a) for a in get_args(tp) if a is not type(None)]
        return " or ".join(parts)
    return {bool: "true or false", int: "an integer", float: "a number", str: "a string"}.get(tp, str(tp))


def coerce(tp: Any, value: Any) -> Any:
    """Return value as type tp, or raise ValueError saying what is allowed."""
    origin = get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in get_args(tp):
            return None   # "not set": the default applies (`--set precision.reduce_dtype=none`)
        for a in (a for a in get_args(tp) if a is not type(None)):
            try:
                return coerce(a, value)
            except ValueError:
                continue
        raise ValueError(f"expected {_describe(tp)}, got {value!r}")
    if origin is Literal:
        allowed = get_args(tp)
        if value in allowed and type(value) is type(allowed[0]):
            return value
        close = difflib.get_close_matches(str(value), [str(a) for a in allowed], n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ValueError(f"{value!r} is not allowed; expected {_describe(tp)}{hint}")
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ValueError(f"expected true or false, got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            if not -2**63 <= value < 2**63:
                # TOML integers are 64-bit: a bigger one would be written as a file no reader accepts.
                raise ValueError(f"{value} is out of range; TOML integers are 64-bit (at most {2**63 - 1})")
            return value
        if isinstance(value, float) and value.is_integer() and abs(value) < 2**63:
            return int(value)  # 5e8 written in TOML as a float
        raise ValueError(f"expected an integer, got {value!r}")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            if value != value or value in (float("inf"), float("-inf")):
                raise ValueError(f"expected a finite number, got {value!r}")
            return float(value)
        raise ValueError(f"expected a number, got {value!r}")
    if tp is str:
        if isinstance(value, str):
            return value
        raise ValueError(f"expected a string, got {value!r}")
    raise ValueError(f"unsupported type {tp}")  # pragma: no cover - a bug in this module


def parse_override_value(tp: Any, text: str) -> Any:
    """A --set value: strings stay strings for string fields; others are read as TOML values."""
    origin = get_origin(tp)
    args = get_args(tp) if origin in (typing.Union, types.UnionType, Literal) else ()
    wants_str = tp is str or (origin is Literal and all(isinstance(a, str) for a in args)) or (
        origin in (typing.Union, types.UnionType) and any(
            a is str or (get_origin(a) is Literal and isinstance(get_args(a)[0], str)) for a in args))
    stripped = text.strip()
    if wants_str and not (stripped.startswith('"') or stripped.startswith("'")):
        if stripped.lower() in ("none", "null") and type(None) in args:
            return None
        return stripped
    if stripped.lower() in ("none", "null") and type(None) in args:
        return None
    try:
        return tomllib.loads(f"v = {stripped}")["v"]
    except tomllib.TOMLDecodeError:
        if stripped.lower() in ("true", "false"):
            return stripped.lower() == "true"
        return stripped  # let coerce say what was expected
