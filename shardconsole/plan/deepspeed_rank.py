"""One DeepSpeed ZeRO rank's memory over the moments of a step (backends/deepspeed.py, stages 0-3,
with or without CPU offload)."""

from __future__ import annotations

from shardconsole.settings import config as C
from shardconsole.plan.activation_memory import activations
from shardconsole.plan.constants import (CUBLAS_WORKSPACE_BYTES, DS_BUILD_BASE_RSS, DS_SUB_GROUP_SIZE, DTYPE_BYTES,
                                         NVME_PARAM_BUFFER_NUMEL, RANK_BASE_RSS, GiB)
from shardconsole.plan.rank import _Rank
from shardconsole.plan.shapes import Shapes, _numel, pow2_ceil


def _ds_sub_groups(s: Shapes, world: int, limit: int = DS_SUB_GROUP_SIZE) -> list[int]:
    """ZeRO-3 sub-groups (elements of this rank's partition): parameters in model order, a group
    closes once it reaches `limit` (stage3.py _create_fp16_sub_groups)."""
    groups, run = [], 0
    order = s.root_params()[:1] + s.layer_params() * s.layers + s.root_params()[1:]
    for sh in order:
        run += -(-_numel(sh) // world)
        if run >= limit:
            groups.append(run)
            run = 0
    if run:
        groups.append(run)
    return groups


def _deepspeed(cfg: C.RunConfig, s: Shapes) -> _Rank:
    """backends/deepspeed.py with the ds_config of ds_json.to_ds_config, modelled on DeepSpeed 0.19's
    runtime/zero/stage3.py, stage_1_and_2.py, partitioned_param_coordinator.py and
    partition_parameters.py (buffers named as there). Stage 3 builds under zero.Init (partitioned at
    construction, on the GPU or, with offload_param, on the CPU); stages 0-2 build the whole fp32
    model on the CPU of every rank, and DeepSpeed casts it and moves it to the GPU at initialize."""
    d, p = cfg.deepspeed, cfg.parallel
    W = p.nproc_per_node * p.nnodes
    c = DTYPE_BYTES[cfg.precision.dtype]
    stage = d.stage
    # precision.master_dtype = "bf16": DeepSpeed's bf16_master_weights_and_grads + bf16_optimizer_states
    m = 2 if cfg.precision.master_dtype == "bf16" and stage >= 1 else 4
    mtag = "bf16" if m == 2 else "fp32"
    # NVMe offload keeps the same things off the GPU as CPU offload; on the host only DeepSpeed's
    # pinned swap buffers stay (below), the states themselves are files under nvme_path.
    off_opt = d.offload_optimizer in ("cpu", "nvme") and stage >= 1
    off_par = d.offload_param in ("cpu", "nvme") and stage == 3
    opt_nvme = off_opt and d.offload_optimizer == "nvme"
    par_nvme = off_par and d.offload_param == "nvme"
    nvme = opt_nvme or par_nvme
    a = activations(cfg, s)
    P = s.n_params
    part = -(-P // W)
    pin = pow2_ceil if d.pin_memory else (lambda n: n)
    ptag = ", pinned" if d.pin_memory else ""
    all_params = s.all_params()
    largest_param = max(_numel(sh) for sh in all_params)
    head_grad = 0 if s.tied else c * s.vocab * s.hidden
    gpu: dict[str, int] = {}          # held through training
    host: dict[str, int] = {}
    side: dict[str, int] = {}         # pools held beside the compute stream's peak
    opt_tmp = 0                       # transient at the optimizer step
    gathered = 0                      # stage 3: gathered parameters in forward/backward
    bucket = 0                        # reduction buffers alive in backward
    build_gpu = 0
    if stage == 3:
        subs = _ds_sub_groups(s, W)
        if par_nvme:
            # AsyncPartitionedParameterSwapper: one tensor of buffer_count (5) x buffer_size (1e8)
            # elements in the model dtype, page-locked by the async I/O op itself (exact bytes, not
            # torch's power-of-two pinned blocks), holds the partitions being swapped
            host["parameter swap buffers (5 x 1e8, locked)"] = 5 * c * NVME_PARAM_BUFFER_NUMEL
        elif off_par:
            # zero.Init puts each parameter's partition on the host; initialize then copies them into
            # one pinned flat buffer (_create_param_groups_fp16_flat_cpu_memory) and drops them.
            # Measured (ds-1b-z3-alloff): the per-parameter copies do not stay.
            host[f"parameters (flat partition{ptag})"] = pin(c * part)
        else:
            gpu["parameters (partition)"] = c * part           # lp_param_buffer
            # defragment() moves the partitions into one flat buffer through a host copy, so the GPU
            # holds one copy at a time (zero/utils.py), and the host holds c * part for a moment
            build_gpu = c * part
        if off_opt:
            if opt_nvme:
                # PartitionedOptimizerSwapper: buffer_count (4) buffers of the largest sub-group, locked
                # by the async I/O op (new_cpu_locked_tensor: exact bytes), hold the master and Adam's
                # moments of the sub-group being stepped (swap_tensor/optimizer_utils.py, utils.py); the
                # gradients stay on the host as with CPU offload
                host[f"optimizer swap buffers (4 x largest sub-group, {mtag}, locked)"] = 4 * m * max(subs)
            else:
                host[f"{mtag} master (partition{ptag})"] = sum(pin(m * g) for g in subs)
                host[f"optimizer states (Adam {mtag})"] = 2 * m * part
            host[f"{mtag} gradients{ptag}"] = sum(pin(m * g) for g in subs)
            # grad_partitions_flat_buffer lives on the optimizer's device (the host) in the model dtype
            host[f"gradients (partition{ptag})"] = pin(c * part)
        else:
            gpu[f"{mtag} master (partition)"] = m * part
            gpu[f"optimizer states (Adam {mtag})"] = 2 * m * part
            gpu["gradients (partition)"] = c * part             # grad_partitions_flat_buffer
            opt_tmp = m * max(subs)                             # a sub-group's gradients in fp32 at step()
        # __ipg_bucket_flat_buffer: reduce_bucket_size elements of the model dtype, allocated in full
        # whatever the model's size (contiguous gradients). Measured: +0.68 GiB over min(bucket, P) for
        # the 0.134e9-parameter runs.
        bucket = c * d.reduce_bucket_size if d.contiguous_gradients else 0
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
        persistent = sum(_numel(sh) for sh in all_params if _numel(sh) < d.stage3_param_persistence_threshold)
        if W == 1 and not off_par:
            gathered = 0
        elif W == 1:
            gathered = c * min(d.stage3_max_live_parameters, P)
        else:
            kept = min(d.stage3_max_reuse_distance // 2, s.layers * s.per_layer)
            live = min(d.stage3_max_live_parameters, P, kept + head + running + d.stage3_prefetch_bucket_size)
            gathered = c * (live + persistent)
        # Beside the compute stream's peak the allocator holds the reduction stream's buffers (the
        # flattened bucket, its reduced copy and the partition it is copied into: 2.5 x
        # min(reduce_bucket_size, P) on average) and the fp32 step buffer freed after each step.
        # Fitted to the ZeRO-3 runs (reserved minus the compute stream's peak: 6.3-6.9 GiB at 0.94e9
        # parameters without offload, 1.9-2.8 GiB with it, 1.2-1.4 GiB at 0.134e9; the 1.9 is
        # 4090x2-zero3 on one GPU in benchmarks/data/h200_issue3.json).
        side["reduction stream pool (buckets)"] = int(2.5 * c * min(d.reduce_bucket_size, P))
        side[f"{mtag} step buffer (cached)"] = 0 if off_opt else m * max(subs)
        if off_par and W == 1 and P > d.stage3_max_live_parameters:
            # More parameters than stage3_max_live_parameters: layers are released after use and
            # fetched from the host again, each fetch a new block, and the allocator keeps what was
            # freed. Measured on the H200 (ZeRO-3, parameters and optimizer offloaded, one rank, 3b):
            # reserved minus the modelled parts was 4.6 GiB with bf16 masters and 8.2 GiB with fp32
            # masters, about the master dtype's bytes for each parameter over the limit; at 1b (under
            # the limit) nothing. The mechanism is not pinned down: a fitted term (docs/PLANNER.md).
            side["parameter re-fetch blocks (cached)"] = m * (P - d.stage3_max_live_parameters)
    elif stage in (1, 2):
        gpu["parameters (full, flat)"] = c * P                 # bit16_groups_flat
        build_gpu = 2 * c * P                                   # the moved module + its flat copy
        if off_opt:
            host[f"{mtag} master (partition{ptag})"] = pin(m * part)
            host[f"optimizer states (Adam {mtag})"] = 2 * m * part
            host[f"{mtag} gradients (partition{ptag})"] = pin(m * part)
            host["gradient staging (largest parameter)"] = pin(c * largest_param)
            gpu["gradient staging (largest parameter)"] = c * largest_param
            # accumulated_grads_in_cpu: one host buffer per parameter in the model dtype, pinned one by
            # one (async_accumulate_grad_in_cpu_via_gpu). Measured: ds-1b-z2-optoff ranks held 1.97 GiB
            # over the other parts; this sum is 2.25 GiB there.
            host[f"gradient accumulation buffers (per parameter{ptag})"] = sum(pin(c * _numel(sh)) for sh in all_params)
        else:
            gpu[f"{mtag} master (partition)"] = m * part
            gpu[f"optimizer states (Adam {mtag})"] = 2 * m * part
            gpu["gradients (partition)" if stage == 2 else "gradients (full)"] = c * (part if stage == 2 else P)
            opt_tmp = c * part + m * part          # the flattened gradient partition and its fp32 copy
        # setup_buckets: reduce_bucket_size elements (x2 with overlap_comm), allocated in full at the
        # first gradient of each backward and released after it (_release_ipg_buffers).
        n_buf = 2 if d.overlap_comm else 1
        bucket = n_buf * c * d.reduce_bucket_size if d.contiguous_gradients else 0
        # Held beside the compute stream's peak: the released buckets and the fp32 gradient partition
        # of the step. Fitted to the ZeRO-2 calibration runs (reserved minus the compute peak).
        side["reduce buckets (cached)"] = bucket
        side[f"{mtag} step buffer (cached)"] = 0 if off_opt else m * part
        if W > 1:
            opt_tmp += c * min(d.allgather_bucket_size, P)      # all-gather of the updated parameters
    else:
        # Stage 0: bf16 -> BF16_Optimizer (fp32 master, fp32 gradients); fp16 -> FP16_Optimizer.
        gpu["parameters"] = c * P
        build_gpu = c * P
        if c == 4:
            gpu["gradients"] = 4 * P
            gpu["optimizer states (Adam fp32)"] = 8 * P
        else:
            gpu["fp32 master"] = 4 * P
            gpu["gradients"] = (4 if cfg.precision.dtype == "bf16" else c) * P
            gpu["optimizer states (Adam fp32)"] = 8 * P
            opt_tmp = 4 * P if cfg.precision.dtype == "fp16" else 0

    ws = {"cuBLAS workspaces": CUBLAS_WORKSPACE_BYTES}
    comm = {"reduce bucket": bucket} if bucket else {}
    early = comm if stage == 3 else {}     # ZeRO-1/2 allocate their buckets at the first gradient
    gath = {"gathered parameters + prefetch": gathered} if gathered else {}
    acts_all = a.saved_all
    phases: dict[str, dict[str, int]] = {
        "end of forward": {**gpu, **gath, **early, "activations": acts_all, "loss chunk": a.loss_forward, **ws},
        "loss backward": {**gpu, **gath, **early, "head gradient (unsharded)": head_grad, "activations": acts_all,
                          "loss chunk": a.loss_backward, **ws},
        "last layer backward": {**gpu, **gath, **comm, "head gradient (unsharded)": head_grad,
                                "activations": acts_all - a.final + a.recompute, "layer backward": a.layer_backward,
                                **ws},
        "optimizer step": {**gpu, **early, "optimizer temporaries": opt_tmp, **ws},
        "model build": {"parameters while built and moved": build_gpu},
    }

    hphases: dict[str, dict[str, int]] = {}
    if stage < 3:
        # the whole fp32 model on the CPU (random init in place), then a cast copy per tensor; the
        # process is smaller then (no kernels loaded yet): DS_BUILD_BASE_RSS
        hphases["build"] = {"process (python, torch, CUDA)": DS_BUILD_BASE_RSS, "model built on the CPU (fp32)": 4 * P,
                            "cast copy (largest tensor)": c * largest_param}
    hphases["training"] = {"process (python, torch, CUDA)": RANK_BASE_RSS["deepspeed"], **host}
    if stage == 3 and not off_par:
        hphases["build"] = {"process (python, torch, CUDA)": DS_BUILD_BASE_RSS,
                            "defragment(): partitions copied through the host": c * part}
    if stage == 3 and off_opt and d.pin_memory:
        # the gradient partition buffer is allocated on the host, then pinned: a plain copy exists
        # while its pinned twin is made, after the other optimizer buffers (stage3.py
        # grad_partitions_flat_buffer). Measured: 1.75 GiB over the steady RSS at 0.94e9 parameters.
        hphases["training"]["gradient buffer being pinned (transient)"] = c * part
    notes = []
    if nvme:
        files = (3 * m * part if opt_nvme else 0) + (c * part if par_nvme else 0)
        notes.append(f"NVMe offload: the host side is DeepSpeed's swap buffers as its source sizes them (not "
                     f"measured yet); the files under deepspeed.nvme_path take about {files / GiB:.1f} GiB a rank")
    if stage < 3:
        notes.append(f"ZeRO-{stage} builds the whole fp32 model on the CPU of every rank "
                     f"({4 * P / GiB:.1f} GiB each) before DeepSpeed moves it to the GPU")
    # In use beside the compute stream: one bucket being reduced, during backward (ZeRO-3)
    side_live = {"last layer backward": c * min(d.reduce_bucket_size, P)} if stage == 3 else {}
    return _Rank(phases, hphases, notes, side, side_live)
