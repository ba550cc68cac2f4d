"""What a run writes to disk and what its saves add to host RAM, before it is launched (issue 30).

Sizes as the engines write them (checked against real tiny-cpu checkpoints on disk in tests/test_plan_saves.py):

  FSDP2    torch.distributed.checkpoint (DCP): each rank's shards of the weights and of each optimizer
           state, in the master dtype, one torch.save record per tensor (DCP_TENSOR_RECORD_BYTES), the
           replicated step counters once, the .metadata pickle (DCP_METADATA_ITEM_BYTES an item).
  DeepSpeed engine.save_checkpoint: every rank's optimizer partition (the master, Adam's two moments);
           the module's weights in the compute dtype once (ZeRO-0/1/2), or each rank's empty ZeRO-3
           placeholders; zero_to_fp32.py and the other fixed files.
  both     each rank's rank_state/rankN.json (RNG states), the manifest.

A "model" save (train.save_final = "model") is FSDP2's weights alone as the full checkpoint holds them
(DeepSpeed's is a full checkpoint: its master weights live in the optimizer's partitions); the export
(train.export_dir, FSDP2) is a Hugging Face folder of safetensors at train.export_dtype (default: the
master dtype, as export-model).

The disk total follows backends/checkpoint/checkpoints.py: a save writes step_N.partial beside the kept ones and
prunes to train.keep_checkpoints only once it is complete, so the peak is the kept ones plus the one
being written. Standard library only.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shardconsole.settings import config as C
from shardconsole.plan.constants import (DCP_METADATA_ITEM_BYTES, DCP_TENSOR_RECORD_BYTES, DS_FILE_BYTES,
                                         DS_FIXED_FILES_BYTES, DS_TENSOR_RECORD_BYTES, DTYPE_BYTES,
                                         EXPORT_FIXED_BYTES, RANK_STATE_BYTES, SAVE_FIXED_BYTES,
                                         SAFETENSORS_TENSOR_BYTES, GiB)
from shardconsole.plan import optim_states
from shardconsole.plan.shapes import Shapes, shape_numel, shard_numel


def save_final_of(cfg: C.RunConfig) -> str:
    """train.save_final as "full" | "model" | "none" (older settings hold true/false)."""
    v = getattr(cfg.train, "save_final", True)
    if isinstance(v, bool):
        return "full" if v else "none"
    return str(v)


def export_dtype_of(cfg: C.RunConfig) -> str:
    """The export's dtype: train.export_dtype, else the master weights' own (as export-model)."""
    given = getattr(cfg.train, "export_dtype", None)
    if given:
        return str(given)
    if cfg.parallel.backend == "deepspeed" and cfg.deepspeed.stage == 0:
        return "fp32"
    return "bf16" if cfg.kept_bytes == 2 else "fp32"


@dataclass
class Saves:
    """What a run writes (bytes) and keeps, from its settings alone."""
    full_bytes: int                      # one full (resumable) checkpoint, every rank's files
    model_bytes: int                     # one weights-only save
    export_bytes: int                    # the Hugging Face folder at export_dtype
    export_dtype: str
    schedule: list[tuple[int, str]]      # (step, "full" | "model") of each save after start_step
    kept_at_once: int                    # checkpoints on disk at the peak (the kept ones + the one written)
    disk_peak_bytes: int                 # the checkpoint folder at its fullest (checkpoints already there included)
    disk_end_bytes: int                  # the checkpoints kept once the run is done
    existing_bytes: int                  # the checkpoints already there (a resume)
    export_dir: str                      # "" when no export
    host_add_rank_bytes: int             # what a save adds to one rank's RSS beside training
    largest_tensor_bytes: int            # the largest tensor a rank writes (the save's bound: max(1 GiB, this))
    notes: list[str] = field(default_factory=list)

    def size_of(self, kind: str) -> int:
        return self.full_bytes if kind == "full" else self.model_bytes

    def to_dict(self) -> dict[str, Any]:
        return {"full_checkpoint_bytes": self.full_bytes, "model_save_bytes": self.model_bytes,
                "export_bytes": self.export_bytes if self.export_dir else None, "export_dtype": self.export_dtype,
                "export_dir": self.export_dir or None, "saves": [list(s) for s in self.schedule],
                "checkpoints_at_once": self.kept_at_once, "checkpoint_disk_bytes": self.disk_peak_bytes,
                "save_host_add_rank_bytes": self.host_add_rank_bytes}


def schedule(cfg: C.RunConfig, start_step: int = 0, save_final: str | None = None) -> list[tuple[int, str]]:
    """The saves the ranks make after start_step (backends/checkpoint/checkpoints.py save_due, final_save_due):
    every checkpoint_every steps but the last, then the final one."""
    t = cfg.train
    final = save_final or save_final_of(cfg)
    every = t.checkpoint_every
    out = [(s, "full") for s in range(every, t.steps, every) if s > start_step] if every else []
    if t.steps > start_step:
        periodic = bool(every and t.steps % every == 0)
        if final != "none" or periodic:
            # checkpoints.final_what: "model" only when no periodic checkpoint falls on the last step
            out.append((t.steps, "model" if final == "model" and not periodic else "full"))
    return out


def disk_peak(sizes: list[int], keep: int, existing: Sequence[int] = ()) -> tuple[int, int, int]:
    """(bytes at the fullest, checkpoints then, bytes kept at the end) of a checkpoint folder holding
    `existing` (oldest first) that takes `sizes` in turn, pruned to `keep` (0: all) after each is
    complete (the new one is written beside the kept ones first)."""
    kept = collections.deque(existing)
    total = sum(kept)       # kept's sum, carried: a run saving every step of 100,000 was quadratic
    peak, count = total, len(kept)
    for size in sizes:
        if total + size > peak:
            peak, count = total + size, len(kept) + 1
        kept.append(size)
        total += size
        while keep > 0 and len(kept) > keep:
            total -= kept.popleft()
    return peak, count, total


def _fsdp_sizes(cfg: C.RunConfig, s: Shapes) -> tuple[int, int, int]:
    """(full, model, largest tensor) of an FSDP2 DCP checkpoint."""
    p = cfg.parallel
    world = p.nproc_per_node * p.nnodes
    shard = {"no_shard": 1, "hybrid_shard": p.nproc_per_node}.get(cfg.fsdp.sharding, world)
    m = cfg.kept_bytes
    kahan = m == 2 and getattr(cfg.precision, "master_rounding", "") == "kahan"
    states = 3 if kahan else 2               # exp_avg, exp_avg_sq (+ the bf16 compensation)
    state_bytes = states * m * s.n_params
    if cfg.optim.name == "adam-mini":        # exp_avg, exp_avg_sq_row (+ weight_low): optim_states counts them
        states = 3 if cfg.split_masters else 2
        state_bytes = optim_states.adam_mini_bytes(s.all_params(), 1, m, cfg.split_masters)
    n_t = len(s.all_params())
    P = s.n_params
    # DCP writes each distinct shard once (replicas deduplicated): every element once, one record per
    # shard; the step counters (one scalar a tensor) and the top-level step once.
    model_records = shard * n_t
    opt_records = shard * n_t * states + n_t + 1
    model = m * P + model_records * (DCP_TENSOR_RECORD_BYTES + DCP_METADATA_ITEM_BYTES)
    optim = state_bytes + 4 * n_t + 8 + opt_records * (DCP_TENSOR_RECORD_BYTES + DCP_METADATA_ITEM_BYTES)
    fixed = world * RANK_STATE_BYTES + 4096
    largest = m * max(shape_numel(sh) for sh in s.all_params())
    return model + optim + fixed, model + fixed, largest


def _deepspeed_sizes(cfg: C.RunConfig, s: Shapes) -> tuple[int, int, int]:
    """(full, model, largest tensor) of engine.save_checkpoint's files."""
    d, p = cfg.deepspeed, cfg.parallel
    W = p.nproc_per_node * p.nnodes
    c = DTYPE_BYTES[cfg.precision.dtype]
    P = s.n_params
    n_t = len(s.all_params())
    part = -(-P // W)
    fixed = W * RANK_STATE_BYTES + DS_FIXED_FILES_BYTES + 4096
    if d.stage == 0:
        model = c * P + n_t * DS_TENSOR_RECORD_BYTES + DS_FILE_BYTES
        optim = 12 * P + DS_FILE_BYTES        # one fp32 master + Adam's moments
        largest = 4 * P
    else:
        m = 2 if cfg.precision.master_dtype == "bf16" else 4
        if d.stage == 3:
            # each rank's module file holds the ZeRO-3 placeholders (no elements), the weights are in
            # the optimizer partitions
            model = W * (n_t * DS_TENSOR_RECORD_BYTES + DS_FILE_BYTES)
        else:
            model = c * P + n_t * DS_TENSOR_RECORD_BYTES + DS_FILE_BYTES
        optim = W * (3 * m * part + DS_FILE_BYTES)
        largest = m * part                     # a flat partition is one tensor
    # A DeepSpeed "model" save is a full checkpoint (ds_checkpoint.save): the master weights are in the
    # optimizer's partitions, which export-model merges.
    return model + optim + fixed, model + optim + fixed, largest


def _export_bytes(cfg: C.RunConfig, s: Shapes, spec_path: str | Path | None) -> int:
    """model.safetensors at the export dtype, config and tokenizer files."""
    b = DTYPE_BYTES[export_dtype_of(cfg)] * s.n_params + len(s.all_params()) * SAFETENSORS_TENSOR_BYTES
    tok = 0
    if spec_path is not None and Path(spec_path).is_dir():
        for f in Path(spec_path).iterdir():
            if f.is_file() and (f.name.startswith("tokenizer") or f.name in ("special_tokens_map.json", "vocab.json",
                                                                              "merges.txt")):
                tok += f.stat().st_size
    return b + tok + EXPORT_FIXED_BYTES


def host_save_add(cfg: C.RunConfig, s: Shapes) -> tuple[int, int]:
    """(what a checkpoint or model save adds to one rank's RSS over training, what the export adds to
    rank 0's), as the save path copies:
      FSDP2   save_stream.StreamingWriter copies one tensor at a time to the host (a GPU shard, or a view
              into the host arena cloned so that torch.save does not write the whole arena) and drops it
              once written: the rank's largest shard, in the master dtype.
      export  hf_export gathers each tensor whole and rank 0 converts it to export_dtype: one full tensor
              in the master dtype and its converted copy.
      DeepSpeed engine.save_checkpoint's torch.save copies each GPU storage to the host one at a time; a
              flat partition (a ZeRO-3 sub-group, the ZeRO-1/2 partition) is one storage. Offloaded
              states are written from where they are; the module's GPU weights one at a time."""
    p = cfg.parallel
    world = p.nproc_per_node * p.nnodes
    c = DTYPE_BYTES[cfg.precision.dtype]
    m = 2 if cfg.precision.master_dtype == "bf16" else 4
    largest = max(shape_numel(sh) for sh in s.all_params())
    export = (m + (DTYPE_BYTES[export_dtype_of(cfg)] if export_dtype_of(cfg) != ("bf16" if m == 2 else "fp32")
                   else 0)) * largest + SAVE_FIXED_BYTES
    if getattr(cfg, "adapters", False):
        # LoRA / QLoRA save what trains (fp32): an adapter, or a lora.modules_to_save copy, one at a time. The
        # base's largest tensor was counted here: 2 GiB of host RAM for an 8B's embedding a LoRA save never
        # copies (an 8B QLoRA folder planned 4.5 GiB of host, measured 2.8 on an H100).
        from shardconsole.plan.lora import largest_trained
        return 4 * largest_trained(cfg, s) + SAVE_FIXED_BYTES, export
    if p.backend == "deepspeed":
        d = cfg.deepspeed
        if d.stage == 0:
            return 4 * s.n_params + SAVE_FIXED_BYTES, export
        if d.offload_optimizer != "none":
            return c * largest + SAVE_FIXED_BYTES, export
        part = -(-s.n_params // world)
        flat = max(_ds_flat_groups(s, world)) if d.stage == 3 else part
        return m * flat + SAVE_FIXED_BYTES, export
    shard = {"no_shard": 1, "hybrid_shard": p.nproc_per_node}.get(cfg.fsdp.sharding, world)
    return m * max(shard_numel(sh, shard) for sh in s.all_params()) + SAVE_FIXED_BYTES, export


def _ds_flat_groups(s: Shapes, world: int) -> list[int]:
    from shardconsole.plan.deepspeed_rank import ds_sub_groups
    return ds_sub_groups(s, world)


def saves(cfg: C.RunConfig, s: Shapes, spec_path: str | Path | None = None, *, start_step: int = 0,
          existing: Sequence[int] = ()) -> Saves:
    """The run's saves: sizes, schedule, the checkpoint folder's peak, the host RAM a save adds."""
    if getattr(cfg, "adapters", False):
        from shardconsole.plan.lora import checkpoint_sizes     # LoRA: only what trains is saved
        full, model, largest = checkpoint_sizes(cfg, s)
    elif cfg.parallel.backend == "deepspeed":
        full, model, largest = _deepspeed_sizes(cfg, s)
    else:
        full, model, largest = _fsdp_sizes(cfg, s)
    sched = schedule(cfg, start_step)
    sizes = [full if k == "full" else model for _, k in sched]
    peak, count, end = disk_peak(sizes, cfg.train.keep_checkpoints, list(existing))
    export_dir = getattr(cfg.train, "export_dir", "") or ""
    notes: list[str] = []
    save_add, export_add = host_save_add(cfg, s)
    add = max(save_add if sched else 0, export_add if export_dir else 0)
    return Saves(full, model, _export_bytes(cfg, s, spec_path), export_dtype_of(cfg), sched, count, peak, end,
                 sum(existing), export_dir, add, largest, notes)


def text_lines(sv: Saves, checkpoint_dir: str = "") -> list[str]:
    """`plan`'s disk section: the three sizes, the saves and the checkpoint folder at its fullest."""
    fs = C.format_size
    out = [f"disk: one full checkpoint {fs(sv.full_bytes)}, a model-only save {fs(sv.model_bytes)}, "
           f"the export {fs(sv.export_bytes)} ({sv.export_dtype})"]
    where = checkpoint_dir or "<run dir>/checkpoints"
    if sv.schedule:
        steps = [f"{step}" + ("" if kind == "full" else f" ({kind})") for step, kind in sv.schedule]
        shown = ", ".join(steps[:6]) + (f", ... ({len(steps)} in all)" if len(steps) > 6 else "")
        out.append(f"  saves at step {shown}; at most {sv.kept_at_once} checkpoint(s) at once in {where}: "
                   f"{fs(sv.disk_peak_bytes)}")
    else:
        out.append(f"  no checkpoint saved (train.save_final = \"none\", train.checkpoint_every = 0)")
    if sv.export_dir:
        out.append(f"  export to {sv.export_dir}: {fs(sv.export_bytes)}")
    return out
