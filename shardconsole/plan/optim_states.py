"""The bytes of the optimizer's states for optim.name (issue 35): torch's AdamW keeps two moments in the
master dtype; torchao's AdamW8bit / AdamW4bit keep each moment block-quantized (one byte or half a byte
a value, plus one fp32 scale a block), except tensors under 4096 values or not a multiple of the block,
which keep the parameter's dtype (torchao/optim/adam.py _new_buffer: the local shard decides)."""

from __future__ import annotations

import math

# torchao's defaults (backends/lowbit_optim.BLOCK_SIZE passes the same; a test compares them)
BLOCK_SIZE = {"adamw8bit": 256, "adamw4bit": 128}
CODE_BITS = {"adamw8bit": 8, "adamw4bit": 4}
MIN_QUANTIZED_NUMEL = 4096
SCALE_BYTES = 4
# each quantized moment carries its own code book (the fp32 values of its codes)
QMAP_BYTES = {"adamw8bit": 256 * 4, "adamw4bit": 16 * 4}


def moment_bytes(name: str, numel: int, master_b: int) -> int:
    """One moment of one (sharded) parameter of numel values, master_b bytes a value for torch's AdamW."""
    block = BLOCK_SIZE.get(name)
    if block is None or numel < MIN_QUANTIZED_NUMEL or numel % block:
        return master_b * numel
    return numel * CODE_BITS[name] // 8 + SCALE_BYTES * (numel // block) + QMAP_BYTES[name]


def adam_state_bytes(name: str, shard_numels: list[int], master_b: int) -> int:
    """exp_avg + exp_avg_sq over the shards of one rank."""
    return 2 * sum(moment_bytes(name, n, master_b) for n in shard_numels)


def adam_mini_bytes(shapes: list[tuple[int, ...]], shard: int, kept_b: int, split: bool) -> int:
    """adam-mini's states over one rank's shards (backends/optim/adam_mini.py layout): exp_avg like the
    kept shard, exp_avg_sq_row one fp32 value a row (a value for a vector), weight_low int16 when the
    masters are split. Rows of a shard: dim 0 padded to the shard group, as FSDP2 does."""
    total = 0
    for sh in shapes:
        rows0 = -(-sh[0] // shard)
        numel = rows0 * math.prod(sh[1:])
        rows = rows0 * math.prod(sh[1:-1]) if len(sh) >= 2 else rows0
        total += kept_b * numel + 4 * rows + (2 * numel if split else 0)
    return total


def states_bytes(cfg, shapes: list[tuple[int, ...]], shard: int, shard_numels: list[int]) -> int:
    """The optimizer's states over one rank's shards, for optim.name."""
    name = getattr(getattr(cfg, "optim", None), "name", "adamw")
    if name == "adam-mini":
        return adam_mini_bytes(shapes, shard, cfg.kept_bytes, cfg.split_masters)
    return adam_state_bytes(name, shard_numels, cfg.kept_bytes)


def state_tag(name: str, mtag: str, split: bool = False) -> str:
    """How the plan names the states: "Adam fp32", "AdamW 8-bit"."""
    if name == "adam-mini":
        return "adam-mini: bf16 moment, fp32 a row" + (", the fp32 masters' low 16 bits" if split else "")
    return f"AdamW {CODE_BITS[name]}-bit" if name in CODE_BITS else f"Adam {mtag}"
