"""The host's side of an offloaded step in the speed model (plan/speed/model.py): the PCIe copies of the
parameters in and the gradients out, the share of them the compute waits on, and the optimizer step on the
host at its memory bandwidth (HostRates: --host-gbps, $SHARDCONSOLE_HOST_GBPS or the H200 test host's,
scaled by cores). Apart from model.py because these rates are the host's, not the card's: they are set,
measured and reported on their own (plan's "host step at ... GB/s" note). Pure: no torch, no probes.
"""

from __future__ import annotations

from dataclasses import dataclass

from shardconsole.envvars import read
from shardconsole.plan.machine import Hardware
from shardconsole.plan.speed.cards import GB, Card
from shardconsole.settings import config as C

HOST_GBPS_ENV = "SHARDCONSOLE_HOST_GBPS"

# Offload copies on the H200's PCIe 5.0 (benchmarks/results/issue35_*: the offload view's h2d/d2h bytes
# and seconds): a micro-batch sends 4 bytes a parameter either way; fp32 masters go at 25 GB/s (the fp32
# shard is sent and cast on the GPU), a bf16/fp16 copy at 48; gradients come back at 49.
PCIE_SHARE_FP32_H2D = 25.0 / 54.4
PCIE_SHARE_LOW_H2D = 48.0 / 54.4
PCIE_SHARE_D2H = 49.0 / 54.4
# The share of the H2D time the compute waits for (GPU span less the compute predicted): fp32 masters
# (the shard is sent, then cast on the GPU before the layer can run) 0.85: 3B mb 2 and 4, 0.43 s of
# 0.48, 7B mb 12 ~0.9 s of 1.04; a bf16 copy 0.4: 13B mb 8, ~0.4 s of 1.1 (issue35_20261203, session6).
EXPOSED_FP32 = 0.85
EXPOSED_LOW = 0.4
# Host memory bandwidth a step reaches, the H200 test host (16 cores): AdamW's bytes over its host step
# (3B fp32 masters 0.79 s, 7B 1.60 s, 13B bf16 masters 2.9 s): ~118 GB/s.
DEFAULT_HOST_GBPS = 118.0
DEFAULT_HOST_CORES = 16
# DeepSpeed's C++ CPUAdam against the same bytes, by ZeRO stage: its step and its copies run slower in this
# package's runs. ZeRO-3 (3B under 24 GiB, offload against FSDP2's: session4/rds.json, h200_issue7.json):
# 2.0. ZeRO-1/2 step one flat fp32 partition: the h200-fsdp preset as ZeRO-2 + offload_optimizer cpu (1b,
# mb 3, 24 GiB cap, H200, 16 cores) stepped in 0.578 s (10,637 tokens/s), 0.45 s of it beside its 0.13 s GPU
# part: 1.7 (2.0 planned it 12% slow; issue 63). One run: the split between the stages is that run's alone.
DS_OFFLOAD_SLOWDOWN = {"stage3": 2.0, "stage12": 1.7}


@dataclass(frozen=True)
class HostRates:
    gbps: float                 # memory bandwidth a step reaches
    cores: int
    source: str                 # "SHARDCONSOLE_HOST_GBPS", "assumed (the H200 test host's)"


def host_rates(hw: Hardware) -> HostRates:
    """The host's rates: --host-gbps when given (hw.host_gbps), else $SHARDCONSOLE_HOST_GBPS when set, else
    the H200 test host's, scaled down by cores where the host has fewer (a host step of torch's foreach
    AdamW uses every core); the cores are --host-cores' when given, else this machine's."""
    if hw.host_gbps > 0:
        return HostRates(hw.host_gbps, hw.cpus, "--host-gbps")
    gbps = read(HOST_GBPS_ENV)      # checked: a bad value is refused, not passed over (envvars.check)
    if gbps:
        return HostRates(gbps, hw.cpus, HOST_GBPS_ENV)
    cores = hw.cpus or DEFAULT_HOST_CORES
    share = min(1.0, cores / DEFAULT_HOST_CORES)
    whose = "--host-cores'" if "--host-cores" in hw.host_given else ("this host's" if hw.cpus else "assumed")
    return HostRates(DEFAULT_HOST_GBPS * share, cores,
                     f"the H200 test host's {DEFAULT_HOST_GBPS:.0f} GB/s at {DEFAULT_HOST_CORES} cores, "
                     f"scaled to {whose} cores")


def host_step_bytes(cfg: C.RunConfig) -> float:
    """Bytes AdamW reads and writes a parameter on the host: fp32 masters read master, gradient and two
    moments (16) and write three back (12) and the compute copy (2): 30, counted as 33 (the fp32 step ran at
    88-95 GB/s of these 30 bytes on issue 45's H200 host, 119-126 on earlier calls' hosts: 33 bytes at
    DEFAULT_HOST_GBPS splits them); bf16 masters 2 + 4 (fp32 gradient) + 8 read, 10 written (119 GB/s on
    both); stochastic/kahan rounding draw or keep one more word each."""
    if cfg.optim.name == "adam-mini":
        # backends/optim/adam_mini.py: reads the bf16 weight, its remainder, the bf16 moment and the bf16
        # gradient (8), writes the first three (6); the row means add a read of the gradient, from cache
        return 16.0 if cfg.split_masters else 12.0
    if cfg.precision.master_dtype == "bf16":
        extra = 4 if cfg.precision.master_rounding != "nearest" else 0
        return 24.0 + extra
    return 33.0


def host_transfers(cfg: C.RunConfig, card: Card, host: HostRates, n: int, trained: float, ranks: int,
                    params_on_host: bool, step_on_host: bool) -> tuple[float, float, float, float]:
    """Offload's costs, each rank's: (h2d, d2h) a micro-batch's PCIe copies of the parameters in and the
    gradients out, the host optimizer step, and the part of h2d the GPU waits on (exposed)."""
    h2d = d2h = host_s = 0.0
    exposed = 0.0
    if params_on_host:
        low = (cfg.precision.master_dtype == "bf16" or cfg.fsdp.offload_compute_copy
               or cfg.parallel.backend == "deepspeed")
        h2d = 4.0 * n / ranks / (card.pcie_gbps * GB * (PCIE_SHARE_LOW_H2D if low else PCIE_SHARE_FP32_H2D))
        exposed = h2d * (EXPOSED_LOW if low else EXPOSED_FP32)
    if step_on_host:
        reduce = cfg.precision.reduce_dtype or ("fp32" if cfg.parallel.backend == "fsdp" else cfg.precision.dtype)
        d2h = (4.0 if reduce == "fp32" else 2.0) * trained / ranks / (card.pcie_gbps * GB * PCIE_SHARE_D2H)
        host_s = host_step_bytes(cfg) * trained / ranks / (host.gbps * GB)
        if cfg.parallel.backend == "deepspeed":
            host_s *= DS_OFFLOAD_SLOWDOWN["stage3" if cfg.deepspeed.stage == 3 else "stage12"]
    return h2d, d2h, host_s, exposed


def host_note(host: HostRates) -> str:
    """Where the host step's bandwidth and cores came from, and how to set them."""
    cores = f"{host.cores} cores" if host.cores else "cores not known"
    return (f"host step at {host.gbps:.0f} GB/s, {cores} ({host.source}"
            + ("" if host.source in ("--host-gbps", HOST_GBPS_ENV) else
               f"; --host-gbps or ${HOST_GBPS_ENV} sets the bandwidth, --host-cores the cores") + ")")
