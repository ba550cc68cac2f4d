"""The FSDP2 rank's model: built on the meta device, sharded, filled; its optimizer. The engine that
trains it (steps, saves, resumes, exports) is fsdp_engine.py; its checkpoint format is fsdp_checkpoint.py.

Sharding map (torch.distributed.fsdp.fully_shard on each decoder layer, then on the root):
  full_shard     mesh (world,)               reshard_after_forward=True
  shard_grad_op  mesh (world,)               reshard_after_forward=False (params stay gathered until backward)
  no_shard       mesh (world, 1) replicate   plain data parallel
  hybrid_shard   mesh (nnodes, nproc)        shard within a node, replicate across nodes
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

from shardconsole.backends.model import adapters, float8, modeling, qlora, tiled_mlp
from shardconsole.backends.rank import common
from shardconsole.backends.optim import adam_mini, lowbit_optim, master_update
from shardconsole.backends.offload import host_copy as offload, pinned_arena

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def make_mesh(r: common.Rank):
    s = r.cfg.fsdp.sharding
    dev = r.device.type
    if s == "no_shard":
        return init_device_mesh(dev, (r.world, 1), mesh_dim_names=("replicate", "shard"))
    if s == "hybrid_shard":
        per_node = r.cfg.parallel.nproc_per_node
        return init_device_mesh(dev, (r.world // per_node, per_node), mesh_dim_names=("replicate", "shard"))
    return init_device_mesh(dev, (r.world,), mesh_dim_names=("shard",))


def reduce_dtype(cfg) -> torch.dtype | None:
    """The dtype gradients are reduce-scattered in; None for fp32 runs (no mixed-precision policy: the
    parameters' own)."""
    if cfg.precision.dtype == "fp32":
        return None
    return DTYPES[cfg.precision.reduce_dtype or "fp32"]


def shard_model(r: common.Rank, model: modeling.CausalLMLoss, ignored: set | None = None) -> bool:
    """`ignored`: parameters each rank keeps whole (QLoRA's 4-bit base). Returns whether the decoder layers
    all-gather their weights in float8 (precision.fp8; the engine then precomputes their scales a step)."""
    cfg = r.cfg
    kwargs: dict = {"mesh": make_mesh(r), "reshard_after_forward": cfg.reshard_after_forward}
    if ignored:
        kwargs["ignored_params"] = ignored
    if cfg.precision.dtype != "fp32":
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=DTYPES[cfg.precision.dtype],
                                                   reduce_dtype=reduce_dtype(cfg))
    if cfg.fsdp.cpu_offload:
        # Pinned host memory needs an accelerator (docs/MEASURED.md): unpinned on CPU-only runs.
        # With the host arena the shards are pinned in one region (pinned_arena.py), not by FSDP2.
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=cfg.fsdp.pin_memory and r.is_cuda
                                                    and not cfg.fsdp.host_arena)
    layers = modeling.decoder_layers(model.lm)
    fp8, fp8_gather = cfg.precision.fp8, False
    if fp8 != "none":      # before compiling and sharding: the layers compile and shard their Float8Linears
        fp8_gather = float8.gathers_fp8(fp8, r.world, cfg.fsdp.cpu_offload)
        float8.convert_for_rank(r, layers, all_gather=fp8_gather)
    for i, layer in enumerate(layers):
        if cfg.compiles_layers:
            layer.compile()   # per layer, before sharding: docs/MEASURED.md's fastest bare loop
        fully_shard(layer, **kwargs)
    # The root (embeddings, final norm, output head) is needed again at once by backward: keep it
    # gathered after forward instead of freeing and re-gathering it.
    fully_shard(model, **{**kwargs, "reshard_after_forward": False})
    # Explicit prefetch: issue the next layers' all-gathers while this one computes.
    if len(layers) > 1 and cfg.fsdp.sharding != "no_shard":
        fwd, bwd = cfg.fsdp.forward_prefetch, cfg.fsdp.backward_prefetch
        for i, layer in enumerate(layers):
            if fwd and i + 1 < len(layers):
                layer.set_modules_to_forward_prefetch(list(layers[i + 1:i + 1 + fwd]))
            if bwd and i > 0:
                layer.set_modules_to_backward_prefetch(list(reversed(layers[max(0, i - bwd):i])))
    return fp8_gather


