"""The hardware a run is planned for: one node's GPUs and RAM, given or detected here."""

from __future__ import annotations

from dataclasses import dataclass, replace

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
    host_gbps: float = 0.0         # host memory bandwidth a step reaches (--host-gbps); 0: not given
    host_given: str = ""           # the host flags given ("--host-cores 16"): a host other than this one


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


MAX_GPUS = 1024     # GPUs of one node, far past any machine's


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


def cores_arg(flag: str, text: str | None) -> int | None:
    """A core count (--host-cores 16); None when not given; a bad one is one ConfigError line."""
    if text is None:
        return None
    try:
        n = int(text.strip())
    except ValueError:
        raise C.ConfigError(f"{flag}: {text!r} is not a whole number of CPU cores; give e.g. 16") from None
    if not 1 <= n <= 4096:
        raise C.ConfigError(f"{flag}: {n} is not a core count; it takes 1 to 4096")
    return n


def gbps_arg(flag: str, text: str | None) -> float | None:
    """A bandwidth in GB/s (--host-gbps 118); None when not given; a bad one is one ConfigError line."""
    if text is None:
        return None
    try:
        x = float(text.strip())
    except ValueError:
        raise C.ConfigError(f"{flag}: {text!r} is not a number of GB/s; give e.g. 118") from None
    # nan compares false both ways, inf (1e400 parses as it) is above any bound: both refused here
    if not 0 < x <= 100_000:
        raise C.ConfigError(f"{flag}: {text} is not a host memory bandwidth; it takes more than 0 up to 100000 GB/s")
    return x


def with_host(hw: Hardware, cores: int | None, gbps: float | None) -> Hardware:
    """hw with the host given instead of this one's: its cores (--host-cores), its bandwidth (--host-gbps)."""
    if cores is None and gbps is None:
        return hw
    given = " ".join(f for f in (f"--host-cores {cores}" if cores is not None else "",
                                 f"--host-gbps {gbps:g}" if gbps is not None else "") if f)
    return replace(hw, cpus=cores if cores is not None else hw.cpus, host_gbps=gbps or 0.0, host_given=given)


def hardware_from_args(gpus: int | None, gpu_memory: str | None, host_memory: str | None,
                       host_cores: str | None = None, host_gbps: str | None = None) -> Hardware:
    """What was given wins; the rest is detected (NVML, psutil). host_cores, host_gbps: the host's
    CPU cores and memory bandwidth as given (--host-cores, --host-gbps), for a host other than this one."""
    cores, gbps = cores_arg("--host-cores", host_cores), gbps_arg("--host-gbps", host_gbps)
    if gpus is not None and gpus < 0:
        raise C.ConfigError(f"--gpus: {gpus} is below 0")
    if gpus is not None and gpus > MAX_GPUS:      # 10**23 GPUs a node was planned, row by row
        raise C.ConfigError(f"--gpus: {gpus} is not a GPU count of one node; it takes 0 to {MAX_GPUS}")
    g_mem = size_arg("--gpu-memory", gpu_memory)
    h_mem = size_arg("--host-memory", host_memory)
    found = detect_hardware() if (gpus is None or g_mem is None or h_mem is None) else None
    given = gpus is not None or g_mem is not None or h_mem is not None
    n = gpus if gpus is not None else (found.gpus if found else 0)
    if n == 0 and g_mem is not None:
        n = 1   # a GPU size was given for a machine whose GPUs were not counted: one per node
    return with_host(Hardware(
        gpus=n,
        gpu_memory_bytes=g_mem if g_mem is not None else (found.gpu_memory_bytes if found else 0),
        host_memory_bytes=h_mem if h_mem is not None else (found.host_memory_bytes if found else 0),
        gpu_name=(found.gpu_name if found and g_mem is None else ""), cpus=found.cpus if found else 0,
        source="given" if not found else ("detected + given" if given else "detected")), cores, gbps)
