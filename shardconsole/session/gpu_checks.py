"""The settings against this machine's GPUs, for what needs a kind of GPU rather than a count of them:
QLoRA's bitsandbytes (CUDA), precision.fp8's FP8 tensor cores (compute capability 8.9+). Called by
preflight.check_gpus before every launch; each failure is one ConfigError naming the source of the value."""

from __future__ import annotations

from typing import TYPE_CHECKING

from shardconsole.settings.resolve import Resolved
from shardconsole.settings.values import FP8_GPUS, FP8_MIN_CAPABILITY, fp8_emulated

if TYPE_CHECKING:
    from shardconsole.machine.probes import Card


def check_qlora(r: Resolved, gpu_count: int) -> None:
    """train.method = "qlora" needs a CUDA GPU and the bitsandbytes package (the optional extra
    shardconsole[qlora]); found without importing either."""
    if r.cfg.train.method != "qlora":
        return
    if gpu_count == 0:
        raise r.error("train", "method", "\"qlora\" keeps the frozen base in 4-bit NF4 through bitsandbytes, "
                      "which needs CUDA, and this machine has no CUDA GPU: use method = \"lora\"")
    import importlib.util
    if importlib.util.find_spec("bitsandbytes") is None:
        raise r.error("train", "method", "\"qlora\" needs the bitsandbytes package: pip install "
                      "'shardconsole[qlora]' (or use method = \"lora\")")


def check_fp8(r: Resolved, gpu_count: int, cards: "list[Card] | None" = None) -> None:
    """precision.fp8 needs FP8 tensor cores: a CUDA GPU of compute capability 8.9 or newer (Ada, Hopper,
    Blackwell). Known before launch from NVML (`cards`: machine.probes.Card, default this machine's)."""
    fp8 = r.cfg.precision.fp8
    if fp8 == "none" or fp8_emulated():     # emulated: any device will do (settings/values.py)
        return
    if gpu_count == 0:
        raise r.error("precision", "fp8", f"\"{fp8}\" (float8 linears) needs a CUDA GPU with FP8 tensor cores "
                      f"({FP8_GPUS}) and this machine has none: set fp8 = \"none\"")
    if cards is None:
        from shardconsole.machine.probes import gpu_cards
        cards = gpu_cards()
    for c in cards[:r.cfg.parallel.nproc_per_node]:
        cap = c.capability
        if cap is not None and tuple(cap) < FP8_MIN_CAPABILITY:
            raise r.error("precision", "fp8", f"\"{fp8}\" (float8 linears) needs FP8 tensor cores ({FP8_GPUS}); "
                          f"GPU {c.index} ({c.name}) is {cap[0]}.{cap[1]}: set fp8 = \"none\"")
