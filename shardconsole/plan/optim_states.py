"""The bytes of the optimizer's states for optim.name (issue 35): torch's AdamW keeps two moments in the
master dtype; torchao's AdamW8bit / AdamW4bit keep each moment block-quantized (one byte or half a byte
a value, plus one fp32 scale a block), except tensors under 4096 values or not a multiple of the block,
which keep the parameter's dtype (torchao/optim/adam.py _new_buffer: the local shard decides)."""

from __future__ import annotations

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


def state_tag(name: str, mtag: str) -> str:
    """How the plan names the states: "Adam fp32", "AdamW 8-bit"."""
    return f"AdamW {CODE_BITS[name]}-bit" if name in CODE_BITS else f"Adam {mtag}"
