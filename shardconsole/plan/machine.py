"""The hardware a run is planned for: one node's GPUs and RAM, given or detected here."""

from __future__ import annotations

from dataclasses import dataclass

from shardconsole.settings import config as C


@dataclass(frozen=True)
class Hardware:
    """One node: its GPUs (all alike) and its RAM. gpu_memory_bytes is per GPU."""
    gpus: int
    gpu_memory_bytes: int
    host_memory_bytes: int
    gpu_name: str = ""
    source: str = "given"          # "detected" (NVML + psutil) or "given"
    cpus: int = 0                  # CPUs a rank may use (torch.compile's worker pool); 0: not known


# ---------------------------------------------------------------------------------------------------
# The machine

def detect_hardware() -> Hardware:
    """GPUs from NVML (count and the first one's memory), RAM from psutil. Never raises."""
    import os
    import psutil
    from shardconsole.machine.probes import GpuProbe
    probe = GpuProbe()
    samples = probe.sample()
    gpu_mem = min((g.total_bytes for g in samples), default=0)
    name = samples[0].name if samples else ""
    return Hardware(gpus=len(samples), gpu_memory_bytes=int(gpu_mem),
                    host_memory_bytes=int(psutil.virtual_memory().total), gpu_name=name, source="detected",
                    cpus=len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 0))


def size_arg(flag: str, text: str | None) -> int | None:
    """A size flag (--gpu-memory 24GiB) in bytes; None when not given; a bad one is one ConfigError line."""
    if text is None:
        return None
    try:
        n = C.parse_size(text)
    except ValueError as e:
        raise C.ConfigError(f"{flag}: {e}") from None
    if n <= 0:
        raise C.ConfigError(f"{flag}: must be more than 0")
    return n


def hardware_from_args(gpus: int | None, gpu_memory: str | None, host_memory: str | None) -> Hardware:
    """What was given wins; the rest is detected (NVML, psutil)."""
    if gpus is not None and gpus < 0:
        raise C.ConfigError(f"--gpus: {gpus} is below 0")
    g_mem = size_arg("--gpu-memory", gpu_memory)
    h_mem = size_arg("--host-memory", host_memory)
    found = detect_hardware() if (gpus is None or g_mem is None or h_mem is None) else None
    given = gpus is not None or g_mem is not None or h_mem is not None
    n = gpus if gpus is not None else (found.gpus if found else 0)
    if n == 0 and g_mem is not None:
        n = 1   # a GPU size was given for a machine whose GPUs were not counted: one per node
    return Hardware(
        gpus=n,
        gpu_memory_bytes=g_mem if g_mem is not None else (found.gpu_memory_bytes if found else 0),
        host_memory_bytes=h_mem if h_mem is not None else (found.host_memory_bytes if found else 0),
        gpu_name=(found.gpu_name if found and g_mem is None else ""), cpus=found.cpus if found else 0,
        source="given" if not found else ("detected + given" if given else "detected"))
