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

from shardconsole.backends.model import adapters, modeling, qlora
from shardconsole.backends.checkpoint import checkpoints, hf_export, save_stream
from shardconsole.backends.rank import common
from shardconsole.backends.engine import fsdp_step, loop, trainstate
from shardconsole.backends.optim import lowbit_optim, master_update, step_in_backward
from shardconsole.backends.observe import metrics, step_timing
from shardconsole.backends.offload import host_copy as offload, overlap as offload_overlap, pinned_arena

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


def shard_model(r: common.Rank, model: modeling.CausalLMLoss, ignored: set | None = None) -> None:
    """`ignored`: parameters each rank keeps whole (QLoRA's 4-bit base)."""
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


def build(r: common.Rank) -> modeling.CausalLMLoss:
    """A sharded model with no full copy on any rank: built on the meta device, sharded, then each
    rank fills its own shards (random init) or receives them from rank 0 (a checkpoint folder)."""
    r.phase("loading model")
    r.faults.on_load()
    hf_cfg = modeling.hf_config(r.spec, r.cfg)
    if r.cfg.train.method == "qlora":       # the 4-bit base whole on each GPU, the rest sharded
        model = qlora.build(r, hf_cfg)
        if r.cfg.memory.activation_checkpointing:
            modeling.apply_checkpointing(model.lm, r.cfg.memory.checkpoint_policy, compiled=r.cfg.compiles_layers)
        shard_model(r, model, ignored=qlora.quantised_params(model))
        return model.train()
    pretrained = r.spec.path is not None and r.spec.has_weights
    full_sd = None
    if pretrained and r.rank == 0:
        full_sd = modeling.load_pretrained(r.spec, hf_cfg).state_dict()
    with torch.device("meta"):
        model = modeling.CausalLMLoss(modeling.build_causal_lm(hf_cfg))
    if r.cfg.adapters:
        adapters.inject(model.lm, r.cfg)     # on the meta device, before sharding: the adapters shard too
    if r.cfg.precision.master_dtype == "bf16":
        model.to(torch.bfloat16)    # on the meta device: the shards are born bf16 (8 bytes a parameter)
    elif r.cfg.adapters and r.cfg.precision.dtype != "fp32":
        adapters.cast_frozen_(model, DTYPES[r.cfg.precision.dtype])
    if r.cfg.memory.activation_checkpointing:
        modeling.apply_checkpointing(model.lm, r.cfg.memory.checkpoint_policy, compiled=r.cfg.compiles_layers)
    shard_model(r, model)
    init_device = "cpu" if r.cfg.fsdp.cpu_offload else r.device
    model.to_empty(device=init_device)
    modeling.reset_buffers_(model, hf_cfg, r.device)
    if pretrained:
        sd = {f"lm.{k}": v for k, v in full_sd.items()} if full_sd is not None else {}
        if r.cfg.adapters and full_sd is not None:
            sd = adapters.remap_base_state(full_sd, model, prefix="lm.")
        set_model_state_dict(model, sd, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True,
                                                                 strict=not r.cfg.adapters))
        del full_sd, sd
    else:
        modeling.init_random_(model, float(getattr(hf_cfg, "initializer_range", 0.02)), r.cfg.train.seed, r.rank,
                              draw_on=r.device if r.is_cuda else None)
    if r.cfg.adapters:
        adapters.init_adapters_(model, r.cfg.train.seed, r.rank)
        r.log(f"{r.cfg.train.method}: {adapters.count_line(model)}")
    arena = None
    if r.cfg.fsdp.cpu_offload and r.cfg.fsdp.host_arena and not r.cfg.adapters:
        pin = r.cfg.fsdp.pin_memory and r.is_cuda
        prec = r.cfg.precision
        arena = r.arena = pinned_arena.ShardArena(
            model, pin=pin, rounding=prec.master_rounding if prec.master_dtype == "bf16" else "fp32",
            copy_dtype=DTYPES[prec.dtype] if uses_compute_copy(r.cfg) else None, grads_pinned=pin)
        arena.watch(model, lambda line: r.event("warning", line))
        r.log(arena.describe())
    if uses_compute_copy(r.cfg):
        copy = r.compute_copy = offload.ComputeCopy(model, DTYPES[r.cfg.precision.dtype],
                                                    pin=r.cfg.fsdp.pin_memory and r.is_cuda, arena=arena)
        r.log(f"offload: all-gathers read a {r.cfg.precision.dtype} host copy of {len(copy.params)} shards "
              f"({copy.nbytes / 2**20:,.1f} MiB)")
    model.train()
    return model


