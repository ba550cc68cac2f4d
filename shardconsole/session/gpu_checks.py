"""The settings against this machine's GPUs, for what needs a kind of GPU rather than a count of them:
QLoRA's bitsandbytes (CUDA), precision.fp8's FP8 tensor cores (compute capability 8.9+). Called by
preflight.check_gpus before every launch; each failure is one ConfigError naming the source of the value.
And the GPU memory the planner puts a run at against the memory it knows (gpu_overrun), which --headless
refuses unless --force and the console asks about."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from shardconsole.settings import config as C
from shardconsole.settings.resolve import Resolved
from shardconsole.settings.values import FP8_GPUS, FP8_MIN_CAPABILITY, fp8_emulated

if TYPE_CHECKING:
    from shardconsole.machine.probes import Card
    from shardconsole.session.planner import Planner
    from shardconsole.settings.models import ModelSpec

FORCE = " (--force launches anyway)"      # the override --headless takes; the console asks instead


def gpu_overrun(r: Resolved, spec: "ModelSpec | None" = None, hardware: Any = None,
                planner: "Planner | None" = None) -> C.ConfigError | None:
    """The refusal of a launch whose own plan says its largest rank does not fit the GPU: one line with
    the plan's verdict (planned against available, the largest part and what would fit) and the override
    (FORCE, at its end). Only where the plan knows the GPU's memory: a GPU found here, or a cap the
    settings give (memory.gpu_memory_limit, a card of that size: the error then names where the cap came
    from); never on CPU ranks, and None when the planner cannot say (a check that cannot run must not
    block a launch). A GPU out of memory after the model is built and its host states pinned costs minutes
    on a big model (issue 63); the planner was within a few percent of the measured runs."""
    if r.cfg.parallel.device == "cpu":
        return None
    try:
        if planner is None:
            from shardconsole import plan as planner_module
            planner = planner_module
        if spec is None:
            from shardconsole.settings.models import resolve as resolve_model
            spec = resolve_model(r.cfg.model.name)
        est = planner.estimate(r.cfg, spec, hardware if hardware is not None else planner.detect_hardware())
    except Exception:
        return None
    budget = est.gpu_budget_bytes       # 0: a device smaller than its context and driver, still known
    if budget is None or est.gpu_required_bytes <= budget:
        return None
    verdict = est.verdict.removeprefix("does not fit: ")
    import shlex
    sets = "".join(f" --set {shlex.quote(str(o))}" for o in r.overrides)
    text = (f"the plan says this run does not fit: {verdict}; `shardconsole plan --preset {shlex.quote(r.preset)}{sets}` "
            f"lists the parts{FORCE}")
    if r.cfg.gpu_memory_limit_bytes and (est.gpu_device_bytes or 0) <= r.cfg.gpu_memory_limit_bytes:
        return r.error("memory", "gpu_memory_limit", text)      # the cap decided: blame where it came from
    return C.ConfigError(text, source=r.preset)


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
