"""Test-only fault injection, so every failure class is exercised for real in CI.

Set SHARDCONSOLE_FAULT to one or more `kind@key=value,...` separated by ';', e.g.
    SHARDCONSOLE_FAULT="sleep@rank=1,step=3"       rank 1 sleeps forever at step 3 (a hang)
    SHARDCONSOLE_FAULT="oom@rank=0,step=2"         raise torch.OutOfMemoryError at step 2
    SHARDCONSOLE_FAULT="oom_load@rank=0"           raise it while the model loads
    SHARDCONSOLE_FAULT="kill@rank=1,step=2"        SIGKILL itself (what the kernel's OOM killer does)
    SHARDCONSOLE_FAULT="nan@step=3"                the loss becomes NaN from step 3
    SHARDCONSOLE_FAULT="overflow@step=2"           a gradient becomes inf from step 2 (fp16 skips)
    SHARDCONSOLE_FAULT="raise@rank=1,step=2"       a plain exception
    SHARDCONSOLE_FAULT="slow_save@step=4"          sleep 60 s inside checkpoint saves from step 4 on
    SHARDCONSOLE_FAULT="slow_save@step=4,ms=8000"  the same, 8 s
    SHARDCONSOLE_FAULT="pace@rank=0,ms=200"        each step takes 200 ms more on rank 0 (the others wait
                                                   for it): a steady pace that a loaded machine barely moves
Without the variable nothing is installed: the rank loops hold no fault code. With it, the loops call
`install` (hooks on the module a loop calls: the step's faults and the loss) or `install_fsdp` (also
FSDP2's unscale and clip: the gradient fault); the load and save faults are an attribute test each,
outside the loop.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass
from typing import Callable

import torch


@dataclass(frozen=True)
class Fault:
    kind: str
    rank: int | None = None
    step: int = 1
    ms: int = 0

    def here(self, rank: int, step: int | None = None) -> bool:
        return (self.rank is None or self.rank == rank) and (step is None or step >= self.step)


def parse(text: str) -> list[Fault]:
    faults = []
    for part in filter(None, (p.strip() for p in text.split(";"))):
        kind, _, args = part.partition("@")
        kw: dict = {}
        for item in filter(None, args.split(",")):
            k, _, v = item.partition("=")
            kw[k.strip()] = int(v)
        faults.append(Fault(kind.strip(), kw.get("rank"), kw.get("step", 1), kw.get("ms", 0)))
    return faults


class Injector:
    def __init__(self, rank: int, spec: str = "") -> None:
        self.rank = rank
        self.faults = parse(spec)       # SHARDCONSOLE_FAULT, read by knobs.Knobs
        self.active = bool(self.faults)

    def _hit(self, kind: str, step: int | None = None) -> bool:
        return any(f.kind == kind and f.here(self.rank, step) for f in self.faults)

    def on_load(self) -> None:
        if self.active and self._hit("oom_load"):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected fault)")

    def on_step(self, step: int) -> None:
        if not self.active:
            return
        if any(f.kind == "sleep" and f.here(self.rank) and f.step == step for f in self.faults):
            while True:
                time.sleep(3600)
        if self._hit("kill", step):
            os.kill(os.getpid(), signal.SIGKILL)
        if self._hit("oom", step):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected fault)")
        if self._hit("raise", step):
            raise ValueError(f"injected failure at step {step}")
        for f in self.faults:
            if f.kind == "pace" and f.here(self.rank, step):
                time.sleep(f.ms / 1000)

    def on_loss(self, loss: torch.Tensor, step: int) -> torch.Tensor:
        if self.active and self._hit("nan", step):
            return loss * float("nan")
        return loss

    def changes_grads(self, step: int) -> bool:
        """on_grads will rewrite this step's gradients after the backward (an update made during the
        backward would not see them)."""
        return self.active and self._hit("overflow", step)

    def on_grads(self, params, step: int) -> bool:
        """True when a gradient was changed (a norm taken before this is stale)."""
        if self.active and self._hit("overflow", step):
            for p in params:
                if p.grad is not None:
                    g = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
                    if g.numel():
                        g.view(-1)[0] = float("inf")
                        return True
        return False

    def on_save(self, step: int) -> None:
        if self.active and self._hit("slow_save", step):
            time.sleep(next((f.ms for f in self.faults if f.kind == "slow_save" and f.ms), 60_000) / 1000)

    def install(self, r, called: torch.nn.Module, model: torch.nn.Module) -> None:
        """The step's faults (sleep, kill, oom, raise) before the first training forward of each step, and
        the loss fault on what that forward returns. `called`: what the loop calls (the model, or DeepSpeed's
        engine); `model` says whether it trains (DeepSpeed's engine.train() sets only its module's flag), so
        an evaluation's forwards are left alone."""
        seen = [0]

        def before(module, args) -> None:
            if model.training and r.step != seen[0]:      # the step's later micro-batches: no second time
                seen[0] = r.step
                self.on_step(r.step)

        def after(module, args, loss):
            return self.on_loss(loss, r.step) if model.training else loss

        # The first pre-hook (FSDP2's root unshards in its own): the fault comes before the step's collectives.
        called.register_forward_pre_hook(before, prepend=True)
        called.register_forward_hook(after)       # the last hook: on the loss the loop receives

    def install_fsdp(self, r, model: torch.nn.Module, scaling, clip: Callable) -> Callable:
        """install, and the gradient fault: an inf written after the backward, before the scaler unscales
        (fp16's scaler must see it); the clip returned is told then that a norm summed during the backward
        is stale."""
        self.install(r, model, model)
        unscale, changed = scaling.unscale, [False]

        def unscale_after_fault(optim) -> None:
            changed[0] = self.on_grads(model.parameters(), r.step)
            unscale(optim)

        scaling.unscale = unscale_after_fault
        return lambda grads_changed=False: clip(grads_changed or changed[0])
