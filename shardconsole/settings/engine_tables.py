"""The engine tables of the settings: [fsdp] (parallel.backend fsdp: FSDP2's sharding, prefetch and host
offload) and [deepspeed] (DeepSpeed ZeRO's stage, offload and buckets, in DeepSpeed's own names, which
ds_json maps one to one). Part of tables.py's RunConfig; apart because each table is one engine's own knobs,
read by that engine and the planner, and to keep tables.py short."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from shardconsole.settings.field_meta import setting


@dataclass
class FsdpSettings:
    sharding: Literal["full_shard", "shard_grad_op", "no_shard", "hybrid_shard"] = setting(
        "full_shard", "what is sharded: params+grads+optimizer, grads+optimizer, nothing, or full within a node")
    cpu_offload: bool = setting(False, "keep parameters, gradients and optimizer states on the CPU")
    reshard_after_forward: bool | None = setting(
        None, "free gathered parameters after forward (default: true except for shard_grad_op)")
    forward_prefetch: int = setting(1, "decoder layers whose all-gather is issued ahead in forward", min=0, max=8)
    backward_prefetch: int = setting(1, "decoder layers whose all-gather is issued ahead in backward", min=0, max=8)
    pin_memory: bool = setting(True, "pin host memory of offloaded parameters (GPU only)")
    # backends/offload/pinned_arena.py: torch pins each tensor in a power-of-two block (28 GB of 7B fp32 shards
    # take ~40 GB pinned); one region pinned in place wastes nothing.
    host_arena: bool = setting(
        True, "offload: the shards and Adam's states in one host region pinned in place (no power-of-two "
        "rounding per tensor); false: torch pins each shard itself")
    offload_compute_copy: bool = setting(
        False, "offload with fp32 masters: send the GPU a bf16/fp16 host copy of the shards (half the PCIe "
        "bytes; 2 more host bytes a parameter and a cast each step)")
    # backends/offload/overlap.py: the host step of a layer under the backward of the layers before it.
    offload_overlap: bool = setting(
        True, "offload: each layer's host optimizer step starts when its gradients reach the host, under the "
        "backward (the same update; not with train.clip_grad_norm > 0 or fp16 loss scaling, which need every "
        "gradient first: those steps run after the backward)")
    offload_grads_in_flight: int = setting(
        4, "offload with the overlapped host step: at most this many layers' gradients on the host at once "
        "(the backward waits for the host step beyond it; each layer's are a pinned block); 0: no bound",
        min=0, max=64)


@dataclass
class DeepspeedSettings:
    stage: int = setting(3, "ZeRO stage: 0 none, 1 optimizer, 2 +gradients, 3 +parameters", min=0, max=3)
    offload_optimizer: Literal["none", "cpu", "nvme"] = setting("none", "where optimizer states live")
    offload_param: Literal["none", "cpu", "nvme"] = setting("none", "where parameters live (stage 3 only)")
    nvme_path: str = setting("", "folder on a fast disk for nvme offload")
    pin_memory: bool = setting(True, "pin host buffers of offloaded tensors")
    overlap_comm: bool = setting(True, "overlap gradient reduction with backward")
    contiguous_gradients: bool = setting(True, "copy gradients into one buffer as they are produced")
    reduce_scatter: bool = setting(True, "reduce gradients with reduce-scatter rather than all-reduce")
    allgather_partitions: bool = setting(True, "all-gather parameters rather than broadcast (stages 1-2)")
    reduce_bucket_size: int = setting(500_000_000, "elements reduced at once", min=1)
    allgather_bucket_size: int = setting(500_000_000, "elements all-gathered at once (stages 1-2)", min=1)
    stage3_prefetch_bucket_size: int = setting(50_000_000, "elements prefetched ahead in stage 3", min=0)
    stage3_param_persistence_threshold: int = setting(
        100_000, "parameters smaller than this stay gathered in stage 3", min=0)
    stage3_max_live_parameters: int = setting(1_000_000_000, "stage 3: gathered elements kept at most", min=0)
    stage3_max_reuse_distance: int = setting(1_000_000_000, "stage 3: keep a parameter if reused within this", min=0)
    torch_adam: bool = setting(False, "use torch's AdamW instead of DeepSpeed's fused/CPU Adam (no op build)")
    stage3_layer_gather: bool = setting(
        True, "stage 3: gather each decoder layer whole (z3 leaf modules): fewer hooks, and train.compile "
        "can compile the layers")

