"""One FSDP2 rank's memory over the moments of a step (backends/engine/fsdp.py)."""

from __future__ import annotations

from dataclasses import dataclass

from shardconsole.settings import config as C
from shardconsole.plan.activation_memory import Activations, activations, float8_casts, offloaded_host
from shardconsole.plan.constants import (CUBLAS_WORKSPACE_BYTES, DTYPE_BYTES, FSDP_FP16_OFFLOAD_HOST_PER_PARAM,
                                         RANK_BASE_RSS)
from shardconsole.plan.rank import RankMemory
from shardconsole.plan.shapes import Shapes, shard_numel, pow2_ceil
from shardconsole.plan import optim_states


@dataclass(frozen=True)
class _Sizes:
    """The byte counts the moments of an FSDP2 step are made of (one rank)."""
    shard: int                 # ranks a parameter is sharded over
    c: int                     # bytes of the compute dtype
    reduce_c: int              # bytes of the reduce dtype
    m: int                     # bytes of a kept (sharded) parameter, its gradient and each Adam moment
    mtag: str
    offload: bool
    a: Activations
    shard_numels: list[int]
    params_b: int
    adam_b: int
    adam_tag: str              # "Adam fp32", "AdamW 8-bit"
    layer_shard: int
    root_shard: int
    layer_full: int            # one layer gathered in the compute dtype
    root_full: int             # the root, gathered from forward to the end of backward
    head_grad: int
    sharded: bool
    bwd_n: int                 # layers prefetched in backward
    held: int                  # layers kept gathered from forward to backward
    last_fwd: int
    accum: int                 # gradients accumulated without sync
    kahan: int
    in_backward: bool          # optim.step_in_backward: each sharded gradient stepped and freed at once


def fsdp_rank_memory(cfg: C.RunConfig, s: Shapes) -> RankMemory:
    """backends/engine/fsdp.py: fully_shard per decoder layer and on the root (the root kept gathered after
    forward); parameters fp32 sharded; MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=fp32
    by default) unless fp32; fused AdamW with fp32 states shaped like the sharded parameters;
    explicit prefetch of N layers. Peaks are evaluated at the moments where memory turns: the end of
    forward, the loss backward, the last layer's backward (all activations, no gradients yet), the
    first layer's backward (all but one layer's gradients), the end of backward, the optimizer step."""
    z = _sizes(cfg, s)
    side, side_live = _side_pools(cfg, s, z)
    notes = []
    if z.shard == 1 and cfg.fsdp.sharding != "no_shard":
        notes.append(f"{cfg.fsdp.sharding} over one rank shards nothing: same memory as no_shard")
    if cfg.fsdp.cpu_offload and cfg.fsdp.offload_overlap and cfg.train.clip_grad_norm > 0:
        # backends/offload_overlap.why_not: the clip factor is the global norm's, known after the backward
        notes.append(f"the host optimizer step runs after the backward: train.clip_grad_norm = "
                     f"{cfg.train.clip_grad_norm:g} needs every gradient first; 0 lets it run under the backward "
                     f"(on the H200: 1.2x at 3b, 1.46x at 7B; docs/OFFLOAD.md)")
    return RankMemory(_gpu_moments(cfg, s, z), _host(cfg, s, z), notes, side, side_live)


# Layers whose host gradients have landed and not yet stepped (offload overlap), in torch's pinned blocks
# (a power of two each), beside the root's. Measured on the H100 box (16 cores, benchmarks/results/issue60,
# the ranks' RSS from step 1 less the arena and the process): 8B 14 layers' worth, 14B 10, 24B 12; the host
# thread runs up to a third of the layers behind the backward. 12 puts all three within 2%.
# fsdp.offload_grads_in_flight bounds them (backends/offload/overlap.InFlight: the landing unit counted).
GRAD_LAYERS_IN_FLIGHT = 12


def grad_layers_in_flight(cfg: C.RunConfig, layers: int) -> int:
    """The layers' gradients on the host at once under the overlapped host step (the root's apart)."""
    bound = getattr(cfg.fsdp, "offload_grads_in_flight", 0)
    return min(GRAD_LAYERS_IN_FLIGHT, layers, *( (bound,) if bound else () ))


def host_step_overlaps(cfg: C.RunConfig) -> bool:
    """backends/offload/overlap.why_not, as the settings know it: the offloaded host step runs under the
    backward, unit by unit (and frees each unit's gradients after its step)."""
    f = cfg.fsdp
    return (f.cpu_offload and f.offload_overlap and cfg.train.clip_grad_norm <= 0 and cfg.precision.dtype != "fp16"
            and _optim_name(cfg) in ("adamw", "adam-mini"))


