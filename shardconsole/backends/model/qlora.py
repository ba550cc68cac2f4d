"""QLoRA's frozen base (train.method = "qlora"): every decoder linear in 4-bit NF4 through bitsandbytes
(double quantisation, bf16 compute, bf16 quant storage so both engines see bf16 tensors), on each
rank's GPU; the adapters on top come from backends/model/adapters.py as for LoRA.

The 4-bit base is replicated, not sharded: 7B is 3.8 GB in NF4, and bitsandbytes' packed weights
and their quant states do not survive FSDP2's flat shards or ZeRO-3's partitions. FSDP2 is told to
leave them alone (fully_shard's ignored_params) and shards the rest (adapters, norms, embeddings);
DeepSpeed runs it at stages 0-2 only (settings/rules.py refuses stage 3).

bitsandbytes is imported here only, by a qlora run: the optional extra shardconsole[qlora]. The
front end refuses the method before launch on a machine without CUDA or the package
(session/gpu_checks.check_qlora). Not run on a GPU in this repository's tests (CPU only).
"""

from __future__ import annotations

import itertools
import types

import torch
import torch.nn as nn

from shardconsole.backends.model import adapters, modeling
from shardconsole.backends.rank import common


def _is_quantised_linear(name: str, module: nn.Module) -> bool:
    # The output head stays bf16 (as transformers' BitsAndBytesConfig keeps lm_head): the chunked loss
    # reads its weight directly.
    return isinstance(module, nn.Linear) and not name.endswith("lm_head")


@torch.no_grad()
def quantise_(module: nn.Module, device: torch.device) -> int:
    """Each decoder nn.Linear under `module` (bf16, on the host or already on `device`) replaced by a
    bnb Linear4bit on `device`; the rest moved there in bf16. Returns the number of linears quantised.
    One linear's bf16 weight is on the GPU at a time: Params4bit.to(cuda) quantises (bitsandbytes
    nn/modules.py, Params4bit._quantize) and its data becomes the packed weight; the bf16 original is
    freed with the replaced nn.Linear."""
    import bitsandbytes as bnb
    count = 0
    targets = [(parent, child_name) for name, parent in module.named_modules()
               for child_name, child in parent.named_children()
               if _is_quantised_linear(f"{name}.{child_name}" if name else child_name, child)]
    for parent, child_name in targets:
        child = getattr(parent, child_name)
        q = bnb.nn.Linear4bit(child.in_features, child.out_features, bias=child.bias is not None,
                              compute_dtype=torch.bfloat16, compress_statistics=True, quant_type="nf4",
                              quant_storage=torch.bfloat16, device="meta")
        q.weight = bnb.nn.Params4bit(child.weight.data.to(torch.bfloat16), requires_grad=False,
                                     compress_statistics=True, quant_type="nf4",
                                     quant_storage=torch.bfloat16).to(device)    # quantised on the move
        if child.bias is not None:
            q.bias = nn.Parameter(child.bias.data.to(device, torch.bfloat16), requires_grad=False)
        # bitsandbytes' own state dict adds the quantisation state as "weight.absmax", "weight.quant_map"...,
        # keys that name no attribute: torch's get_model_state_dict resolves every key to one and failed on
        # them ("'Params4bit' object has no attribute 'absmax'") at every QLoRA save. The frozen base is
        # never saved (a checkpoint holds the adapters; the base is the folder's or the seed's): the module's
        # plain state dict, its parameters under their own names, is all a save reads.
        q._save_to_state_dict = types.MethodType(nn.Module._save_to_state_dict, q)   # type: ignore[method-assign]
        setattr(parent, child_name, q)
        count += 1
    module.to(device=device)
    for p in module.parameters():
        if p.is_floating_point() and p.dtype != torch.bfloat16 and not hasattr(p, "quant_state"):
            p.data = p.data.to(torch.bfloat16)
    return count


