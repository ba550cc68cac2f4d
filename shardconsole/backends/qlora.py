"""QLoRA's frozen base (train.method = "qlora"): every decoder linear in 4-bit NF4 through bitsandbytes
(double quantisation, bf16 compute, bf16 quant storage so both engines see bf16 tensors), on each
rank's GPU; the adapters on top come from backends/adapters.py as for LoRA.

The 4-bit base is replicated, not sharded: 7B is 3.8 GB in NF4, and bitsandbytes' packed weights
and their quant states do not survive FSDP2's flat shards or ZeRO-3's partitions. FSDP2 is told to
leave them alone (fully_shard's ignored_params) and shards the rest (adapters, norms, embeddings);
DeepSpeed runs it at stages 0-2 only (settings/rules.py refuses stage 3).

bitsandbytes is imported here only, by a qlora run: the optional extra shardconsole[qlora]. The
front end refuses the method before launch on a machine without CUDA or the package
(session/preflight.check_qlora). Not run on a GPU in this repository's tests (CPU only).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from shardconsole.backends import adapters, common, modeling


def _is_quantised_linear(name: str, module: nn.Module) -> bool:
    # The output head stays bf16 (as transformers' BitsAndBytesConfig keeps lm_head): the chunked loss
    # reads its weight directly.
    return isinstance(module, nn.Linear) and not name.endswith("lm_head")


@torch.no_grad()
def quantise_(lm: nn.Module, device: torch.device) -> int:
    """Each decoder nn.Linear of `lm` (bf16, on the host) replaced by a bnb Linear4bit on `device`;
    the rest moved there in bf16. Returns the number of linears quantised."""
    import bitsandbytes as bnb
    count = 0
    for name, module in list(lm.named_modules()):
        for child_name, child in list(module.named_children()):
            full = f"{name}.{child_name}" if name else child_name
            if not _is_quantised_linear(full, child):
                continue
            q = bnb.nn.Linear4bit(child.in_features, child.out_features, bias=child.bias is not None,
                                  compute_dtype=torch.bfloat16, compress_statistics=True, quant_type="nf4",
                                  quant_storage=torch.bfloat16, device="meta")
            q.weight = bnb.nn.Params4bit(child.weight.data.to(torch.bfloat16).cpu(), requires_grad=False,
                                         compress_statistics=True, quant_type="nf4",
                                         quant_storage=torch.bfloat16).to(device)    # quantised on the move
            if child.bias is not None:
                q.bias = nn.Parameter(child.bias.data.to(device, torch.bfloat16), requires_grad=False)
            setattr(module, child_name, q)
            count += 1
    lm.to(device=device)
    for p in lm.parameters():
        if p.is_floating_point() and p.dtype != torch.bfloat16 and not hasattr(p, "quant_state"):
            p.data = p.data.to(torch.bfloat16)
    return count


def build(r: common.Rank, hf_cfg) -> modeling.CausalLMLoss:
    """The whole model on this rank's GPU: the base (the folder's weights, or the seed's random init,
    alike on every rank) quantised, the adapters injected and initialised."""
    if r.spec.path is not None and r.spec.has_weights:
        from transformers import AutoModelForCausalLM     # in bf16 on the host: 2 bytes a parameter, once
        lm = AutoModelForCausalLM.from_pretrained(r.spec.path, config=hf_cfg, local_files_only=True,
                                                  dtype=torch.bfloat16)
    else:
        # The same random base on every rank, drawn in bf16 on the GPU (7B: 13.5 GB there for a moment,
        # instead of 27 GB of fp32 on the host): init_random_ as one FSDP2 rank draws it, so a 1-GPU
        # QLoRA run starts from the base of a 1-GPU LoRA or bf16-master run of the same seed.
        default = torch.get_default_dtype()
        torch.set_default_dtype(torch.bfloat16)
        try:
            with torch.device(r.device):
                lm = modeling.build_causal_lm(hf_cfg)
        finally:
            torch.set_default_dtype(default)
        modeling.init_random_(lm, float(getattr(hf_cfg, "initializer_range", 0.02)), r.cfg.train.seed, 0)
    n = quantise_(lm, r.device)
    model = modeling.CausalLMLoss(lm)
    adapters.inject(lm, r.cfg)
    adapters.init_adapters_(model, r.cfg.train.seed, r.rank)
    for name, p in model.named_parameters():
        if adapters.is_trained(name):
            p.data = p.data.float()     # fp32 masters for what trains; the base computes in bf16
    r.log(f"qlora: {n} linears in 4-bit NF4 (double quantisation, bf16 compute); {adapters.count_line(model)}")
    return model


def quantised_params(model: nn.Module) -> set[nn.Parameter]:
    """The bitsandbytes weights FSDP2 must not shard (fully_shard's ignored_params)."""
    return {p for p in model.parameters() if hasattr(p, "quant_state") or p.__class__.__name__ == "Params4bit"}
