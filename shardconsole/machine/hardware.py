"""Facts about GPUs that both sides need: the peak bf16 dense matmul rate used for MFU.

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
