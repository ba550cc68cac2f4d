"""DeepSpeed's JSON config, in and out: the one mapping between shardconsole's settings and a ds_config.

    to_ds_config(cfg)            the exact dict the DeepSpeed rank passes to deepspeed.initialize
    from_ds_config(d, source)    a ds_config -> preset overrides, plus which keys mapped and which did not
    cmd_export / cmd_import      `shardconsole export ... --format deepspeed`, `shardconsole import FILE.json`

Front-end module: no torch, no deepspeed at import time (the console and the CLI stay fast and work on
a machine with a broken CUDA install).

Choices that shape the JSON:
- The optimizer is the ds_config's "optimizer" block (AdamW), so DeepSpeed picks the implementation
  exactly as it would for any user of the file: DeepSpeedCPUAdam when the optimizer is offloaded,
  FusedAdam on a GPU, torch's AdamW with "torch_adam": true. CPU ranks without offload get torch_adam
  (a FusedAdam build there takes ~36 s and buys nothing, docs/MEASURED.md); the exported file follows
  parallel.device, never the machine it is exported on ("auto" is a GPU machine's file).
- The rank's config has no "scheduler" block: the learning-rate schedule (linear warm-up, cosine) is
  shardconsole's own lr_factor, applied by the loop before each optimizer step, so both backends follow
  the same curve step for step. The exported file carries the schedule as DeepSpeed's WarmupCosineLR /
  WarmupLR (file_config) for a user's own script; an import without a scheduler block gets a constant
  rate, as DeepSpeed runs it.
- `--format hf-trainer` (hf_trainer.py) writes "auto" where the Hugging Face Trainer fills a value from
  its TrainingArguments, and prints the arguments that give the preset's values.
- fp16 loss-scale knobs are written only when set: DeepSpeed's defaults are shardconsole's defaults
  (same names, same meanings), so leaving them out runs the same and round-trips exactly.
- Every zero_optimization key shardconsole owns is written, even those a stage ignores (DeepSpeed
  ignores them too): the file shows every value in force and imports back to the same settings.

Where it lives (every name is re-exported here, so `from shardconsole import ds_json; ds_json.X` and
`from shardconsole.ds_json import X` work; to monkeypatch a name that the package itself looks up,
patch the module that uses it, e.g. shardconsole.cli.ds_json.to_ds_config). The FSDP -> ZeRO
equivalents of `--set parallel.backend=deepspeed` belong to the settings pipeline (settings.py).

  export.py       settings -> ds_config: ADAM_EPS, ZERO_KEYS, ZERO_BOOL_KEYS, DS_ZERO_DEFAULTS,
                  DS_OFFLOAD_PIN_DEFAULT, device_type, uses_torch_adam, _offload_block, to_ds_config
  export_file.py  the exported file: scheduler_block, file_config
  hf_trainer.py   the same for the HF Trainer: hf_trainer_config, training_arguments
  import_report.py  what an import reports: KNOWN_UNMAPPED, ZERO_UNMAPPED, OFFLOAD_UNMAPPED, ImportReport,
                  known_hint
  importer.py     ds_config -> settings: _TOP_KEYS, from_ds_config and its per-section readers
                  _batch, _optimizer, _scheduler, _precision
  import_zero.py  its zero_optimization reader: _ZERO_ALL, read_zero and the offload blocks
  commands.py     the CLI commands: _read_json, merge, _write_text, cmd_export, cmd_import
"""

from __future__ import annotations

from shardconsole.ds_json.export import (ADAM_EPS, DS_OFFLOAD_PIN_DEFAULT, DS_ZERO_DEFAULTS, ZERO_KEYS, ZERO_BOOL_KEYS,
                                         device_type, to_ds_config, uses_torch_adam)
from shardconsole.ds_json.import_report import ImportReport, KNOWN_UNMAPPED, OFFLOAD_UNMAPPED, ZERO_UNMAPPED, known_hint
from shardconsole.ds_json.importer import from_ds_config, merge

__all__ = [
    # export
    "ADAM_EPS", "ZERO_KEYS", "ZERO_BOOL_KEYS", "DS_ZERO_DEFAULTS", "DS_OFFLOAD_PIN_DEFAULT", "device_type",
    "uses_torch_adam", "to_ds_config",
    # importer
    "KNOWN_UNMAPPED", "ZERO_UNMAPPED", "OFFLOAD_UNMAPPED", "ImportReport", "known_hint",
    "from_ds_config",
    "merge",
]
