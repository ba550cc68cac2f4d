"""One rank's memory under LoRA and QLoRA (train.method, backends/model/adapters.py), both engines.

What trains is small: the adapters (rank r: r * (in + out) per target linear) and lora.modules_to_save,
each with an fp32 master, its gradient and Adam's two moments (16 bytes a parameter), sharded like the
base by FSDP2, partitioned by ZeRO (the optimizer from stage 1, gradients from 2). What is frozen is
the base: in the compute dtype (the ranks cast it, backends/adapters.cast_frozen_) or, under QLoRA,
the linear layers in 4-bit NF4 with their quantisation constants (bitsandbytes, double quantisation:
one 8-bit absmax per 64 weights and one fp32 scale per 256 of those), the rest in bf16, replicated on
every rank. Activations are full fine-tuning's (a frozen linear saves no input, the adapter's A saves
the same input instead), plus the adapter's r-wide intermediate per target linear and, with dropout,
the dropped copy of its input. Not calibrated on a GPU yet: the notes say so.
"""

from __future__ import annotations

from shardconsole.plan.activation_memory import activations, offloaded_host
from shardconsole.plan.constants import CUBLAS_WORKSPACE_BYTES, DTYPE_BYTES, RANK_BASE_RSS, RANK_BASE_RSS_CPU
from shardconsole.plan.rank import RankMemory
from shardconsole.plan.shapes import Shapes
from shardconsole.settings import config as C

# NF4 with double quantisation: 4 bits a weight, an 8-bit absmax per 64-weight block, and an fp32
# scale (plus offset) per 256 blocks of absmax (bitsandbytes functional.quantize_4bit, blocksize 64).
NF4_BYTES_PER_PARAM = 0.5 + 1 / 64 + 8 / (64 * 256)
ADAM_FP32_BYTES = 16          # fp32 master + fp32 gradient + exp_avg + exp_avg_sq


# The families whose decoder layers layer_linears names: a LoRA target that names none of them is refused
# before launch (peft's "Target modules ... not found" would end the run after it started).
KNOWN_LINEARS = frozenset({"llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3", "gemma3_text", "phi3",
                           "olmo2", "qwen2_moe", "qwen3_moe", "mixtral", "olmoe"})


