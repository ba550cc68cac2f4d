"""One DeepSpeed ZeRO rank's memory over the moments of a step (backends/engine/deepspeed.py, stages 0-3,
with or without CPU offload)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from shardconsole.settings import config as C
from shardconsole.plan.activation_memory import activations, float8_casts, offloaded_host
from shardconsole.plan.constants import (CUBLAS_WORKSPACE_BYTES, DS_BUILD_BASE_RSS, DS_SUB_GROUP_SIZE, DTYPE_BYTES,
                                         NVME_PARAM_BUFFER_NUMEL, RANK_BASE_RSS, GiB)
from shardconsole.plan.rank import RankMemory
from shardconsole.plan.shapes import Shapes, shape_numel, pow2_ceil


def ds_sub_groups(s: Shapes, world: int, limit: int = DS_SUB_GROUP_SIZE) -> list[int]:
    """ZeRO-3 sub-groups (elements of this rank's partition): parameters in model order, a group
    closes once it reaches `limit` (stage3.py _create_fp16_sub_groups)."""
    groups, run = [], 0
    order = s.root_params()[:1] + s.layer_params() * s.layers + s.root_params()[1:]
    for sh in order:
        run += -(-shape_numel(sh) // world)
        if run >= limit:
            groups.append(run)
            run = 0
    if run:
        groups.append(run)
    return groups


@dataclass(frozen=True)
class _Ctx:
    """What every stage's memory is computed from (one rank)."""
    c: int                        # bytes of the compute dtype
    m: int                        # bytes of the master, its gradients and Adam's moments
    mtag: str
    off_opt: bool
    off_par: bool
    opt_nvme: bool
    par_nvme: bool
    W: int                        # world size
    P: int                        # parameters
    part: int                     # parameters in this rank's partition
    pin: Callable[[int], int]     # bytes a pinned buffer of n bytes takes
    ptag: str
    largest_param: int
    all_params: list


@dataclass
class _Held:
    """One stage's buffers: held through training (GPU, host, side pools) and the moments' extras."""
    gpu: dict[str, int] = field(default_factory=dict)
    host: dict[str, int] = field(default_factory=dict)
    side: dict[str, int] = field(default_factory=dict)    # pools held beside the compute stream's peak
    opt_tmp: int = 0                                      # transient at the optimizer step
    gathered: int = 0                                     # stage 3: gathered parameters in forward/backward
    bucket: int = 0                                       # reduction buffers alive in backward
    build_gpu: int = 0


def deepspeed_rank_memory(cfg: C.RunConfig, s: Shapes) -> RankMemory:
    """backends/engine/deepspeed.py with the ds_config of ds_json.to_ds_config, modelled on DeepSpeed 0.19's
    runtime/zero/stage3.py, stage_1_and_2.py, partitioned_param_coordinator.py and
    partition_parameters.py (buffers named as there). Stage 3 builds under zero.Init (partitioned at
    construction, on the GPU or, with offload_param, on the CPU); stages 0-2 build the whole fp32
    model on the CPU of every rank, and DeepSpeed casts it and moves it to the GPU at initialize."""
    k = _ctx(cfg, s)
    stage = cfg.deepspeed.stage
    h = {3: _stage3, 1: _stage12, 2: _stage12}.get(stage, _stage0)(cfg, s, k)
    # In use beside the compute stream: one bucket being reduced, during backward (ZeRO-3)
    side_live = {"last layer backward": k.c * min(cfg.deepspeed.reduce_bucket_size, k.P)} if stage == 3 else {}
    return RankMemory(_gpu_phases(cfg, s, k, h), _host_phases(cfg, s, k, h), _notes(cfg, k), h.side, side_live)


def _ctx(cfg: C.RunConfig, s: Shapes) -> _Ctx:
    d, p = cfg.deepspeed, cfg.parallel
    W = p.nproc_per_node * p.nnodes
    stage = d.stage
    # precision.master_dtype = "bf16": DeepSpeed's bf16_master_weights_and_grads + bf16_optimizer_states
    m = 2 if cfg.precision.master_dtype == "bf16" and stage >= 1 else 4
    # NVMe offload keeps the same things off the GPU as CPU offload; on the host only DeepSpeed's
    # pinned swap buffers stay (_stage3), the states themselves are files under nvme_path.
    off_opt = d.offload_optimizer in ("cpu", "nvme") and stage >= 1
    off_par = d.offload_param in ("cpu", "nvme") and stage == 3
    all_params = s.all_params()
    return _Ctx(c=DTYPE_BYTES[cfg.precision.dtype], m=m, mtag="bf16" if m == 2 else "fp32", off_opt=off_opt,
                off_par=off_par, opt_nvme=off_opt and d.offload_optimizer == "nvme",
                par_nvme=off_par and d.offload_param == "nvme", W=W, P=s.n_params, part=-(-s.n_params // W),
                pin=pow2_ceil if d.pin_memory else (lambda n: n), ptag=", pinned" if d.pin_memory else "",
                largest_param=max(shape_numel(sh) for sh in all_params), all_params=all_params)


def _stage3(cfg: C.RunConfig, s: Shapes, k: _Ctx) -> _Held:
    d, h = cfg.deepspeed, _Held()
    subs = ds_sub_groups(s, k.W)
    if k.par_nvme:
        # AsyncPartitionedParameterSwapper: one tensor of buffer_count (5) x buffer_size (1e8)
        # elements in the model dtype, page-locked by the async I/O op itself (exact bytes, not
        # torch's power-of-two pinned blocks), holds the partitions being swapped
        h.host["parameter swap buffers (5 x 1e8, locked)"] = 5 * k.c * NVME_PARAM_BUFFER_NUMEL
    elif k.off_par:
        # zero.Init puts each parameter's partition on the host; initialize then copies them into
        # one pinned flat buffer (_create_param_groups_fp16_flat_cpu_memory) and drops them.
        # Measured (ds-1b-z3-alloff): the per-parameter copies do not stay.
        h.host[f"parameters (flat partition{k.ptag})"] = k.pin(k.c * k.part)
    else:
        h.gpu["parameters (partition)"] = k.c * k.part           # lp_param_buffer
        # defragment() moves the partitions into one flat buffer through a host copy, so the GPU
        # holds one copy at a time (zero/utils.py), and the host holds c * part for a moment
        h.build_gpu = k.c * k.part
    if k.off_opt:
        if k.opt_nvme:
            # PartitionedOptimizerSwapper: buffer_count (4) buffers of the largest sub-group, locked
            # by the async I/O op (new_cpu_locked_tensor: exact bytes), hold the master and Adam's
            # moments of the sub-group being stepped (swap_tensor/optimizer_utils.py, utils.py); the
            # gradients stay on the host as with CPU offload
            h.host[f"optimizer swap buffers (4 x largest sub-group, {k.mtag}, locked)"] = 4 * k.m * max(subs)
        else:
            h.host[f"{k.mtag} master (partition{k.ptag})"] = sum(k.pin(k.m * g) for g in subs)
            h.host[f"optimizer states (Adam {k.mtag})"] = 2 * k.m * k.part
        h.host[f"{k.mtag} gradients{k.ptag}"] = sum(k.pin(k.m * g) for g in subs)
        # grad_partitions_flat_buffer lives on the optimizer's device (the host) in the model dtype
        h.host[f"gradients (partition{k.ptag})"] = k.pin(k.c * k.part)
    else:
        h.gpu[f"{k.mtag} master (partition)"] = k.m * k.part
        h.gpu[f"optimizer states (Adam {k.mtag})"] = 2 * k.m * k.part
        h.gpu["gradients (partition)"] = k.c * k.part             # grad_partitions_flat_buffer
        h.opt_tmp = k.m * max(subs)                             # a sub-group's gradients in fp32 at step()
    # __ipg_bucket_flat_buffer: reduce_bucket_size elements of the model dtype, allocated in full
    # whatever the model's size (contiguous gradients). Measured: +0.68 GiB over min(bucket, P) for
    # the 0.134e9-parameter runs.
    h.bucket = k.c * d.reduce_bucket_size if d.contiguous_gradients else 0
    # Gathered while computing. With one rank per partition group DeepSpeed does not gather: the
    # parameter is its partition (partition_parameters.py _no_gather_coalesced), a view when the
    # partition is on the GPU, a copy when it is offloaded. Otherwise a module's parameters are
    # released after its forward unless used again within stage3_max_reuse_distance elements of
    # the fetch trace (partitioned_param_coordinator.py __params_to_release): a layer's next use
    # is its backward, two passes over the layers after it away, so the last
    # max_reuse_distance / 2 elements stay gathered into backward; plus the head (an external
    # parameter of the root, gathered for the whole step), the running module and the prefetch
    # bucket; at most stage3_max_live_parameters. Parameters under
    # stage3_param_persistence_threshold stay gathered. Measured with offload_param on one rank
    # (ds-1b-z3-alloff): the whole model stays on the GPU (max_live_parameters 1e9 > 0.94e9).
    head = 0 if s.tied else s.vocab * s.hidden
    running = max(s.intermediate * s.hidden, s.q_dim * s.hidden)
    persistent = sum(shape_numel(sh) for sh in k.all_params if shape_numel(sh) < d.stage3_param_persistence_threshold)
    if k.W == 1 and not k.off_par:
        h.gathered = 0
    elif k.W == 1:
        h.gathered = k.c * min(d.stage3_max_live_parameters, k.P)
    else:
        kept = min(d.stage3_max_reuse_distance // 2, s.layers * s.per_layer)
        live = min(d.stage3_max_live_parameters, k.P, kept + head + running + d.stage3_prefetch_bucket_size)
        h.gathered = k.c * (live + persistent)
    # Beside the compute stream's peak the allocator holds the reduction stream's buffers (the
    # flattened bucket, its reduced copy and the partition it is copied into: 2.5 x
    # min(reduce_bucket_size, P) on average) and the fp32 step buffer freed after each step.
    # Fitted to the ZeRO-3 runs (reserved minus the compute stream's peak: 6.3-6.9 GiB at 0.94e9
    # parameters without offload, 1.9-2.8 GiB with it, 1.2-1.4 GiB at 0.134e9; the 1.9 is
    # 4090x2-zero3 on one GPU in benchmarks/data/h200_issue3.json).
    h.side["reduction stream pool (buckets)"] = int(2.5 * k.c * min(d.reduce_bucket_size, k.P))
    h.side[f"{k.mtag} step buffer (cached)"] = 0 if k.off_opt else k.m * max(subs)
    if k.off_par and k.W == 1 and k.P > d.stage3_max_live_parameters:
        # More parameters than stage3_max_live_parameters: layers are released after use and
        # fetched from the host again, each fetch a new block, and the allocator keeps what was
        # freed. Measured on the H200 (ZeRO-3, parameters and optimizer offloaded, one rank, 3b):
        # reserved minus the modelled parts was 4.6 GiB with bf16 masters and 8.2 GiB with fp32
        # masters, about the master dtype's bytes for each parameter over the limit; at 1b (under
        # the limit) nothing. The mechanism is not pinned down: a fitted term (docs/PLANNER.md).
        h.side["parameter re-fetch blocks (cached)"] = k.m * (k.P - d.stage3_max_live_parameters)
    return h


def _stage12(cfg: C.RunConfig, s: Shapes, k: _Ctx) -> _Held:
    d, h, stage = cfg.deepspeed, _Held(), cfg.deepspeed.stage
    h.gpu["parameters (full, flat)"] = k.c * k.P                 # bit16_groups_flat
    h.build_gpu = 2 * k.c * k.P                                   # the moved module + its flat copy
    if k.off_opt:
        h.host[f"{k.mtag} master (partition{k.ptag})"] = k.pin(k.m * k.part)
        h.host[f"optimizer states (Adam {k.mtag})"] = 2 * k.m * k.part
        h.host[f"{k.mtag} gradients (partition{k.ptag})"] = k.pin(k.m * k.part)
        h.host["gradient staging (largest parameter)"] = k.pin(k.c * k.largest_param)
        h.gpu["gradient staging (largest parameter)"] = k.c * k.largest_param
        # accumulated_grads_in_cpu: one host buffer per parameter in the model dtype, pinned one by
        # one (async_accumulate_grad_in_cpu_via_gpu). Measured: ds-1b-z2-optoff ranks held 1.97 GiB
        # over the other parts; this sum is 2.25 GiB there.
        h.host[f"gradient accumulation buffers (per parameter{k.ptag})"] = sum(k.pin(k.c * shape_numel(sh))
                                                                                for sh in k.all_params)
    else:
        h.gpu[f"{k.mtag} master (partition)"] = k.m * k.part
        h.gpu[f"optimizer states (Adam {k.mtag})"] = 2 * k.m * k.part
        h.gpu["gradients (partition)" if stage == 2 else "gradients (full)"] = k.c * (k.part if stage == 2 else k.P)
        h.opt_tmp = k.c * k.part + k.m * k.part          # the flattened gradient partition and its fp32 copy
    # setup_buckets: reduce_bucket_size elements (x2 with overlap_comm), allocated in full at the
    # first gradient of each backward and released after it (_release_ipg_buffers).
    n_buf = 2 if d.overlap_comm else 1
    h.bucket = n_buf * k.c * d.reduce_bucket_size if d.contiguous_gradients else 0
    # Held beside the compute stream's peak: the released buckets and the fp32 gradient partition
    # of the step. Fitted to the ZeRO-2 calibration runs (reserved minus the compute peak).
    h.side["reduce buckets (cached)"] = h.bucket
    h.side[f"{k.mtag} step buffer (cached)"] = 0 if k.off_opt else k.m * k.part
    if k.W > 1:
        h.opt_tmp += k.c * min(d.allgather_bucket_size, k.P)      # all-gather of the updated parameters
    return h


def _stage0(cfg: C.RunConfig, s: Shapes, k: _Ctx) -> _Held:
    h = _Held()
    # Stage 0: bf16 -> BF16_Optimizer (fp32 master, fp32 gradients); fp16 -> FP16_Optimizer.
    h.gpu["parameters"] = k.c * k.P
    h.build_gpu = k.c * k.P
    if k.c == 4:
        h.gpu["gradients"] = 4 * k.P
        h.gpu["optimizer states (Adam fp32)"] = 8 * k.P
    else:
        h.gpu["fp32 master"] = 4 * k.P
        h.gpu["gradients"] = (4 if cfg.precision.dtype == "bf16" else k.c) * k.P
        h.gpu["optimizer states (Adam fp32)"] = 8 * k.P
        h.opt_tmp = 4 * k.P if cfg.precision.dtype == "fp16" else 0
    return h


def _gpu_phases(cfg: C.RunConfig, s: Shapes, k: _Ctx, h: _Held) -> dict[str, dict[str, int]]:
    a = activations(cfg, s)
    stage = cfg.deepspeed.stage
    head_grad = 0 if s.tied else k.c * s.vocab * s.hidden
    gpu = h.gpu
    ws = {"cuBLAS workspaces": CUBLAS_WORKSPACE_BYTES}
    comm = {"reduce bucket": h.bucket} if h.bucket else {}
    early = comm if stage == 3 else {}     # ZeRO-1/2 allocate their buckets at the first gradient
    gath = {"gathered parameters + prefetch": h.gathered} if h.gathered else {}
    acts_all = a.saved_all
    fp8 = float8_casts(cfg, s)
    return {
        "end of forward": {**gpu, **gath, **early, "activations": acts_all, "loss chunk": a.loss_forward, **ws, **fp8},
        "loss backward": {**gpu, **gath, **early, "head gradient (unsharded)": head_grad, "activations": acts_all,
                          "loss chunk": a.loss_backward, **ws},
        "last layer backward": {**gpu, **gath, **comm, "head gradient (unsharded)": head_grad,
                                "activations": acts_all - a.final + a.recompute, "layer backward": a.layer_backward,
                                **ws, **fp8},
        "optimizer step": {**gpu, **early, "optimizer temporaries": h.opt_tmp, **ws},
        "model build": {"parameters while built and moved": h.build_gpu},
    }


def _host_phases(cfg: C.RunConfig, s: Shapes, k: _Ctx, h: _Held) -> dict[str, dict[str, int]]:
    stage, c, P, part = cfg.deepspeed.stage, k.c, k.P, k.part
    hphases: dict[str, dict[str, int]] = {}
    if stage < 3:
        # the whole fp32 model on the CPU (random init in place), then a cast copy per tensor; the
        # process is smaller then (no kernels loaded yet): DS_BUILD_BASE_RSS
        hphases["build"] = {"process (python, torch, CUDA)": DS_BUILD_BASE_RSS, "model built on the CPU (fp32)": 4 * P,
                            "cast copy (largest tensor)": c * k.largest_param}
    hphases["training"] = {"process (python, torch, CUDA)": RANK_BASE_RSS["deepspeed"], **h.host,
                           **offloaded_host(cfg, s)}
    if stage == 3 and not k.off_par:
        hphases["build"] = {"process (python, torch, CUDA)": DS_BUILD_BASE_RSS,
                            "defragment(): partitions copied through the host": c * part}
    if stage == 3 and k.off_opt and cfg.deepspeed.pin_memory:
        # the gradient partition buffer is allocated on the host, then pinned: a plain copy exists
        # while its pinned twin is made, after the other optimizer buffers (stage3.py
        # grad_partitions_flat_buffer). Measured: 1.75 GiB over the steady RSS at 0.94e9 parameters.
        hphases["training"]["gradient buffer being pinned (transient)"] = c * part
    return hphases


def _notes(cfg: C.RunConfig, k: _Ctx) -> list[str]:
    stage = cfg.deepspeed.stage
    notes = []
    if k.opt_nvme or k.par_nvme:
        files = (3 * k.m * k.part if k.opt_nvme else 0) + (k.c * k.part if k.par_nvme else 0)
        notes.append(f"NVMe offload: the host side is DeepSpeed's swap buffers as its source sizes them (not "
                     f"measured yet); the files under deepspeed.nvme_path take about {files / GiB:.1f} GiB a rank")
    # Measured on the H200 (benchmarks/results/session6/plan_issue16.json): the lanes' first DeepSpeed runs
    # had 2.6-3.6 GiB of build processes beside the ranks; later runs loaded the cached ops.
    notes.append("the first DeepSpeed run on a machine builds its ops (ninja, nvcc): up to ~3.6 GiB of host "
                 "RAM for a minute beside this figure; later runs load them from the cache")
    if stage < 3:
        notes.append(f"ZeRO-{stage} builds the whole fp32 model on the CPU of every rank "
                     f"({4 * k.P / GiB:.1f} GiB each) before DeepSpeed moves it to the GPU")
    return notes
