"""The FSDP2 rank: build, shard, train, log, checkpoint. Reads top to bottom; one step is `train_step`.

Sharding map (torch.distributed.fsdp.fully_shard on each decoder layer, then on the root):
  full_shard     mesh (world,)               reshard_after_forward=True
  shard_grad_op  mesh (world,)               reshard_after_forward=False (params stay gathered until backward)
  no_shard       mesh (world, 1) replicate   plain data parallel
  hybrid_shard   mesh (nnodes, nproc)        shard within a node, replicate across nodes
"""

from __future__ import annotations

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict, set_model_state_dict,
                                                     set_optimizer_state_dict)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

from shardconsole.backends import checkpoints, common, metrics, modeling, offload
from shardconsole.backends.data import make_source, next_batch

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


def shard_model(r: common.Rank, model: modeling.CausalLMLoss) -> None:
    cfg = r.cfg
    kwargs: dict = {"mesh": make_mesh(r), "reshard_after_forward": cfg.reshard_after_forward}
    if cfg.precision.dtype != "fp32":
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=DTYPES[cfg.precision.dtype],
                                                   reduce_dtype=reduce_dtype(cfg))
    if cfg.fsdp.cpu_offload:
        # Pinned host memory needs an accelerator (DESIGN.md): unpinned on CPU-only runs.
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=cfg.fsdp.pin_memory and r.is_cuda)
    layers = modeling.decoder_layers(model.lm)
    for i, layer in enumerate(layers):
        if cfg.compiles_layers:
            layer.compile()   # per layer, before sharding: DESIGN.md's fastest bare loop
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


def build(r: common.Rank) -> modeling.CausalLMLoss:
    """A sharded model with no full copy on any rank: built on the meta device, sharded, then each
    rank fills its own shards (random init) or receives them from rank 0 (a checkpoint folder)."""
    r.phase("loading model")
    r.faults.on_load()
    hf_cfg = modeling.hf_config(r.spec, r.cfg)
    pretrained = r.spec.path is not None and r.spec.has_weights
    full_sd = None
    if pretrained and r.rank == 0:
        full_sd = modeling.load_pretrained(r.spec, hf_cfg).state_dict()
    with torch.device("meta"):
        model = modeling.CausalLMLoss(modeling.build_causal_lm(hf_cfg))
    if r.cfg.precision.master_dtype == "bf16":
        model.to(torch.bfloat16)    # on the meta device: the shards are born bf16 (8 bytes a parameter)
    if r.cfg.memory.activation_checkpointing:
        modeling.apply_checkpointing(model.lm, r.cfg.memory.checkpoint_policy, compiled=r.cfg.compiles_layers)
    shard_model(r, model)
    init_device = "cpu" if r.cfg.fsdp.cpu_offload else r.device
    model.to_empty(device=init_device)
    modeling.reset_buffers_(model, hf_cfg, r.device)
    if pretrained:
        sd = {f"lm.{k}": v for k, v in full_sd.items()} if full_sd is not None else {}
        set_model_state_dict(model, sd, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
        del full_sd, sd
    else:
        modeling.init_random_(model, float(getattr(hf_cfg, "initializer_range", 0.02)), r.cfg.train.seed, r.rank,
                              draw_on=r.device if r.is_cuda else None)
    if uses_compute_copy(r.cfg):
        copy = r.extra["compute_copy"] = offload.ComputeCopy(model, DTYPES[r.cfg.precision.dtype],
                                                             pin=r.cfg.fsdp.pin_memory and r.is_cuda)
        r.log(f"offload: all-gathers read a {r.cfg.precision.dtype} host copy of {len(copy.params)} shards "
              f"({copy.nbytes / 2**20:,.1f} MiB)")
    model.train()
    return model


def uses_compute_copy(cfg) -> bool:
    """fsdp.offload_compute_copy applies: offloaded fp32 shards computed in a lower precision."""
    return (cfg.fsdp.cpu_offload and cfg.fsdp.offload_compute_copy and cfg.precision.dtype != "fp32"
            and cfg.precision.master_dtype == "fp32")


def refresh_compute_copy(r: common.Rank) -> None:
    copy = r.extra.get("compute_copy")
    if copy is not None:
        copy.refresh()


def make_optimizer(r: common.Rank, model: torch.nn.Module) -> torch.optim.Optimizer:
    t = r.cfg.train
    # fused AdamW: one kernel for all tensors (CUDA, and the CPU for offloaded shards). Not with fp16:
    # the sharded grad scaler hands fused AdamW a found_inf of the wrong shape (torch 2.13).
    fused = r.cfg.precision.dtype != "fp16"
    return torch.optim.AdamW(model.parameters(), lr=t.lr, betas=(t.beta1, t.beta2), weight_decay=t.weight_decay,
                             fused=fused, foreach=None if fused else True)


def make_scaler(r: common.Rank):
    """fp16 only: dynamic loss scaling over sharded gradients."""
    if r.cfg.precision.dtype != "fp16":
        return None
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
    p = r.cfg.precision
    if p.hysteresis is not None:
        r.event("warning", "precision.hysteresis is a DeepSpeed setting; FSDP's scaler cuts the scale on "
                "the first overflow")
    static = p.fp16_value("loss_scale")
    return ShardedGradScaler(device=r.device.type, init_scale=static or 2.0 ** p.fp16_value("initial_scale_power"),
                             growth_interval=p.fp16_value("loss_scale_window") if not static else 10**9,
                             growth_factor=1.0 if static else 2.0, backoff_factor=1.0 if static else 0.5)


def save(r: common.Rank, model, optim, step: int) -> None:
    r.phase("saving checkpoint")
    tmp = checkpoints.prepare_checkpoint(r, step)
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optim),
             "step": torch.tensor(step)}
    dcp.save(state, checkpoint_id=str(tmp))
    checkpoints.finish_checkpoint(r, step)
    r.phase("training")