def random_base(hf_cfg, device: torch.device, seed: int, quantise=quantise_) -> tuple[nn.Module, int]:
    """The seed's random base, with never more than one decoder layer of it in bf16 on `device`: the
    model is built on the meta device; the root (embeddings, final norm, head: bf16 in QLoRA anyway)
    is made on `device`, then each decoder layer in turn is made there, drawn and quantised before the
    next. (Drawing the whole bf16 7B first held 13.5 GB, plus the NF4 copy, and set the run's peak.)

    The draws are modeling.init_random_'s as one FSDP2 rank makes them (RandomInit, seeded for rank 0,
    the parameters in the whole model's order), so the base equals that of a 1-GPU LoRA or bf16-master
    run of the same seed. Returns (model, linears quantised)."""
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("meta"):
            lm = modeling.build_causal_lm(hf_cfg)
    finally:
        torch.set_default_dtype(default)
    layers = modeling.decoder_layers(lm)
    layer_of = {id(p): i for i, layer in enumerate(layers) for p in layer.parameters()}
    in_layers = {id(m) for layer in layers for m in layer.modules()}
    for m in lm.modules():
        if id(m) not in in_layers:
            m.to_empty(device=device, recurse=False)
    if getattr(hf_cfg, "tie_word_embeddings", False):
        lm.tie_weights()     # to_empty made the head's own tensor; named_parameters lists the tied one once
    reference = modeling.Reference(hf_cfg)
    init = modeling.RandomInit(float(getattr(hf_cfg, "initializer_range", 0.02)), seed, 0, reference=reference)
    count, done = 0, set()
    for i, names in itertools.groupby([(n, layer_of.get(id(p))) for n, p in lm.named_parameters()],
                                      key=lambda item: item[1]):
        if i is not None:
            assert i not in done, f"decoder layer {i}'s parameters are not contiguous in the model's order"
            layers[i].to_empty(device=device)
        for name, _ in names:
            init.draw_(name, lm.get_parameter(name))
        if i is not None:
            count += quantise(layers[i], device)
            done.add(i)
    modeling.reset_buffers_(lm, reference, device)     # after every to_empty (a layer's own rotary too)
    return lm, count


def build(r: common.Rank, hf_cfg) -> modeling.CausalLMLoss:
    """The whole model on this rank's GPU: the base (the folder's weights, or the seed's random init,
    alike on every rank) quantised, the adapters injected and initialised. The bf16 base is never whole
    on the GPU; the build's peak is logged and then forgotten (empty_cache, reset_peak_memory_stats),
    so the memory lines' peaks are training's."""
    if r.spec.path is not None and r.spec.has_weights:
        from transformers import AutoModelForCausalLM     # in bf16 on the host: 2 bytes a parameter, once
        lm = AutoModelForCausalLM.from_pretrained(r.spec.path, config=hf_cfg, local_files_only=True,
                                                  dtype=torch.bfloat16)
        n = quantise_(lm, r.device)                       # a linear at a time onto the GPU
    else:
        lm, n = random_base(hf_cfg, r.device, r.cfg.train.seed)
    model = modeling.CausalLMLoss(lm, loss=r.cfg.memory.loss_on(r.is_cuda))
    adapters.inject(lm, r.cfg)
    adapters.init_adapters_(model, r.cfg.train.seed, r.rank)
    for name, p in model.named_parameters():
        if adapters.is_trained(name):
            p.data = p.data.float()     # fp32 masters for what trains; the base computes in bf16
    r.log(f"qlora: {n} linears in 4-bit NF4 (double quantisation, bf16 compute); {adapters.count_line(model)}")
    if r.is_cuda:
        gib = 2**30
        r.log(f"qlora: build peak {torch.cuda.max_memory_allocated(r.device) / gib:.2f} GiB allocated, "
              f"{torch.cuda.max_memory_reserved(r.device) / gib:.2f} GiB reserved; after it "
              f"{torch.cuda.memory_allocated(r.device) / gib:.2f} GiB allocated")
        torch.cuda.empty_cache()            # the caching allocator would keep the build's blocks reserved
        torch.cuda.reset_peak_memory_stats(r.device)
    return model


def quantised_params(model: nn.Module) -> set[nn.Parameter]:
    """The bitsandbytes weights FSDP2 must not shard (fully_shard's ignored_params)."""
    return {p for p in model.parameters() if hasattr(p, "quant_state") or p.__class__.__name__ == "Params4bit"}
