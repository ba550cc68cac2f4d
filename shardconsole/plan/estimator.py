"""The estimate: the GPU peak of the largest rank and the host peak of the node, the budgets and
the verdict (estimate, Estimate); the model states alone (model_states); and replace_cfg, the
settings with a few changes."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from shardconsole.settings import config as C
from shardconsole.settings.models import ModelSpec
from shardconsole.plan import grpo_terms
from shardconsole.plan.activation_memory import activations
from shardconsole.machine.hardware import driver_reserved_bytes
from shardconsole.plan.constants import (ALLOCATOR_SLACK_FIXED, ALLOCATOR_SLACK_FRACTION, CUDA_CONTEXT_BYTES,
                                         DTYPE_BYTES, HOST_USABLE_FRACTION, LONG_CONTEXT, MLP_TILE, RANK_BASE_RSS_CPU,
                                         REQUIRED_FIXED, REQUIRED_FRAGMENTATION)
from shardconsole.plan.deepspeed_rank import deepspeed_rank_memory
from shardconsole.plan.fsdp_rank import fsdp_rank_memory
from shardconsole.plan.host import HostPeak, host_peak, compile_threads, compile_workers_bytes  # noqa: F401
from shardconsole.plan.loading import Loading, loading
from shardconsole.plan.lora import lora_rank, trainable_params
from shardconsole.plan.machine import Hardware
from shardconsole.plan.rank import RankMemory
from shardconsole.plan.saves import Saves, saves
from shardconsole.plan.shapes import Shapes, shard_numel
from shardconsole.plan import optim_states


@dataclass
class Estimate:
    gpu_peak_bytes: int                     # largest rank's device as NVML sees it: allocator peak + CUDA
                                            # context + the driver's reserved bytes
    host_peak_bytes: int                    # the node: its ranks + launcher + front end
    fits: bool
    gpu_parts: dict[str, int]               # alive at the GPU peak; sums to gpu_peak_bytes
    host_parts: dict[str, int]              # at the host peak; sums to host_peak_bytes
    verdict: str
    gpu_allocator_peak_bytes: int = 0       # max_memory_reserved of the largest rank, memory to spare
    gpu_allocated_peak_bytes: int = 0       # max_memory_allocated of the largest rank
    gpu_required_bytes: int = 0             # what the allocator must be allowed (a cap, a card) to run
    gpu_peak_phase: str = ""                # the moment that sets the GPU peak
    gpu_phases: dict[str, int] = field(default_factory=dict)   # allocated bytes at each moment
    gpu_budget_bytes: int | None = None     # what the allocator may use: the device less the driver and context
    gpu_device_bytes: int | None = None     # the device planned for, as NVML totals it: the card, or the cap
                                            # (memory.gpu_memory_limit names a card of that size)
    gpu_driver_reserved_bytes: int = 0      # the driver's part of that device (machine/hardware.CARD_MEMORY)
    host_budget_bytes: int | None = None
    host_rank_bytes: int = 0                # one rank's peak RSS
    ranks_per_node: int = 1
    alternatives: dict[str, int] = field(default_factory=dict)  # the activations the other way, etc.
    notes: list[str] = field(default_factory=list)
    model: str = ""
    n_params: int = 0
    host_peak_phase: str = ""               # the moment of a rank that sets the host peak ("training", "saving", ...)
    host_save_adds_bytes: int = 0           # what the save adds to the node over training
    host_phases: dict[str, int] = field(default_factory=dict)  # the node's ranks' bytes at each moment
    saves: Saves | None = None              # what the run writes to disk (plan/saves.py)
    trainable_params: int = 0               # what the optimizer steps: n_params, or the adapters (train.method)
    loading: Loading | None = None          # loading the model folder's weights (plan/loading.py); None: no folder

    @property
    def trainable_line(self) -> str:
        """"40.0M of 6.74B trainable, 0.59%"."""
        from shardconsole.settings.models import human_count
        n, total = self.trainable_params or self.n_params, max(self.n_params, 1)
        return f"{human_count(n)} of {human_count(total)} trainable, {100 * n / total:.2f}%"

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model, "n_params": self.n_params, "trainable_params": self.trainable_params,
            "gpu_peak_bytes": self.gpu_peak_bytes, "host_peak_bytes": self.host_peak_bytes,
            "fits": self.fits, "verdict": self.verdict,
            "gpu_parts": dict(self.gpu_parts), "host_parts": dict(self.host_parts),
            "gpu_allocator_peak_bytes": self.gpu_allocator_peak_bytes,
            "gpu_allocated_peak_bytes": self.gpu_allocated_peak_bytes, "gpu_required_bytes": self.gpu_required_bytes,
            "gpu_peak_phase": self.gpu_peak_phase, "gpu_phases": dict(self.gpu_phases),
            "gpu_budget_bytes": self.gpu_budget_bytes, "host_budget_bytes": self.host_budget_bytes,
            "gpu_device_bytes": self.gpu_device_bytes, "gpu_driver_reserved_bytes": self.gpu_driver_reserved_bytes,
            "host_rank_bytes": self.host_rank_bytes, "ranks_per_node": self.ranks_per_node,
            "alternatives": dict(self.alternatives), "notes": list(self.notes),
            "host_peak_phase": self.host_peak_phase, "host_save_adds_bytes": self.host_save_adds_bytes,
            "host_phases": dict(self.host_phases),
            "saves": self.saves.to_dict() if self.saves is not None else None,
            "loading": self.loading.to_dict() if self.loading is not None else None,
        }


def _cpu_ranks(cfg: C.RunConfig, s: Shapes) -> RankMemory:
    """device = cpu: everything lives in host memory; rough (no calibration on CPU)."""
    r = (fsdp_rank_memory(replace_cfg(cfg, ("fsdp", "cpu_offload", False)), s) if cfg.parallel.backend == "fsdp"
         else deepspeed_rank_memory(cfg, s))
    moment = max(r.gpu, key=lambda k: sum(r.gpu[k].values()))
    parts = {k: v for k, v in r.gpu[moment].items() if v and k != "cuBLAS workspaces"}
    host = {"process (python, torch)": RANK_BASE_RSS_CPU, **parts}
    return RankMemory({}, {"training": host}, ["CPU ranks: the training memory is host memory (not calibrated)"])


def _device(cfg: C.RunConfig, hw: Hardware) -> tuple[int | None, int, str]:
    """The device a run is planned for: (its total as NVML reports it, the driver's part of it, how the
    verdict names it). A cap smaller than the card is a card of that size, the whole device (issue 34)."""
    cap, card = cfg.gpu_memory_limit_bytes, hw.gpu_memory_bytes or None
    if cap and (card is None or cap < card):
        return cap, driver_reserved_bytes(None, cap), f"the {C.format_size(cap)} cap"
    if card:
        return card, driver_reserved_bytes(hw.gpu_name, card), f"the {C.format_size(card)} card"
    return None, driver_reserved_bytes(hw.gpu_name, None), ""


# ---------------------------------------------------------------------------------------------------
# The estimate

def estimate(cfg: C.RunConfig, spec: ModelSpec, hw: Hardware, *, start_step: int = 0,
             existing: Sequence[int] = ()) -> Estimate:
    """start_step, existing: a resumed run's newest checkpoint step and the sizes of the checkpoints
    already in its folder (oldest first), for the disk total."""
    s = Shapes.of(spec)
    on_cpu = cfg.parallel.device == "cpu"
    r = _rank_model(cfg, s)
    g = _gpu(cfg, r, hw)
    sv = saves(cfg, s, spec.path, start_step=start_step, existing=existing)
    ld = loading(cfg, spec, s)
    h = host_peak(cfg, r, sv, hw, ld)
    reasons, gpu_budget, host_budget = _budgets(cfg, hw, g, h, ld)
    notes = list(r.notes)
    if ld is not None:
        notes.append(f"loading the model folder: {ld.who} reads its {C.format_size(ld.mapped_bytes)} of weights "
                     f"files; their pages stay resident while it loads (the rank's RSS shows them) but are page "
                     f"cache the kernel can drop, so they are not counted here")
    if gpu_budget is not None and g.required <= gpu_budget < g.allocator_peak:
        notes.append(_allocator_at_budget(g, r, gpu_budget))
    notes += preference_notes(cfg) + grpo_terms.notes(cfg, s)
    a = activations(cfg, s)
    alt = {("activations without checkpointing" if cfg.memory.activation_checkpointing
            else "activations with checkpointing"): a.alternative_saved}
    est = Estimate(gpu_peak_bytes=int(g.peak), host_peak_bytes=int(h.peak), fits=not reasons,
                   gpu_parts=g.parts, host_parts=h.parts, verdict="",
                   gpu_allocator_peak_bytes=int(g.allocator_peak), gpu_peak_phase=g.moment,
                   gpu_allocated_peak_bytes=int(g.allocated_peak), gpu_required_bytes=int(g.required),
                   gpu_phases={k: int(v) for k, v in g.phases.items()}, gpu_budget_bytes=gpu_budget,
                   gpu_device_bytes=None if on_cpu else g.device_total, gpu_driver_reserved_bytes=g.reserved,
                   host_budget_bytes=host_budget, host_rank_bytes=int(h.rank), ranks_per_node=h.per_node,
                   alternatives=alt, notes=notes, model=spec.name, n_params=s.n_params,
                   host_peak_phase=h.moment, host_save_adds_bytes=int(h.save_adds), saves=sv,
                   host_phases={k: int(v) for k, v in h.node.items()}, loading=ld,
                   trainable_params=trainable_params(cfg, s) if cfg.adapters else s.n_params)
    est.verdict = _verdict(est, reasons, cfg)
    return est


def preference_notes(cfg: C.RunConfig) -> list[str]:
    """What a preference objective adds (backends/objective/preference.py), beside the activations of two rows
    a pair that the memory above counts already."""
    objective = cfg.train.objective
    if objective in ("sft", "grpo"):
        return []
    out = [f"{objective}: a sample is a pair, its chosen and rejected rows of data.seq_len tokens together "
           f"(micro_batch {cfg.train.micro_batch} = {cfg.train.micro_batch * 2} sequences a forward)"]
    if objective in ("dpo", "kto") and cfg.adapters:
        out.append(f"{objective} with adapters: the reference is the base with the adapters off, one more forward without "
                   "grad a micro-batch (about a third more compute a step, no more memory than the forward)")
    elif objective in ("dpo", "kto"):      # KTO's pair: a record's row and its KL row, both with a reference
        out.append(f"{objective}, full fine-tuning: before step 1 a reference pass, one forward without grad over every pair "
                   "(about a third of what an epoch of steps computes), cached beside the token cache at 16 bytes a "
                   "pair and read back by later runs and resumes on the same model and data")
    return out


def _rank_model(cfg: C.RunConfig, s: Shapes) -> RankMemory:
    """One rank's memory by moment, from the model of its engine."""
    if cfg.adapters:
        r = lora_rank(cfg, s)       # LoRA / QLoRA, either engine (plan/lora.py)
    elif cfg.parallel.device == "cpu":
        return _cpu_ranks(cfg, s)
    else:
        r = fsdp_rank_memory(cfg, s) if cfg.parallel.backend == "fsdp" else deepspeed_rank_memory(cfg, s)
    if cfg.train.objective == "grpo" and r.gpu:
        ref = grpo_terms.reference_bytes(cfg, s)
        if ref:
            for parts in r.gpu.values():
                parts["grpo reference (frozen copy)"] = ref
        r.gpu["sampling"] = grpo_terms.sampling_moment(cfg, s, r.gpu)
    return r


