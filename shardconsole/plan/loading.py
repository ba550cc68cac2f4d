"""The host RAM of loading a model folder's weights (model.name a folder with weights; a catalog size
trains from random init and loads nothing): the "loading" moment of a rank, as the ranks load it.

  FSDP2 (full, LoRA)   rank 0 alone: transformers' from_pretrained in fp32 (backends/model/modeling.py
                       load_pretrained), its state dict held while set_model_state_dict broadcasts it a
                       tensor at a time into every rank's shards (backends/engine/fsdp.py build: the shards are
                       made before, on the host with CPU offload or on CPU ranks, and filled as the
                       tensors arrive; a rank whose shards live on the host receives each tensor whole
                       first, torch's _broadcast_tensors: under NCCL every rank, under gloo all but 0).
  ZeRO-0/1/2           every rank: from_pretrained in fp32, the whole model (backends/engine/deepspeed.py build);
                       it replaces the random-init "build" moment, the same model on the CPU.
  ZeRO-3               rank 0 reads one tensor at a time into its gathered parameter
                       (deepspeed.load_pretrained_partitions): a tensor and its cast; on CPU ranks
                       every rank gathers on the host too.
  QLoRA                every rank: from_pretrained in bf16, whole, then a linear at a time to the GPU
                       (backends/model/qlora.py build).

What from_pretrained holds, measured (benchmarks/load_host_memory.py): a tensor whose file dtype differs
from the one asked for is converted into new memory (its bytes in the asked dtype); a tensor already in
that dtype stays a view of the mapped file (no copy). The file's pages it reads are resident while it
loads (the process's RSS shows them) but they are page cache the kernel can drop, so they are said
apart (Loading.mapped_bytes), not counted against the host budget. The dtypes are read from the
safetensors headers (a few KiB); a pytorch_model.bin is counted as converted (its dtypes are not read).
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shardconsole.settings import config as C
from shardconsole.settings.models import ModelSpec
from shardconsole.plan.constants import DS_BUILD_BASE_RSS, DTYPE_BYTES, RANK_BASE_RSS, RANK_BASE_RSS_CPU
from shardconsole.plan.lora import frozen_bytes
from shardconsole.plan.shapes import Shapes, shape_numel, shard_numel

# safetensors' dtype names and their bytes (safetensors' Dtype enum)
_ST_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "I64": 8, "I32": 4,
             "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}
_ASKED = {4: "F32", 2: "BF16"}


@dataclass(frozen=True)
class FolderWeights:
    """The folder's weight files: their bytes on disk, and the elements stored in each dtype (empty
    when the dtypes cannot be read: a pytorch_model.bin)."""
    file_bytes: int
    numel_by_dtype: dict[str, int] = field(default_factory=dict)

    def converted_bytes(self, to: int, n_params: int) -> int:
        """Bytes from_pretrained allocates loading into `to`-byte floats: every tensor not already stored so."""
        if not self.numel_by_dtype:
            return to * n_params
        return to * sum(n for d, n in self.numel_by_dtype.items() if d != _ASKED[to])


def _safetensors_header(path: Path) -> dict[str, Any]:
    with path.open("rb") as fh:
        (n,) = struct.unpack("<Q", fh.read(8))
        return json.loads(fh.read(n))


def folder_weights(folder: str) -> FolderWeights | None:
    """What the folder's weights hold, from the files' headers; None when none can be read."""
    root = Path(folder)
    index = root / "model.safetensors.index.json"
    try:
        if index.is_file():
            files = sorted({root / f for f in json.loads(index.read_text())["weight_map"].values()})
        elif (root / "model.safetensors").is_file():
            files = [root / "model.safetensors"]
        else:
            bins = root / "pytorch_model.bin.index.json"
            files = (sorted({root / f for f in json.loads(bins.read_text())["weight_map"].values()})
                     if bins.is_file() else [root / "pytorch_model.bin"])
            return FolderWeights(sum(f.stat().st_size for f in files))
        numel: dict[str, int] = {}
        for f in files:
            for name, t in _safetensors_header(f).items():
                if name != "__metadata__":
                    numel[t["dtype"]] = numel.get(t["dtype"], 0) + shape_numel(tuple(t["shape"]))
        return FolderWeights(sum(f.stat().st_size for f in files), numel)
    except (OSError, ValueError, KeyError, TypeError, struct.error):
        return None


@dataclass
class Loading:
    """One node's ranks while the folder loads: what every local rank holds, what rank 0 holds on top."""
    who: str                                # "rank 0" or "every rank": who reads the whole folder
    dtype: str                              # what it is loaded as ("fp32", "bf16")
    each: dict[str, int]                    # parts every local rank holds at the load's peak
    rank0: dict[str, int]                   # parts rank 0 alone holds on top
    mapped_bytes: int                       # the folder's pages resident in a reading rank (page cache)
    help: str                               # what would make the load smaller, from what the code offers
    replaces: str = ""                      # the moment it stands for ("build": ZeRO-0/1/2's random init)
    others: dict[str, int] = field(default_factory=dict)   # parts the ranks but rank 0 hold on top
    whole: bool = True                      # the whole model at once; False: a tensor at a time (ZeRO-3)

    @property
    def how(self) -> str:
        """"rank 0 reads it whole in fp32"."""
        return f"{self.who} reads it " + (f"whole in {self.dtype}" if self.whole else f"a tensor at a time ({self.dtype})")

    def rank_bytes(self, rank: int) -> int:
        """One rank's bytes at the load's peak."""
        return sum(self.each.values()) + sum((self.rank0 if rank == 0 else self.others).values())

    def to_dict(self) -> dict[str, Any]:
        return {"who": self.who, "dtype": self.dtype, "whole": self.whole, "each_rank": dict(self.each), "rank0_adds": dict(self.rank0),
                "other_ranks_add": dict(self.others), "rank0_bytes": self.rank_bytes(0),
                "other_rank_bytes": self.rank_bytes(1), "mapped_bytes": self.mapped_bytes, "help": self.help}


