"""The trained module: a Llama-style causal LM from the catalog or a local Hugging Face folder, wrapped so
its forward returns the loss, with a cross-entropy that never holds the full fp32 logits."""

from __future__ import annotations

import contextlib
import inspect
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from shardconsole.backends.model.fused_loss import fused_linear_cross_entropy
from shardconsole.settings import config as C
from shardconsole.settings.models import ModelSpec


# The model

def transformers_config(spec: ModelSpec):
    """transformers' config of the model: a folder's own config.json (architecture and all), or a catalog
    entry's shape under its family's config class (AutoConfig.for_model). The ranks and export build
    from it; the planner reads the same shape from spec.config without transformers."""
    from transformers import AutoConfig
    if spec.path is not None:
        return AutoConfig.from_pretrained(spec.path, local_files_only=True)
    kwargs = dict(spec.config)
    return AutoConfig.for_model(kwargs.pop("model_type", "llama"), **kwargs)


def hf_config(spec: ModelSpec, cfg: C.RunConfig):
    hf = transformers_config(spec)
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


class Reference:
    """What the model's own code gives that a build on the meta device loses: the non-persistent buffers
    (rotary frequencies, Gemma's embedding scale sqrt(hidden)) and the starting value of each vector
    parameter (norm weights: 1 for Llama's x * w, 0 for Gemma's x * (1 + w); biases 0). Made by building
    the model once with its matrices on the meta device and only its vectors and buffers real, so the
    family's own __init__ and _init_weights decide them, not a rule of ours (a Gemma 3 folder trained
    with a garbage embedding scale learned nothing, exit 0)."""

    def __init__(self, hf_cfg) -> None:
        lm = _build_vectors_only(hf_cfg)
        persistent = set(lm.state_dict().keys())
        self.buffers = {n: b for n, b in lm.named_buffers() if n not in persistent}
        self.vectors: dict[str, float] = {}
        with torch.no_grad():
            for n, p in lm.named_parameters():
                if p.dim() == 1 and not p.is_meta and p.numel() and bool((p == p[0]).all()):
                    self.vectors[n] = float(p[0])

    def vector_value(self, name: str) -> float | None:
        """The constant a vector parameter starts at (`name` as the trained module has it: "lm."-prefixed,
        peft's wrappers in it), or None where the model gave none."""
        from shardconsole.backends.model.adapters import base_key
        return self.vectors.get(base_key(name.removeprefix("lm.")))


def _build_vectors_only(hf_cfg) -> nn.Module:
    """The LM with every parameter of two or more dimensions moved to the meta device as it is registered
    (so neither memory nor init time is spent on them) and the rest real on the CPU."""
    register = nn.Module.register_parameter

    def to_meta_if_matrix(module: nn.Module, name: str, param) -> None:
        register(module, name, param)
        if param is not None and param.dim() > 1 and not param.is_meta:
            module._parameters[name] = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)

    nn.Module.register_parameter = to_meta_if_matrix     # type: ignore[method-assign]
    try:
        with torch.device("cpu"):
            return build_causal_lm(hf_cfg)
    finally:
        nn.Module.register_parameter = register          # type: ignore[method-assign]


class RandomInit:
    """The random-init rules, one parameter at a time: normal(0, std) for matrices, for vectors the
    model's own starting value (Reference: ones for Llama's norm weights, zeros for Gemma's and for
    biases), drawn from one generator per device seeded from (seed, rank). Drawing the same parameters
    in the same order gives the same values however they are materialised (a whole model, or QLoRA's
    one decoder layer at a time, backends/model/qlora.py)."""

    def __init__(self, std: float, seed: int, rank: int, draw_on: torch.device | None = None,
                 reference: Reference | None = None) -> None:
        self.std, self.seed, self.rank, self.draw_on = std, seed, rank, draw_on
        self.reference = reference
        self.gens: dict[torch.device, torch.Generator] = {}

    @torch.no_grad()
    def draw_(self, name: str, p: torch.Tensor) -> None:
        local = p.to_local() if hasattr(p, "to_local") else p
        if local.numel() == 0 or ".lora_" in name or ".modules_to_save." in name:
            return      # LoRA's own (backends/model/adapters.py): the base draws as without them, the same model
        value = vector_value(self.reference, name, p.dim())
        if value is not None:
            local.fill_(value)
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


def vector_value(reference: Reference | None, name: str, dim: int) -> float | None:
    """The constant a parameter starts at, or None for a drawn one: the model's own value for a vector
    (Reference), else the Llama rules (norm weights 1, biases 0) where no reference was made."""
    if dim != 1:
        return None
    if reference is not None:
        value = reference.vector_value(name)
        if value is not None:
            return value
    if "norm" in name.lower():
        return 1.0
    return 0.0 if name.endswith("bias") else None


