"""LoRA and QLoRA in the ranks (train.method, [lora]): peft's adapters injected into the Hugging Face
model in place, so CausalLMLoss, the sharding and the loop stay as they are for full fine-tuning.

peft's `inject_adapter_in_model` rewrites each target Linear `x` into `x.base_layer` (frozen) with
`x.lora_A.default` / `x.lora_B.default` beside it, and each module of lora.modules_to_save into
`x.original_module` (frozen) and `x.modules_to_save.default` (trained). Those names are the
checkpoint's, and export_model/adapters.py maps them onto peft's own adapter folder.

The adapters are initialised here, not by peft, because both engines fill parameters after the model
is built (FSDP2 on the meta device, ZeRO-3 partitioned): lora_B is zero (the model starts as the base),
lora_A is uniform in +-1/sqrt(in_features) (peft's kaiming_uniform(a=sqrt(5)) bound), each rank
drawing its own shard; the fully trained copies start as the originals.
"""

from __future__ import annotations

import contextlib
import math
import re
from typing import Iterator

import torch
import torch.nn as nn

# Parameter names peft gives the frozen originals and the trained copies.
BASE = ".base_layer"
ORIGINAL, SAVED = ".original_module", ".modules_to_save.default"
_WRAP = re.compile(r"\.(base_layer|original_module|modules_to_save\.default)(?=\.)")


def lora_config(cfg):
    from peft import LoraConfig
    lo = cfg.lora
    return LoraConfig(r=lo.rank, lora_alpha=lo.alpha, lora_dropout=lo.dropout, target_modules=lo.target_list(),
                      modules_to_save=lo.saved_list() or None, bias="none", task_type="CAUSAL_LM")


def inject(lm: nn.Module, cfg) -> nn.Module:
    """The adapters into `lm` in place (on whatever device it is: meta, partitioned or real); every
    parameter but the adapters and the saved copies frozen. A name in lora.target_modules or
    modules_to_save that matches no module is peft's ValueError, which the rank reports as a failure."""
    from peft import inject_adapter_in_model
    on_meta = next(lm.parameters()).is_meta        # FSDP2 builds on the meta device: no adapter init there
    inject_adapter_in_model(lora_config(cfg), lm, low_cpu_mem_usage=on_meta)
    for name, p in lm.named_parameters():
        p.requires_grad_(is_trained(name))
    return lm


def is_trained(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name or SAVED + "." in name


def base_key(name: str) -> str:
    """The key a parameter of the injected model had in the base model (and in its weight files)."""
    return _WRAP.sub("", name)


def remap_base_state(state: dict, model: nn.Module, prefix: str = "") -> dict:
    """A base model's state dict under the injected model's names: each frozen original and each saved
    copy gets its base weight; the adapters are not in it (initialised by init_adapters_)."""
    out = {}
    for name, _ in model.named_parameters():
        key = base_key(name[len(prefix):]) if name.startswith(prefix) else None
        if key is not None and key in state and not (".lora_A." in name or ".lora_B." in name):
            out[name] = state[key]
    for name, _ in model.named_buffers():
        key = base_key(name[len(prefix):]) if name.startswith(prefix) else None
        if key is not None and key in state:
            out[name] = state[key]
    return out


def _local(p: torch.Tensor) -> torch.Tensor:
    """The part of a parameter this rank holds: an FSDP2 shard, a ZeRO-3 partition, or itself."""
    if hasattr(p, "ds_tensor"):
        return p.ds_tensor
    return p.to_local() if hasattr(p, "to_local") else p


@torch.no_grad()
def init_adapters_(model: nn.Module, seed: int, rank: int) -> None:
    """lora_B zero, lora_A uniform(+-1/sqrt(in_features)), saved copies = originals. Called after the
    base weights are in place (random init or a model folder). A sharded adapter (FSDP2) is drawn per
    rank; a whole one (DeepSpeed, which partitions it at initialize) alike on every rank."""
    gens = {k: torch.Generator(device="cpu").manual_seed(seed * 104_729 + k) for k in (rank, -1)}
    params = dict(model.named_parameters())
    for name, p in params.items():
        local = _local(p)
        if ".lora_B." in name:
            local.zero_()
        elif ".lora_A." in name and local.numel():
            bound = 1.0 / (p.ds_shape[1] if hasattr(p, "ds_shape") else p.shape[1]) ** 0.5
            gen = gens[rank if local is not p else -1]
            drawn = torch.empty(local.shape, dtype=torch.float32).uniform_(-bound, bound, generator=gen)
            local.copy_(drawn.to(local.device, local.dtype))
        elif SAVED + "." in name:
            _copy_original_(p, params[name.replace(SAVED, ORIGINAL)])


def _copy_original_(saved: nn.Parameter, original: nn.Parameter) -> None:
    if hasattr(original, "ds_tensor") and not hasattr(saved, "ds_tensor"):
        # ZeRO-3: peft's copy of a partitioned module is a whole tensor; fill it from the gathered original
        import deepspeed
        with deepspeed.zero.GatheredParameters([original]):
            saved.data = original.data.clone()
        return
    _local(saved).copy_(_local(original))   # the same shapes sharded the same way: each rank its own part


def cast_frozen_(model: nn.Module, dtype: torch.dtype) -> None:
    """The frozen base in the compute dtype (2 bytes a parameter in bf16 instead of fp32's 4): nothing
    updates it, so fp32 masters would only cost memory. The adapters keep the master dtype."""
    for name, p in model.named_parameters():
        if not p.requires_grad and p.is_floating_point():
            p.data = p.data.to(dtype)


def trained_params(model: nn.Module) -> list[nn.Parameter]:
    """What the optimizer steps: every parameter for full fine-tuning, the adapters under LoRA."""
    return [p for p in model.parameters() if p.requires_grad]


def trained_state(state: dict, model: nn.Module) -> dict:
    """A model state dict cut to what trains: a LoRA checkpoint holds the adapters, not the base."""
    keep = {n for n, p in model.named_parameters() if p.requires_grad}
    return {k: v for k, v in state.items() if k in keep}


def count_line(model: nn.Module) -> str:
    """ "40.0M of 6.74B trainable, 0.59%": the trained parameters against the base model's own count
    (adapters and the saved copies left out of the second)."""
    from shardconsole.settings.models import human_count
    trained = total = 0
    for name, p in model.named_parameters():
        n = p.ds_numel if hasattr(p, "ds_numel") else p.numel()
        shape = getattr(getattr(p, "quant_state", None), "shape", None)
        if shape is not None:       # a 4-bit weight packs several values an element: count the weight's own
            n = math.prod(shape)
        if p.requires_grad:
            trained += n
        else:
            total += n
    return f"{human_count(trained)} of {human_count(total)} trainable, {100 * trained / max(total, 1):.2f}%"


@contextlib.contextmanager
def disabled(model: nn.Module) -> Iterator[None]:
    """The base model without its adapters, for the forwards inside: the reference of LoRA DPO
    (backends/objective/preference.py). Sets peft's own switch (`_disable_adapters`, which each LoRA layer
    and saved-module wrapper reads in forward) on every such module under `model`: FSDP2's root module and
    DeepSpeed's engine both hold the peft modules as submodules, so this works under either engine and
    changes no parameter, no requires_grad (peft's enable_adapters(False) would freeze the adapters)."""
    switched = [m for m in model.modules() if getattr(m, "_disable_adapters", None) is False]
    for m in switched:
        m._disable_adapters = True
    try:
        yield
    finally:
        for m in switched:
            m._disable_adapters = False
