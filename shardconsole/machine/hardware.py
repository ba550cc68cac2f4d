"""Facts about GPUs that both sides need: the peak bf16 dense matmul rate used for MFU, and what a
card gives to processes (CARD_MEMORY: its NVML total less the driver's part; what a memory cap means).

Standard library only. The figures are the vendors' dense (no sparsity) bf16 tensor-core peaks, except
the H200/H100 SXM entries, which are the 790 TFLOP/s measured on the project's H200 test machine
(docs/MEASURED.md) so that MFU figures compare with the baselines there. A preset can override the rate with
train.peak_tflops.
"""

from __future__ import annotations

# (substring of the CUDA device name, lower case) -> bf16 TFLOP/s. First match wins: order matters.
PEAK_BF16_TFLOPS: list[tuple[str, float]] = [
    ("h200", 790.0),   # measured on the test machine (docs/MEASURED.md); datasheet says 989
    ("h100", 790.0),   # same chip as the H200
    ("gh200", 790.0),
    ("a100", 312.0),
    ("a800", 312.0),
    ("l40s", 362.0),
    ("l40", 181.0),
    ("a6000", 154.8),
    ("a40", 149.7),
    ("a10", 125.0),
    ("4090", 165.2),
    ("4080", 97.5),
    ("3090", 71.0),
    ("3080", 59.5),
    ("v100", 125.0),   # fp16 (no bf16 on Volta)
    ("t4", 65.0),      # fp16
]


def peak_tflops(device_name: str | None) -> float | None:
    if not device_name:
        return None
    name = device_name.lower()
    for key, rate in PEAK_BF16_TFLOPS:
        if key in name:
            return rate
    return None


# ---------------------------------------------------------------------------------------------------
# What a card gives to processes (issue 34: a 24 GiB cap means a 24 GB card, the whole device)

MiB = 2**20

# (substring of the device name, lower case; NVML's total bytes; bytes NVML counts as used on the
# idle card, the driver's part that no process gets). First match wins. A size given without a name
# (`--gpu-memory 24GiB`, memory.gpu_memory_limit) is matched by total within CARD_SIZE_TOLERANCE.
CARD_MEMORY: list[tuple[str, int, int]] = [
    # measured: the test machine, 0.60 GiB used before every calibration run (plan/constants.py)
    ("h200", 143771 * MiB, 615 * MiB),
    # RTX 3090 / 4090: NVML's totals of the cards (24576 and 24564 MiB); what processes get once the
    # driver has its part is about 23.5-23.7 GiB as users report it (nvidia-smi on an idle headless
    # card, 300-500 MiB "used"): 384 MiB taken here, 23.6 GiB usable. Not measured on this project.
    ("3090", 24576 * MiB, 384 * MiB),
    ("4090", 24564 * MiB, 384 * MiB),
]
# A card not in the table: the H200's measured part (ECC and a large card keep more; a guess elsewhere).
DEFAULT_DRIVER_RESERVED_BYTES = 615 * MiB
CARD_SIZE_TOLERANCE = 0.01

# CUDA context + NCCL communicator + loaded kernels of one rank, beyond the caching allocator's reserved
# bytes (NVML used minus the idle device's, minus max_memory_reserved), measured on the H200 (torch 2.11
# + CUDA 13, DeepSpeed 0.19.8): 1.29 GiB in every FSDP2 run and 1.67-1.68 GiB in every DeepSpeed run of
# the calibration (benchmarks/data/plan_calibration.json). The planner and the cap's rehearsal use it.
CUDA_CONTEXT_BYTES = {"fsdp": 1320 * MiB, "deepspeed": 1720 * MiB}


def driver_reserved_bytes(device_name: str | None, total_bytes: int | None) -> int:
    """What the driver keeps of this card: by its name, else by its size, else the default."""
    name = (device_name or "").lower()
    for key, _total, reserved in CARD_MEMORY:
        if name and key in name:
            return reserved
    if total_bytes:
        for _key, total, reserved in CARD_MEMORY:
            if abs(total_bytes - total) <= CARD_SIZE_TOLERANCE * total:
                return reserved
    return DEFAULT_DRIVER_RESERVED_BYTES


def usable_bytes(total_bytes: int, device_name: str | None = None) -> int:
    """What processes get of a card of this total (as NVML reports it): the total less the driver's part."""
    return max(total_bytes - driver_reserved_bytes(device_name, total_bytes), 0)


def allocator_limit_bytes(device_cap_bytes: int, engine: str) -> int:
    """memory.gpu_memory_limit names a card (the whole device): the caching allocator of a rank may
    hold what that card gives to processes less the rank's CUDA context and NCCL, so that allocator +
    context + NCCL fit, as they must on the card itself (backends/rank/common.py sets the fraction from it)."""
    return max(usable_bytes(device_cap_bytes) - CUDA_CONTEXT_BYTES.get(engine, CUDA_CONTEXT_BYTES["fsdp"]), 0)


def device_cap_for_allocator(allocator_bytes: int, engine: str) -> int:
    """The memory.gpu_memory_limit (a whole device) under which a rank's allocator may hold
    allocator_bytes: the inverse of allocator_limit_bytes (benchmarks set an allocator edge with it, and
    the measurements made when the cap limited the allocator alone are read with it)."""
    context = CUDA_CONTEXT_BYTES.get(engine, CUDA_CONTEXT_BYTES["fsdp"])
    for reserved in (DEFAULT_DRIVER_RESERVED_BYTES, *(r for _k, _t, r in CARD_MEMORY)):
        cap = allocator_bytes + context + reserved
        if driver_reserved_bytes(None, cap) == reserved:
            return cap
    return allocator_bytes + context + DEFAULT_DRIVER_RESERVED_BYTES