@dataclass
class _Gpu:
    """The largest rank's device: its moments, the peak and what the allocator must be allowed."""
    device_total: int | None
    reserved: int                      # the driver's part, which NVML counts
    device_what: str                   # how the verdict names the device
    phases: dict[str, int]             # allocated bytes at each moment of the compute stream
    moment: str = ""
    parts: dict[str, int] = field(default_factory=dict)
    allocated_peak: int = 0
    allocator_peak: int = 0
    context: int = 0
    peak: int = 0
    required: int = 0


def _gpu(cfg: C.RunConfig, r: RankMemory, hw: Hardware) -> _Gpu:
    """The compute stream's largest moment, the pools of the other streams, the allocator's
    fragmentation, then the context outside the allocator."""
    phases = {k: sum(v.values()) for k, v in r.gpu.items()}
    g = _Gpu(*_device(cfg, hw), phases)
    if not phases:
        return g
    g.moment = max(phases, key=lambda k: phases[k])
    allocated = phases[g.moment]
    g.parts = {k: int(v) for k, v in r.gpu[g.moment].items() if v}
    g.parts.update({k: int(v) for k, v in r.side.items() if v})
    slack = int(allocated * ALLOCATOR_SLACK_FRACTION) + ALLOCATOR_SLACK_FIXED
    g.parts["allocator slack (fragmentation)"] = slack
    g.allocator_peak = allocated + sum(r.side.values()) + slack
    g.context = CUDA_CONTEXT_BYTES[cfg.parallel.backend]
    g.parts["CUDA context + NCCL"] = g.context
    # NVML's used bytes of the device include what the driver keeps on an idle card: the peak is
    # given as a user reads it (nvidia-smi, the console's GPU panel, issue 16's measured runs).
    g.parts["driver reserved (NVML counts it)"] = g.reserved
    g.peak = g.allocator_peak + g.context + g.reserved
    # Under a cap the allocator frees its cached blocks and retries before it fails, so a run
    # needs its largest allocated moment (compute stream + the pools' live part), plus headroom
    # for blocks it cannot free (split segments).
    live = {k: v + r.side_live.get(k, 0) for k, v in phases.items()}
    g.allocated_peak = max(live.values())
    g.required = int(g.allocated_peak * (1 + REQUIRED_FRAGMENTATION)) + REQUIRED_FIXED
    if cfg.parallel.backend == "deepspeed":
        # DeepSpeed's step allocates multi-GiB contiguous buffers (the fp32 gradients of a
        # sub-group): after the allocator frees its cached blocks the memory is still in split
        # segments and the retry fails. Measured: ZeRO-3 1b with a cap 8% over the allocated-peak
        # rule died at step 2 (edge-ds-1b-z3-mb4-ckpt-above). It needs its full reserved peak.
        g.required = max(g.required, g.allocator_peak)
    return g


