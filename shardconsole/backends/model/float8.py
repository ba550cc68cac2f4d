"""precision.fp8: torchao's float8 training on the decoder layers' linear layers (FSDP2 and DeepSpeed).

Each nn.Linear of a decoder layer becomes torchao's Float8Linear before the layer is compiled and sharded:
its forward casts the input and the weight to float8_e4m3 with a dynamic scale (one a tensor for
"tensorwise", one a row for "rowwise") and multiplies with torch._scaled_mm, twice bf16's rate on FP8
tensor cores; backward does the same for both gradients. Parameters keep their names, dtype and shape, so
checkpoints, resume and export are those of a bf16 run. The embeddings, the final norm and the output head
stay bf16 (the head's vocab-wide matmul feeds the loss, where float8's error would land on every token).

Float8Linear keeps each nn.Linear's parameter object, so DeepSpeed's partitions (ZeRO-3's included) and
hooks work on it as on a Linear; DeepSpeed gathers in bf16. FSDP2's FP8 all-gather (tensorwise, several
ranks, no offload): FSDP2 gathers the weights already cast to float8,
half the bytes of bf16; torchao then needs the scales of the next step's weights computed once after each
optimizer step (precompute_scales). With one rank there is nothing to gather, and with CPU offload the
all-gather input lives on the host (a cast there would run on the CPU), so both keep the bf16 gather.
A float8 gather on one rank, where it would move the casts out of a checkpointed layer's forward,
recompute and backward, was tried and measured slower than the casts it saves (an H200: 3b at mb 8 -7%,
1b -10%; docs/MEASURED.md, "The 24 GB rows at larger micro-batches").
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn as nn

from shardconsole.backends.rank.common import Rank
from shardconsole.backends.rank.errors import RankFailure
from shardconsole.settings.values import FP8_GPUS, FP8_MIN_CAPABILITY



class Fp8Unsupported(RankFailure, RuntimeError):
    """precision.fp8 on a GPU without FP8 tensor cores (preflight refuses it on the launching machine; a rank
    on another node checks its own)."""
    cause = "config_error"
    hint = f"set precision.fp8 = \"none\" on this GPU (FP8 needs {FP8_GPUS})"


def check_device(device: torch.device, emulate: bool = False) -> None:
    """`emulate` (SHARDCONSOLE_FP8_EMULATE=1): any device will do."""
    if emulate:
        return
    if device.type != "cuda":
        raise Fp8Unsupported(f"precision.fp8 needs a CUDA GPU; this rank computes on {device.type}")
    cap = torch.cuda.get_device_capability(device)
    if cap < FP8_MIN_CAPABILITY:
        raise Fp8Unsupported(f"precision.fp8 needs FP8 tensor cores; {torch.cuda.get_device_name(device)} "
                             f"is compute capability {cap[0]}.{cap[1]} (8.9+ has them)")


def gathers_fp8(recipe: str, world: int, offloaded: bool) -> bool:
    """FP8 all-gather applies: torchao offers it for tensorwise scales only; see the module's docstring."""
    return recipe == "tensorwise" and world > 1 and not offloaded


def _fits(module: nn.Module, _fqn: str) -> bool:
    # torch._scaled_mm needs both dimensions divisible by 16 (every catalog size's are; a local folder's
    # odd-sized projection stays bf16 rather than failing).
    return isinstance(module, nn.Linear) and module.in_features % 16 == 0 and module.out_features % 16 == 0


def convert_layers(layers: nn.ModuleList, recipe: str, *, all_gather: bool, emulate: bool = False) -> int:
    """Swap the decoder layers' linears for Float8Linear in place (on the meta device, before sharding and
    compiling). Returns how many were converted. `emulate`: torchao's emulation (the same float8 casts and
    scales, the matmul in high precision), which runs on a CPU: the tests' way to train through this path."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    from torchao.float8.float8_linear import Float8Linear
    config = dataclasses.replace(Float8LinearConfig.from_recipe_name(recipe),
                                 enable_fsdp_float8_all_gather=all_gather, emulate=emulate)
    for layer in layers:
        convert_to_float8_training(layer, module_filter_fn=_fits, config=config)
    return sum(isinstance(m, Float8Linear) for layer in layers for m in layer.modules())


def convert_for_rank(r: Rank, layers: nn.ModuleList, *, all_gather: bool) -> None:
    """convert_layers for a rank's engine (r.cfg.precision.fp8), after checking its GPU, and say so."""
    recipe, emulate = r.cfg.precision.fp8, r.knobs.fp8_emulate
    check_device(r.device, emulate)
    n = convert_layers(layers, recipe, all_gather=all_gather, emulate=emulate)
    r.log(f"fp8: {n} linears in {len(layers)} decoder layers multiply in float8 ({recipe} scales; "
          f"all-gather in {'float8' if all_gather else 'bf16'}); the embeddings and the head stay bf16"
          + ("; emulated (SHARDCONSOLE_FP8_EMULATE=1): float8's casts, the matmuls in bf16" if emulate else ""))


def precompute_scales(model: nn.Module) -> None:
    """After the optimizer step, under FP8 all-gather: the next step's weight scales, one all-reduce for
    all the layers instead of one a weight inside each all-gather."""
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp
    precompute_float8_dynamic_scale_for_fsdp(model)
