"""optim.step_in_backward = true (issue 35): each parameter stepped, and its gradient freed, as soon as
FSDP2 has reduce-scattered it in the backward pass, so no step holds the whole model's gradients: at
most a layer's (the one just reduced, and the next one in flight). torchtune's optimizer-in-backward.

How: torch's `register_post_accumulate_grad_hook` on each trained (sharded DTensor) parameter. FSDP2
calls those hooks itself once it has assigned the sharded gradient (torch's _fsdp_collectives.py
foreach_reduce, on the stream the reduce ran on, before the event the next forward waits for). The hook
runs the run's one optimizer narrowed to that one parameter (partial_step.py, which offload_overlap.py
shares), so

- the update is the ordinary step's (torch's AdamW and torchao's low-bit AdamW update each tensor on
  its own; RoundedAdamW seeds its rounding by the parameter's place in the whole list, not the
  narrowed one), the losses are the same;
- the optimizer's state and its checkpoint are the ordinary ones (one optimizer, one group): a run
  resumes across the switch either way.

What it cannot do, refused before launch (settings/rules.py): a clip by the global norm (the norm is
known only after the last gradient, by which time the first ones have stepped), gradient accumulation
(a step per micro-batch), fp16's loss scaler (the step must be skipped on an overflow found later),
offload (the host optimizer step has its own path), DeepSpeed (its engine steps).
"""

from __future__ import annotations

import torch

from shardconsole.backends.optim.partial_step import PartialStep


class StepInBackward:
    """The hooks on `params` stepping `optim`; `remove()` takes them off."""

    def __init__(self, optim: torch.optim.Optimizer, params: list[torch.nn.Parameter]) -> None:
        self.optim = optim
        self.partial = PartialStep(optim)
        self.handles = [p.register_post_accumulate_grad_hook(self._step) for p in params]
        self.stepped = 0            # parameters stepped since the last `check_stepped`

    def _step(self, p: torch.nn.Parameter) -> None:
        # The one optimizer over this one parameter: the step walks nothing else.
        self.partial.step([p])
        p.grad = None               # the gradient's memory goes back now, not at the end of the step
        self.stepped += 1

    def check_stepped(self) -> None:
        """After a backward: some parameter stepped (else FSDP2 called no hook, and nothing trains)."""
        n, self.stepped = self.stepped, 0
        if not n:
            raise RuntimeError("optim.step_in_backward: no parameter was stepped in the backward pass "
                               "(FSDP2 called no post-accumulate-grad hook)")

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []


def attach(r, optim: torch.optim.Optimizer, params: list[torch.nn.Parameter]) -> StepInBackward | None:
    """The hooks when r.cfg.optim.step_in_backward is on (said once in the stream), else None."""
    if not r.cfg.optim.step_in_backward:
        return None
    hooks = StepInBackward(optim, params)
    r.event("info", f"optim.step_in_backward: {len(hooks.handles)} parameters step as their gradients are "
                    "reduced, each gradient freed at once")
    return hooks
