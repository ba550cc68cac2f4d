"""The node's host RAM at its peak: one rank's largest moment (training, the save, tokenizing) times
the local ranks, plus the launcher, the front end and torch.compile's workers (host_peak); the line that
names the moment (estimator.host_peak_line)."""

from __future__ import annotations

import os
from dataclasses import dataclass

from shardconsole.settings import config as C
from shardconsole.settings.data.data_scan import TOKENIZE_WORK_BYTES
from shardconsole.plan.constants import (COMPILE_SIDECAR_BYTES, COMPILE_THREADS_MAX, COMPILE_WORKER_BYTES,
                                         FRONTEND_RSS, LAUNCHER_RSS)
from shardconsole.plan.loading import Loading
from shardconsole.plan.machine import Hardware
from shardconsole.plan.rank import RankMemory
from shardconsole.plan.saves import Saves


def compile_threads(hw: Hardware) -> int:
    """inductor's compile_threads: min(32, the CPUs a rank may use) (torch/_inductor/config.py)."""
    return min(COMPILE_THREADS_MAX, hw.cpus or os.cpu_count() or 1)


def compile_workers_bytes(cfg: C.RunConfig, hw: Hardware) -> int:
    """One rank's torch.compile processes (train.compile): the sidecar and its worker pool."""
    if not cfg.train.compile:
        return 0
    return COMPILE_SIDECAR_BYTES + compile_threads(hw) * COMPILE_WORKER_BYTES


@dataclass
class HostPeak:
    """The node at its peak: one rank's largest moment times the local ranks, and the rest."""
    phases: dict[str, int]             # the largest rank's bytes at each moment (rank 0's)
    node: dict[str, int]               # the node's ranks' bytes at each moment
    moment: str                        # the node's largest
    rank: int                          # the largest rank at the node's peak
    parts: dict[str, int]
    peak: int
    save_adds: int
    per_node: int


def host_peak(cfg: C.RunConfig, r: RankMemory, sv: Saves, hw: Hardware, ld: Loading | None = None) -> HostPeak:
    """One rank's largest moment (the save's among them: plan/saves.py; loading a model folder's weights:
    plan/loading.py, where rank 0 may hold more than the others); the node holds every local rank, the
    launcher, the front end and, with train.compile, inductor's compile workers."""
    host_by_phase = {k: dict(v) for k, v in r.host.items()}
    rank0_adds: dict[str, dict[str, int]] = {}      # moment -> parts rank 0 holds on top of every rank's
    others_add: dict[str, dict[str, int]] = {}      # moment -> parts the other ranks hold on top
    if sv.host_add_rank_bytes:
        # the save runs after training, with training's memory still held (its start-up transients gone, and
        # the offloaded gradients' pinned blocks, which the FSDP2 rank gives back before a save: fsdp_engine)
        held = {k: v for k, v in host_by_phase["training"].items() if "transient" not in k and "in flight" not in k}
        host_by_phase["saving"] = {**held, "save (the piece being written)": sv.host_add_rank_bytes}
    if cfg.data.source in ("auto", "text") and cfg.data.path:
        # One rank tokenizes before training (the others wait): its tokenizer's work is bounded by
        # the batch of text it is handed (backends/data/corpus.py), whatever the records' length.
        base = {k: v for k, v in host_by_phase["training"].items() if k.startswith("process")}
        host_by_phase["tokenizing"] = {**base, "tokenizer before training (one rank's work, split over the node)":
                                       TOKENIZE_WORK_BYTES // max(1, cfg.parallel.nproc_per_node)}
    if ld is not None:
        host_by_phase.pop(ld.replaces, None)      # ZeRO-0/1/2: the folder is the model built on the CPU
        host_by_phase["loading"], rank0_adds["loading"], others_add["loading"] = ld.each, ld.rank0, ld.others
    per_node = cfg.parallel.nproc_per_node
    n_others = per_node - 1

    def adds(k: str) -> tuple[int, int]:
        """(what rank 0 adds, what each other rank adds) at moment k"""
        other = sum(others_add.get(k, {}).values()) if n_others else 0
        return sum(rank0_adds.get(k, {}).values()), other
    # the largest rank's bytes, and the node's, at each moment
    hphases = {k: sum(v.values()) + max(adds(k)) for k, v in host_by_phase.items()}
    node = {k: sum(v.values()) * per_node + adds(k)[0] + adds(k)[1] * n_others for k, v in host_by_phase.items()}
    hmoment = max(node, key=lambda k: node[k])
    host_parts = {k + (f" x {per_node} ranks" if per_node > 1 else ""): int(v) * per_node
                  for k, v in host_by_phase[hmoment].items() if v}
    host_parts.update({k: int(v) for k, v in rank0_adds.get(hmoment, {}).items() if v})
    if n_others:
        host_parts.update({k + (f" x {n_others} ranks" if n_others > 1 else ", rank 1"): int(v) * n_others
                           for k, v in others_add.get(hmoment, {}).items() if v})
    host_parts["launcher (torchrun)" if cfg.parallel.launcher == "torchrun" else "launcher (deepspeed)"] = LAUNCHER_RSS
    host_parts["front end"] = FRONTEND_RSS
    compile_b = compile_workers_bytes(cfg, hw)
    if compile_b:
        host_parts[f"torch.compile workers ({compile_threads(hw)} + 1 a rank)"] = compile_b * per_node
    return HostPeak(hphases, node, hmoment, hphases[hmoment], host_parts, sum(host_parts.values()),
                 sv.host_add_rank_bytes * per_node, per_node)