def layer_linears(s: Shapes) -> dict[str, tuple[int, int]]:
    """A decoder layer's nn.Linear layers as transformers names them: name -> (in_features, out_features).
    Phi-3 fuses q, k, v into qkv_proj and gate, up into gate_up_proj; a mixture of experts has attention,
    its router ("gate", [experts, h]) and a shared expert (qwen2_moe), its experts being 3-D parameters
    (transformers' fused layout: _expert_adapters)."""
    h, q, kv, i = s.hidden, s.q_dim, s.kv_dim, s.intermediate
    attn = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h)}
    if s.fused_proj:
        return {"qkv_proj": (h, q + 2 * kv), "o_proj": (q, h), "gate_up_proj": (h, 2 * i), "down_proj": (i, h)}
    if s.moe is None:
        return {**attn, "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}
    shared = s.moe.shared_inter
    attn["gate"] = (h, s.moe.experts)
    if not shared:
        return attn
    return {**attn, "gate_proj": (h, shared), "up_proj": (h, shared), "down_proj": (shared, h),
            "shared_expert_gate": (h, 1)}


def _expert_adapters(s: Shapes) -> list[tuple[int, int]]:
    """peft's all-linear on transformers' fused experts (peft 0.21's ParamWrapper, read from its
    get_nb_trainable_parameters on a qwen3_moe): gate_up [E, 2 I, h] at twice the rank, lora_A [2 r E, h]
    and lora_B [2 I, 2 r E]; down [E, h, I] at the rank, [r E, I] and [h, r E]. As (in, out) pairs whose
    r * (in + out) is those counts."""
    if s.moe is None or s.fused_proj:
        return []
    e, h, i = s.moe.experts, s.hidden, s.moe.expert_inter
    return [(2 * e * h, 4 * e * i), (e * i, e * h)]


def target_problem(cfg: C.RunConfig, s: Shapes) -> str | None:
    """Why lora.target_modules adapts nothing in this model (None: it does, or the family is not one whose
    linears are known here): every name matches no Linear of the family, so peft would refuse it in the ranks."""
    targets = cfg.lora.target_list()
    if not cfg.adapters or targets == "all-linear" or s.model_type not in KNOWN_LINEARS:
        return None
    known = set(layer_linears(s)) | {"lm_head", "embed_tokens"}
    if any(t.rsplit(".", 1)[-1] in known for t in targets):
        return None
    return (f"{', '.join(targets)} name no linear layer of this {s.model_type} model (its layers have "
            f"{', '.join(layer_linears(s))}; or all-linear)")


def _targets(cfg: C.RunConfig, s: Shapes) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """(per-layer target linears, root target linears) as (in, out). all-linear: every linear but the
    output head (peft leaves it out); names: those of the layer's linears, and lm_head if named."""
    targets = cfg.lora.target_list()
    linears = layer_linears(s)
    if targets == "all-linear":
        return list(linears.values()) + _expert_adapters(s), []
    names = {t.rsplit(".", 1)[-1] for t in targets}
    root = [(s.hidden, s.vocab)] if "lm_head" in names else []
    return [shape for name, shape in linears.items() if name in names], root


def _saved_params(cfg: C.RunConfig, s: Shapes) -> int:
    sizes = {"embed_tokens": s.vocab * s.hidden, "lm_head": s.vocab * s.hidden, "norm": s.hidden}
    return sum(sizes.get(name.rsplit(".", 1)[-1], 0) for name in cfg.lora.saved_list())


def trainable_params(cfg: C.RunConfig, s: Shapes) -> int:
    """What peft makes trainable (its get_nb_trainable_parameters): adapters + the fully trained modules."""
    r = cfg.lora.rank
    layer, root = _targets(cfg, s)
    adapters = s.layers * sum(r * (i + o) for i, o in layer) + sum(r * (i + o) for i, o in root)
    return adapters + _saved_params(cfg, s)


def largest_trained(cfg: C.RunConfig, s: Shapes) -> int:
    """Elements of the largest trained tensor: an adapter's A or B, or a saved module's full copy."""
    layer, root = _targets(cfg, s)
    r = cfg.lora.rank
    adapters = max((r * max(i, o) for i, o in layer + root), default=0)
    saved = {"embed_tokens": s.vocab * s.hidden, "lm_head": s.vocab * s.hidden, "norm": s.hidden}
    return max([adapters] + [saved.get(name.rsplit(".", 1)[-1], 0) for name in cfg.lora.saved_list()])


def trainable_line(cfg: C.RunConfig, s: Shapes) -> str:
    """"40.0M of 6.74B trainable, 0.59%" (of the base model's parameters); full fine-tuning: all of them."""
    from shardconsole.settings.models import human_count
    n = trainable_params(cfg, s) if cfg.adapters else s.n_params
    return f"{human_count(n)} of {human_count(s.n_params)} trainable, {100 * n / s.n_params:.2f}%"


def frozen_bytes(cfg: C.RunConfig, s: Shapes) -> int:
    """The whole frozen base, unsharded: bf16 / fp32 weights, or QLoRA's NF4 linears + the rest in bf16."""
    if cfg.train.method == "qlora":
        linear = s.layers * sum(i * o for i, o in layer_linears(s).values())
        return int(NF4_BYTES_PER_PARAM * linear) + 2 * (s.n_params - linear)
    return DTYPE_BYTES[cfg.precision.dtype] * s.n_params


def adapter_activations(cfg: C.RunConfig, s: Shapes) -> tuple[int, int]:
    """(LoRA's saved activations beyond full fine-tuning's, QLoRA's transient bytes in a layer's
    backward), from peft's tuners/lora layer.py and bnb.py forward and bitsandbytes' MatMul4Bit.

    Saved: lora_A saves the linear's input, the tensor full fine-tuning's weight gradient saved (a
    frozen linear saves none; no dtype copy: FSDP2's mp_policy and DeepSpeed's bf16 module make the
    adapters compute in the compute dtype, so peft's _cast_input_dtype is a no-op); lora_B saves A's
    [tokens, r] output; with lora.dropout each target's own nn.Dropout saves its dropped copy of the
    input (c bytes) and its mask (1 byte), three copies for q/k/v. Full checkpointing recomputes one
    layer's worth; the selective policy keeps every aten.mm output, so each adapter's two matmul outputs
    ([tokens, r], [tokens, out]) in every layer, and under QLoRA not the base linears' outputs that the
    policy's figure in activation_memory counts (bitsandbytes' 4-bit matmul is not aten.mm: recomputed).
    Transient (QLoRA): at 8192 tokens bitsandbytes dequantises the weight to bf16 and calls F.linear
    (backends/cuda/ops.py; backward: dequantize_4bit then matmul), and peft clones each base output."""
    c = DTYPE_BYTES[cfg.precision.dtype]
    tokens = cfg.train.micro_batch * cfg.rows_per_sample * cfg.data.seq_len
    layer, _ = _targets(cfg, s)
    r, ckpt = cfg.lora.rank, cfg.memory.activation_checkpointing
    per_layer = tokens * sum(c * r + (c + 1) * i * (cfg.lora.dropout > 0) for i, _ in layer)
    extra = per_layer * (1 if ckpt else s.layers)
    qlora = cfg.train.method == "qlora"
    if ckpt and cfg.memory.checkpoint_policy == "selective":
        kept = sum(c * (r + o) for _, o in layer)
        if qlora:
            kept -= sum(c * o for _, o in layer_linears(s).values())
        extra = max(extra + s.layers * tokens * kept, 0)
    linears = layer_linears(s).values()
    transient = (2 * max(i * o for i, o in linears) + tokens * c * max(o for _, o in linears)) if qlora else 0
    return extra, transient


def lora_rank(cfg: C.RunConfig, s: Shapes) -> RankMemory:
    p, f, d = cfg.parallel, cfg.fsdp, cfg.deepspeed
    world = p.nproc_per_node * p.nnodes
    c = DTYPE_BYTES[cfg.precision.dtype]
    fsdp = p.backend == "fsdp"
    qlora = cfg.train.method == "qlora"
    # The frozen base: FSDP2 shards it (QLoRA's 4-bit base is replicated), ZeRO-3 partitions it.
    shard = 1 if qlora else ({"no_shard": 1, "hybrid_shard": p.nproc_per_node}.get(f.sharding, world) if fsdp
                             else (world if d.stage == 3 else 1))
    base = frozen_bytes(cfg, s) // shard
    offload_base = fsdp and f.cpu_offload and not qlora or (not fsdp and d.offload_param != "none")
    gathered = 0 if shard == 1 else 2 * c * s.per_layer + c * s.root   # a layer and its prefetch, the root
    T = trainable_params(cfg, s)
    t_shard = world if fsdp and f.sharding != "no_shard" else 1
    weights_b = 4 * T // t_shard
    grads_b = 4 * T // (world if (not fsdp and d.stage >= 2) or (fsdp and t_shard > 1) else 1)
    adam_b = 8 * T // (world if (not fsdp and d.stage >= 1) or (fsdp and t_shard > 1) else 1)
    opt_on_host = (not fsdp and d.offload_optimizer != "none") or (fsdp and f.cpu_offload)
    a = activations(cfg, s)
    extra, transient = adapter_activations(cfg, s)
    states = {f"frozen base ({'NF4 + constants' if qlora else cfg.precision.dtype}"
              f"{', sharded' if shard > 1 else ''})": 0 if offload_base else base,
              "gathered base layers": gathered,
              "adapters (fp32)": 0 if opt_on_host and fsdp else weights_b,
              "adapter optimizer states (Adam fp32)": 0 if opt_on_host else adam_b}
    ws = {"cuBLAS workspaces": CUBLAS_WORKSPACE_BYTES}
    acts = {"activations": a.saved_all, "LoRA activations": extra}
    gpu = {
        "end of forward": {**states, **acts, "loss chunk": a.loss_forward, **ws},
        "last layer backward": {**states, **acts, "layer backward": a.layer_backward + a.recompute,
                                "QLoRA's dequantised weight and peft's clone": transient, **ws},
        "end of backward": {**states, "adapter gradients": 0 if opt_on_host and fsdp else grads_b, **ws},
        "optimizer step": {**states, "adapter gradients": 0 if opt_on_host and fsdp else grads_b, **ws},
    }
    host = {"process (python, torch, CUDA)": RANK_BASE_RSS[p.backend], **offloaded_host(cfg, s)}
    if offload_base:
        host["frozen base (host)"] = base
    if opt_on_host:
        host["adapter optimizer states (Adam fp32, host)"] = adam_b + (weights_b + grads_b if fsdp else 0)
    notes = [f"{cfg.train.method}: {trainable_line(cfg, s)}"]
    # The allocator keeps a layer backward's freed blocks cached: with the base frozen, the backward's
    # transients (and QLoRA's dequantised weights) are the largest blocks a step frees and allocates
    # again at other sizes, and the reserved peak sits about one layer backward above the allocated one.
    # Measured on the H200 (benchmarks/results/session6/lora_cal.json, 7B LoRA, 7B QLoRA with and without
    # dropout, 13B QLoRA): reserved - allocated 1.7-2.7 GiB against a layer backward of 2.1-2.6 GiB; the
    # generic slack alone left the reserved peak 8-15% low; 0.9 of a layer backward fits all four within
    # 5% (1.0 put the dropout run 10% high). A cached pool: under a cap it is freed first.
    side = {"a layer backward's freed blocks (cached)": int(0.9 * (a.layer_backward + a.recompute))}
    if cfg.parallel.device == "cpu":
        moment = max(gpu, key=lambda k: sum(gpu[k].values()))
        ram = {"process (python, torch)": RANK_BASE_RSS_CPU,
               **{k: v for k, v in gpu[moment].items() if v and k != "cuBLAS workspaces"}}
        return RankMemory({}, {"training": ram}, notes + ["CPU ranks: the training memory is host memory"])
    return RankMemory(gpu, {"training": host}, notes, side=side)


def checkpoint_sizes(cfg: C.RunConfig, s: Shapes) -> tuple[int, int, int]:
    """(full checkpoint, weights-only save, largest tensor) bytes of a LoRA run: only what trains is
    saved (backends/engine/fsdp.py _model_state, ds_checkpoint.py exclude_frozen_parameters), an fp32 master
    and Adam's two moments a trained parameter, plus the small fixed files (a MiB is generous)."""
    T = trainable_params(cfg, s)
    fixed = 2**20 + cfg.world_size * 64 * 1024
    saved = _saved_params(cfg, s)
    largest = 4 * max(s.vocab * s.hidden if saved else 0, cfg.lora.rank * max(s.intermediate, s.vocab, s.hidden))
    return 12 * T + fixed, 4 * T + fixed, largest