def init_random_(model: nn.Module, std: float, seed: int, rank: int, draw_on: torch.device | None = None,
                 reference: Reference | None = None) -> None:
    """Random init of (possibly sharded) parameters in place (RandomInit's rules). Works on each rank's
    local shard, seeded per rank, so a model built on the meta device never needs a full copy anywhere.
    `draw_on`: a GPU to draw host shards on (CPU offload), a tensor at a time."""
    init = RandomInit(std, seed, rank, draw_on, reference)
    for name, p in model.named_parameters():
        init.draw_(name, p)


@torch.no_grad()
def reset_buffers_(model: nn.Module, reference: Reference, device: torch.device) -> None:
    """Non-persistent buffers are garbage after to_empty() (and cast by a model-wide .to(dtype)): each
    gets the value the model's own code gives it (Reference), on the compute device even with CPU
    offload. A buffer the reference lacks is an error, not a guess: training on it would be silently wrong."""
    from shardconsole.backends.model.adapters import base_key
    for module_name, module in model.named_modules():
        for bname in list(module._buffers):
            if bname not in module._non_persistent_buffers_set or module._buffers[bname] is None:
                continue
            full = f"{module_name}.{bname}" if module_name else bname
            fresh = reference.buffers.get(base_key(full.removeprefix("lm.")))
            if fresh is None:
                raise RuntimeError(f"{full}: a buffer the model's own build does not make; cannot restore it")
            module._buffers[bname] = fresh.to(device)


def _logits(h: torch.Tensor, w: torch.Tensor, softcap: float | None) -> torch.Tensor:
    """fp32 logits of hidden rows `h`; softcap: final_logit_softcapping's c * tanh(z / c) (Gemma 2)."""
    z = (h @ w.t()).float()
    return z if softcap is None else torch.tanh(z / softcap) * softcap


def chunked_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                          chunk_tokens: int = 4096, reduction: str = "mean", softcap: float | None = None):
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
        total = F.cross_entropy(_logits(h, weight, softcap), y, ignore_index=-100, reduction="sum")
    else:
        def part(hc: torch.Tensor, w: torch.Tensor, yc: torch.Tensor) -> torch.Tensor:
            return F.cross_entropy(_logits(hc, w, softcap), yc, ignore_index=-100, reduction="sum")

        total = hidden.new_zeros((), dtype=torch.float32)
        for i in range(0, n, chunk_tokens):
            total = total + torch.utils.checkpoint.checkpoint(
                part, h[i:i + chunk_tokens], weight, y[i:i + chunk_tokens], use_reentrant=False)
    if reduction == "sum":
        return total, count
    return total / count.clamp(min=1)


