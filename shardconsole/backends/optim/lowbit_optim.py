"""optim.name = "adamw8bit" / "adamw4bit": torchao's low-bit AdamW for the FSDP2 ranks (issue 35).

torchao keeps each moment block-quantized (8-bit: 256 values a block, 4-bit: 128, one fp32 scale a
block; tensors under 4096 values or not a multiple of the block stay in the parameter's dtype) and
wraps its state tensors in DTensors shaped like FSDP2's shards, so each rank steps its own shard. The
step is torch.compile'd per parameter (Inductor: CUDA kernels on a GPU, C++ on a CPU rank, which needs
a C++ compiler). With bf16 weights (precision.master_dtype = "bf16") torchao rounds the update into
them stochastically, so small updates survive on average.
"""

from __future__ import annotations

import torch

# torchao's defaults (torchao/optim/adam.py AdamW8bit/AdamW4bit); plan/optim_states.py counts the same.
BLOCK_SIZE = {"adamw8bit": 256, "adamw4bit": 128}


def make(cfg, params) -> torch.optim.Optimizer:
    """torchao's AdamW8bit or AdamW4bit over params, with train's lr, betas and weight decay."""
    from torchao.optim import AdamW4bit, AdamW8bit     # optional dependency: shardconsole[lowbit]
    register_view_dtype()
    # Inductor's on-disk caches (FX graph, AOT autograd) hand one of these steps the other's compiled graph
    # on FSDP2's DTensor states: an adamw8bit run, then an adamw4bit one of the same model (or the reverse)
    # crashed at step 1, "wrong number of dimensions1 for op: input". Compiled fresh each run instead.
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config
    inductor_config.fx_graph_cache = False
    functorch_config.enable_autograd_cache = False
    cls = {"adamw8bit": AdamW8bit, "adamw4bit": AdamW4bit}[cfg.optim.name]
    t = cfg.train
    return cls(params, lr=t.lr, betas=(t.beta1, t.beta2), weight_decay=t.weight_decay,
               block_size=BLOCK_SIZE[cfg.optim.name], bf16_stochastic_round=cfg.precision.master_dtype == "bf16")


def set_lr(optim: torch.optim.Optimizer, lr: float) -> None:
    """The step's lr into each group: torchao keeps lr as a tensor (its compiled step reads it without
    recompiling), which must be filled in place; torch's AdamW takes the float."""
    for group in optim.param_groups:
        if isinstance(group["lr"], torch.Tensor):
            group["lr"].fill_(lr)
        else:
            group["lr"] = lr


def register_view_dtype() -> None:
    """torchao 0.18's moment subclasses take the parameter's dtype as their "appearance", but their
    aten.view drops it (the view comes back fp32) and they implement no aten.view.dtype. With bf16
    parameters sharded by FSDP2 (DTensor.from_local views the state), torch.compile's fake copy of the
    state then fails the step: "OptimState8bit dispatch: ... aten.view.dtype", or a dtype mismatch of the
    view against its base (on the GPU as on the CPU; pytorch/ao PR 4216, open). Here both keep the
    appearance dtype, as torchao's own _to_copy does. Once per process; a torchao that has view.dtype
    keeps its own."""
    from torch.utils._python_dispatch import return_and_correct_aliasing
    from torchao.optim.subclass_4bit import OptimState4bit
    from torchao.optim.subclass_8bit import OptimState8bit
    aten = torch.ops.aten
    remake = {OptimState8bit: lambda x, dt: OptimState8bit(x.codes, x.scale, x.qmap, x.signed, dtype=dt),
              OptimState4bit: lambda x, dt: OptimState4bit(x.codes, x.scale, x.qmap, x.signed, x._shape, dtype=dt)}
    for cls, like in remake.items():
        table = getattr(cls, "_ATEN_OP_TABLE", {}).get(cls, {})
        if aten.view.dtype in table:
            continue

        def view_as_dtype(func, types, args, kwargs, like=like):
            return return_and_correct_aliasing(func, args, kwargs, like(args[0], args[1]))

        def view_keeping_dtype(func, types, args, kwargs, like=like, view=table[aten.view.default]):
            out = view(func, types, args, kwargs)
            return out if out.dtype == args[0].dtype else like(out, args[0].dtype)
        cls.implements(aten.view.dtype)(view_as_dtype)
        cls.implements(aten.view.default)(view_keeping_dtype)