def uses_compute_copy(cfg) -> bool:
    """fsdp.offload_compute_copy applies: offloaded fp32 shards computed in a lower precision."""
    return (cfg.fsdp.cpu_offload and cfg.fsdp.offload_compute_copy and cfg.precision.dtype != "fp32"
            and cfg.precision.master_dtype == "fp32" and not cfg.adapters)   # a frozen base is stored bf16


def refresh_compute_copy(r: common.Rank) -> None:
    if r.compute_copy is not None:
        r.compute_copy.refresh()


def make_optimizer(r: common.Rank, model: torch.nn.Module) -> torch.optim.Optimizer:
    t = r.cfg.train
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


def save(r: common.Rank, model, optim, scaling: fsdp_step.LossScaling, data: trainstate.Data, step: int,
         what: str = "checkpoint") -> None:
    """DCP's format, written by save_stream.StreamingWriter: one tensor copied at a time, never the
    rank's whole state (DCP's own writer holds a copy of every tensor until the file closes)."""
    state = {"model": _model_state(r, model), "step": torch.tensor(step)}
    if what == "checkpoint":
        state["optim"] = get_optimizer_state_dict(model, optim)

    def write(tmp) -> None:
        dcp.save(state, storage_writer=save_stream.StreamingWriter(tmp))
        checkpoints.write_rank_state(tmp, r.rank, {"rng": trainstate.rng_state(r.device), "scaler": scaling.state()})

    checkpoints.run_save(r, step, what, _state_bytes(r, state), write, {"samples_consumed": data.samples})
    if step < r.cfg.train.steps:
        r.phase("training")


def _state_bytes(r: common.Rank, state: dict) -> int:
    """All ranks' bytes of the tensors to write (the local shards, summed over the ranks)."""
    own = sum(t.numel() * t.element_size() for t in _tensors(state))
    total = torch.tensor([own], dtype=torch.int64, device=r.device)
    torch.distributed.all_reduce(total)
    return int(total.item())


def _tensors(obj):
    if isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v)
    elif isinstance(obj, torch.Tensor):
        yield obj.to_local() if hasattr(obj, "to_local") else obj


def resume(r: common.Rank, model, optim, scaling: fsdp_step.LossScaling, data: trainstate.Data) -> int:
    """Load the newest complete checkpoint (any world size: DCP reshards); 0 when there is none."""
    checkpoints.remove_partials(r)
    found = checkpoints.newest_complete(r)
    if found is None:
        r.event("info", f"no checkpoint in {r.checkpoint_dir()}: starting from step 0")
        return 0
    state = {"model": _model_state(r, model), "optim": get_optimizer_state_dict(model, optim),
             "step": torch.tensor(0)}
    try:
        dcp.load(state, storage_reader=fsdp_step.SafeReader(str(found.path)),
                 planner=fsdp_step.safe_load_planner())
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:   # DCP's CheckpointException (a BaseException) wraps each rank's error
        raise checkpoints.CheckpointError(f"{found.path}: cannot be read as an FSDP2 checkpoint: "
                                          f"{_first_cause(e)}") from e
    set_model_state_dict(model, state["model"], options=StateDictOptions(strict=not r.cfg.adapters))
    set_optimizer_state_dict(model, optim, state["optim"])
    if r.arena is not None:
        r.arena.place_states(optim)      # where DCP's load left them, if not in place
    refresh_compute_copy(r)
    step = int(state["step"])
    _restore_rank_state(r, found, scaling)
    data.seek(int(found.meta.get("samples_consumed", step * data.samples_per_step)))
    r.event("info", f"resumed from {found.path} (step {step})")
    return step


def _model_state(r: common.Rank, model) -> dict:
    """What a checkpoint holds of the model: every weight, or under LoRA only the adapters (the base is
    the model folder's, unchanged)."""
    state = get_model_state_dict(model)
    return adapters.trained_state(state, model) if r.cfg.adapters else state


def _restore_rank_state(r: common.Rank, found: checkpoints.Found, scaling) -> None:
    own = checkpoints.read_rank_state(found.path, r.rank)
    if own is None or found.meta.get("world", r.world) != r.world:
        # Another rank count: the weights and moments reshard, the per-rank RNG streams do not.
        r.event("warning", f"{found.path} was written by {found.meta.get('world', '?')} rank(s), this run has "
                           f"{r.world}: weights and optimizer resharded, random states start afresh")
        own = checkpoints.read_rank_state(found.path, 0) if own is None else own
        if own:
            scaling.load(own.get("scaler"))
        return
    trainstate.set_rng_state(own["rng"], r.device)
    scaling.load(own.get("scaler"))


