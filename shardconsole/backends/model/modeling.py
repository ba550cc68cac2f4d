"""The trained module: a Llama-style causal LM from the catalog or a local Hugging Face folder, wrapped so
its forward returns the loss, with a cross-entropy that never holds the full fp32 logits."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from shardconsole.backends.model.fused_loss import fused_linear_cross_entropy
from shardconsole.settings import config as C
from shardconsole.settings.models import ModelSpec


# The model

def hf_config(spec: ModelSpec, cfg: C.RunConfig):
    from transformers import AutoConfig, LlamaConfig
    if spec.path is not None:
        hf = AutoConfig.from_pretrained(spec.path, local_files_only=True)
    else:
        hf = LlamaConfig(**spec.config)
    hf._attn_implementation = cfg.model.attn_implementation
    hf.use_cache = False
    return hf


def build_causal_lm(hf_cfg) -> nn.Module:
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_config(hf_cfg, attn_implementation=hf_cfg._attn_implementation)


def decoder_layers(lm: nn.Module) -> nn.ModuleList:
    """The repeated blocks (the unit of sharding, prefetch and checkpointing)."""
    for path in ("model.layers", "transformer.h", "model.decoder.layers"):
        obj = lm
        try:
            for part in path.split("."):
                obj = getattr(obj, part)
            return obj
        except AttributeError:
            continue
    raise TypeError(f"{type(lm).__name__}: cannot find its decoder layers")


class RandomInit:
    """The random-init rules, one parameter at a time: normal(0, std) for matrices, ones for norm
    weights, zeros for biases, drawn from one generator per device seeded from (seed, rank). Drawing
    the same parameters in the same order gives the same values however they are materialised (a
    whole model, or QLoRA's one decoder layer at a time, backends/model/qlora.py)."""

    def __init__(self, std: float, seed: int, rank: int, draw_on: torch.device | None = None) -> None:
        self.std, self.seed, self.rank, self.draw_on = std, seed, rank, draw_on
        self.gens: dict[torch.device, torch.Generator] = {}

    @torch.no_grad()
    def draw_(self, name: str, p: torch.Tensor) -> None:
        local = p.to_local() if hasattr(p, "to_local") else p
        if local.numel() == 0 or ".lora_" in name or ".modules_to_save." in name:
            return      # LoRA's own (backends/model/adapters.py): the base draws as without them, the same model
        if "norm" in name.lower() and local.dim() == 1:
            local.fill_(1.0)
        elif name.endswith("bias"):
            local.zero_()
        else:
            # Generated where the shard lives: a 7B model's 27 GiB of fp32 draws on one CPU core is minutes.
            # Offloaded shards are drawn on the GPU and copied: 13B on the CPU is minutes more.
            where = self.draw_on if local.device.type == "cpu" and self.draw_on is not None else local.device
            gen = self.gens.get(where)
            if gen is None:
                gen = self.gens[where] = torch.Generator(device=where).manual_seed(self.seed * 7919 + self.rank)
            if where == local.device:
                local.normal_(0.0, self.std, generator=gen)
            else:
                local.copy_(torch.empty(local.shape, dtype=local.dtype, device=where).normal_(0.0, self.std, generator=gen))


def init_random_(model: nn.Module, std: float, seed: int, rank: int, draw_on: torch.device | None = None) -> None:
    """Random init of (possibly sharded) parameters in place (RandomInit's rules). Works on each rank's
    local shard, seeded per rank, so a model built on the meta device never needs a full copy anywhere.
    `draw_on`: a GPU to draw host shards on (CPU offload), a tensor at a time."""
    init = RandomInit(std, seed, rank, draw_on)
    for name, p in model.named_parameters():
        init.draw_(name, p)


@torch.no_grad()
def reset_buffers_(model: nn.Module, hf_cfg, device: torch.device) -> None:
    """Non-persistent buffers (rotary inv_freq) are garbage after to_empty(): rebuild them."""
    for name, module in model.named_modules():
        if name.endswith("rotary_emb"):
            with torch.device("cpu"):
                fresh = type(module)(config=hf_cfg)
            for bname, buf in fresh.named_buffers(recurse=False):
                module._buffers[bname] = buf.to(device)   # on the compute device even with CPU offload


def chunked_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                          chunk_tokens: int = 4096, reduction: str = "mean"):
    """Next-token loss over the labels that are not -100, without ever holding the full [tokens, vocab]
    fp32 logits. reduction="mean": the mean over those labels (0, with a zero gradient, when there are
    none: a window of prompt tokens only); "sum": (sum of their losses, their count as a tensor), for a
    mean over several batches or ranks.

    Each chunk's logits are recomputed in backward (checkpoint), so the peak is one chunk's logits,
    not all of them: for seq 2048 x micro-batch 8 x vocab 32000 that is 2 GiB of fp32 saved."""
    h = hidden.reshape(-1, hidden.shape[-1])
    y = labels.reshape(-1)
    n = y.numel()
    count = (y != -100).sum()
    if n <= chunk_tokens:
        total = F.cross_entropy((h @ weight.t()).float(), y, ignore_index=-100, reduction="sum")
    else:
        def part(hc: torch.Tensor, w: torch.Tensor, yc: torch.Tensor) -> torch.Tensor:
            return F.cross_entropy((hc @ w.t()).float(), yc, ignore_index=-100, reduction="sum")

        total = hidden.new_zeros((), dtype=torch.float32)
        for i in range(0, n, chunk_tokens):
            total = total + torch.utils.checkpoint.checkpoint(
                part, h[i:i + chunk_tokens], weight, y[i:i + chunk_tokens], use_reentrant=False)
    if reduction == "sum":
        return total, count
    return total / count.clamp(min=1)


