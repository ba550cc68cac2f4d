"""Full GRPO's reference with beta > 0 (backends/objective/grpo.py): a frozen copy of the starting weights,
built from the same source as the policy (the model folder, or the same seeded random init), so its first
forward equals the policy's and a resume's reference is still the start's (not the checkpoint's). Completions
are sampled online, so the reference's log-probs cannot be precomputed as full DPO's table is
(objective/preference.py): the copy stays resident, and the planner counts it (plan/grpo_terms.py).

FSDP2: a second module built and fully_shard'ed as the policy is (engine/fsdp.py's build), its parameters
without grad. ZeRO-3: the same build under zero.Init, wrapped by deepspeed.initialize without an optimizer
(its hooks gather each layer as the policy's do); ZeRO 0-2: a whole copy per rank in the compute dtype, as
those stages keep the policy's parameters. Offloaded parameters (fsdp.cpu_offload, deepspeed.offload_param)
are refused before launch (settings/grpo_rules.py): the copy would need the engine's host-side machinery."""

from __future__ import annotations

from typing import Any, Callable

import torch

from shardconsole.backends.objective.base import Forward
from shardconsole.backends.rank.common import Rank

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _frozen(module: torch.nn.Module) -> torch.nn.Module:
    module.requires_grad_(False)
    module.eval()
    return module


def fsdp_reference(r: Rank) -> Forward:
    from shardconsole.backends.engine import fsdp
    model: Forward = _frozen(fsdp.build(r).model)
    return model


def deepspeed_reference(r: Rank) -> Forward:
    import deepspeed
    from shardconsole import ds_json
    from shardconsole.backends.engine import deepspeed as ds
    from shardconsole.backends.model import modeling
    hf_cfg = modeling.hf_config(r.spec, r.cfg)
    reference = modeling.Reference(hf_cfg)
    ds_cfg = ds_json.to_ds_config(r.cfg, device=r.device.type)
    model = ds.build(r, ds_cfg, hf_cfg, reference)
    _frozen(model)
    if r.cfg.deepspeed.stage == 3:
        # no optimizer, no scheduler: DeepSpeed then only partitions and gathers (as TRL's ref model under ZeRO-3)
        cfg = {k: v for k, v in ds_cfg.items() if k not in ("optimizer", "scheduler")}
        cfg["zero_optimization"] = {k: v for k, v in ds_cfg["zero_optimization"].items() if k != "offload_optimizer"}
        engine, _, _, _ = deepspeed.initialize(model=model, config=cfg)
        modeling.reset_buffers_(model, reference, r.device)     # zero.Init cast the rotary frequencies
        engine.eval()
        out: Forward = engine
        return out
    model.to(device=r.device, dtype=DTYPES[r.cfg.precision.dtype])
    modeling.reset_buffers_(model, reference, r.device)         # the rotary frequencies back in fp32
    plain: Forward = model
    return plain


def builder(r: Rank) -> Callable[[], Forward] | None:
    """What builds the frozen copy for this run, or None where it needs none (adapters: the base with the
    adapters off; beta = 0; another objective)."""
    cfg = r.cfg
    if cfg.train.objective != "grpo" or cfg.adapters or not cfg.grpo.beta:
        return None
    make: Callable[[Rank], Forward] = deepspeed_reference if cfg.parallel.backend == "deepspeed" else fsdp_reference
    return lambda: make(r)


def attach(objective: Any, r: Rank) -> Any:
    """The objective with its reference builder, where it takes one (Grpo.reference_builder)."""
    if hasattr(objective, "reference_builder"):
        objective.reference_builder = builder(r)
    return objective