def _optim_name(cfg: C.RunConfig) -> str:
    return getattr(getattr(cfg, "optim", None), "name", "adamw")


def _sizes(cfg: C.RunConfig, s: Shapes) -> _Sizes:
    p, f = cfg.parallel, cfg.fsdp
    world = p.nproc_per_node * p.nnodes
    shard = {"no_shard": 1, "hybrid_shard": p.nproc_per_node}.get(f.sharding, world)
    c = DTYPE_BYTES[cfg.precision.dtype]
    reduce_c = 4 if cfg.precision.dtype == "fp32" else DTYPE_BYTES[cfg.precision.reduce_dtype or "fp32"]
    # bytes of a kept (sharded) parameter, its gradient and each Adam moment: fp32, or bf16 masters
    m = cfg.kept_bytes         # adam-mini's split fp32 masters are bf16 shards (the rest in its states)
    L = s.layers
    # Sharded fp32 parameters: dim 0 padded to the shard group (exactly as FSDP2 pads).
    shard_numels = [shard_numel(sh, shard) for sh in s.all_params()]
    params_b = m * sum(shard_numels)
    layer_full = c * s.per_layer
    # fsdp.py sets explicit prefetch unless no_shard; FSDP2 then still prefetches one layer in
    # backward by itself.
    sharded = f.sharding != "no_shard"
    bwd_n = min(f.backward_prefetch if sharded else 1, max(L - 1, 0))
    # reshard_after_forward false (shard_grad_op): every layer stays gathered from forward to backward
    held, last_fwd = (0, layer_full) if cfg.reshard_after_forward else (L * layer_full, 0)
    # Gradient accumulation without sync: FSDP2 keeps each layer's unsharded gradient, in the reduce
    # dtype when it differs from the compute dtype (_fsdp_param.py to_accumulated_grad_if_needed).
    accum = (reduce_c if reduce_c != c else c) * s.n_params if cfg.train.grad_accum > 1 else 0
    # precision.master_rounding = kahan (backends/optim/master_update.py): a bf16 compensation buffer shaped like
    # the sharded parameters, beside the masters (on the host when offloaded).
    kahan = 2 * sum(shard_numels) if m == 2 and getattr(cfg.precision, "master_rounding", "") == "kahan" else 0
    return _Sizes(
        shard=shard, c=c, reduce_c=reduce_c, m=m, mtag="bf16" if m == 2 else "fp32", offload=f.cpu_offload,
        a=activations(cfg, s), shard_numels=shard_numels, params_b=params_b,
        # exp_avg + exp_avg_sq: shaped and typed like the sharded parameter, or torchao's low-bit blocks
        adam_b=optim_states.states_bytes(cfg, s.all_params(), shard, shard_numels),
        adam_tag=optim_states.state_tag(_optim_name(cfg), "bf16" if m == 2 else "fp32", cfg.split_masters),
        layer_shard=sum(shard_numel(sh, shard) for sh in s.layer_params()),
        root_shard=sum(shard_numel(sh, shard) for sh in s.root_params()),
        layer_full=layer_full, root_full=c * s.root,
        head_grad=0 if s.tied else c * s.vocab * s.hidden,    # the head's unsharded gradient, from the loss on
        sharded=sharded, bwd_n=bwd_n, held=held, last_fwd=last_fwd, accum=accum, kahan=kahan,
        in_backward=bool(getattr(getattr(cfg, "optim", None), "step_in_backward", False)))