def loading(cfg: C.RunConfig, spec: ModelSpec, s: Shapes) -> Loading | None:
    """The loading moment of cfg's ranks, None when nothing is loaded (no folder, or no weights in it)."""
    if spec.path is None or not spec.has_weights:
        return None
    w = folder_weights(spec.path) or FolderWeights(4 * s.n_params)
    p = cfg.parallel
    cpu = p.device == "cpu"
    base = RANK_BASE_RSS_CPU if cpu else (RANK_BASE_RSS["fsdp"] if p.backend == "fsdp" else DS_BUILD_BASE_RSS)
    each = {"process (python, torch, CUDA)" if not cpu else "process (python, torch)": base}
    largest = max(shape_numel(sh) for sh in s.all_params())
    if cfg.train.method == "qlora":
        each["bf16 copy of the folder (from_pretrained, whole)"] = w.converted_bytes(2, s.n_params)
        return Loading("every rank", "bf16", each, {}, w.file_bytes,
                       "every rank loads the whole model in bf16 before quantising it: fewer ranks per node "
                       "(parallel.nproc_per_node) or more host RAM")
    copy = w.converted_bytes(4, s.n_params)
    if p.backend == "fsdp":
        return _fsdp_loading(cfg, s, w, each, copy, largest)
    if cfg.deepspeed.stage == 3:
        # zero.Init has placed the partitions (on the host with offload_param); rank 0 reads one tensor
        # (safetensors' get_tensor: a copy in the file's dtype) and casts it to the parameters' dtype
        c = DTYPE_BYTES[cfg.precision.dtype]
        if cfg.deepspeed.offload_param != "none" or cpu:
            each["parameters (partitions, host)"] = c * -(-s.n_params // cfg.world_size)
        if cpu:
            # CPU ranks gather every parameter whole on the host, and the C heap keeps many of the freed
            # blocks: measured 0.4-0.6 GiB per rank over the partitions at 0.63 GiB of fp32 parameters
            # (benchmarks/load_host_memory.py), so the whole model is counted
            each["parameters gathered on the host (CPU ranks, freed blocks kept)"] = c * s.n_params
        return Loading("rank 0", cfg.precision.dtype, each,
                       {"one tensor read and cast (largest, rank 0)": largest * (4 + c)}, w.file_bytes,
                       "ZeRO-3 reads the folder a tensor at a time; more host RAM", whole=False)
    each["fp32 copy of the folder (from_pretrained, whole)"] = copy
    each["cast copy (largest tensor)"] = DTYPE_BYTES[cfg.precision.dtype] * largest
    return Loading("every rank", "fp32", each, {}, w.file_bytes,
                   f"every rank loads the whole model in fp32 under ZeRO-{cfg.deepspeed.stage}: fewer ranks per "
                   f"node (parallel.nproc_per_node), or deepspeed.stage = 3, which reads the folder a tensor at "
                   f"a time", replaces="build")


def _fsdp_loading(cfg: C.RunConfig, s: Shapes, w: FolderWeights, each: dict[str, int], copy: int,
                  largest: int) -> Loading:
    """FSDP2: rank 0's fp32 state dict; every rank's shards, made before the broadcast, where they live."""
    p, f = cfg.parallel, cfg.fsdp
    if f.cpu_offload or p.device == "cpu":
        shard = {"no_shard": 1, "hybrid_shard": p.nproc_per_node}.get(f.sharding, cfg.world_size)
        if cfg.adapters:
            each["frozen base (shards, host)"] = frozen_bytes(cfg, s) // shard
        else:
            m = cfg.kept_bytes
            each[f"parameters ({'bf16' if m == 2 else 'fp32'} shards, host)"] = \
                m * sum(shard_numel(sh, shard) for sh in s.all_params())
    rank0 = {"fp32 copy of the folder (from_pretrained, rank 0 only)": copy}
    others: dict[str, int] = {}
    if f.cpu_offload and p.device != "cpu":
        # NCCL broadcasts on the GPU, then every rank copies each tensor back to its host shards whole
        each["one tensor received whole (largest)"] = 4 * largest
    elif p.device == "cpu":
        # gloo broadcasts from rank 0's own tensor; the others receive it whole into a new one
        others["one tensor received whole (largest)"] = 4 * largest
    return Loading("rank 0", "fp32", each, rank0, w.file_bytes,
                   "rank 0 loads the whole model in fp32 (backends/modeling.load_pretrained); parallel.backend = "
                   "deepspeed with deepspeed.stage = 3 reads the folder a tensor at a time; a folder saved in "
                   "fp32 is read in place (page cache, not a copy); or more host RAM", others=others)