def chunked_row_logps(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                      chunk_tokens: int = 4096, softcap: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
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
        nll = F.cross_entropy(_logits(hc, w, softcap), yc, ignore_index=-100, reduction="none")
        return nll.new_zeros(B).index_add(0, rc, nll)

    if y.numel() <= chunk_tokens:
        return -part(h, weight, y, rows), counts
    total = hidden.new_zeros(B, dtype=torch.float32)
    for i in range(0, y.numel(), chunk_tokens):
        total = total + torch.utils.checkpoint.checkpoint(
            part, h[i:i + chunk_tokens], weight, y[i:i + chunk_tokens], rows[i:i + chunk_tokens], use_reentrant=False)
    return -total, counts


def token_logps(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0,
                chunk_tokens: int = 4096, softcap: float | None = None) -> torch.Tensor:
    """Per token of labels [B, S]: the log-probability of its label under logits / temperature [B, S] fp32, 0
    where the label is -100: what GRPO's loss reads (backends/objective/grpo.py; TRL divides by the sampling
    temperature too). Only the labelled rows' logits are made, a chunk at a time, recomputed in backward."""
    where = (labels != -100).nonzero(as_tuple=True)
    h, y = hidden[where], labels[where]

    def part(hc: torch.Tensor, w: torch.Tensor, yc: torch.Tensor) -> torch.Tensor:
        return -F.cross_entropy(_logits(hc, w, softcap) / temperature, yc, reduction="none")

    if y.numel() <= chunk_tokens:
        picked = part(h, weight, y)
    else:
        picked = torch.cat([torch.utils.checkpoint.checkpoint(part, h[i:i + chunk_tokens], weight,
                                                              y[i:i + chunk_tokens], use_reentrant=False)
                            for i in range(0, y.numel(), chunk_tokens)])
    out = hidden.new_zeros(labels.shape, dtype=torch.float32)
    return out.index_put(where, picked)


class CausalLMLoss(nn.Module):
    """The trained module: a causal LM whose forward returns the next-token loss.

    model(inputs, labels[, positions]) is the mean over labels != -100; with reduction="sum" it is
    (loss sum, token count), which evaluation and token-weighted accumulation add up across batches;
    with reduction="row" (per-row log-prob sum [B], label count [B]) for the preference losses.
    positions (None: 0..S-1) restart per packed document; transformers then masks attention
    block-diagonally (data.cross_document_attention = false).

    Wrapping the LM keeps the loss inside the root module's forward, so FSDP2's root hooks (and
    DeepSpeed's) gather the embedding and output head for it. The loss is computed from the decoder's
    hidden states and the head's weight, so whatever the family's own forward does to its logits is
    done here too (LogitRule): a family that does more than that is refused where the model is built.

    loss: "chunked" (chunked_cross_entropy) or "fused" (fused_loss.py: memory.loss, resolved by the
    engine for its device); the per-row log-probs are chunked either way."""

    def __init__(self, lm: nn.Module, loss: str = "chunked") -> None:
        super().__init__()
        self.lm = lm
        self.loss = loss
        self.rule = LogitRule.of(lm)
        self.offload: Any = None       # memory.activation_offload: activation_offload.Offloader, set by the engine

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None, positions: torch.Tensor | None = None,
                reduction: str = "mean", attention_mask: torch.Tensor | None = None, cache: Any = None,
                temperature: float = 1.0):
        """reduction "next" (GRPO's sampler, backends/objective/sampler.py): the last position's fp32 logits
        [B, V], `cache` (a transformers Cache) grown in place; "token": token_logps. attention_mask [B, S]
        (0: a prompt's left padding) for both; the other reductions train on packed rows without it."""
        if reduction == "next":
            # transformers 5.x renames past_key_values to cache (the old name warns until 5.40)
            named = "cache" if "cache" in inspect.signature(self.lm.model.forward).parameters else "past_key_values"
            out = self.lm.model(input_ids=input_ids, position_ids=positions, attention_mask=attention_mask,
                                use_cache=True, **{named: cache})
            return _logits(out.last_hidden_state[:, -1] * self.rule.scale, self.lm.lm_head.weight, self.rule.softcap)
        # No KV cache: with one, transformers ignores the restarted positions and masks causally only.
        with self.offload.active() if self.offload is not None else contextlib.nullcontext():
            hidden = self.lm.model(input_ids=input_ids, position_ids=positions, attention_mask=attention_mask,
                                   use_cache=False).last_hidden_state
        if self.rule.scale != 1.0:
            hidden = hidden * self.rule.scale     # (h * s) @ W.T is s * logits: every loss kernel as it is
        softcap = self.rule.softcap
        assert labels is not None       # only "next" runs without labels
        if reduction == "token":
            return token_logps(hidden, self.lm.lm_head.weight, labels, temperature, softcap=softcap)
        if reduction == "row":
            return chunked_row_logps(hidden, self.lm.lm_head.weight, labels, softcap=softcap)
        if self.loss == "fused":
            return fused_linear_cross_entropy(hidden, self.lm.lm_head.weight, labels, reduction=reduction,
                                              softcap=softcap)
        return chunked_cross_entropy(hidden, self.lm.lm_head.weight, labels, reduction=reduction, softcap=softcap)


class LogitRule:
    """What a family's forward does between its head's matmul and the logits, read from its config:
    logit_scale (Cohere: multiplied), logits_scaling (Granite: divided), final_logit_softcapping
    (Gemma 2: c * tanh(z / c)). A head with a bias is refused: no loss kernel here adds one."""

    def __init__(self, scale: float = 1.0, softcap: float | None = None) -> None:
        self.scale, self.softcap = scale, softcap

    @classmethod
    def of(cls, lm: nn.Module) -> "LogitRule":
        config = getattr(lm, "config", None)
        if config is not None and hasattr(config, "get_text_config"):
            config = config.get_text_config()       # a multimodal config keeps the language model's keys there
        head = getattr(lm, "lm_head", None)
        if head is not None and getattr(head, "bias", None) is not None:
            raise ValueError(f"{type(lm).__name__}: its output head has a bias, which shardconsole's losses "
                             "do not add; training it would not be the model transformers defines")
        scale = float(getattr(config, "logit_scale", None) or 1.0)
        divisor = getattr(config, "logits_scaling", None)
        if divisor:
            scale /= float(divisor)
        softcap = getattr(config, "final_logit_softcapping", None)
        return cls(scale, float(softcap) if softcap else None)


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
