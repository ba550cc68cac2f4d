"""The planner's constants: sizes, measured overheads, fitted allocator terms, speed factors.

Each one says where it comes from: the sources (PyTorch, DeepSpeed, transformers), or a measurement
of benchmarks/plan_calibrate.py on the H200 test machine (benchmarks/data/plan_calibration.json;
docs/PLANNER.md has the comparison and what is fitted)."""

from __future__ import annotations

KiB, MiB, GiB = 2**10, 2**20, 2**30

# ---------------------------------------------------------------------------------------------------
# Constants. Each one: value, then where it comes from.

# CUDA context + NCCL communicator + loaded kernels: what NVML counts for a rank beyond the caching
# allocator's reserved bytes. Measured: NVML used (minus the idle device's) minus max_memory_reserved
# was 1.29 GiB in every FSDP2 run and 1.67-1.68 GiB in every DeepSpeed run of the calibration
# (benchmarks/data/plan_calibration.json; H200, torch 2.11 + CUDA 13, DeepSpeed 0.19.8, whose
# FusedAdam/CPUAdam modules and extra communicators add the difference). Kept in machine/hardware.py:
# the ranks size the allocator under a cap with it (a cap is the whole device, issue 34).
# NVML reports GPU_DRIVER_RESERVED_BYTES used on an idle H200 (driver and ECC reservations): no process
# can use it. Measured: 0.60 GiB before every calibration run. Other cards: machine/hardware.CARD_MEMORY.
from shardconsole.machine.hardware import CUDA_CONTEXT_BYTES  # noqa: E402,F401
from shardconsole.machine.hardware import DEFAULT_DRIVER_RESERVED_BYTES as GPU_DRIVER_RESERVED_BYTES  # noqa: E402

# The caching allocator reserves more than it hands out. Most of it is modelled as parts: the pools
# of the communication streams (blocks cached for one stream are not reused by another) and the
# buffers freed between moments. What is left, blocks rounded and split, is this fraction of the
# compute stream's peak plus a constant. Fitted to the 22 finished calibration runs (0.03 and 64 MiB:
# mean error of the reserved peak +0.6%, largest 6.8%; 0.00-0.05 and 0-128 MiB all stay under 9%).
ALLOCATOR_SLACK_FRACTION = 0.03
ALLOCATOR_SLACK_FIXED = 64 * MiB

# A run under a cap needs its allocated peak plus blocks the allocator cannot free when it retries
# (split segments with a live block): 5% + 256 MiB. Measured at the edge (benchmarks/plan_calibrate.py
# --subset edge): FSDP2 1b trained under 1.08x this and died under 0.92x. DeepSpeed needs more (see
# estimate()).
REQUIRED_FRAGMENTATION = 0.05
REQUIRED_FIXED = 256 * MiB

# cuBLAS / cuBLASLt workspaces, allocated through the caching allocator: torch's default on Hopper
# is 32 MiB per handle (CUBLAS_WORKSPACE_CONFIG :4096:8) for cuBLAS and cuBLASLt on the compute
# stream. From the torch source; small next to the rest.
CUBLAS_WORKSPACE_BYTES = 64 * MiB

# Tokens per chunk of the loss: backends/rank/common.py chunked_cross_entropy(chunk_tokens=4096).
LOSS_CHUNK_TOKENS = 4096
# Tokens a sample from which a layer's checkpointed input is worth moving to the host and the MLP worth
# computing in tiles (memory.activation_offload, memory.mlp_tile_tokens; issue 62), and the tile the planner proposes
LONG_CONTEXT = 8192
MLP_TILE = 4096

# Host RSS of one rank in training before any model byte: Python + torch + CUDA runtime and
# libraries + NCCL + transformers (+ DeepSpeed). Measured: VmHWM of the rank in the calibration runs
# without offload, 1.85-2.01 GiB for FSDP2 whatever the model (125m to 3b); DeepSpeed's ranks' RSS in
# training (memory lines) 2.01 GiB.
RANK_BASE_RSS = {"fsdp": 1960 * MiB, "deepspeed": 2060 * MiB}
# DeepSpeed ZeRO-0/1/2 build the fp32 model on the CPU before the CUDA kernels are loaded: the rank
# is smaller then. Measured: ds-1b-z2-bf16-mb4-ckpt peaked at 4.90 GiB = this + 4 x 0.94e9 + a cast.
DS_BUILD_BASE_RSS = 1300 * MiB
# On CPU ranks (device = cpu) there is no CUDA runtime: 360 MB per rank of a tiny 2-rank gloo run
# (torch + transformers imported) on the CPU CI machine. Rough.
RANK_BASE_RSS_CPU = 400 * MiB

# torchrun's agent (imports torch) and the headless front end (psutil, NVML; no torch): the other
# Python processes of a run. Measured VmHWM: 0.50-0.62 GiB and 0.04-0.05 GiB.
LAUNCHER_RSS = 530 * MiB
FRONTEND_RSS = 48 * MiB

# Host transients whose mechanism is not pinned down, measured as VmHWM minus the steady RSS:
# FSDP2 with CPU offload in fp16 (ShardedGradScaler's inf/nan checks run on the host gradients):
# 2.62 GiB for 0.94e9 parameters, 0.24 GiB for 0.134e9: about 2.5 bytes a parameter.
FSDP_FP16_OFFLOAD_HOST_PER_PARAM = 2.5