def _first_cause(e: BaseException) -> str:
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and failures:
        inner = next(iter(failures.values()))
        inner = inner[0] if isinstance(inner, tuple) and inner else getattr(inner, "exc", inner)
        return f"{type(inner).__name__}: {str(inner).splitlines()[0] if str(inner) else ''}"[:400]
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:400]


def train(r: common.Rank) -> None:
    common.init_process_group(r)
    with loop.ending(r) as held:
        held.append(lambda: release(r))
        _train(r)


def release(r: common.Rank) -> None:
    """What the Rank holds beyond train (the model and optimizer end with its frame): the host arena
    and the compute copy."""
    r.arena = r.compute_copy = None


def _train(r: common.Rank) -> None:
    cfg, t = r.cfg, r.cfg.train
    stop = trainstate.StopRequest(r)
    model = build(r)
    optim = make_optimizer(r, model)
    if r.arena is not None:
        r.arena.place_states(optim)      # Adam's states in the host arena before the first step
    scaling = fsdp_step.LossScaling(r)
    data = trainstate.Data(r)                 # before resume: resume moves it to the checkpoint's position
    tail = loop.Tail(r, stop, trainstate.Evaluator(r), model,
                     lambda step, what="checkpoint": save(r, model, optim, scaling, data, step, what),
                     export=lambda step: hf_export.export(r, model, step))
    start_step = resume(r, model, optim, scaling, data) if t.resume else 0
    clip = fsdp_step.Clip(r, model, optim, scaling, reduce_dtype(cfg))
    # optim.step_in_backward: each parameter steps as FSDP2 reduces its gradient (no clip, no scaler)
    in_backward = step_in_backward.attach(r, optim, adapters.trained_params(model))
    if r.faults.active:         # test faults, wrapped around the model, the unscale and the clip (faults.py)
        clip = r.faults.install_fsdp(r, model, scaling, clip)
    meter = metrics.StepMeter(r, model)
    floor = metrics.ScaleFloorWatch(cfg)
    phases = metrics.PhaseTimes(r)
    timing = step_timing.StepTiming(r)           # the offload view (offloaded runs); after Clip's hooks
    step_timing.instrument_fsdp(model, timing)
    overlap, timing.overlap = offload_overlap.make(r, model, optim, scaling.scaler)
    r.phase("training")
    stop.start_round()
    for step in range(start_step + 1, t.steps + 1):
        r.step = step
        phases.start()
        timing.start()
        lr = t.lr * common.lr_factor(cfg, step)
        lowbit_optim.set_lr(optim, lr)
        for micro in range(t.grad_accum):
            batch = data.next()
            # Reduce-scatter gradients only on the last micro-batch (fewer collectives, more memory).
            model.set_requires_gradient_sync(micro == t.grad_accum - 1)
            loss = model(batch.inputs, batch.labels, batch.positions)
            meter.add(loss)
            phases.mark("forward")
            if overlap is not None and micro == t.grad_accum - 1:
                overlap.arm(step)        # each unit's host step starts as its gradients land (offload_overlap)
            scaling.backward(loss / t.grad_accum)
            phases.mark("backward")
        timing.compute_done()
        with timing.host_step():
            grad_norm = None
            if overlap is not None and overlap.armed:
                timing.overlapped(overlap.finish())     # no clip, no scaler (offload_overlap.why_not)
            else:
                if in_backward is None:
                    scaling.unscale(optim)
                    grad_norm = clip()
                    phases.mark("clip")
                    scaling.step(optim)
                    phases.mark("step")
                else:
                    in_backward.check_stepped()
                refresh_compute_copy(r)       # (the overlap refreshes each unit's copy after its step)
        optim.zero_grad(set_to_none=True)
        phases.mark("copy+zero")
        timing.end()
        if meter.due(step):
            norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm
            skipped = scaling.skipped_since_last_line()
            mean = meter.report(step, lr, norm, scaling.value(), skipped)
            metrics.check_loss(r, mean, step)
            floor.check(step, scaling.value(), skipped)
            phases.report(step)
            timing.report(step)
        tail.after_step(step)
    tail.after_last_step(start_step)