def _gpu_moments(cfg: C.RunConfig, s: Shapes, z: _Sizes) -> dict[str, dict[str, int]]:
    """The compute stream's allocations at each moment. FSDP2 allocates the all-gather buffers on its
    all-gather copy-in stream and the reduce-scatter inputs and outputs (the sharded gradients) on
    its reduce-scatter stream; the caching allocator keeps a pool per stream, so those pools add to
    the compute stream's peak instead of sharing its free blocks (_side_pools)."""
    a, L, c, m = z.a, s.layers, z.c, z.m
    st = {} if z.offload else {f"parameters ({z.mtag} shards)": z.params_b,
                               f"optimizer states ({z.adam_tag})": z.adam_b}
    if z.kahan and not z.offload:
        st["Kahan compensation (bf16)"] = z.kahan
    ws = {"cuBLAS workspaces": CUBLAS_WORKSPACE_BYTES}
    acc = {"accumulated gradients (no sync)": z.accum}
    root = {"gathered root (embedding, head)": z.root_full}
    unsharded_grad = c * s.per_layer        # a layer's gradient from autograd, before its reduce-scatter
    acc_c = (z.reduce_c if z.reduce_c != c else c)
    # The clip is folded into fused AdamW except under fp16's scaler (backends/engine/fsdp_step.py Clip): then
    # clip_grad_norm_ and the scaler's unscale run over the sharded DTensor gradients and hold a copy
    # of them at the step. Measured (i16-fsdp-3b-fp16-mb4-ckpt): allocated 58.6 GiB = parameters +
    # Adam + gradients + one more copy of the gradients (11.7 GiB each).
    folded = cfg.precision.dtype != "fp16"
    clip_copy = {} if (folded or z.offload) else {
        f"clip and unscale copy of the gradients ({z.mtag})": m * sum(z.shard_numels)}
    head = {"head gradient (unsharded)": z.head_grad}
    fp8 = float8_casts(cfg, s)
    return {
        "end of forward": {**st, **root, "gathered layers": z.held + z.last_fwd, "activations": a.saved_all,
                           "loss chunk": a.loss_forward, **acc, **ws, **fp8},
        "loss backward": {**st, **root, "gathered layers": z.held, **head,
                          "activations": a.saved_all, "loss chunk": a.loss_backward, **acc, **ws},
        "last layer backward": {**st, **root, "gathered layers + prefetch":
                                z.held + (0 if z.held else (1 + z.bwd_n) * z.layer_full), **head,
                                "activations": a.saved_all - a.final + a.recompute,
                                "layer backward": a.layer_backward + unsharded_grad, **acc, **ws, **fp8},
        # the other layers' gradients are in the reduce-scatter pool by now, or, without sync, in fp32
        # accumulators on this stream
        "first layer backward": {**st, **root, "gathered layers": z.layer_full, **head,
                                 "activations": a.saved_layer + a.inputs + a.mask + a.recompute,
                                 "layer backward": a.layer_backward + unsharded_grad,
                                 # the root's accumulator, and the layers' where (unsharded, without
                                 # sync) they outweigh the sharded gradients counted in the pool
                                 "accumulated gradients (no sync)": acc_c * s.root + max(
                                     0, (L - 1) * (acc_c * s.per_layer - m * z.layer_shard)) if z.accum else 0,
                                 **ws, **fp8},
        "end of backward": {**st, **root, "root gradients (unsharded)": c * s.root, **ws},
        "optimizer step": {**st, **ws, **clip_copy},
    }


def _side_pools(cfg: C.RunConfig, s: Shapes, z: _Sizes) -> tuple[dict[str, int], dict[str, int]]:
    """Side pools. Reduce-scatter stream: every sharded gradient (the reduce-scatter outputs; with
    offload each goes to the host at once) and the largest reduce-scatter input (the root's, or two
    layers' in flight). All-gather copy-in stream: the largest all-gather buffers in flight (the
    root's, or a layer and its prefetch), plus with offload the fp32 shards copied to the GPU.
    Returns (pool -> bytes, moment -> bytes of the pools in use then)."""
    L, m, reduce_c, offload = s.layers, z.m, z.reduce_c, z.offload
    layer_shard, root_shard = z.layer_shard, z.root_shard
    # optim.step_in_backward (backends/optim/step_in_backward.py): each sharded gradient is stepped and freed
    # by its hook as it lands, as an offloaded one leaves for the host at once: the pool holds a layer's
    # (and the next one in flight), never the whole model's.
    one_at_a_time = offload or z.in_backward
    rs_in = reduce_c * max(s.root, 2 * s.per_layer)
    # With offload each sharded gradient leaves for the host at once. The reduce-scatter output is in the
    # reduce dtype; with bf16 masters it is cast to bf16 before the copy, so the largest output and its
    # cast share the pool with the next layer's gradient. Measured (i16-fsdp-*-offload-bf16m-*): the
    # model with the gradients in the master dtype alone was under by 0.75 GiB (1b) and 1.36 GiB (7b);
    # fp32 masters need no cast (off_g = 4: as before).
    off_g = reduce_c + (m if m != reduce_c else 0)
    g_root = m * root_shard
    grads_gpu = (off_g * max(root_shard, layer_shard) + m * layer_shard if m != reduce_c
                 else m * max(root_shard, 2 * layer_shard)) if one_at_a_time else (L * m * layer_shard + g_root)
    n_ag = 1 + max(min(cfg.fsdp.forward_prefetch if z.sharded else 0, max(L - 1, 0)), z.bwd_n)
    ag = z.c * max(s.root, n_ag * s.per_layer) + (m * max(root_shard, n_ag * layer_shard) if offload else 0)
    side = {"reduce-scatter stream pool (sharded gradients, inputs)": grads_gpu + rs_in,
            "all-gather stream pool": ag}
    # What of those pools is in use at each moment (the allocated view, and what a cap must hold).
    g_layer = 0 if one_at_a_time else m * layer_shard
    in_flight_ag = z.c * s.per_layer + (m * layer_shard if offload else 0)
    side_live = {"last layer backward": in_flight_ag if z.bwd_n else 0,
                 "first layer backward": (L - 1) * g_layer + reduce_c * s.per_layer
                 + (m * layer_shard if one_at_a_time else 0),
                 "end of backward": L * g_layer + g_root + reduce_c * s.root,
                 "optimizer step": 0 if one_at_a_time else L * g_layer + g_root}
    return side, side_live