def _allocator_at_budget(g: _Gpu, r: RankMemory, gpu_budget: int) -> str:
    """The allocator stops at the budget: it frees cached blocks and retries instead of growing. The
    slack and the pools are cut to it; the note that says so."""
    excess = g.allocator_peak - gpu_budget
    for key in ["allocator slack (fragmentation)"] + [k for k in r.side if k in g.parts]:
        cut = min(excess, g.parts.get(key, 0))
        g.parts[key] -= cut
        excess -= cut
    g.allocator_peak = gpu_budget
    g.peak = g.allocator_peak + g.context + g.reserved
    return ("the allocator will reach the budget and free cached blocks to go on (steps a little slower); "
            "with memory to spare it would reserve more")


def _host_total(cfg: C.RunConfig, hw: Hardware) -> tuple[int, str]:
    """The host RAM a run is planned against, and how the verdict names it: memory.host_memory_limit where
    it is below the machine's (a box of that size, as gpu_memory_limit is a card of that size), else the
    machine's (--host-memory's, or this one's)."""
    cap = cfg.host_memory_limit_bytes
    if cap and (not hw.host_memory_bytes or cap < hw.host_memory_bytes):
        return cap, f"the {C.format_size(cap)} of memory.host_memory_limit"
    return hw.host_memory_bytes, C.format_size(hw.host_memory_bytes)


