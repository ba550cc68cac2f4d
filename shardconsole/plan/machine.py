"""The hardware a run is planned for: one node's GPUs and RAM, given or detected here."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Hardware:
    """One node: its GPUs (all alike) and its RAM. gpu_memory_bytes is per GPU."""
    gpus: int
    gpu_memory_bytes: int
    host_memory_bytes: int
    gpu_name: str = ""
    source: str = "given"          # "detected" (NVML + psutil) or "given"


# ---------------------------------------------------------------------------------------------------
# The machine

def detect_hardware() -> Hardware:
    """GPUs from NVML (count and the first one's memory), RAM from psutil. Never raises."""
    import psutil
    from shardconsole.probes import GpuProbe
    probe = GpuProbe()
    samples = probe.sample()
    gpu_mem = min((g.total_bytes for g in samples), default=0)
    name = samples[0].name if samples else ""
    return Hardware(gpus=len(samples), gpu_memory_bytes=int(gpu_mem),
                    host_memory_bytes=int(psutil.virtual_memory().total), gpu_name=name, source="detected")
