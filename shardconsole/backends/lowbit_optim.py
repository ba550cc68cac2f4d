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
