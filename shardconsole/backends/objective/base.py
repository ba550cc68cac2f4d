"""The objective seam: both engines ask it for a micro-batch's loss, so SFT and preference training run on
FSDP2 and DeepSpeed alike without either engine knowing which one it trains.

`model` is what the engine calls for a forward (FSDP2's root module, DeepSpeed's engine): called as
model(inputs, labels, positions, **kwargs), it runs modeling.CausalLMLoss.forward inside the engine's hooks.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
import torch.distributed as dist

from shardconsole.backends.data.batches import Batch
from shardconsole.backends.objective import held_out_loss

def all_summed(sums: torch.Tensor) -> list[float]:
    """A figures' tally added over every rank (a collective: every rank calls it) and read to the host (the
    step line's one sync)."""
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(sums)
    return sums.tolist()


class Forward(Protocol):
    """FSDP2's root module or DeepSpeed's engine: called for a forward, switched between train and eval."""
    training: bool

    def __call__(self, *args: Any, **kwargs: Any) -> Any: ...

    def train(self, mode: bool = True) -> Any: ...


class Objective(Protocol):
    """One training objective. `prepare` runs once before the first step of a session (a reference pass,
    say); `start_step` once per optimizer step with its micro-batches, before the first `micro_loss` (GRPO
    samples the whole window there: DAPO divides by the window's completion tokens, as TRL does);
    `micro_loss` once per micro-batch, its result goes to backward; `figures` once per step line."""

    name: str

    def prepare(self, model: Forward) -> None: ...

    def start_step(self, model: Forward, batches: list[Batch]) -> None: ...

    def micro_loss(self, model: Forward, batch: Batch) -> torch.Tensor: ...

    def figures(self) -> dict[str, Any]:
        """What the step line adds (all ranks reduced), since the last call, Step fields by name; {} when nothing."""
        ...

    def evaluate(self, model: Forward, source: Any, micro_batch: int, device: torch.device) -> dict[str, Any] | None:
        """The eval line's figures over the held-out source this objective's data made (Eval fields by name;
        every rank calls it: a sharded forward is a collective); None: nothing to say."""
        ...


class NextToken:
    """Supervised fine-tuning and pre-training: the mean next-token loss over the labelled tokens."""

    name = "sft"

    def prepare(self, model: Forward) -> None:
        return None

    def start_step(self, model: Forward, batches: list[Batch]) -> None:
        return None

    def micro_loss(self, model: Forward, batch: Batch) -> torch.Tensor:
        loss: torch.Tensor = model(batch.inputs, batch.labels, batch.positions)
        return loss

    def figures(self) -> dict[str, Any]:
        return {}

    def evaluate(self, model: Forward, source: Any, micro_batch: int, device: torch.device) -> dict[str, Any] | None:
        """The mean token loss over the held-out windows, and each source's of a mix (data.path's several)."""
        if not hasattr(source, "parts"):
            loss, tokens = held_out_loss.evaluate(model, source, micro_batch, device)
            return {"loss": loss, "tokens": tokens}
        losses = [(name, *held_out_loss.evaluate(model, s, micro_batch, device)) for name, s in source.parts]
        tokens = sum(n for _, _, n in losses)
        return {"loss": sum(lo * n for _, lo, n in losses if lo is not None) / tokens if tokens else None,
                "tokens": tokens, "sources": tuple(name for name, lo, _ in losses if lo is not None),
                "source_losses": tuple(float(lo) for _, lo, _ in losses if lo is not None)}
