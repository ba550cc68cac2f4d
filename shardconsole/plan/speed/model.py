"""How fast a run will be, before it is launched: a step's time from its parts, each from a rate that was
measured or published, and the step as its critical path (issue 45). Pure: no torch, no probes.

  GPU        the step's FLOPs (ModelSpec.flops_per_token's model FLOPs, plus what the hardware computes
             again: the recomputed forward under full activation checkpointing and the chunked loss's
             logits in backward) at the card's matmul rate (plan/speed/cards.py) times an efficiency calibrated
             per engine and compile on the H200 (GPU_EFFICIENCY), plus a launch cost per decoder layer and
             micro-batch, or the launches themselves where eager FSDP2's CPU cannot keep up (what makes small
             models and micro-batches slow), plus a cost a layer each optimizer step and the optimizer
             step where it runs on the GPU (bytes over the card's memory bandwidth);
  PCIe       offload: the bytes each micro-batch moves (parameters to the GPU, gradients back) at the
             link's one-direction rate times the share the copies reached on the H200 (PCIE_SHARE_*,
             plan/speed/host.py);
  host step  offload: the bytes AdamW touches a parameter at the host's memory bandwidth (HostRates, host.py);
  ranks      several: the gathers and reductions over NVLink or PCIe, hidden under the compute when shorter.

The overlap rules are the offload view's (machine/offload_verdict.py, backends/offload/overlap.py): the
copies run beside the compute but the compute waits on a part of them (EXPOSED_*); the host step runs
after the backward, or under it with fsdp.offload_overlap (no clip, not fp16), where it slows the copies
(OVERLAP_DRAG). Each constant names the runs it was calibrated on (benchmarks/speed_calibrate.py prints
predicted against measured for every recorded H200 run).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from shardconsole.plan.speed.cards import CARDS, GB, Card, card_of
from shardconsole.plan.lora import trainable_params
from shardconsole.plan.machine import Hardware
from shardconsole.plan import grpo_terms
from shardconsole.plan.speed.host import HostRates, host_note, host_rates, host_transfers
from shardconsole.plan.speed.fp8 import FP8_LAYER_SPEEDUP, fp8_checkpointed_speedup, fp8_even_tokens
from shardconsole.plan.shapes import Shapes
from shardconsole.settings import config as C
from shardconsole.settings.models import ModelSpec

# Hardware FLOPs over (matmul rate x time), by engine and compile, for large matmuls (the launch costs
# below hold the rest). FSDP2 eager: 0.95B at mb 8 x 2048, 60.5k tokens/s (h200_presets.json,
# h200-fsdp-nocompile) and 7B LoRA mb 4 (lora_cal.json); compiled: 0.95B, 81.6-83.1k (h200-fsdp) and 60.1k
# checkpointed at mb 4 x 2 (issue45); ZeRO-3: 0.95B, 48-51k at mb 8 (h200_issue3/7.json, z3-1b), 49.6k at mb 4 (oos2_20261204).
# ZeRO with compiled layers (train.compile, stage3_layer_gather: cfg.compiles_layers): the h200-fsdp preset as
# ZeRO-3 (1b, mb 8, H200) measured 68,718 tokens/s in bf16 and 89,039 with fp8 where the eager efficiency
# predicted 54,172 and 69,035 (issue 63): 0.80 (no per-layer dispatch bound: compiled) puts them at -0.1% and -4%.
GPU_EFFICIENCY = {"fsdp": 0.74, "fsdp_compiled": 0.88, "deepspeed": 0.58, "deepspeed_compiled": 0.80}
# Eager FSDP2 is bound by the CPU that launches its kernels when a micro-batch is small: a decoder layer's
# ~300 kernels of forward and backward take DISPATCH_LAYER_S to launch whatever their size, twice that with
# full activation checkpointing (the forward again, and the checkpoint's own hooks), so a micro-batch takes
# the longer of its GPU work and its launches. 0.95B at mb 2 steps in 0.21 s checkpointed, as at mb 4 (0.20 s),
# and 0.16 s without (issue45 oos_20261204); 125M steps 4 micro-batches in 0.21 s and 1 in 0.10.
# Fitted (least squares on log step time) over 14 eager runs of 125M-3B, mb 2-16, grad_accum 1 and 4.
DISPATCH_LAYER_S = {"fsdp": 0.0036, "fsdp_compiled": 0.0, "deepspeed": 0.0036, "deepspeed_compiled": 0.0}
DISPATCH_CHECKPOINTED = 2.0
# What an optimizer step costs a decoder layer beside the optimizer's bytes, once a step whatever grad_accum
# is: clipping's norms, the foreach optimizer's and zero_grad's launches, FSDP2's per-step bookkeeping.
# The same fit: 4.4 ms a layer (125M: 0.06 s of its 0.10 s step at mb 8). DeepSpeed (eager too): ZeRO-2 and
# ZeRO-3 1b at mb 4 stepped in 0.165-0.179 s (oos2_20261204) and ZeRO-3 at mb 8 in 0.28-0.34 s (h200_issue7):
# efficiency 0.58 and 4 ms a layer fit both; the additive launch cost fitted on ZeRO-3 at mb 8 before (7 ms a layer) overcounted mb 4 by 40%.
STEP_LAYER_S = {"fsdp": 0.0044, "fsdp_compiled": 0.0, "deepspeed": 0.004, "deepspeed_compiled": 0.004}
# Seconds of launch and synchronisation a compiled decoder layer adds to each micro-batch beside its FLOPs
# (its few kernels overlap the GPU's work less): 0.95B compiled at mb 4-8 (h200_issue7.json, issue45).
LAYER_LAUNCH_S = {"fsdp": 0.0, "fsdp_compiled": 0.0025, "deepspeed": 0.0, "deepspeed_compiled": 0.0}
# LoRA's adapters: two small matmuls (and a dropout) beside each of a layer's 7 target linears, memory-bound:
# GPU time a token and unit of width a layer (7B at mb 4 x 2048 ran 0.23 s a micro-batch beyond its FLOPs,
# 13B QLoRA ~0.35: readme-3090-* in benchmarks/results/issue45) and more launches a layer (1B LoRA at mb 4
# and 7B at mb 2 x 1024 are bound by them: ~10 ms a layer checkpointed).
LORA_S_PER_TOKEN_WIDTH = 2.1e-10
LORA_LAYER_LAUNCH_S = 0.003
# Offloaded parameters (eager): each layer's launches add to its GPU work rather than hide under it
# (1B offloaded at mb 2-8 and grad_accum 3, 3B at grad_accum 2: issue45, oos_20261204).
OFFLOAD_LAYER_LAUNCH_S = {"fsdp": 0.005, "fsdp_compiled": 0.0025, "deepspeed": 0.007, "deepspeed_compiled": 0.007}
# Selective checkpointing in eager mode intercepts every op of the forward (torch's SAC dispatch mode) to
# decide what to keep: 1b mb 3 ran 0.069 s a step slower than no checkpointing would (issue45: 26.9k
# tokens/s), ~4.5 ms a layer. Compiled layers decide at compile time: 1b compiled + selective ran as fast
# as without checkpointing (h200_issue7.json, fsdp-1b-compile+ac-sac).
SELECTIVE_EAGER_LAYER_S = 0.0045
# bf16 masters rounded stochastically or with Kahan compensation on the GPU: a kernel chain a tensor
# (backends/optim/master_update.py); 125M at seq 1024 runs 0.05 s a step slower (call1_curves.json).
ROUNDING_S_PER_TENSOR = 0.00045
# The GPU's optimizer step: bytes a trained parameter over the card's memory bandwidth at this share.
HBM_SHARE = 0.7
# torchao's 8/4-bit AdamW costs more than its bytes (per-block quantisation, one kernel chain a tensor):
# 3B with adamw8bit steps in ~0.02-0.09 s on the H200 beyond its FLOPs (issue35_20261203 compiled mb 4 and
# 6, issue45 eager mb 3; with optim.step_in_backward much of it runs under the backward).
LOWBIT_S_PER_PARAM_H200 = 0.05 / 3.14e9
# The host step under the backward (fsdp.offload_overlap): the step is the longer of the GPU's span and
# the host step plus this share of the shorter (the host step's threads slow the copies and the launches):
# eager, 3B mb 4 1.45 s with a 0.88 s host step, 7B mb 12 3.70 s with 1.6 s, 13B mb 8 4.2-4.8 s with 2.9 s
# (0.4 and 0.6 fit these runs worse: benchmarks/speed_calibrate.py); compiled layers launch a few kernels a
# layer, so the host step's threads barely slow them: 7B mb 12 3.12-3.15 s with a 1.9 s host step beside a
# 3.04 s GPU part, 13B stochastic 3.9 s with 2.9 s (callD, 7b_fp32_compiled.json).
OVERLAP_DRAG = {"fsdp": 0.5, "fsdp_compiled": 0.15, "deepspeed": 0.5, "deepspeed_compiled": 0.5}
# Startup before the first step: launcher, imports, the process group (~20 s on the H200 machine), the
# model build (s a billion parameters; ZeRO-3's zero.Init builds slower), the compile of the layers.
START_S = 20.0
# Between nodes: a 100 Gb/s network (assumed; `shardconsole doctor` measures the all-reduce of a machine).
NODE_LINK_GBPS = 12.5
BUILD_S_PER_B = {"fsdp": 2.0, "deepspeed": 8.0}
PIN_S_PER_GB = 0.15       # pinning the offloaded host states (cudaHostRegister of the arena)
COMPILE_S = 45.0


def _fully_checkpointed(cfg: C.RunConfig) -> bool:
    return cfg.memory.activation_checkpointing and cfg.memory.checkpoint_policy != "selective"


@dataclass
class SpeedPrediction:
    tokens_per_s: float
    step_s: float
    bound: str                          # "GPU", "PCIe", "host step", "communication"
    parts: dict[str, float]             # seconds an optimizer step: gpu, h2d, d2h, host step, comm
    start_s: float                      # before the first step: start, build, pin, compile
    seconds: float                      # start + train.steps steps
    card: str
    notes: list[str] = field(default_factory=list)
    host: HostRates | None = None       # the host's rates the host step was planned at

    def to_dict(self) -> dict[str, Any]:
        host = None if self.host is None else {"cores": self.host.cores, "gbps": round(self.host.gbps, 2),
                                                "source": self.host.source}
        return {"predicted_tokens_per_s": round(self.tokens_per_s, 1), "predicted_seconds": round(self.seconds, 1),
                "predicted_step_s": round(self.step_s, 4), "bound": self.bound, "card": self.card,
                "parts_s": {k: round(v, 4) for k, v in self.parts.items()}, "start_s": round(self.start_s, 1),
                "host": host}


def engine_key(cfg: C.RunConfig) -> str:
    if cfg.parallel.backend == "deepspeed":
        return "deepspeed_compiled" if cfg.compiles_layers else "deepspeed"
    return "fsdp_compiled" if cfg.train.compile else "fsdp"


def hardware_flops_per_token(cfg: C.RunConfig, spec: ModelSpec) -> float:
    """What the GPU computes a token: the model FLOPs of ModelSpec.flops_per_token (6N + 12 L h s, or
    LoRA's 4 a frozen and 6 a trained parameter), the forward again under full checkpointing (the
    decoder layers' 2 a parameter and attention's 4 L h s; selective checkpointing recomputes no matmul),
    and the chunked loss's logits again in backward (2 V h; not memory.loss's fused one)."""
    s = Shapes.of(spec)
    seq = cfg.data.seq_len
    if cfg.adapters:
        trained = trainable_params(cfg, s)
        flops = spec.flops_per_token(seq, trained=trained)
    else:
        flops = spec.flops_per_token(seq)
    head = s.vocab * s.hidden
    if _fully_checkpointed(cfg):
        layer_params = spec.n_params - head * (1 if s.tied else 2)
        flops += 2.0 * layer_params + 4.0 * s.layers * s.hidden * seq
    if _fused_loss(cfg):
        return flops            # the fused loss works out the gradients in forward: no logits recomputed
    return flops + 2.0 * head


def _fused_loss(cfg: C.RunConfig) -> bool:
    """The GPU's next-token loss is memory.loss's fused one (DPO and ORPO read chunked per-row log-probs)."""
    return cfg.memory.loss_on(cuda=True) == "fused" and cfg.train.objective == "sft"


def _card_for(hw: Hardware, card: Card | None) -> Card | None:
    if card is not None:
        return card
    return card_of(hw.gpu_name) if hw.gpu_name else None


def _offloaded(cfg: C.RunConfig) -> tuple[bool, bool]:
    """(parameters on the host, optimizer step on the host)."""
    if cfg.parallel.backend == "fsdp":
        return cfg.fsdp.cpu_offload, cfg.fsdp.cpu_offload
    d = cfg.deepspeed
    return (d.offload_param != "none" and d.stage == 3), d.offload_optimizer != "none"


def _gpu_optimizer_s(cfg: C.RunConfig, trained: float, card: Card, s: Shapes) -> float:
    if cfg.optim.name in ("adamw8bit", "adamw4bit"):
        return trained * LOWBIT_S_PER_PARAM_H200 * CARDS["h200"].hbm_gbps / card.hbm_gbps
    p = cfg.precision
    per_param = 16.0 if p.master_dtype == "bf16" or cfg.optim.name == "adam-mini" else 28.0
    rounding = 0.0
    if p.master_dtype == "bf16" and p.master_rounding != "nearest" and not cfg.adapters:
        rounding = (9 * s.layers + 3) * ROUNDING_S_PER_TENSOR
    return trained * per_param / (card.hbm_gbps * GB * HBM_SHARE) + rounding


def _micro_batch_s(cfg: C.RunConfig, spec: ModelSpec, card: Card, params_on_host: bool) -> float:
    """A micro-batch's forward and backward on the GPU: its FLOPs at the calibrated efficiency, LoRA's
    adapters, and the kernels' launches: overlapped with the GPU's work (the longer of the two) unless the
    parameters come from the host, where each layer's gather waits on its copy and the launch queue
    drains (OFFLOAD_LAYER_LAUNCH_S adds)."""
    s = Shapes.of(spec)
    key = engine_key(cfg)
    tokens_mb = cfg.train.micro_batch * cfg.data.seq_len
    flops = hardware_flops_per_token(cfg, spec)
    gpu_mb = flops * tokens_mb / (card.matmul_tflops * 1e12 * GPU_EFFICIENCY[key])
    if cfg.precision.dtype == "fp32":
        gpu_mb *= 4.0              # no bf16 tensor cores: TF32 at best (an assumption, not measured)
    full_ckpt = _fully_checkpointed(cfg)
    if cfg.precision.fp8 != "none" and card.fp8:
        # (a card without FP8 tensor cores refuses it at launch: predicted as bf16)
        # the decoder layers' share runs FP8_LAYER_SPEEDUP faster (checkpointed: what runs measured); the
        # head's 6 FLOPs a weight (and the chunked loss's recompute, 2 more) stay bf16
        recompute = 0.0 if _fused_loss(cfg) else 2.0
        head = (6.0 + recompute) * s.vocab * s.hidden / flops
        speedup = (fp8_checkpointed_speedup(cfg.precision.fp8, tokens_mb, params_on_host) if full_ckpt
                   else FP8_LAYER_SPEEDUP[cfg.precision.fp8])
        gpu_mb *= head + (1.0 - head) / speedup
    launches = DISPATCH_LAYER_S[key] * (DISPATCH_CHECKPOINTED if full_ckpt else 1.0)
    if cfg.adapters:
        gpu_mb += s.layers * tokens_mb * s.hidden * LORA_S_PER_TOKEN_WIDTH * CARDS["h200"].hbm_gbps / card.hbm_gbps
        launches += LORA_LAYER_LAUNCH_S
    if params_on_host:
        mb = gpu_mb + s.layers * OFFLOAD_LAYER_LAUNCH_S[key]
    else:
        mb = max(gpu_mb, s.layers * launches) + s.layers * LAYER_LAUNCH_S[key]
    if cfg.memory.activation_checkpointing and cfg.memory.checkpoint_policy == "selective" and key != "fsdp_compiled":
        mb += s.layers * SELECTIVE_EAGER_LAYER_S
    if cfg.train.method == "qlora":
        mb *= 1.03                 # NF4 dequantisation beside each frozen matmul (7B: 16.2k vs 16.5k, lora_cal)
    return mb


def predict(cfg: C.RunConfig, spec: ModelSpec, hw: Hardware, *, card: Card | None = None,
            host: HostRates | None = None) -> SpeedPrediction | None:
    """The predicted speed of cfg on hw's GPUs (or `card`, with this host); None on CPU ranks or on a GPU
    whose rate is not known (plan says so and names --card)."""
    card = _card_for(hw, card)
    if card is None or cfg.parallel.device == "cpu":
        return None
    host = host or host_rates(hw)
    s = Shapes.of(spec)
    key = engine_key(cfg)
    ranks = max(1, cfg.parallel.nproc_per_node * cfg.parallel.nnodes)
    k = cfg.train.grad_accum
    params_on_host, step_on_host = _offloaded(cfg)
    trained_cfg, tokens_mb = _trained_rows(cfg)
    compute_mb = _micro_batch_s(trained_cfg, spec, card, params_on_host)
    n = spec.n_params
    trained = trainable_params(cfg, s) if cfg.adapters else n
    notes = _fp8_notes(cfg, card, tokens_mb, params_on_host)
    h2d, d2h, host_s, exposed = host_transfers(cfg, card, host, n, trained, ranks, params_on_host, step_on_host)
    gpu = k * (compute_mb + exposed) + (0.0 if params_on_host else s.layers * STEP_LAYER_S[key])
    gpu += 0.0 if step_on_host else _gpu_optimizer_s(cfg, trained / ranks, card, s)
    comm = _comm_s(cfg, card, n, ranks) if ranks > 1 else 0.0
    if cfg.train.objective == "grpo":
        # sampling, and LoRA's reference forward (a forward: about a third of a micro-batch's compute)
        gpu += k * grpo_terms.generation_s(cfg, s, n, card.hbm_gbps, _link_gbps(cfg, card), ranks, _sharded(cfg))
        gpu += k * compute_mb / 3 if cfg.grpo.beta and cfg.adapters else 0.0
        notes += _grpo_notes(cfg, tokens_mb * k * ranks)
    parts = {"gpu": gpu, "h2d": k * h2d, "d2h": k * d2h, "host step": host_s, "communication": comm}
    step = _step_s(cfg, key, gpu, host_s, comm, step_on_host)
    bound = max(("GPU", gpu), ("host step", host_s), ("communication", comm), key=lambda x: x[1])[0]
    if bound == "GPU" and exposed > compute_mb:
        bound = "PCIe"
    tokens_per_s = tokens_mb * k * ranks / step
    start = _start_s(cfg, n, trained, step_on_host, params_on_host)
    if step_on_host:
        notes.append(host_note(host))
    return SpeedPrediction(tokens_per_s, step, bound, parts, start, start + cfg.train.steps * step,
                           card.name, notes, host)


def _trained_rows(cfg: C.RunConfig) -> tuple[C.RunConfig, int]:
    """The settings whose micro-batch the GPU computes, and its tokens: cfg's own, but for GRPO the rows the
    run trains and its step line counts (micro_batch x generations of prompt + completion)."""
    if cfg.train.objective != "grpo":
        return cfg, cfg.train.micro_batch * cfg.data.seq_len
    rows, row_tokens = grpo_terms.step_rows(cfg)
    trained_cfg = C.copy(cfg)
    trained_cfg.train.micro_batch, trained_cfg.data.seq_len = rows, row_tokens
    return trained_cfg, rows * row_tokens


def _fp8_notes(cfg: C.RunConfig, card: Card, tokens_mb: int, params_on_host: bool) -> list[str]:
    """What the prediction says of precision.fp8 where it does not pay: a card without FP8, or a
    micro-batch too small under full checkpointing."""
    if cfg.precision.fp8 != "none" and not card.fp8:
        return [f"precision.fp8: the {card.title} has no FP8 tensor cores, so a launch on it refuses fp8 "
                "(predicted as bf16)"]
    if cfg.precision.fp8 != "none" and _fully_checkpointed(cfg):
        fp8_x = fp8_checkpointed_speedup(cfg.precision.fp8, tokens_mb, params_on_host)
        if fp8_x < 1.0:
            return [f"precision.fp8: at {tokens_mb:,} tokens a micro-batch under full checkpointing the "
                    f"float8 layers are predicted {1 / fp8_x:.2f}x slower than bf16 (each casts its weights "
                    f"three times a micro-batch, more than the matmuls save at this size"
                    f"{'; offloaded, after each copy lands' if params_on_host else ''}); it pays from "
                    f"about {fp8_even_tokens(cfg.precision.fp8, params_on_host):,} "
                    f"(train.micro_batch x data.seq_len)"]
    return []


def _sharded(cfg: C.RunConfig) -> bool:
    """The parameters are sharded across the ranks (FSDP2 but no_shard, ZeRO-3), so every micro-batch gathers them."""
    return (cfg.fsdp.sharding != "no_shard") if cfg.parallel.backend == "fsdp" else cfg.deepspeed.stage == 3


def _link_gbps(cfg: C.RunConfig, card: Card) -> float:
    """The ranks' link: between nodes the network (NODE_LINK_GBPS), else NVLink (~300 GB/s usable) or the
    PCIe link: assumed rates, not measured here."""
    return NODE_LINK_GBPS if cfg.parallel.nnodes > 1 else (300.0 if card.nvlink else card.pcie_gbps * 0.8)


def _comm_s(cfg: C.RunConfig, card: Card, n: int, ranks: int) -> float:
    """A step's collectives on several ranks. Sharded: the all-gathers of forward and backward (compute dtype)
    and the reduce-scatter (fp32) of every parameter a micro-batch; replicated: the gradients' all-reduce
    (twice 4 bytes). Each rank sends (ranks-1)/ranks of it over the link."""
    link = _link_gbps(cfg, card)
    return cfg.train.grad_accum * (2 * 2 + 4 if _sharded(cfg) else 8) * n * (ranks - 1) / ranks / (link * GB)


def _grpo_notes(cfg: C.RunConfig, step_tokens: int) -> list[str]:
    """What GRPO's prediction assumes, and what its tokens/s counts (step_tokens a step)."""
    prompt, whence = grpo_terms.prompt_tokens(cfg)
    return ["grpo: sampling max_new_tokens decode steps a micro-batch counted at assumed rates "
            "(plan/grpo_terms.py); completions that end sooner make the step shorter",
            f"grpo: tokens/s counts what the step line counts, {step_tokens:,} tokens a step: "
            f"micro_batch x grad_accum x ranks x generations rows of a prompt of ~{prompt:,} tokens "
            f"({whence}) and max_new_tokens {cfg.grpo.max_new_tokens} completion tokens, their longest"]