def _host(cfg: C.RunConfig, s: Shapes, z: _Sizes) -> dict[str, dict[str, int]]:
    """One rank's RSS. The model is built on the meta device, so no full copy exists anywhere
    (backends/engine/fsdp.py build), and init_random_ draws each shard in place on its device."""
    f, m, mtag = cfg.fsdp, z.m, z.mtag
    host: dict[str, dict[str, int]] = {"training": {"process (python, torch, CUDA)": RANK_BASE_RSS["fsdp"],
                                                    **offloaded_host(cfg, s)}}
    if not z.offload:
        return host
    # to_empty(cpu) allocates the shards unpinned, FSDP2 then pins each (.pin_memory(): rounded to a
    # power of two) and drops the unpinned copy; gradients arrive D2H into pinned tensors
    # (.to("cpu", non_blocking=True) allocates pinned memory); Adam's states are plain zeros_like.
    pinned = pow2_ceil if f.pin_memory else (lambda n: n)
    tag = ", pinned" if f.pin_memory else ""
    # fsdp.host_arena (backends/offload/pinned_arena.py): the shards and Adam's states in one region pinned in
    # place, each view 4 KiB-aligned: no power-of-two block per shard. The gradients are still pinned
    # a block per tensor by torch.
    arena = getattr(f, "host_arena", False)
    in_arena = (lambda n: -(-n // 4096) * 4096) if arena else pinned
    where = " in the host arena" if arena else tag
    grads = [pinned(m * n) for n in z.shard_numels]
    if host_step_overlaps(cfg):
        # backends/offload/overlap.py frees each unit's host gradients once it has stepped: the units between
        # landing and stepping are on the host, not the model (a few layers behind the backward, and the
        # root's, which lands last); torch's pinned cache keeps their blocks for the next step's
        L = s.layers
        layer, root = grads[:len(grads) - len(s.root_params())], grads[len(grads) - len(s.root_params()):]
        per_layer = sum(layer) // max(L, 1)
        n = grad_layers_in_flight(cfg, L)
        label, amount = f"gradients in flight ({mtag} shards{tag}: {n} layers and the root)", \
            n * per_layer + sum(root)
    else:
        label, amount = f"gradients ({mtag} shards{tag})", sum(grads)
    host["training"].update({
        f"parameters ({mtag} shards{where})": sum(in_arena(m * n) for n in z.shard_numels),
        label: amount,
        f"optimizer states ({z.adam_tag}{', in the host arena' if arena else ', host'})": z.adam_b})
    if (f.offload_compute_copy and cfg.precision.dtype != "fp32"
            and cfg.kept_bytes == 4):
        # backends/offload/host_copy.py ComputeCopy: one flat buffer, page-locked in place (no rounding).
        host["training"][f"{cfg.precision.dtype} copy of the shards (all-gather input, pinned)"] = \
            2 * sum(z.shard_numels)
    if z.kahan:
        host["training"]["Kahan compensation (bf16, host)"] = z.kahan
    if cfg.precision.dtype == "fp16":
        host["training"]["fp16 scaler checks on host gradients"] = int(FSDP_FP16_OFFLOAD_HOST_PER_PARAM * s.n_params)
    return host
