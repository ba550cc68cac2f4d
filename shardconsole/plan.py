"""Will it fit? Peak GPU memory (largest rank) and host RAM of a run, before it is launched.

Pure functions of the settings (RunConfig), the model's shape (ModelSpec, from its config: nothing is
built and torch is not imported) and the hardware (Hardware). The model follows what the ranks of this
package really do (backends/fsdp.py, backends/deepspeed.py, backends/common.py), part by part:

  GPU   parameters, gradients and optimizer states (where the backend keeps them, in which dtype,
        divided by the shard group), gathered (unsharded) parameters and prefetch, activations saved
        for backward (per decoder layer, by micro-batch, sequence length, dtype and attention kernel;
        with checkpointing only each layer's input plus one recomputed layer), the chunked loss
        (logits in 4096-token chunks, recomputed in backward), communication buffers (FSDP2
        reduce-scatter; DeepSpeed's reduce bucket, prefetch bucket, live parameters), the caching
        allocator's slack, and the CUDA context (what NVML shows beyond the allocator).
  host  each rank's baseline RSS (Python, torch, CUDA, NCCL), the model build path, offloaded
        parameters, gradients and optimizer states (pinned buffers are rounded up to a power of two
        by PyTorch's CachingHostAllocator), and the launcher and front-end processes.

The peak is not the sum of every part: gradients appear as activations are freed, so the GPU model
evaluates the moments that can set the peak (end of forward, loss backward, last and first layer's
backward, end of backward, optimizer step, model build) and reports the parts alive at the largest
one, plus the pools the caching allocator keeps for the communication streams.

Every constant says where it comes from: the sources (PyTorch, DeepSpeed, transformers), or a
measurement of benchmarks/plan_calibrate.py on the H200 test machine
(benchmarks/data/plan_calibration.json; docs/PLANNER.md has the comparison and what is fitted).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from shardconsole import config as C
from shardconsole.models import CATALOG, ModelSpec, resolve

KiB, MiB, GiB = 2**10, 2**20, 2**30

# ---------------------------------------------------------------------------------------------------
# Constants. Each one: value, then where it comes from.

# CUDA context + NCCL communicator + loaded kernels: what NVML counts for a rank beyond the caching
# allocator's reserved bytes. Measured: NVML used (minus the idle device's) minus max_memory_reserved
# was 1.29 GiB in every FSDP2 run and 1.67-1.68 GiB in every DeepSpeed run of the calibration
# (benchmarks/data/plan_calibration.json; H200, torch 2.11 + CUDA 13, DeepSpeed 0.19.8, whose
# FusedAdam/CPUAdam modules and extra communicators add the difference).
CUDA_CONTEXT_BYTES = {"fsdp": 1320 * MiB, "deepspeed": 1720 * MiB}
# NVML reports this much used on an idle H200 (driver and ECC reservations): no process can use it.
# Measured: 0.60 GiB before every calibration run.
GPU_DRIVER_RESERVED_BYTES = 615 * MiB

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

# Tokens per chunk of the loss: backends/common.py chunked_cross_entropy(chunk_tokens=4096).
LOSS_CHUNK_TOKENS = 4096

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
# under this fraction of the total. DESIGN.md: a DeepSpeed run was killed at 123 GiB used of 125 GiB,
# an FSDP run with 120 GiB used trained; 0.97 * 125 = 121 GiB.
HOST_USABLE_FRACTION = 0.97

# The largest segment DeepSpeed may fill before it reduces: reduce_bucket_size is counted in elements
# (DeepSpeed's zero/config.py). Its ZeRO-3 default sub_group_size is 1e9 elements (same file).
DS_SUB_GROUP_SIZE = 1_000_000_000

DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}

# The lever "how fast" for settings_that_fit, relative to FSDP2 without offload or checkpointing, all
# from DESIGN.md's bare loops on the H200 (0.95B, seq 2048, micro-batch 8 unless said):
SPEED_FACTOR = {
    "fsdp": 1.0,                    # 61.5k tokens/s
    "fsdp_offload": 1.3 / 15.6,     # 3.1B under 24 GiB, full offload + checkpointing: 1.3k, against
                                    # 19.5k * 0.80 (checkpointing) = 15.6k for the same model on GPU
    "zero3": 49.1 / 61.5,           # 49.1k tokens/s
    "zero2": 49.1 / 61.5,           # not measured: assumed as ZeRO-3 (fewer gathers, same reductions)
    "zero3_offload_opt": 14.7 / 49.1 * 49.1 / 61.5,    # 14.7k
    "zero3_offload_all": 19.6 / 49.1 * 49.1 / 61.5,    # 19.6k (params+optimizer beat optimizer only)
    "zero2_offload_opt": 14.7 / 49.1 * 49.1 / 61.5,    # not measured: assumed as ZeRO-3's
    "checkpointing": 49.4 / 61.5,   # 49.4k with activation checkpointing
}


# ---------------------------------------------------------------------------------------------------
# Inputs and outputs

@dataclass(frozen=True)
class Hardware:
    """One node: its GPUs (all alike) and its RAM. gpu_memory_bytes is per GPU."""
    gpus: int
    gpu_memory_bytes: int
    host_memory_bytes: int
    gpu_name: str = ""
    source: str = "given"          # "detected" (NVML + psutil) or "given"


@dataclass
class Estimate:
    gpu_peak_bytes: int                     # largest rank, as NVML sees it: allocator peak + CUDA context
    host_peak_bytes: int                    # the node: its ranks + launcher + front end
    fits: bool
    gpu_parts: dict[str, int]               # alive at the GPU peak; sums to gpu_peak_bytes
    host_parts: dict[str, int]              # at the host peak; sums to host_peak_bytes
    verdict: str
    gpu_allocator_peak_bytes: int = 0       # max_memory_reserved of the largest rank, memory to spare
    gpu_allocated_peak_bytes: int = 0       # max_memory_allocated of the largest rank
    gpu_required_bytes: int = 0             # what the allocator must be allowed (a cap, a card) to run
    gpu_peak_phase: str = ""                # the moment that sets the GPU peak
    gpu_phases: dict[str, int] = field(default_factory=dict)   # allocated bytes at each moment
    gpu_budget_bytes: int | None = None     # what the allocator may use: the cap, or the card minus context
    host_budget_bytes: int | None = None
    host_rank_bytes: int = 0                # one rank's peak RSS
    ranks_per_node: int = 1
    alternatives: dict[str, int] = field(default_factory=dict)  # the activations the other way, etc.
    notes: list[str] = field(default_factory=list)
    model: str = ""
    n_params: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model, "n_params": self.n_params,
            "gpu_peak_bytes": self.gpu_peak_bytes, "host_peak_bytes": self.host_peak_bytes,
            "fits": self.fits, "verdict": self.verdict,
            "gpu_parts": dict(self.gpu_parts), "host_parts": dict(self.host_parts),
            "gpu_allocator_peak_bytes": self.gpu_allocator_peak_bytes,
            "gpu_allocated_peak_bytes": self.gpu_allocated_peak_bytes, "gpu_required_bytes": self.gpu_required_bytes,
            "gpu_peak_phase": self.gpu_peak_phase, "gpu_phases": dict(self.gpu_phases),
            "gpu_budget_bytes": self.gpu_budget_bytes, "host_budget_bytes": self.host_budget_bytes,
            "host_rank_bytes": self.host_rank_bytes, "ranks_per_node": self.ranks_per_node,
            "alternatives": dict(self.alternatives), "notes": list(self.notes),
        }


# ---------------------------------------------------------------------------------------------------
# The model's shape, from its config alone

@dataclass(frozen=True)
class Shapes:
    hidden: int
    layers: int
    vocab: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    tied: bool
    attention_bias: bool
    mlp_bias: bool

    @classmethod
    def of(cls, spec: ModelSpec) -> "Shapes":
        c = spec.config
        h = int(c["hidden_size"])
        heads = int(c["num_attention_heads"])
        return cls(hidden=h, layers=int(c["num_hidden_layers"]), vocab=int(c["vocab_size"]), heads=heads,
                   kv_heads=int(c.get("num_key_value_heads") or heads),
                   head_dim=int(c.get("head_dim") or h // heads), intermediate=int(c["intermediate_size"]),
                   tied=bool(c.get("tie_word_embeddings", False)), attention_bias=bool(c.get("attention_bias")),
                   mlp_bias=bool(c.get("mlp_bias")))

    @property
    def q_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    def layer_params(self) -> list[tuple[int, ...]]:
        """Shapes of one decoder layer's parameters (nn.Linear weight is [out, in])."""
        h, q, kv, i = self.hidden, self.q_dim, self.kv_dim, self.intermediate
        out: list[tuple[int, ...]] = [(q, h), (kv, h), (kv, h), (h, q), (i, h), (i, h), (h, i), (h,), (h,)]
        if self.attention_bias:
            out += [(q,), (kv,), (kv,), (h,)]
        if self.mlp_bias:
            out += [(i,), (i,), (h,)]
        return out

    def root_params(self) -> list[tuple[int, ...]]:
        """Parameters outside the decoder layers: embedding, final norm, output head (unless tied)."""
        out: list[tuple[int, ...]] = [(self.vocab, self.hidden), (self.hidden,)]
        if not self.tied:
            out.append((self.vocab, self.hidden))
        return out

    @property
    def per_layer(self) -> int:
        return sum(math.prod(s) for s in self.layer_params())

    @property
    def root(self) -> int:
        return sum(math.prod(s) for s in self.root_params())

    @property
    def n_params(self) -> int:
        return self.layers * self.per_layer + self.root

    def all_params(self) -> list[tuple[int, ...]]:
        return self.layer_params() * self.layers + self.root_params()


