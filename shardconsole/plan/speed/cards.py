"""The cards a speed can be predicted for (`shardconsole plan --card NAME`), from their published figures,
and the host link and memory they are read with. Standard library only.

bf16_tflops is the datasheet's dense bf16 tensor rate with fp32 accumulation (what torch's bf16 matmuls
use; GeForce cards run fp16-accumulate at twice this), no sparsity. matmul_tflops is what a large bf16
matmul reaches: measured on the H200 test machine (790 of 989, docs/MEASURED.md), and for the others the
same share of the datasheet (an assumption: clocks under load fall short of the boost clock on every card).
"""

from __future__ import annotations

from dataclasses import dataclass

# The H200's measured large-matmul rate over its datasheet rate (docs/MEASURED.md: 790 of 989 TFLOP/s).
MATMUL_SHARE = 790.0 / 989.0

# One direction of a x16 link as a cudaMemcpy of pinned memory reaches it: PCIe 5.0 measured on the H200
# test machine (54.4 GB/s H2D, 55.3 D2H, benchmarks/results/issue17/call1_host_transfers.json); 4.0 and 3.0
# are half and a quarter of it (each generation doubles the rate per lane).
PCIE_GBPS = {3: 54.4 / 4, 4: 54.4 / 2, 5: 54.4}


@dataclass(frozen=True)
class Card:
    name: str                   # the --card name
    title: str                  # as a person calls it
    bf16_tflops: float          # datasheet, dense, fp32 accumulate
    memory_bytes: int
    pcie_gen: int
    hbm_gbps: float             # datasheet memory bandwidth (the GPU's optimizer step reads and writes it)
    nvlink: bool = False        # several of them talk over NVLink (SXM), not PCIe
    match: tuple[str, ...] = ()   # substrings of the CUDA/NVML device name (lower case) that are this card
    fp8: bool = False           # FP8 tensor cores (compute capability 8.9+): precision.fp8 runs on it

    @property
    def matmul_tflops(self) -> float:
        return 790.0 if self.name in ("h200", "h100") else self.bf16_tflops * MATMUL_SHARE

    @property
    def pcie_gbps(self) -> float:
        return PCIE_GBPS[self.pcie_gen]


GB = 10**9
GiB = 2**30
# Published figures: NVIDIA's Ampere GA102, Ada, Blackwell GB202 whitepapers and the A100, H100 SXM,
# H200 and L40S datasheets.
CARDS: dict[str, Card] = {c.name: c for c in (
    Card("rtx3090", "RTX 3090", 71.0, 24 * GiB, 4, 936.0, match=("3090",)),
    Card("rtx4090", "RTX 4090", 165.2, 24 * GiB, 4, 1008.0, match=("4090",), fp8=True),
    Card("rtx5090", "RTX 5090", 209.5, 32 * GiB, 5, 1792.0, match=("5090",), fp8=True),
    Card("a100-40g", "A100 40GB", 312.0, 40 * GiB, 4, 1555.0, nvlink=True, match=("a100-sxm4-40", "a100-pcie-40")),
    Card("a100-80g", "A100 80GB", 312.0, 80 * GiB, 4, 2039.0, nvlink=True, match=("a100",)),
    Card("h100", "H100 SXM", 989.0, 80 * GiB, 5, 3350.0, nvlink=True, match=("h100",), fp8=True),
    Card("h200", "H200", 989.0, 141 * GB, 5, 4800.0, nvlink=True, match=("h200", "gh200"), fp8=True),
    Card("l40s", "L40S", 362.0, 48 * GB, 4, 864.0, match=("l40s",), fp8=True),
)}


def card_named(name: str) -> Card:
    """The card of a --card value; a name not in the table is a ValueError that lists them."""
    key = name.strip().lower().replace(" ", "").replace("_", "-")
    key = {"3090": "rtx3090", "4090": "rtx4090", "5090": "rtx5090", "a100": "a100-80g"}.get(key, key)
    if key not in CARDS:
        raise ValueError(f"unknown card {name!r}; known: {', '.join(CARDS)}")
    return CARDS[key]


def card_of(device_name: str) -> Card | None:
    """The card NVML or CUDA names (e.g. "NVIDIA H200", "NVIDIA GeForce RTX 4090"); None when not in the table."""
    low = device_name.lower()
    for card in CARDS.values():
        if any(m in low for m in card.match):
            return card
    return None