def _budgets(cfg: C.RunConfig, hw: Hardware, g: _Gpu, h: HostPeak,
             ld: Loading | None = None) -> tuple[list[str], int | None, int | None]:
    """(why it does not fit, the allocator's budget, the host's). The allocator's budget: what the
    device (the card, or a cap: a card of that size) gives to processes, less the rank's context and
    NCCL. The same for a 24 GiB cap on a big card and for a real 24 GB card (issue 34): the cap's
    allocator fraction is set from it (backends/rank/common.py)."""
    gpu_budget = None
    reasons: list[str] = []
    if cfg.parallel.device != "cpu":
        gpu_budget = max(g.device_total - g.reserved - g.context, 0) if g.device_total else None
        if hw.gpus and h.per_node > hw.gpus:
            reasons.append(f"{h.per_node} ranks per node but the node has {hw.gpus} GPU(s)")
        if gpu_budget is None:
            reasons.append("no GPU found here and no GPU size given (--gpu-memory SIZE or memory.gpu_memory_limit)")
        elif g.required > gpu_budget:
            reasons.append(f"GPU needs {C.format_size(g.required + g.context + g.reserved)} (allocator "
                           f"{C.format_size(g.required)} + context {C.format_size(g.context)} + driver "
                           f"{C.format_size(g.reserved)}) over {g.device_what}")
    host_total, host_what = _host_total(cfg, hw)
    host_budget = int(host_total * HOST_USABLE_FRACTION) if host_total else None
    if host_budget is not None and h.peak > host_budget:
        line = f"host needs {C.format_size(h.peak)} over {C.format_size(host_budget)} usable of {host_what}"
        if h.moment == "loading" and ld is not None:
            # the load, not training, is what does not fit: say so, and what the code offers against it
            trained = h.peak - h.node["loading"] + max(v for k, v in h.node.items() if k != "loading")
            line += (f" while loading the model folder (the other moments need {C.format_size(trained)}; "
                     f"{ld.help})")
        reasons.append(line)
    return reasons, gpu_budget, host_budget