# The kernel, page cache and other processes need some RAM: a run is said to fit in host memory only
# under this fraction of the total. docs/MEASURED.md: a DeepSpeed run was killed at 123 GiB used of 125 GiB,
# an FSDP run with 120 GiB used trained; 0.97 * 125 = 121 GiB.
HOST_USABLE_FRACTION = 0.97

# The largest segment DeepSpeed may fill before it reduces: reduce_bucket_size is counted in elements
# (DeepSpeed's zero/config.py). Its ZeRO-3 default sub_group_size is 1e9 elements (same file).
DS_SUB_GROUP_SIZE = 1_000_000_000
# offload_param = nvme: DeepSpeed's default buffer_size (elements) of its parameter swap buffers
# (runtime/zero/offload_config.py, 0.19)
NVME_PARAM_BUFFER_NUMEL = 100_000_000

DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}

# Bytes a parameter of FSDP2's kept state (weight, gradient, two Adam moments) for each way of keeping the
# masters: fp32 16; bf16 with precision.master_rounding nearest or stochastic 8, kahan 10 (a bf16
# compensation buffer). From backends/optim/master_update.py; tests/test_master_rounding.py measures the
# optimizer's tensors against it.
MASTER_STATE_BYTES = {"fp32": 16, "nearest": 8, "stochastic": 8, "kahan": 10}
# fsdp.host_arena (backends/offload/pinned_arena.py): offloaded shards, Adam's states (with the compensation) and
# the compute copy in one region pinned in place, each view aligned to this many bytes: no power-of-two
# block per tensor. The gradients are still pinned a block per tensor by torch (pow2_ceil).
HOST_ARENA_ALIGN = 4096

# The cold start of "how fast" (plan/speed/book.py: measurements on the user's machine replace it),
# relative to FSDP2 without offload or checkpointing, from docs/MEASURED.md's bare loops on the H200 (0.95B,
# seq 2048, micro-batch 8 unless said):
SPEED_FACTOR = {
    "fsdp": 1.0,                    # 61.5k tokens/s
    # FSDP2 offload against ZeRO-3 offload of parameters and optimizer in the same call: 3.1B under 24 GiB,
    # 4.33k and 4.41k tokens/s against 3.64k and 3.82k (benchmarks/data/h200_issue7c.json, off-3b-*): 1.17x.
    # (The old 1.3/15.6 came from a run before the host step was fused; it ranked DeepSpeed first.)
    "fsdp_offload": 1.17 * 19.6 / 49.1 * 49.1 / 61.5,
    "zero3": 49.1 / 61.5,           # 49.1k tokens/s
    "zero2": 49.1 / 61.5,           # not measured: assumed as ZeRO-3 (fewer gathers, same reductions)
    "zero0": 49.1 / 61.5,           # not measured: assumed as ZeRO-2
    "zero3_offload_opt": 14.7 / 49.1 * 49.1 / 61.5,    # 14.7k
    "zero3_offload_all": 19.6 / 49.1 * 49.1 / 61.5,    # 19.6k (params+optimizer beat optimizer only)
    "zero2_offload_opt": 14.7 / 49.1 * 49.1 / 61.5,    # not measured: assumed as ZeRO-3's
    "checkpointing": 49.4 / 61.5,   # 49.4k with activation checkpointing
}

# ---------------------------------------------------------------------------------------------------
# Saves (plan/saves.py). Measured on tiny-cpu checkpoints of this suite (torch 2.13, DeepSpeed 0.19.8):
# DCP writes each tensor with torch.save (a zip of its records): 1.5-1.7 KB beyond the data a tensor
# (1,684 B averaged over the 148 tensor records of a 2-rank checkpoint), and its .metadata pickle holds
# about 280 B an item (44,354 B for 160 items).
DCP_TENSOR_RECORD_BYTES = 1684
DCP_METADATA_ITEM_BYTES = 280
# engine.save_checkpoint: a torch.save'd dict per file (about 4-5 KB of zip and pickle), about 400 B a
# tensor in the module's state dict; zero_to_fp32.py, zero_to_torch.py and `latest` (41 KB).
DS_FILE_BYTES = 5 * KiB
DS_TENSOR_RECORD_BYTES = 400
DS_FIXED_FILES_BYTES = 41 * KiB
# rank_state/rankN.json: the RNG states as JSON (21.5 KB on CPU ranks; the CUDA generator adds little).
RANK_STATE_BYTES = 22 * KiB
# The export: save_pretrained's config, generation config and README; the safetensors header an entry.
EXPORT_FIXED_BYTES = 16 * KiB
SAFETENSORS_TENSOR_BYTES = 160
# What a save holds beside the state it writes, besides the one tensor it copies at a time
# (backends/checkpoint/save_stream.py StreamingWriter, hf_export.py): the writer's buffers, the zip records, the
# progress thread. Measured: +7 MB on the CPU arena run of tests/test_save_path.py; rounded up.
SAVE_FIXED_BYTES = 32 * MiB
# torch.compile (train.compile): inductor's compile sidecar per rank (a Python with torch imported)
# and its pool of compile_threads = min(32, CPUs) workers forked from it. Measured here (CPU torch 2.13,
# 4 workers): the sidecar 298 MB RSS, each worker 3-5 MB of its own (USS) at rest. On the H200
# (benchmarks/results/session6/plan_issue16.json, i34-fsdp-1b-mb4-compiled-cap24: 16 workers, Triton
# compiling a 1b model) the ranks' children held 0.49 GiB PSS at most: the sidecar and ~12 MiB a worker.
COMPILE_SIDECAR_BYTES = 320 * MiB
COMPILE_WORKER_BYTES = 12 * MiB
COMPILE_THREADS_MAX = 32