def chunked_row_logps(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                      chunk_tokens: int = 4096) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of labels [B, S]: (sum of the log-probabilities of its labels that are not -100 [B] fp32,
    their count [B]), what a preference loss reads (backends/objective/preference.py: DPO sums a
    completion's log-probs, ORPO averages them per token). The same chunking as chunked_cross_entropy:
    one chunk's fp32 logits at a time, recomputed in backward."""
    B, S = labels.shape
    h = hidden.reshape(-1, hidden.shape[-1])
    y = labels.reshape(-1)
    rows = torch.arange(B, device=y.device).repeat_interleave(S)
    counts = (labels != -100).sum(dim=1)

    def part(hc: torch.Tensor, w: torch.Tensor, yc: torch.Tensor, rc: torch.Tensor) -> torch.Tensor:
        nll = F.cross_entropy((hc @ w.t()).float(), yc, ignore_index=-100, reduction="none")
        return nll.new_zeros(B).index_add(0, rc, nll)

    if y.numel() <= chunk_tokens:
        return -part(h, weight, y, rows), counts
    total = hidden.new_zeros(B, dtype=torch.float32)
    for i in range(0, y.numel(), chunk_tokens):
        total = total + torch.utils.checkpoint.checkpoint(
            part, h[i:i + chunk_tokens], weight, y[i:i + chunk_tokens], rows[i:i + chunk_tokens], use_reentrant=False)
    return -total, counts


class CausalLMLoss(nn.Module):
    """The trained module: a causal LM whose forward returns the next-token loss.

    model(inputs, labels[, positions]) is the mean over labels != -100; with reduction="sum" it is
    (loss sum, token count), which evaluation and token-weighted accumulation add up across batches;
    with reduction="row" (per-row log-prob sum [B], label count [B]) for the preference losses.
    positions (None: 0..S-1) restart per packed document; transformers then masks attention
    block-diagonally (data.cross_document_attention = false).

    Wrapping the LM keeps the loss inside the root module's forward, so FSDP2's root hooks (and
    DeepSpeed's) gather the embedding and output head for it.

    loss: "chunked" (chunked_cross_entropy) or "fused" (fused_loss.py: memory.loss, resolved by the
    engine for its device); the per-row log-probs are chunked either way."""

    def __init__(self, lm: nn.Module, loss: str = "chunked") -> None:
        super().__init__()
        self.lm = lm
        self.loss = loss

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor, positions: torch.Tensor | None = None,
                reduction: str = "mean"):
        # No KV cache: with one, transformers ignores the restarted positions and masks causally only.
        hidden = self.lm.model(input_ids=input_ids, position_ids=positions, use_cache=False).last_hidden_state
        if reduction == "row":
            return chunked_row_logps(hidden, self.lm.lm_head.weight, labels)
        ce = fused_linear_cross_entropy if self.loss == "fused" else chunked_cross_entropy
        return ce(hidden, self.lm.lm_head.weight, labels, reduction=reduction)


