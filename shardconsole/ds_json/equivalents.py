"""FSDP settings -> the closest DeepSpeed settings, for `--set parallel.backend=deepspeed` on an FSDP
preset (apply_fsdp_equivalents), and deepspeed_config_for, a RunConfig built as the CLI builds it."""

from __future__ import annotations

from typing import Any

from shardconsole import config as C


# ---------------------------------------------------------------------------------------------------
# FSDP settings -> the closest DeepSpeed settings (for `--set parallel.backend=deepspeed`)

FSDP_TO_STAGE = {"full_shard": 3, "hybrid_shard": 3, "shard_grad_op": 2, "no_shard": 0}
_DERIVED_KEYS = ("stage", "offload_optimizer", "offload_param", "pin_memory")


def user_set_keys(preset: dict[str, Any] | None, overrides: list[str] | None, table: str) -> set[str]:
    """Keys of `table` that the preset file or a --set names (as opposed to defaults)."""
    keys = set((preset or {}).get(table, {}) or {}) if isinstance((preset or {}).get(table), dict) else set()
    for text in overrides or []:
        path = text.split("=", 1)[0].strip()
        if path.startswith(table + "."):
            keys.add(path.split(".", 1)[1].strip())
    return keys


def apply_fsdp_equivalents(cfg: C.RunConfig, preset: dict[str, Any] | None = None,
                           overrides: list[str] | None = None) -> list[str]:
    """For a DeepSpeed run, fill the deepspeed settings that the user did not set from the fsdp table:

        fsdp.sharding    full_shard -> stage 3, hybrid_shard -> stage 3, shard_grad_op -> 2, no_shard -> 0
        fsdp.cpu_offload -> offload_param = "cpu" (stage 3) and offload_optimizer = "cpu" (stage >= 1)
        fsdp.pin_memory  -> pin_memory

    The fsdp defaults (full_shard, no offload, pinned) give the deepspeed defaults, so a preset written
    for DeepSpeed is unchanged. Returns one line per setting changed. Mutates cfg; validate after."""
    if cfg.parallel.backend != "deepspeed":
        return []
    given = user_set_keys(preset, overrides, "deepspeed")
    f, d = cfg.fsdp, cfg.deepspeed
    notes: list[str] = []

    def put(key: str, value: Any, why: str) -> None:
        if key in given or getattr(d, key) == value:
            return
        setattr(d, key, value)
        notes.append(f"deepspeed.{key} = {value!r} ({why})")

    put("stage", FSDP_TO_STAGE[f.sharding], f"from fsdp.sharding = {f.sharding!r}")
    if f.cpu_offload:
        if d.stage == 3:
            put("offload_param", "cpu", "from fsdp.cpu_offload = true")
        if d.stage >= 1:
            put("offload_optimizer", "cpu", "from fsdp.cpu_offload = true")
        else:
            notes.append("fsdp.cpu_offload: nothing offloaded, ZeRO stage 0 cannot offload")
    put("pin_memory", f.pin_memory, "from fsdp.pin_memory")
    if f.sharding == "hybrid_shard":
        notes.append("fsdp.sharding = 'hybrid_shard': ZeRO-3 shards across all ranks (DeepSpeed's hpZ, "
                     "zero_hpz_partition_size, is not a shardconsole setting)")
    return notes


def deepspeed_config_for(preset: dict[str, Any] | None, source: str, overrides: list[str] | None,
                         *, gpu_count: int | None = None) -> tuple[C.RunConfig, list[str]]:
    """Build a RunConfig as the CLI does and apply the FSDP equivalents when it is a DeepSpeed run."""
    cfg = C.build(preset, source, overrides, gpu_count=gpu_count)
    notes = apply_fsdp_equivalents(cfg, preset, overrides)
    if notes:
        C.validate(cfg, source, gpu_count=gpu_count)
    return cfg, notes