def model_states(cfg: C.RunConfig, spec: ModelSpec) -> dict[str, dict[str, int]]:
    """Parameters, gradients and optimizer states of one rank, where they live ("gpu" / "host"), in
    bytes: the part of the estimate that the article's 16 bytes a parameter and DeepSpeed's
    estimate_zero*_model_states_mem_needs count (no activations, buffers or allocator)."""
    s = Shapes.of(spec)
    p = cfg.parallel
    W = p.nproc_per_node * p.nnodes
    c = DTYPE_BYTES[cfg.precision.dtype]
    out: dict[str, dict[str, int]] = {"gpu": {}, "host": {}}
    if p.backend == "fsdp":
        shard = {"no_shard": 1, "hybrid_shard": p.nproc_per_node}.get(cfg.fsdp.sharding, W)
        numels = [shard_numel(sh, shard) for sh in s.all_params()]
        n = sum(numels)
        where = out["host" if cfg.fsdp.cpu_offload else "gpu"]
        m = cfg.kept_bytes
        opt_bytes = optim_states.states_bytes(cfg, s.all_params(), shard, numels)   # torchao's low-bit blocks too
        # optim.step_in_backward: a layer's gradients live from their reduce-scatter to their steps (one
        # buffer a layer, freed when its last view is), so one layer's (or the root's) at most
        one_layer = max(sum(shard_numel(sh, shard) for sh in part) for part in (s.layer_params(), s.root_params()))
        grads = m * one_layer if cfg.optim.step_in_backward else m * n
        where.update({"parameters": m * n, "gradients": grads, "optimizer states": opt_bytes})
        return out
    d = cfg.deepspeed
    P = s.n_params
    part = -(-P // W)
    m = 2 if cfg.precision.master_dtype == "bf16" and d.stage >= 1 else 4
    opt = out["host" if d.offload_optimizer != "none" and d.stage >= 1 else "gpu"]
    if d.stage == 3:
        out["host" if d.offload_param != "none" else "gpu"]["parameters"] = c * part
        opt.update({"gradients": c * part, "optimizer states": 3 * m * part})     # master + Adam
    elif d.stage in (1, 2):
        out["gpu"]["parameters"] = c * P
        grads = c * (part if d.stage == 2 else P)
        opt.update({"optimizer states": 3 * m * part})
        (opt if d.offload_optimizer != "none" else out["gpu"])["gradients"] = grads
    else:
        fp32_grads = cfg.precision.dtype == "bf16"    # BF16_Optimizer keeps fp32 gradients
        out["gpu"].update({"parameters": c * P, "gradients": (4 if fp32_grads else c) * P,
                           "optimizer states": (8 if c == 4 else 12) * P})
    return out


def _verdict(e: Estimate, reasons: list[str], cfg: C.RunConfig) -> str:
    if reasons:
        if e.gpu_budget_bytes is None and e.gpu_parts and len(reasons) == 1:
            return "cannot tell: " + reasons[0]
        hint = ""
        if any(r.startswith("GPU needs") for r in reasons):
            sized = [(k, v) for k, v in e.gpu_parts.items()
                     if "context" not in k and "slack" not in k and "pool" not in k and "cached" not in k]
            largest = max(sized, key=lambda kv: kv[1])[0] if sized else ""
            if largest.startswith("activations") or largest in ("loss chunk", "layer backward"):
                hint = "largest part: activations; lower train.micro_batch or data.seq_len" + _activation_hint(cfg)
            elif largest.startswith("sampling"):
                hint = (f"largest part: {largest}, while GRPO samples; lower grpo.generations, train.micro_batch, "
                        "data.seq_len or grpo.max_new_tokens")
            elif largest:
                hint = f"largest part: {largest}; shard it over more GPUs or offload it to the CPU"
        return "does not fit: " + "; ".join(reasons) + (f" ({hint})" if hint else "")
    parts = []
    if e.gpu_budget_bytes and e.gpu_device_bytes:
        # The peak against the whole card, as nvidia-smi shows it (issue 34: "needs 16.3 of 24.0 GiB (68%)"
        # read as room to spare on a run at 97% of the card); what the allocator cannot do without after.
        parts.append(gpu_peak_text(e) + f" (the allocator needs {C.format_size(e.gpu_required_bytes)} of the "
                     f"{C.format_size(e.gpu_budget_bytes)} left to it after context and driver; more it caches)")
    if e.host_budget_bytes:
        parts.append(f"host {C.format_size(e.host_peak_bytes)} of {C.format_size(e.host_budget_bytes)} usable")
    tight = e.gpu_budget_bytes and e.gpu_required_bytes > 0.9 * e.gpu_budget_bytes
    return ("fits, tight" if tight else "fits") + (": " + ", ".join(parts) if parts else "")


def _activation_hint(cfg: C.RunConfig) -> str:
    """The setting that moves activations off the card, where one is still off: checkpointing, then at long
    sequences the layer inputs on the host and the MLP in tiles (FSDP2 only: ZeRO's hooks refuse tiles)."""
    m = cfg.memory
    if not m.activation_checkpointing:
        return ", or set memory.activation_checkpointing = true"
    if cfg.data.seq_len < LONG_CONTEXT:
        return ""
    missing = ([] if m.activation_offload else ["memory.activation_offload = true"]) + (
        [f"memory.mlp_tile_tokens = {MLP_TILE}"] if not m.mlp_tile_tokens and cfg.parallel.backend == "fsdp" else [])
    return ", or set " + " and ".join(missing) if missing else ""


def gpu_peak_text(e: Estimate) -> str:
    """"peak 23.7 of 24.0 GiB (99%) as NVML shows it": the largest rank's device against its total."""
    if not e.gpu_device_bytes:
        return f"peak {C.format_size(e.gpu_peak_bytes)} as NVML shows it"
    return (f"peak {C.format_size(e.gpu_peak_bytes)} of {C.format_size(e.gpu_device_bytes)} "
            f"({100 * e.gpu_peak_bytes / e.gpu_device_bytes:.0f}%) as NVML shows it")


def replace_cfg(cfg: C.RunConfig, *changes: tuple[str, str, Any]) -> C.RunConfig:
    """A copy of cfg with (table, key, value) changes, checked like a preset."""
    out = C.copy(cfg)
    for table, key, value in changes:
        setattr(getattr(out, table), key, value)
    return out


def host_peak_line(e: Estimate) -> str:
    """Which moment sets the host peak, and what the save adds: "host peak 56.1 GiB (training); the save
    adds 0.8 GiB"."""
    line = f"host peak {C.format_size(e.host_peak_bytes)} ({e.host_peak_phase})"
    if e.host_save_adds_bytes:
        line += f"; the save adds {C.format_size(e.host_save_adds_bytes)}"
        if e.host_peak_phase != "saving":
            line += " (under the peak)"
    elif e.saves is not None and not e.saves.schedule and not e.saves.export_dir:
        line += "; no save"
    return line