def _step_s(cfg: C.RunConfig, key: str, gpu: float, host_s: float, comm: float, step_on_host: bool) -> float:
    """A step's seconds from its parts: FSDP2's overlapped host step runs under the backward (with a drag);
    otherwise the host step follows the GPU's work; the collectives bound it from below."""
    overlap = (cfg.parallel.backend == "fsdp" and step_on_host and cfg.fsdp.offload_overlap
               and cfg.train.clip_grad_norm <= 0 and cfg.precision.dtype != "fp16")
    if overlap:
        step = max(gpu, host_s) + OVERLAP_DRAG[key] * min(gpu, host_s)
    else:
        step = gpu + host_s
    return max(step, comm + host_s)


def against_measured(p: SpeedPrediction, measured: float) -> str:
    """`predicted 8.2k tok/s (GPU bound), measured 8.0k (-2%)`: what a finished run says."""
    def rate(x: float) -> str:
        return f"{x / 1000:.1f}k" if x >= 1000 else f"{x:.0f}"
    return (f"predicted {rate(p.tokens_per_s)} tok/s ({p.bound} bound), measured {rate(measured)} "
            f"({100 * (measured / p.tokens_per_s - 1):+.0f}%)")


def _start_s(cfg: C.RunConfig, n: int, trained: float, step_on_host: bool, params_on_host: bool) -> float:
    build = BUILD_S_PER_B["deepspeed" if cfg.parallel.backend == "deepspeed" else "fsdp"] * n / 1e9
    pinned = (16.0 * trained if step_on_host else 0.0) + (2.0 * n if params_on_host else 0.0)
    return START_S + build + PIN_S_PER_GB * pinned / GB + (COMPILE_S if cfg.train.compile else 0.0)