@dataclass
class Built:
    """What build makes: the sharded model and, under offload, its host arena and compute copy."""
    model: modeling.CausalLMLoss
    arena: pinned_arena.ShardArena | None = None
    compute_copy: offload.ComputeCopy | None = None
    fp8_gather: bool = False      # float8 all-gather: scales precomputed after each optimizer step


def build(r: common.Rank) -> Built:
    """A sharded model with no full copy on any rank: built on the meta device, sharded, then each
    rank fills its own shards (random init) or receives them from rank 0 (a checkpoint folder)."""
    r.phase("loading model")
    r.faults.on_load()
    hf_cfg = modeling.hf_config(r.spec, r.cfg)
    if r.cfg.train.method == "qlora":       # the 4-bit base whole on each GPU, the rest sharded
        model = qlora.build(r, hf_cfg)
        _tile_mlps(r, model)
        if r.cfg.memory.activation_checkpointing:
            modeling.apply_checkpointing(model.lm, r.cfg.memory.checkpoint_policy, compiled=r.cfg.compiles_layers)
        shard_model(r, model, ignored=qlora.quantised_params(model))
        return Built(model.train())
    pretrained = r.spec.path is not None and r.spec.has_weights
    full_sd = None
    if pretrained and r.rank == 0:
        full_sd = modeling.load_pretrained(r.spec, hf_cfg).state_dict()
    with torch.device("meta"):
        model = modeling.CausalLMLoss(modeling.build_causal_lm(hf_cfg), loss=r.cfg.memory.loss_on(r.is_cuda))
    if r.cfg.adapters:
        adapters.inject(model.lm, r.cfg)     # on the meta device, before sharding: the adapters shard too
    if r.cfg.precision.master_dtype == "bf16" or r.cfg.split_masters:
        # on the meta device: the shards are born bf16 (8 bytes a parameter; adam-mini's fp32 masters keep
        # their low 16 bits in the optimizer)
        model.to(torch.bfloat16)
    elif r.cfg.adapters and r.cfg.precision.dtype != "fp32":
        adapters.cast_frozen_(model, DTYPES[r.cfg.precision.dtype])
    _tile_mlps(r, model)
    if r.cfg.memory.activation_checkpointing:
        modeling.apply_checkpointing(model.lm, r.cfg.memory.checkpoint_policy, compiled=r.cfg.compiles_layers)
    fp8_gather = shard_model(r, model)
    init_device = "cpu" if r.cfg.fsdp.cpu_offload else r.device
    model.to_empty(device=init_device)
    reference = modeling.Reference(hf_cfg)
    modeling.reset_buffers_(model, reference, r.device)
    if pretrained:
        sd = {f"lm.{k}": v for k, v in full_sd.items()} if full_sd is not None else {}
        if r.cfg.adapters and full_sd is not None:
            sd = adapters.remap_base_state(full_sd, model, prefix="lm.")
        set_model_state_dict(model, sd, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True,
                                                                 strict=not r.cfg.adapters))
        del full_sd, sd
    else:
        modeling.init_random_(model, float(getattr(hf_cfg, "initializer_range", 0.02)), r.cfg.train.seed, r.rank,
                              draw_on=r.device if r.is_cuda else None, reference=reference)
    if r.cfg.adapters:
        adapters.init_adapters_(model, r.cfg.train.seed, r.rank)
        r.log(f"{r.cfg.train.method}: {adapters.count_line(model)}")
    arena = None
    if r.cfg.fsdp.cpu_offload and r.cfg.fsdp.host_arena and not r.cfg.adapters:
        pin = r.cfg.fsdp.pin_memory and r.is_cuda
        prec = r.cfg.precision
        layout = (lambda local: adam_mini.layout(local, r.cfg.split_masters)) if r.cfg.optim.name == adam_mini.NAME else None
        arena = pinned_arena.ShardArena(
            model, pin=pin, rounding=prec.master_rounding if prec.master_dtype == "bf16" else "fp32",
            copy_dtype=DTYPES[prec.dtype] if uses_compute_copy(r.cfg) else None, grads_pinned=pin, layout=layout)
        arena.watch(model, lambda line: r.event("warning", line))
        r.log(arena.describe())
    copy = None
    if uses_compute_copy(r.cfg):
        copy = offload.ComputeCopy(model, DTYPES[r.cfg.precision.dtype],
                                   pin=r.cfg.fsdp.pin_memory and r.is_cuda, arena=arena)
        r.log(f"offload: all-gathers read a {r.cfg.precision.dtype} host copy of {len(copy.params)} shards "
              f"({copy.nbytes / 2**20:,.1f} MiB)")
    model.train()
    return Built(model, arena, copy, fp8_gather)


