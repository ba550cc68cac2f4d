"""What the machine says: NVML per GPU, psutil for the host and the ranks' processes.

Never raises: a probe that cannot answer says why in `unavailable` and returns empty samples. NVML
queries cost milliseconds each; polling faster than about once a second is waste (nvitop's advice).
"""

from __future__ import annotations

import os
from collections.abc import Iterable

import psutil

from shardconsole.protocol import GpuSample, HostSample


class GpuProbe:
    def __init__(self) -> None:
        self.unavailable = ""
        self._handles: list = []
        self._names: list[str] = []
        try:
            import pynvml
            self._nvml = pynvml
            pynvml.nvmlInit()
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            count = pynvml.nvmlDeviceGetCount()
            indices = list(range(count))
            if visible is not None and visible.strip() != "":
                try:
                    indices = [int(x) for x in visible.split(",") if x.strip()]
                except ValueError:
                    pass   # UUIDs: show every GPU
            for i in indices:
                h = pynvml.nvmlDeviceGetHandleByIndex(i)
                self._handles.append(h)
                name = pynvml.nvmlDeviceGetName(h)
                self._names.append(name.decode() if isinstance(name, bytes) else name)
            if not self._handles:
                self.unavailable = "NVML found no GPU"
        except ImportError:
            self.unavailable = "nvidia-ml-py is not installed"
        except Exception as e:   # NVMLError_LibraryNotFound, DriverNotLoaded, ...
            self.unavailable = f"no NVIDIA GPU driver ({type(e).__name__})"

    @property
    def count(self) -> int:
        return len(self._handles)

    def sample(self, run: str = "") -> list[GpuSample]:
        out = []
        for i, h in enumerate(self._handles):
            try:
                mem = self._nvml.nvmlDeviceGetMemoryInfo(h)
                try:
                    util = float(self._nvml.nvmlDeviceGetUtilizationRates(h).gpu)
                except Exception:
                    util = None
                try:
                    procs = self._nvml.nvmlDeviceGetComputeRunningProcesses(h)
                    pids = tuple(int(p.pid) for p in procs)
                except Exception:
                    pids = ()
                out.append(GpuSample(run=run, index=i, name=self._names[i], used_bytes=int(mem.used),
                                     total_bytes=int(mem.total), util_pct=util, pids=pids))
            except Exception:
                continue
        return out


def gpu_count() -> int | None:
    """GPUs this machine has per NVML (0 when there is no driver). Used to validate nproc_per_node."""
    probe = GpuProbe()
    return probe.count


def host_sample(rank_pids: Iterable[int] = (), run: str = "") -> HostSample:
    vm = psutil.virtual_memory()
    rss = 0
    for pid in rank_pids:
        try:
            rss += psutil.Process(pid).memory_info().rss
        except psutil.Error:
            continue
    return HostSample(run=run, used_bytes=int(vm.total - vm.available), total_bytes=int(vm.total),
                      ranks_rss_bytes=rss, pinned_bytes=_locked_bytes(rank_pids))


def _locked_bytes(pids: Iterable[int]) -> int | None:
    """Page-locked host memory of the ranks (VmLck): CUDA pinned buffers show here on Linux."""
    total, seen = 0, False
    for pid in pids:
        try:
            with open(f"/proc/{pid}/status") as fh:
                for line in fh:
                    if line.startswith("VmLck:"):
                        total += int(line.split()[1]) * 1024
                        seen = True
                        break
        except OSError:
            continue
    return total if seen else None


def wait_gpu_released(probe: GpuProbe, pids: Iterable[int], timeout_s: float = 10.0) -> str:
    """After a stop: wait until no GPU lists a process of the run, then say what each GPU holds now.
    Empty when there is no GPU to check. (Inside a container NVML may not see the ranks' pids; the
    used memory it reports is then the evidence.)"""
    import time
    if probe.unavailable:
        return ""
    pids = set(pids)
    deadline = time.monotonic() + timeout_s
    while True:
        samples = probe.sample()
        holders = {s.index: sorted(pids & set(s.pids)) for s in samples if pids & set(s.pids)}
        if not holders or time.monotonic() > deadline:
            break
        time.sleep(0.25)
    used = ", ".join(f"GPU{s.index} {s.used_bytes / 2**30:.1f}/{s.total_bytes / 2**30:.0f} GiB used" for s in samples)
    if holders:
        held = "; ".join(f"GPU{i} still held by pid(s) {p}" for i, p in holders.items())
        return f"GPU memory NOT released: {held} ({used})"
    return f"GPU memory released: no process of the run on any GPU ({used})"
