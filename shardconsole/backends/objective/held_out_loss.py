"""Next-token training's held-out loss (objective/base.NextToken.evaluate): every token under loss in the
eval split counted once, on all ranks together.

Every rank runs the same number of forward passes (data.EvalWindows pads the last ones with windows
that hold no label): a sharded model's forward is a collective, so a rank that skipped one would hang
the others. Token losses are summed and counted per rank, all-reduced, and the mean is sum / count, so
the result does not depend on how the windows fell across ranks or batches.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def evaluate(model, eval_source, micro_batch: int, device: torch.device) -> tuple[float | None, int]:
    """(mean token loss, tokens under loss) over the whole eval set; every rank must call it."""
    was_training = model.training
    model.train(False)
    total = torch.zeros((), dtype=torch.float64, device=device)
    count = torch.zeros((), dtype=torch.int64, device=device)
    try:
        with torch.no_grad():
            for batch in eval_source.batches(micro_batch):
                b = batch.to(device)
                s, c = model(b.inputs, b.labels, b.positions, reduction="sum")
                total += s.double()
                count += c
    finally:
        model.train(was_training)
    if dist.is_available() and dist.is_initialized():
        both = torch.stack([total, count.double()])
        dist.all_reduce(both)
        total, count = both[0], both[1].long()
    n = int(count.item())
    return (float(total.item()) / n if n else None), n