def enable_checkpointing(lm: nn.Module) -> None:
    # transformers 5.x renamed it (the old name warns until v6); older releases only have the old one.
    try:
        lm.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    except (AttributeError, TypeError):
        lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


# Kept by the selective policy: the matmul and attention outputs, the costly part to recompute (_scaled_mm:
# precision.fp8's float8 matmuls).
def _selective_policy(ctx, op, *args, **kwargs):
    from torch.utils.checkpoint import CheckpointPolicy
    aten = torch.ops.aten
    saved = (aten.mm.default, aten._scaled_mm.default, aten._scaled_dot_product_flash_attention.default,
             aten._scaled_dot_product_efficient_attention.default, aten._scaled_dot_product_cudnn_attention.default)
    return CheckpointPolicy.MUST_SAVE if op in saved else CheckpointPolicy.PREFER_RECOMPUTE


def checkpoint_forward(layer: nn.Module, selective: bool) -> None:
    """Recompute `layer` in backward by wrapping its forward (not its __call__, as transformers' own
    switch does): when the layer is then compiled, the checkpoint is inside the compiled region and
    inductor fuses the recomputation into the backward graph (56.1% MFU against 54.3% with the
    checkpoint around the compiled layer, 1b on an H200). `selective` keeps the matmul and attention
    outputs and recomputes only the element-wise ops (66.3% MFU, 30.4 GiB against full's 19.0 and
    none's 34.8; benchmarks/data/h200_issue7.json)."""
    import functools
    from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts
    inner = layer.forward
    extra = {"context_fn": functools.partial(create_selective_checkpoint_contexts, _selective_policy)} if selective else {}

    def forward(*args, **kwargs):
        return checkpoint(inner, *args, use_reentrant=False, **extra, **kwargs)
    layer.forward = forward


def apply_checkpointing(lm: nn.Module, policy: str, compiled: bool) -> None:
    """memory.activation_checkpointing with memory.checkpoint_policy; `compiled`: each decoder layer
    will be compiled (fsdp.py), so the checkpoint belongs inside it."""
    if policy == "full" and not compiled:
        enable_checkpointing(lm)
        return
    if compiled:
        # transformers >= 5.2x routes each attention's call through the `kernels` package, which sets and
        # resets a global (its CompileableContextVar) around the forward. Inside a checkpoint, dynamo
        # refuses any mutation of outside state ("HOP: Unsafe side effect") and runs the whole layer
        # eager, compile silently lost (a CPU layer: 0 graphs; 1 with this). The mutation is a set and its
        # reset, nothing the recompute in backward needs replayed: torch's documented switch lets it be.
        import torch._dynamo
        torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint = True
    for layer in decoder_layers(lm):
        checkpoint_forward(layer, selective=policy == "selective")


def load_pretrained(spec: ModelSpec, hf_cfg) -> nn.Module:
    if not spec.has_weights:
        raise FileNotFoundError(f"{spec.path}: no weights (model.safetensors or pytorch_model.bin); "
                                f"a catalog size trains from random init")
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(spec.path, config=hf_cfg, local_files_only=True,
                                                torch_dtype=torch.float32)
