"""What the machine says: NVML per GPU, psutil for the host and the ranks' processes.

NVML directly (nvidia-ml-py), not nvitop's API: the panel needs a dozen NVML calls that nvitop itself
wraps one to one, nvitop would be a second dependency pulling its own pins for nothing we use, and the
calls here are the surface a test fakes for the UUID mapping (tests/test_gpu_truth.py).

Ranks are matched to cards by UUID (each rank's Hello.gpu_uuid against GpuSample.uuid), never by
index: NVML numbers cards by PCI bus id, CUDA (CUDA_DEVICE_ORDER unset) fastest first, and
CUDA_VISIBLE_DEVICES may name cards by UUID. So the probe samples only the cards it can tell are the
run's (UUIDs, or integers under CUDA_DEVICE_ORDER=PCI_BUS_ID) and every card otherwise.

Never raises: a probe that cannot answer says why in `unavailable` and returns empty samples; a field
a card cannot report (power on some boards, PCIe counters in some VMs) is None. NVML queries cost
milliseconds each (the PCIe counters ~20 ms: NVML samples them over that window); polling faster than
about once a second is waste (nvitop's advice).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, cast

import psutil

from shardconsole.runlog.protocol import GpuSample, HostSample, gpu_uuid_key

# NVML's clock-event ("throttle") bits that mean the card is being slowed, by name. Idle, application
# clocks and display clocks are left out: they are not a slowdown of a busy card.
THROTTLE_BITS = {
    0x4: "sw_power_cap", 0x8: "hw_slowdown", 0x10: "sync_boost", 0x20: "sw_thermal",
    0x40: "hw_thermal", 0x80: "hw_power_brake",
}


def throttle_names(mask: int | None) -> tuple[str, ...]:
    if not mask:
        return ()
    return tuple(name for bit, name in THROTTLE_BITS.items() if mask & bit)


def _text(v) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def visible_selection(nvml_uuids: list[str], visible: str | None, order: str | None) -> list[int]:
    """NVML indices of the cards CUDA_VISIBLE_DEVICES gives the run. UUIDs (or their unique prefixes,
    as CUDA accepts) select by UUID, in the order given; integers are CUDA indices, which equal NVML's
    only under CUDA_DEVICE_ORDER=PCI_BUS_ID, so otherwise every card is kept (the ranks' UUIDs then say
    which is whose). MIG instances and anything unparseable keep every card."""
    every = list(range(len(nvml_uuids)))
    if visible is None or visible.strip() == "":
        return every
    items = [x.strip() for x in visible.split(",") if x.strip()]
    if all(x.lstrip("-").isdigit() for x in items):
        if (order or "").strip().upper() != "PCI_BUS_ID":
            return every
        out = []
        for x in items:
            i = int(x)
            if i < 0 or i >= len(nvml_uuids):
                break            # CUDA stops at the first invalid entry
            out.append(i)
        return out
    if all(x.startswith("GPU-") for x in items):
        out = []
        for x in items:
            hits = [i for i, u in enumerate(nvml_uuids) if u.startswith(x)]
            if len(hits) != 1:
                break
            out.append(hits[0])
        return out
    return every


@dataclass(frozen=True)
class Card:
    """What does not change while a run lives: identity and PCIe link (the doctor prints these)."""
    index: int            # NVML's
    uuid: str
    name: str
    bus_id: str
    pcie_gen: int | None = None
    pcie_gen_max: int | None = None
    pcie_width: int | None = None
    pcie_width_max: int | None = None
    capability: tuple[int, int] | None = None   # CUDA compute capability (FP8 tensor cores from 8.9)


class GpuProbe:
    def __init__(self, nvml: Any = None, environ: dict | None = None) -> None:
        """`nvml`: the pynvml module (a stand-in in tests); `environ`: os.environ."""
        self.unavailable = ""
        self.cards: list[Card] = []
        self._handles: list = []
        env = os.environ if environ is None else environ
        try:
            if nvml is None:
                import pynvml
                nvml = pynvml
            self._nvml = nvml
            nvml.nvmlInit()
            handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(nvml.nvmlDeviceGetCount())]
            uuids = [_text(nvml.nvmlDeviceGetUUID(h)) for h in handles]
            for i in visible_selection(uuids, env.get("CUDA_VISIBLE_DEVICES"), env.get("CUDA_DEVICE_ORDER")):
                h = handles[i]
                self._handles.append(h)
                self.cards.append(Card(
                    index=i, uuid=uuids[i], name=_text(nvml.nvmlDeviceGetName(h)),
                    bus_id=_text(self._try(lambda h=h: nvml.nvmlDeviceGetPciInfo(h).busId, "")),
                    pcie_gen=self._try(nvml.nvmlDeviceGetCurrPcieLinkGeneration, None, h),
                    pcie_gen_max=self._try(nvml.nvmlDeviceGetMaxPcieLinkGeneration, None, h),
                    pcie_width=self._try(nvml.nvmlDeviceGetCurrPcieLinkWidth, None, h),
                    pcie_width_max=self._try(nvml.nvmlDeviceGetMaxPcieLinkWidth, None, h),
                    capability=self._try(lambda h=h: tuple(nvml.nvmlDeviceGetCudaComputeCapability(h)), None)))
            if not self._handles:
                self.unavailable = "NVML found no GPU"
        except ImportError:
            self.unavailable = "nvidia-ml-py is not installed"
        except Exception as e:   # NVMLError_LibraryNotFound, DriverNotLoaded, ...
            self.unavailable = f"no NVIDIA GPU driver ({type(e).__name__})"

    @staticmethod
    def _try(fn, default, *args):
        try:
            return fn(*args)
        except Exception:
            return default

    @property
    def count(self) -> int:
        return len(self._handles)

    def by_uuid(self, uuid: str | None) -> Card | None:
        return next((c for c in self.cards if uuid and gpu_uuid_key(c.uuid) == gpu_uuid_key(uuid)), None)

    def sample(self, run: str = "") -> list[GpuSample]:
        nv, t = cast(Any, self._nvml if self._handles else None), self._try     # None: no card, no loop
        out = []
        for card, h in zip(self.cards, self._handles):
            try:
                mem = nv.nvmlDeviceGetMemoryInfo(h)
            except Exception:
                continue
            util = t(lambda: float(nv.nvmlDeviceGetUtilizationRates(h).gpu), None)
            pids = t(lambda: tuple(int(p.pid) for p in nv.nvmlDeviceGetComputeRunningProcesses(h)), ())
            power = t(nv.nvmlDeviceGetPowerUsage, None, h)
            limit = t(nv.nvmlDeviceGetEnforcedPowerLimit, None, h)
            reasons = getattr(nv, "nvmlDeviceGetCurrentClocksEventReasons", None) or \
                getattr(nv, "nvmlDeviceGetCurrentClocksThrottleReasons", None)
            rx = t(nv.nvmlDeviceGetPcieThroughput, None, h, nv.NVML_PCIE_UTIL_RX_BYTES)
            tx = t(nv.nvmlDeviceGetPcieThroughput, None, h, nv.NVML_PCIE_UTIL_TX_BYTES)
            out.append(GpuSample(
                run=run, index=card.index, name=card.name, used_bytes=int(mem.used), total_bytes=int(mem.total),
                util_pct=util, pids=pids, uuid=card.uuid,
                temp_c=_num(t(nv.nvmlDeviceGetTemperature, None, h, nv.NVML_TEMPERATURE_GPU)),
                power_w=None if power is None else power / 1000.0,          # NVML: milliwatts
                power_limit_w=None if limit is None else limit / 1000.0,
                sm_clock_mhz=_num(t(nv.nvmlDeviceGetClockInfo, None, h, nv.NVML_CLOCK_SM)),
                sm_clock_max_mhz=_num(t(nv.nvmlDeviceGetMaxClockInfo, None, h, nv.NVML_CLOCK_SM)),
                throttle=throttle_names(t(reasons, None, h) if reasons else None),
                pcie_rx_bps=None if rx is None else rx * 1024.0,             # NVML: KB/s
                pcie_tx_bps=None if tx is None else tx * 1024.0))
        return out


def _num(v) -> float | None:
    return None if v is None else float(v)


def gpu_count() -> int | None:
    """GPUs this machine has per NVML (0 when there is no driver). Used to validate nproc_per_node."""
    probe = GpuProbe()
    return probe.count


def gpu_cards() -> list[Card]:
    """The GPUs this machine shows the ranks (CUDA_VISIBLE_DEVICES applied), per NVML; [] without one."""
    return GpuProbe().cards


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


def card_label(uuid: str, index: int | None = None) -> str:
    """'GPU1 (GPU-8f3a1c2e)': NVML's index and enough of the UUID to tell the cards of a box apart."""
    short = uuid[:12] if uuid.startswith("GPU-") else uuid[:8]
    return f"GPU{index} ({short})" if index is not None else short