def _numel(shape: tuple[int, ...]) -> int:
    return math.prod(shape)


def _shard_numel(shape: tuple[int, ...], world: int) -> int:
    """FSDP2 shards dim 0 and pads it to a multiple of the world size (_fsdp_param.py)."""
    rows = -(-shape[0] // world)
    return rows * math.prod(shape[1:])


def pow2_ceil(n: int) -> int:
    """PyTorch's CachingHostAllocator rounds every pinned allocation up to a power of two
    (aten/src/ATen/core/CachingHostAllocator.h: c10::llvm::PowerOf2Ceil; the default
    pinned_max_round_threshold is unlimited)."""
    return 1 << (n - 1).bit_length() if n > 1 else n


# ---------------------------------------------------------------------------------------------------
# Activations: what autograd keeps for backward, per decoder layer, from the HF Llama code path
# (transformers models/llama/modeling_llama.py) as run by backends/common.py.

def layer_activation_bytes_per_token(s: Shapes, c: int) -> int:
    """Bytes saved for backward by one decoder layer per token, compute dtype of c bytes, SDPA.

    RMSNorm (x2): the fp32 copy of its input (pow and the rsqrt mul save it: 4h), the normalized
    tensor in the compute dtype (the weight mul saves it: c*h) and its output, saved by the next
    linears (c*h). In fp32 the casts are no-ops but the three tensors are still distinct: 4h + 2ch.
    Attention: q and k after RoPE and v (saved by SDPA), SDPA's output (saved by its backward; the
    transpose(1, 2).contiguous() after it is a no-op because flash returns a [b, s, heads, d]
    tensor, so o_proj saves the same storage) and SDPA's fp32 logsumexp per head. RoPE saves only
    cos/sin: q*cos needs cos for q's gradient, and cos needs no gradient.
    MLP: gate out (saved by SiLU), SiLU out and up out (saved by the mul), their product (saved by
    down_proj). Residual adds save nothing.
    For a 0.95B Llama in bf16 that is 24h + 8I = 93,184 bytes a token a layer; the calibration runs
    (fsdp-1b-fp16-mb8, fsdp-1b-bf16-mb4) measured 92-93 k.
    """
    h, q, kv, i = s.hidden, s.q_dim, s.kv_dim, s.intermediate
    norms = 2 * (4 * h + 2 * c * h)
    attn = c * (2 * q + 2 * kv) + 4 * s.heads
    mlp = 4 * c * i
    return norms + attn + mlp


def compiled_layer_activation_bytes_per_token(s: Shapes, c: int) -> int:
    """The same layer under torch.compile (fsdp.py compiles each decoder layer): inductor's partitioner
    saves each RMSNorm's input in the compute dtype and its fp32 rstd, and recomputes the norm in
    backward, instead of the fp32 copy, the normalized tensor and the norm's output; attention and
    MLP keep what they keep eagerly. For the 0.95B model in bf16: 12h + 8I = 68,608 bytes against a
    measured 65.8 k (h200-fsdp vs h200-fsdp-nocompile in benchmarks/data/h200_presets.json)."""
    h, q, kv, i = s.hidden, s.q_dim, s.kv_dim, s.intermediate
    return c * (2 * h + 2 * q + 2 * kv + 4 * i) + 4 * s.heads + 2 * 4


def eager_attention_bytes_per_sample(s: Shapes, seq: int, c: int) -> int:
    """Eager attention also keeps the [heads, seq, seq] probabilities: softmax's fp32 output and its
    cast to the compute dtype (saved by the matmul with v); in fp32 the cast is a no-op. Its output
    is copied by transpose().contiguous() (saved by o_proj, as SDPA's output is) and it keeps no
    logsumexp."""
    return s.heads * seq * seq * (4 + (c if c != 4 else 0))


@dataclass
class Activations:
    layers: int
    saved_layer: int         # what one layer keeps until its backward (its input, if checkpointed)
    per_layer: int           # one layer's saved tensors in full (as when it is recomputed)
    recompute: int           # the layer recomputed at its backward (checkpointing), else 0
    final: int               # final norm + the loss input kept by the loss checkpoint
    inputs: int              # token ids (labels are a view of the same batch)
    mask: int                # eager's causal mask, shared by the layers
    layer_backward: int      # transient gradient buffers while one layer runs backward
    loss_forward: int        # one chunk of logits in forward
    loss_backward: int       # one chunk recomputed and differentiated
    alternative_saved: int   # all layers' saved activations with checkpointing flipped

    @property
    def saved_all(self) -> int:
        return self.layers * self.saved_layer + self.final + self.inputs + self.mask


def activations(cfg: C.RunConfig, s: Shapes) -> Activations:
    c = DTYPE_BYTES[cfg.precision.dtype]
    mb, seq = cfg.train.micro_batch, cfg.data.seq_len
    tokens = mb * seq
    eager = cfg.model.attn_implementation == "eager"
    compiled = cfg.train.compile and cfg.parallel.backend == "fsdp"
    per_token = compiled_layer_activation_bytes_per_token if compiled else layer_activation_bytes_per_token
    per_layer = tokens * per_token(s, c)
    if eager:
        per_layer += mb * eager_attention_bytes_per_sample(s, seq, c) - tokens * 4 * s.heads
    ckpt_layer = tokens * c * s.hidden        # a checkpointed layer keeps its input only
    ckpt = cfg.memory.activation_checkpointing
    if ckpt and cfg.memory.checkpoint_policy == "selective":
        # and, selectively, the outputs of its matmuls (q, k, v, o, gate, up, down) and of attention
        # (with its fp32 logsumexp); measured 30.4 GiB reserved against this plan's 30.2 (1b, mb 8,
        # compiled, benchmarks/data/h200_issue7.json)
        ckpt_layer += tokens * (c * (2 * s.hidden + 2 * s.q_dim + 2 * s.kv_dim + 2 * s.intermediate) + 4 * s.heads)
    # Backward through one layer: gradient buffers of the MLP's intermediate tensors (about three
    # [tokens, intermediate] at once) and of the residual stream; eager adds the [heads, seq, seq]
    # gradient of the probabilities (compute dtype) and softmax's backward in fp32 (two buffers).
    # From the autograd graph above; small next to the saved tensors.
    layer_bwd = tokens * (3 * c * s.intermediate + 2 * c * s.hidden)
    if eager:
        layer_bwd += mb * s.heads * seq * seq * (c + 8)
    chunk = min(LOSS_CHUNK_TOKENS, tokens)
    v = s.vocab
    # Loss forward, per chunk: logits (c) -> .float() (4) -> log_softmax output (4).
    loss_fwd = chunk * v * (c + 4 + 4)
    # Loss backward, per chunk: the recomputed log_softmax output (4) + nll_loss's dense gradient (4)
    # + log_softmax's gradient (4); the gradient of the loss input accumulates over the chunks into
    # one [tokens, hidden] buffer (two while adding).
    loss_bwd = chunk * v * 12 + 2 * tokens * s.hidden * c
    return Activations(
        layers=s.layers, saved_layer=ckpt_layer if ckpt else per_layer, per_layer=per_layer,
        # the layer being recomputed holds its saved tensors again; selective keeps part of them anyway
        recompute=(per_layer if cfg.memory.checkpoint_policy == "full" else max(per_layer - ckpt_layer, 0))
        if ckpt else 0,
        final=tokens * (4 * s.hidden + 2 * c * s.hidden),
        inputs=mb * (seq + 1) * 8,
        mask=mb * seq * seq * c if eager else 0,
        layer_backward=layer_bwd, loss_forward=loss_fwd, loss_backward=loss_bwd,
        alternative_saved=s.layers * (per_layer if ckpt else ckpt_layer),
    )


# ---------------------------------------------------------------------------------------------------
# One rank's memory over the moments of a step

@dataclass
class _Rank:
    gpu: dict[str, dict[str, int]]          # moment -> part -> compute-stream allocated bytes
    host: dict[str, dict[str, int]]         # moment -> part -> bytes of one rank's RSS
    notes: list[str] = field(default_factory=list)
    side: dict[str, int] = field(default_factory=dict)   # pools held beside the compute stream's peak
    side_live: dict[str, int] = field(default_factory=dict)   # moment -> bytes of those pools in use then


def _fsdp(cfg: C.RunConfig, s: Shapes) -> _Rank:
    """backends/fsdp.py: fully_shard per decoder layer and on the root (the root kept gathered after
    forward); parameters fp32 sharded; MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=fp32
    by default) unless fp32; fused AdamW with fp32 states shaped like the sharded parameters;
    explicit prefetch of N layers. Peaks are evaluated at the moments where memory turns: the end of
    forward, the loss backward, the last layer's backward (all activations, no gradients yet), the
    first layer's backward (all but one layer's gradients), the end of backward, the optimizer step."""
    p, f = cfg.parallel, cfg.fsdp
    world = p.nproc_per_node * p.nnodes
    shard = {"no_shard": 1, "hybrid_shard": p.nproc_per_node}.get(f.sharding, world)
    c = DTYPE_BYTES[cfg.precision.dtype]
    reduce_c = 4 if cfg.precision.dtype == "fp32" else DTYPE_BYTES[cfg.precision.reduce_dtype or "fp32"]
    offload = f.cpu_offload
    # bytes of a kept (sharded) parameter, its gradient and each Adam moment: fp32, or bf16 masters
    m = 2 if cfg.precision.master_dtype == "bf16" else 4
    mtag = "bf16" if m == 2 else "fp32"
    a = activations(cfg, s)
    L = s.layers

    # Sharded fp32 parameters: dim 0 padded to the shard group (exactly as FSDP2 pads).
    shard_numels = [_shard_numel(sh, shard) for sh in s.all_params()]
    params_b = m * sum(shard_numels)
    adam_b = 2 * params_b              # exp_avg + exp_avg_sq, shaped and typed like the sharded parameter
    layer_shard = sum(_shard_numel(sh, shard) for sh in s.layer_params())
    root_shard = sum(_shard_numel(sh, shard) for sh in s.root_params())
    g_root = m * root_shard            # the root's sharded gradient
    layer_full = c * s.per_layer       # one layer gathered in the compute dtype (copied out of the
    root_full = c * s.root             # all-gather buffer); the root stays gathered forward to backward end
    head_grad = 0 if s.tied else c * s.vocab * s.hidden   # the head's unsharded gradient, from the loss on

    # fsdp.py sets explicit prefetch unless no_shard; FSDP2 then still prefetches one layer in
    # backward by itself.
    sharded = f.sharding != "no_shard"
    bwd_n = min(f.backward_prefetch if sharded else 1, max(L - 1, 0))
    if cfg.reshard_after_forward:
        held = 0                       # layers gathered from forward to backward
        last_fwd = layer_full
    else:
        held = L * layer_full          # shard_grad_op: every layer stays gathered from forward to backward
        last_fwd = 0
    # Gradient accumulation without sync: FSDP2 keeps each layer's unsharded gradient, in the reduce
    # dtype when it differs from the compute dtype (_fsdp_param.py to_accumulated_grad_if_needed).
    accum = (reduce_c if reduce_c != c else c) * s.n_params if cfg.train.grad_accum > 1 else 0

    # The compute stream's allocations at each moment. FSDP2 allocates the all-gather buffers on its
    # all-gather copy-in stream and the reduce-scatter inputs and outputs (the sharded gradients) on
    # its reduce-scatter stream; the caching allocator keeps a pool per stream, so those pools add to
    # the compute stream's peak instead of sharing its free blocks (side pools, below).
    st = {} if offload else {f"parameters ({mtag} shards)": params_b, f"optimizer states (Adam {mtag})": adam_b}
    ws = {"cuBLAS workspaces": CUBLAS_WORKSPACE_BYTES}
    acc = {"accumulated gradients (no sync)": accum}
    root = {"gathered root (embedding, head)": root_full}
    acts_all = a.saved_all
    unsharded_grad = c * s.per_layer        # a layer's gradient from autograd, before its reduce-scatter
    acc_c = (reduce_c if reduce_c != c else c)
    gpu: dict[str, dict[str, int]] = {
        "end of forward": {**st, **root, "gathered layers": held + last_fwd, "activations": acts_all,
                           "loss chunk": a.loss_forward, **acc, **ws},
        "loss backward": {**st, **root, "gathered layers": held, "head gradient (unsharded)": head_grad,
                          "activations": acts_all, "loss chunk": a.loss_backward, **acc, **ws},
        "last layer backward": {**st, **root, "gathered layers + prefetch": held + (0 if held else (1 + bwd_n) * layer_full),
                                "head gradient (unsharded)": head_grad,
                                "activations": acts_all - a.final + a.recompute,
                                "layer backward": a.layer_backward + unsharded_grad, **acc, **ws},
        # the other layers' gradients are in the reduce-scatter pool by now, or, without sync, in fp32
        # accumulators on this stream
        "first layer backward": {**st, **root, "gathered layers": layer_full, "head gradient (unsharded)": head_grad,
                                 "activations": a.saved_layer + a.inputs + a.mask + a.recompute,
                                 "layer backward": a.layer_backward + unsharded_grad,
                                 # the root's accumulator, and the layers' where (unsharded, without
                                 # sync) they outweigh the sharded gradients counted in the pool
                                 "accumulated gradients (no sync)": acc_c * s.root + max(
                                     0, (L - 1) * (acc_c * s.per_layer - m * layer_shard)) if accum else 0, **ws},
        "end of backward": {**st, **root, "root gradients (unsharded)": c * s.root, **ws},
        "optimizer step": {**st, **ws},
    }
    # Side pools. Reduce-scatter stream: every sharded gradient (the reduce-scatter outputs; with
    # offload each goes to the host at once) and the largest reduce-scatter input (the root's, or two
    # layers' in flight). All-gather copy-in stream: the largest all-gather buffers in flight (the
    # root's, or a layer and its prefetch), plus with offload the fp32 shards copied to the GPU.
    rs_in = reduce_c * max(s.root, 2 * s.per_layer)
    grads_gpu = (m * max(root_shard, 2 * layer_shard)) if offload else (L * m * layer_shard + g_root)
    n_ag = 1 + max(min(f.forward_prefetch if sharded else 0, max(L - 1, 0)), bwd_n)
    ag = c * max(s.root, n_ag * s.per_layer) + (m * max(root_shard, n_ag * layer_shard) if offload else 0)
    side = {"reduce-scatter stream pool (sharded gradients, inputs)": grads_gpu + rs_in,
            "all-gather stream pool": ag}
    # What of those pools is in use at each moment (the allocated view, and what a cap must hold).
    g_layer = 0 if offload else m * layer_shard
    in_flight_ag = c * s.per_layer + (m * layer_shard if offload else 0)
    side_live = {"last layer backward": in_flight_ag if bwd_n else 0,
                 "first layer backward": (L - 1) * g_layer + reduce_c * s.per_layer + (m * layer_shard if offload else 0),
                 "end of backward": L * g_layer + g_root + reduce_c * s.root,
                 "optimizer step": 0 if offload else L * g_layer + g_root}

    # Host: one rank's RSS. The model is built on the meta device, so no full copy exists anywhere
    # (backends/fsdp.py build), and init_random_ draws each shard in place on its device.
    base = RANK_BASE_RSS["fsdp"]
    host: dict[str, dict[str, int]] = {"training": {"process (python, torch, CUDA)": base}}
    if offload:
        # to_empty(cpu) allocates the shards unpinned, FSDP2 then pins each (.pin_memory(): rounded to a
        # power of two) and drops the unpinned copy; gradients arrive D2H into pinned tensors
        # (.to("cpu", non_blocking=True) allocates pinned memory); Adam's states are plain zeros_like.
        pinned = pow2_ceil if f.pin_memory else (lambda n: n)
        tag = ", pinned" if f.pin_memory else ""
        host["training"].update({
            f"parameters ({mtag} shards{tag})": sum(pinned(m * n) for n in shard_numels),
            f"gradients ({mtag} shards{tag})": sum(pinned(m * n) for n in shard_numels),
            f"optimizer states (Adam {mtag}, host)": adam_b})
        if cfg.precision.dtype == "fp16":
            host["training"]["fp16 scaler checks on host gradients"] = FSDP_FP16_OFFLOAD_HOST_PER_PARAM * s.n_params
    notes = []
    if shard == 1 and f.sharding != "no_shard":
        notes.append(f"{f.sharding} over one rank shards nothing: same memory as no_shard")
    return _Rank(gpu, host, notes, side, side_live)


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
    off_opt = d.offload_optimizer == "cpu" and stage >= 1
    off_par = d.offload_param == "cpu" and stage == 3
    nvme = "nvme" in (d.offload_optimizer, d.offload_param)
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
        if off_par:
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
        notes.append("NVMe offload is not modelled: its host buffers and files are left out")
    if stage < 3:
        notes.append(f"ZeRO-{stage} builds the whole fp32 model on the CPU of every rank "
                     f"({4 * P / GiB:.1f} GiB each) before DeepSpeed moves it to the GPU")
    # In use beside the compute stream: one bucket being reduced, during backward (ZeRO-3)
    side_live = {"last layer backward": c * min(d.reduce_bucket_size, P)} if stage == 3 else {}
    return _Rank(phases, hphases, notes, side, side_live)


def _cpu_ranks(cfg: C.RunConfig, s: Shapes) -> _Rank:
    """device = cpu: everything lives in host memory; rough (no calibration on CPU)."""
    r = _fsdp(replace_cfg(cfg, ("fsdp", "cpu_offload", False)), s) if cfg.parallel.backend == "fsdp" else _deepspeed(cfg, s)
    moment = max(r.gpu, key=lambda k: sum(r.gpu[k].values()))
    parts = {k: v for k, v in r.gpu[moment].items() if v and k != "cuBLAS workspaces"}
    host = {"process (python, torch)": RANK_BASE_RSS_CPU, **parts}
    return _Rank({}, {"training": host}, ["CPU ranks: the training memory is host memory (not calibrated)"])


# ---------------------------------------------------------------------------------------------------
# The estimate

def estimate(cfg: C.RunConfig, spec: ModelSpec, hw: Hardware) -> Estimate:
    s = Shapes.of(spec)
    on_cpu = cfg.parallel.device == "cpu"
    if on_cpu:
        r = _cpu_ranks(cfg, s)
    elif cfg.parallel.backend == "fsdp":
        r = _fsdp(cfg, s)
    else:
        r = _deepspeed(cfg, s)

    # GPU: the compute stream's largest moment, the pools of the other streams, the allocator's
    # fragmentation, then the context outside the allocator.
    phases = {k: sum(v.values()) for k, v in r.gpu.items()}
    if phases:
        moment = max(phases, key=lambda k: phases[k])
        allocated = phases[moment]
        gpu_parts = {k: int(v) for k, v in r.gpu[moment].items() if v}
        gpu_parts.update({k: int(v) for k, v in r.side.items() if v})
        slack = int(allocated * ALLOCATOR_SLACK_FRACTION) + ALLOCATOR_SLACK_FIXED
        gpu_parts["allocator slack (fragmentation)"] = slack
        allocator_peak = allocated + sum(r.side.values()) + slack
        context = CUDA_CONTEXT_BYTES[cfg.parallel.backend]
        gpu_parts["CUDA context + NCCL"] = context
        gpu_peak = allocator_peak + context
        # Under a cap the allocator frees its cached blocks and retries before it fails, so a run
        # needs its largest allocated moment (compute stream + the pools' live part), plus headroom
        # for blocks it cannot free (split segments).
        live = {k: v + r.side_live.get(k, 0) for k, v in phases.items()}
        allocated_peak = max(live.values())
        required = int(allocated_peak * (1 + REQUIRED_FRAGMENTATION)) + REQUIRED_FIXED
        if cfg.parallel.backend == "deepspeed":
            # DeepSpeed's step allocates multi-GiB contiguous buffers (the fp32 gradients of a
            # sub-group): after the allocator frees its cached blocks the memory is still in split
            # segments and the retry fails. Measured: ZeRO-3 1b with a cap 8% over the allocated-peak
            # rule died at step 2 (edge-ds-1b-z3-mb4-ckpt-above). It needs its full reserved peak.
            required = max(required, allocator_peak)
    else:
        moment, allocator_peak, gpu_peak, gpu_parts, context = "", 0, 0, {}, 0
        allocated_peak = required = 0

    # Host: one rank's largest moment; the node holds every local rank, the launcher and the front end.
    hphases = {k: sum(v.values()) for k, v in r.host.items()}
    hmoment = max(hphases, key=lambda k: hphases[k])
    rank_host = hphases[hmoment]
    per_node = cfg.parallel.nproc_per_node
    host_parts = {k + (f" x {per_node} ranks" if per_node > 1 else ""): int(v) * per_node
                  for k, v in r.host[hmoment].items() if v}
    host_parts["launcher (torchrun)" if cfg.parallel.launcher == "torchrun" else "launcher (deepspeed)"] = LAUNCHER_RSS
    host_parts["front end"] = FRONTEND_RSS
    host_peak = sum(host_parts.values())

    # Budgets and the verdict.
    cap = cfg.gpu_memory_limit_bytes
    gpu_budget = None
    reasons: list[str] = []
    if not on_cpu:
        card = hw.gpu_memory_bytes - GPU_DRIVER_RESERVED_BYTES - context if hw.gpu_memory_bytes else None
        budgets = [b for b in (cap, card) if b]
        gpu_budget = min(budgets) if budgets else None
        if hw.gpus and per_node > hw.gpus:
            reasons.append(f"{per_node} ranks per node but the node has {hw.gpus} GPU(s)")
        if gpu_budget is None:
            reasons.append("no GPU found here and no GPU size given (--gpu-memory SIZE or memory.gpu_memory_limit)")
        elif required > gpu_budget:
            what = f"the {C.format_size(cap)} cap" if cap and cap == gpu_budget else \
                f"the {C.format_size(hw.gpu_memory_bytes)} card"
            reasons.append(f"GPU needs {C.format_size(required)} (+{C.format_size(context)} "
                           f"context) over {what}")
    host_budget = int(hw.host_memory_bytes * HOST_USABLE_FRACTION) if hw.host_memory_bytes else None
    if host_budget is not None and host_peak > host_budget:
        reasons.append(f"host needs {C.format_size(host_peak)} over {C.format_size(host_budget)} usable "
                       f"of {C.format_size(hw.host_memory_bytes)}")
    fits = not reasons
    notes = list(r.notes)
    if gpu_budget is not None and required <= gpu_budget < allocator_peak:
        # The allocator stops at the budget: it frees cached blocks and retries instead of growing.
        excess = allocator_peak - gpu_budget
        for key in ["allocator slack (fragmentation)"] + [k for k in r.side if k in gpu_parts]:
            cut = min(excess, gpu_parts.get(key, 0))
            gpu_parts[key] -= cut
            excess -= cut
        allocator_peak = gpu_budget
        gpu_peak = allocator_peak + context
        notes.append("the allocator will reach the budget and free cached blocks to go on (steps a little slower); "
                     "with memory to spare it would reserve more")
    a = activations(cfg, s)
    alt = {("activations without checkpointing" if cfg.memory.activation_checkpointing
            else "activations with checkpointing"): a.alternative_saved}
    est = Estimate(gpu_peak_bytes=int(gpu_peak), host_peak_bytes=int(host_peak), fits=fits,
                   gpu_parts=gpu_parts, host_parts=host_parts, verdict="",
                   gpu_allocator_peak_bytes=int(allocator_peak), gpu_peak_phase=moment,
                   gpu_allocated_peak_bytes=int(allocated_peak), gpu_required_bytes=int(required),
                   gpu_phases={k: int(v) for k, v in phases.items()}, gpu_budget_bytes=gpu_budget,
                   host_budget_bytes=host_budget, host_rank_bytes=int(rank_host), ranks_per_node=per_node,
                   alternatives=alt, notes=notes, model=spec.name, n_params=s.n_params)
    est.verdict = _verdict(est, reasons, cfg)
    return est


def model_states(cfg: C.RunConfig, spec: ModelSpec) -> dict[str, dict[str, int]]:
    """Parameters, gradients and optimizer states of one rank, where they live ("gpu" / "host"), in
    bytes: the part of the estimate that the article's 16 bytes a parameter and DeepSpeed's
    estimate_zero*_model_states_mem_needs count (no activations, buffers or allocator)."""
    s = Shapes.of(spec)
    p = cfg.parallel
    W = p.nproc_per_node * p.nnodes
    c = DTYPE_BYTES[cfg.precision.dtype]
    out: dict[str, dict[str, int]] = {"gpu": {}, "host": {}}
    if p.backend == "fsdp":
        shard = {"no_shard": 1, "hybrid_shard": p.nproc_per_node}.get(cfg.fsdp.sharding, W)
        n = sum(_shard_numel(sh, shard) for sh in s.all_params())
        where = out["host" if cfg.fsdp.cpu_offload else "gpu"]
        m = 2 if cfg.precision.master_dtype == "bf16" else 4
        where.update({"parameters": m * n, "gradients": m * n, "optimizer states": 2 * m * n})
        return out
    d = cfg.deepspeed
    P = s.n_params
    part = -(-P // W)
    m = 2 if cfg.precision.master_dtype == "bf16" and d.stage >= 1 else 4
    opt = out["host" if d.offload_optimizer != "none" and d.stage >= 1 else "gpu"]
    if d.stage == 3:
        out["host" if d.offload_param != "none" else "gpu"]["parameters"] = c * part
        opt.update({"gradients": c * part, "optimizer states": 3 * m * part})     # master + Adam
    elif d.stage in (1, 2):
        out["gpu"]["parameters"] = c * P
        grads = c * (part if d.stage == 2 else P)
        opt.update({"optimizer states": 3 * m * part})
        (opt if d.offload_optimizer != "none" else out["gpu"])["gradients"] = grads
    else:
        fp32_grads = cfg.precision.dtype == "bf16"    # BF16_Optimizer keeps fp32 gradients
        out["gpu"].update({"parameters": c * P, "gradients": (4 if fp32_grads else c) * P,
                           "optimizer states": (8 if c == 4 else 12) * P})
    return out


def _verdict(e: Estimate, reasons: list[str], cfg: C.RunConfig) -> str:
    if reasons:
        if e.gpu_budget_bytes is None and e.gpu_parts and len(reasons) == 1:
            return "cannot tell: " + reasons[0]
        hint = ""
        if any(r.startswith("GPU needs") for r in reasons):
            sized = [(k, v) for k, v in e.gpu_parts.items()
                     if "context" not in k and "slack" not in k and "pool" not in k and "cached" not in k]
            largest = max(sized, key=lambda kv: kv[1])[0] if sized else ""
            if largest.startswith("activations") or largest in ("loss chunk", "layer backward"):
                hint = "largest part: activations; lower train.micro_batch or data.seq_len" + (
                    "" if cfg.memory.activation_checkpointing else ", or set memory.activation_checkpointing = true")
            elif largest:
                hint = f"largest part: {largest}; shard it over more GPUs or offload it to the CPU"
        return "does not fit: " + "; ".join(reasons) + (f" ({hint})" if hint else "")
    parts = []
    if e.gpu_budget_bytes:
        parts.append(f"GPU needs {C.format_size(e.gpu_required_bytes)} of {C.format_size(e.gpu_budget_bytes)} "
                     f"({100 * e.gpu_required_bytes / e.gpu_budget_bytes:.0f}%)")
    if e.host_budget_bytes:
        parts.append(f"host {C.format_size(e.host_peak_bytes)} of {C.format_size(e.host_budget_bytes)} usable")
    tight = e.gpu_budget_bytes and e.gpu_required_bytes > 0.9 * e.gpu_budget_bytes
    return ("fits, tight" if tight else "fits") + (": " + ", ".join(parts) if parts else "")


def replace_cfg(cfg: C.RunConfig, *changes: tuple[str, str, Any]) -> C.RunConfig:
    """A copy of cfg with (table, key, value) changes, checked like a preset."""
    out = C.copy(cfg)
    for table, key, value in changes:
        setattr(getattr(out, table), key, value)
    return out


# ---------------------------------------------------------------------------------------------------
# The machine

def detect_hardware() -> Hardware:
    """GPUs from NVML (count and the first one's memory), RAM from psutil. Never raises."""
    import psutil
    from shardconsole.probes import GpuProbe
    probe = GpuProbe()
    samples = probe.sample()
    gpu_mem = min((g.total_bytes for g in samples), default=0)
    name = samples[0].name if samples else ""
    return Hardware(gpus=len(samples), gpu_memory_bytes=int(gpu_mem),
                    host_memory_bytes=int(psutil.virtual_memory().total), gpu_name=name, source="detected")


# ---------------------------------------------------------------------------------------------------
# Strategies, the fit table and the settings that fit

# The article's strategies as settings of this package (parallel.backend and its table).
STRATEGIES: dict[str, list[tuple[str, str, Any]]] = {
    "no_shard": [("parallel", "backend", "fsdp"), ("fsdp", "sharding", "no_shard"), ("fsdp", "cpu_offload", False)],
    "full_shard": [("parallel", "backend", "fsdp"), ("fsdp", "sharding", "full_shard"), ("fsdp", "cpu_offload", False)],
    "shard_grad_op": [("parallel", "backend", "fsdp"), ("fsdp", "sharding", "shard_grad_op"),
                      ("fsdp", "cpu_offload", False)],
    "full_shard+offload": [("parallel", "backend", "fsdp"), ("fsdp", "sharding", "full_shard"),
                           ("fsdp", "cpu_offload", True)],
    "ZeRO-2": [("parallel", "backend", "deepspeed"), ("deepspeed", "stage", 2),
               ("deepspeed", "offload_optimizer", "none"), ("deepspeed", "offload_param", "none")],
    "ZeRO-3": [("parallel", "backend", "deepspeed"), ("deepspeed", "stage", 3),
               ("deepspeed", "offload_optimizer", "none"), ("deepspeed", "offload_param", "none")],
    "ZeRO-3+offload": [("parallel", "backend", "deepspeed"), ("deepspeed", "stage", 3),
                       ("deepspeed", "offload_optimizer", "cpu"), ("deepspeed", "offload_param", "cpu")],
}
# Also searched by settings_that_fit (the article's two-card recipe offloads the optimizer only).
EXTRA_STRATEGIES: dict[str, list[tuple[str, str, Any]]] = {
    "ZeRO-3+optimizer offload": [("parallel", "backend", "deepspeed"), ("deepspeed", "stage", 3),
                                 ("deepspeed", "offload_optimizer", "cpu"), ("deepspeed", "offload_param", "none")],
    "ZeRO-2+optimizer offload": [("parallel", "backend", "deepspeed"), ("deepspeed", "stage", 2),
                                 ("deepspeed", "offload_optimizer", "cpu"), ("deepspeed", "offload_param", "none")],
}


def _strategy_cfg(base: C.RunConfig, name: str, hw: Hardware, *, model: str | None = None,
                  micro_batch: int | None = None, checkpointing: bool | None = None) -> C.RunConfig:
    changes = list({**STRATEGIES, **EXTRA_STRATEGIES}[name])
    changes.append(("parallel", "nproc_per_node", max(1, hw.gpus or base.parallel.nproc_per_node)))
    changes.append(("parallel", "device", "auto"))
    if base.parallel.backend != dict((t, v) for t, k, v in changes if k == "backend").get("parallel"):
        changes.append(("parallel", "launcher", "torchrun"))
    if model is not None:
        changes.append(("model", "name", model))
    if micro_batch is not None:
        changes.append(("train", "micro_batch", micro_batch))
    if checkpointing is not None:
        changes.append(("memory", "activation_checkpointing", checkpointing))
    return replace_cfg(base, *changes)


def speed_score(cfg: C.RunConfig) -> float:
    """Relative tokens/s (1.0 = FSDP2 on GPU, no checkpointing, 0.95B at micro-batch 8 x 2048),
    from DESIGN.md's measured bare loops (SPEED_FACTOR). Larger micro-batches use the GPU better:
    an assumed factor (tokens / (tokens + 2048)) relative to 16k tokens, not measured."""
    if cfg.parallel.backend == "fsdp":
        key = "fsdp_offload" if cfg.fsdp.cpu_offload else "fsdp"
    else:
        d = cfg.deepspeed
        z = "zero3" if d.stage == 3 else "zero2"
        if d.offload_param != "none":
            key = "zero3_offload_all"
        elif d.offload_optimizer != "none":
            key = f"{z}_offload_opt"
        else:
            key = z
    score = SPEED_FACTOR[key]
    if cfg.memory.activation_checkpointing:
        score *= SPEED_FACTOR["checkpointing"]
    tokens = cfg.train.micro_batch * cfg.data.seq_len
    ref = 16384
    score *= (tokens / (tokens + 2048)) / (ref / (ref + 2048))
    return score


@dataclass
class FitRow:
    strategy: str
    model: str | None               # largest catalog model that trains, None if none does
    n_params: int
    estimate: Estimate | None
    settings: str                   # the settings it was checked with

    def to_dict(self) -> dict[str, Any]:
        return {"strategy": self.strategy, "model": self.model, "n_params": self.n_params,
                "settings": self.settings,
                "gpu_peak_bytes": self.estimate.gpu_peak_bytes if self.estimate else None,
                "host_peak_bytes": self.estimate.host_peak_bytes if self.estimate else None}


def _spec_of(name: str) -> ModelSpec:
    return resolve(name)


def fit_table(hardware: Hardware, *, seq_len: int = 2048, micro_batch: int = 1, checkpointing: bool = True,
              base: C.RunConfig | None = None, models: list[str] | None = None) -> list[FitRow]:
    """For each strategy, the largest catalog model that trains on `hardware` (every GPU of the node
    one rank) at the most frugal settings of that strategy: micro-batch 1, checkpointing, bf16."""
    base = base or C.RunConfig()
    base = replace_cfg(base, ("data", "seq_len", seq_len), ("precision", "dtype", base.precision.dtype))
    names = [n for n in (models or list(CATALOG)) if n != "tiny"]
    specs = sorted((_spec_of(n) for n in names), key=lambda sp: sp.n_params)
    rows = []
    for strategy in STRATEGIES:
        best: tuple[ModelSpec, Estimate] | None = None
        for spec in specs:
            cfg = _strategy_cfg(base, strategy, hardware, model=spec.name, micro_batch=micro_batch,
                                checkpointing=checkpointing)
            est = estimate(cfg, spec, hardware)
            if est.fits:
                best = (spec, est)
        settings = f"micro_batch {micro_batch}, seq_len {seq_len}, " + \
            ("checkpointing" if checkpointing else "no checkpointing") + f", {base.precision.dtype}"
        rows.append(FitRow(strategy, best[0].name if best else None, best[0].n_params if best else 0,
                           best[1] if best else None, settings))
    return rows


@dataclass
class Candidate:
    name: str                       # e.g. "ZeRO-3, checkpointing, micro_batch 4"
    overrides: list[str]            # --set arguments that turn cfg into this candidate
    estimate: Estimate
    speed: float                    # relative tokens/s (speed_score)


def settings_that_fit(cfg: C.RunConfig, hardware: Hardware, spec: ModelSpec | None = None,
                      micro_batches: tuple[int, ...] = (1, 2, 4, 8, 16, 32)) -> list[Candidate]:
    """Every strategy x checkpointing x micro-batch for cfg's model, sequence length and dtype that
    fits on `hardware`, fastest first (speed_score; ties: less GPU memory first)."""
    spec = spec or resolve(cfg.model.name)
    out = []
    for strategy in {**STRATEGIES, **EXTRA_STRATEGIES}:
        for ckpt in (False, True):
            for mb in micro_batches:
                c2 = _strategy_cfg(cfg, strategy, hardware, micro_batch=mb, checkpointing=ckpt)
                c2 = replace_cfg(c2, ("train", "grad_accum", max(1, cfg.train.micro_batch * cfg.train.grad_accum // mb)))
                est = estimate(c2, spec, hardware)
                if not est.fits:
                    continue
                overrides = [f"{t}.{k}={_toml(v)}" for t, k, v in {**STRATEGIES, **EXTRA_STRATEGIES}[strategy]]
                overrides += [f"parallel.nproc_per_node={c2.parallel.nproc_per_node}",
                              f"memory.activation_checkpointing={_toml(ckpt)}", f"train.micro_batch={mb}",
                              f"train.grad_accum={c2.train.grad_accum}"]
                name = f"{strategy}, {'checkpointing' if ckpt else 'no checkpointing'}, micro_batch {mb}"
                out.append(Candidate(name, overrides, est, speed_score(c2)))
    out.sort(key=lambda cand: (-round(cand.speed, 6), cand.estimate.gpu_peak_bytes))
    return out


def _toml(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    return str(v)
