"""The run's one optimizer stepped over some of its parameters: a parameter as FSDP2 reduces its
gradient (step_in_backward.py), an FSDP unit as its gradients reach the host (offload_overlap.py).

How: every param group's "params" is narrowed in place, for the length of one optim.step(), to the
parameters asked for that are in it (empty for the others), then put back. In place, on the optimizer
itself, rather than on a view of it (a copy sharing its __dict__), because a step assigns attributes as
well as reading them: RoundedAdamW caches its step's hyper-parameter tensor in `_hp` (a view would
rebuild it, one host-to-device copy a parameter on the GPU), records why its host op could not be built
in `host_op_failed` (a view would warn again), and torch's step pre/post hooks are handed the object
that steps (a view would hand them a stranger). The rest is shared either way: `state` (the step
counters, the moments), `defaults`, `grad_scale`, and RoundedAdamW's `position`, which seeds each
parameter's rounding by its place in the whole optimizer, not in the narrowed groups. torch's fused
AdamW, RoundedAdamW and torchao's low-bit AdamW update each tensor on its own, so a parameter stepped
alone gets the bits the whole step gives it (tests/test_offload.py checks the first two).

In place means nothing else may use the optimizer while a partial step runs: step_in_backward steps on
the thread of the backward; offload_overlap's one host thread steps while the loop's thread runs the
backward, which does not touch the optimizer until Overlap.finish has waited for every unit.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


class PartialStep:
    """`step(params)`: optim.step() over `params` only (each must be one of optim's)."""

    def __init__(self, optim: torch.optim.Optimizer) -> None:
        self.optim = optim
        # (group index, place in the group) of each parameter. Indices, not the group dicts: a checkpoint
        # load (Optimizer.load_state_dict) replaces the dicts, never their order or contents.
        self.place = {id(p): (i, j) for i, g in enumerate(optim.param_groups) for j, p in enumerate(g["params"])}

    def step(self, params: Iterable[torch.nn.Parameter]) -> None:
        groups = self.optim.param_groups
        narrowed: list[list] = [[] for _ in groups]
        for p in sorted(params, key=lambda p: self.place[id(p)]):          # each group's own order
            narrowed[self.place[id(p)][0]].append(p)
        every = [g["params"] for g in groups]
        for g, ps in zip(groups, narrowed):
            g["params"] = ps
        try:
            self.optim.step()
        finally:
            for g, ps in zip(groups, every):
                g["params"] = ps