def wait_gpu_released(probe: GpuProbe, pids: Iterable[int], timeout_s: float = 10.0,
                      rank_uuids: dict[int, str] | None = None) -> str:
    """After a stop: wait until no GPU lists a process of the run, then say what each of the run's GPUs
    holds now, each named by NVML index and UUID with its ranks (`rank_uuids`: rank -> the UUID of its
    card, from the hello lines; without it, every sampled card). Empty when there is no GPU to check.
    (Inside a container NVML may not see the ranks' pids; the used memory it reports is then the
    evidence.)"""
    import time
    if probe.unavailable:
        return ""
    pids = set(pids)
    ranks_on: dict[str, list[int]] = {}
    for rank, uuid in sorted((rank_uuids or {}).items()):
        if uuid:
            ranks_on.setdefault(gpu_uuid_key(uuid), []).append(rank)
    deadline = time.monotonic() + timeout_s
    while True:
        samples = probe.sample()
        holders = {s.uuid: sorted(pids & set(s.pids)) for s in samples if pids & set(s.pids)}
        if not holders or time.monotonic() > deadline:
            break
        time.sleep(0.25)
    mine = [s for s in samples if gpu_uuid_key(s.uuid) in ranks_on] or samples

    def name(s: GpuSample) -> str:
        ranks = ranks_on.get(gpu_uuid_key(s.uuid))
        return card_label(s.uuid, s.index) + (f" rank {','.join(map(str, ranks))}" if ranks else "")
    used = ", ".join(f"{name(s)} {s.used_bytes / 2**30:.1f}/{s.total_bytes / 2**30:.0f} GiB used" for s in mine)
    if holders:
        by_uuid = {s.uuid: s for s in samples}
        held = "; ".join(f"{name(by_uuid[u])} still held by pid(s) {p}" for u, p in holders.items())
        return f"GPU memory NOT released: {held} ({used})"
    return f"GPU memory released: no process of the run on any GPU ({used})"