def _tile_mlps(r: common.Rank, model: modeling.CausalLMLoss) -> None:
    """memory.mlp_tile_tokens: each layer's MLP a tile of tokens at a time (backends/model/tiled_mlp.py)."""
    tile = r.cfg.memory.mlp_tile_tokens
    if tile:
        n = tiled_mlp.apply(modeling.decoder_layers(model.lm), tile)
        r.log(f"tiled MLP: {n} layers' MLPs computed {tile:,} tokens at a time")


def uses_compute_copy(cfg) -> bool:
    """fsdp.offload_compute_copy applies: offloaded fp32 shards computed in a lower precision."""
    return (cfg.fsdp.cpu_offload and cfg.fsdp.offload_compute_copy and cfg.precision.dtype != "fp32"
            and cfg.kept_bytes == 4 and not cfg.adapters)   # a frozen base is stored bf16


def make_optimizer(r: common.Rank, model: torch.nn.Module) -> torch.optim.Optimizer:
    t = r.cfg.train
    if r.cfg.optim.name == adam_mini.NAME:       # 6 host bytes a parameter with fp32 masters (adam_mini.py)
        optim = adam_mini.AdamMini(adapters.trained_params(model), lr=t.lr, betas=(t.beta1, t.beta2),
                                   weight_decay=t.weight_decay, split=r.cfg.split_masters,
                                   seed=t.seed * 65_537 + r.rank, warn=lambda line: r.event("warning", line))
        if r.cfg.fsdp.cpu_offload:
            optim.host_update()         # built now (once a machine), not in the host thread's first step
        return optim
    if r.cfg.optim.name != "adamw":
        return lowbit_optim.make(r.cfg, adapters.trained_params(model))       # torchao's block-quantized moments
    if r.cfg.precision.master_dtype == "bf16" and r.cfg.precision.master_rounding != "nearest":
        # bf16 weights that still take updates below bf16's resolution (master_update.py)
        return master_update.RoundedAdamW(adapters.trained_params(model), lr=t.lr, betas=(t.beta1, t.beta2),
                                          weight_decay=t.weight_decay, rounding=r.cfg.precision.master_rounding,
                                          seed=t.seed * 65_537 + r.rank, compile=r.is_cuda,
                                          warn=lambda line: r.event("warning", line))
    # fused AdamW: one kernel for all tensors (CUDA, and the CPU for offloaded shards). Not with fp16:
    # the sharded grad scaler hands fused AdamW a found_inf of the wrong shape (torch 2.13).
    fused = r.cfg.precision.dtype != "fp16"
    return torch.optim.AdamW(adapters.trained_params(model), lr=t.lr, betas=(t.beta1, t.beta2), weight_decay=t.weight_decay,
                             fused=fused, foreach=None if fused else True)