def resume(r: common.Rank, model, optim) -> int:
    found = checkpoints.latest_checkpoint(r.checkpoint_dir())
    if found is None:
        r.event("info", f"no checkpoint in {r.checkpoint_dir()}: starting from step 0")
        return 0
    step, path = found
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optim),
             "step": torch.tensor(0)}
    dcp.load(state, checkpoint_id=str(path))
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, optim, state["optim"])
    refresh_compute_copy(r)
    r.event("info", f"resumed from {path} (step {step})")
    return int(state["step"])


def train(r: common.Rank) -> None:
    cfg, t = r.cfg, r.cfg.train
    common.init_process_group(r)
    model = build(r)
    optim = make_optimizer(r, model)
    scaler = make_scaler(r)
    start_step = resume(r, model, optim) if t.resume else 0
    data = make_source(cfg, r.spec.vocab, r.spec.path, r.rank, r.world)
    meter = metrics.StepMeter(r)
    skipped = torch.zeros((), device=r.device, dtype=torch.int64)
    min_scale = cfg.precision.fp16_value("min_loss_scale")
    r.phase("training")
    grad_norm = None
    reported_skips = 0
    floor = metrics.ScaleFloorWatch(cfg)
    # Fused AdamW applies the clip factor as it reads each gradient (no fp16 scaler: that sets grad_scale).
    fold_clip = scaler is None and optim.defaults.get("fused")
    device_norm = None
    if fold_clip and t.clip_grad_norm > 0 and cfg.fsdp.cpu_offload:
        if offload.DeviceGradNorm.applies(model, reduce_dtype(cfg)):
            device_norm = offload.DeviceGradNorm(model, r.device)
            r.log("offload: the gradient norm is summed where each reduce-scatter lands, before the copy to the host")
    norm_fallback_told = False
    phases = metrics.PhaseTimes(r)
    for step in range(start_step + 1, t.steps + 1):
        r.step = step
        phases.start()
        r.faults.on_step(step)
        lr = t.lr * common.lr_factor(cfg, step)
        for group in optim.param_groups:
            group["lr"] = lr
        for micro in range(t.grad_accum):
            batch = next_batch(data, t.micro_batch, r.device)
            last = micro == t.grad_accum - 1
            # Reduce-scatter gradients only on the last micro-batch (fewer collectives, more memory).
            model.set_requires_gradient_sync(last)
            loss = r.faults.on_loss(model(batch[:, :-1], batch[:, 1:]), step)
            meter.add(loss)
            scaled = loss / t.grad_accum
            phases.mark("forward")
            (scaler.scale(scaled) if scaler else scaled).backward()
            phases.mark("backward")
        grads_changed = r.faults.on_grads(model.parameters(), step)
        if scaler:
            scaler.unscale_(optim)
        if t.clip_grad_norm > 0 and fold_clip:
            known = device_norm.take() if device_norm is not None else None
            if grads_changed:
                known = None     # a test fault wrote an inf after the reduce-scatters: read the host's
            elif device_norm is not None and known is None and not norm_fallback_told:
                r.event("warning", "the gradient norm was not seen at every reduce-scatter; reading the host "
                        "gradients instead (slower)")
                norm_fallback_told = True
            grad_norm = offload.fold_clip_into_step(model.parameters(), optim, t.clip_grad_norm, r.device, known)
        elif t.clip_grad_norm > 0:
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), t.clip_grad_norm)
        phases.mark("clip")
        if scaler:
            before = scaler._scale.clone()
            scaler.step(optim)
            scaler.update()
            skipped += (scaler._scale < before).to(torch.int64)   # on device: no sync
            if min_scale:
                scaler._scale.clamp_(min=float(min_scale))   # in place on the device: no sync
        else:
            optim.step()
        phases.mark("step")
        refresh_compute_copy(r)
        optim.zero_grad(set_to_none=True)
        phases.mark("copy+zero")
        if meter.due(step):
            norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm
            scale = float(scaler.get_scale()) if scaler else None
            n_skipped = int(skipped)
            if n_skipped > reported_skips:
                r.event("overflow", f"{n_skipped - reported_skips} step(s) skipped on fp16 overflow "
                        f"since the last line; loss scale now {scale:g}")
                reported_skips = n_skipped
            mean = meter.report(step, lr, norm, scale, n_skipped)
            metrics.check_loss(r, mean, step)
            floor.check(step, scale, n_skipped)
            phases.report(step)
        if cfg.memory.empty_cache_every and r.is_cuda and step % cfg.memory.empty_cache_every == 0:
            torch.cuda.empty_cache()
        if checkpoints.save_due(r, step):
            save(r, model, optim, step)
    if checkpoints.final_save_due(r):
        save(r, model, optim, t.steps)
