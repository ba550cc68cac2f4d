"""KTO (train.objective kto, [preference] beta, desirable_weight, undesirable_weight) over a Batch of KTO
records (backends/data/preference.py: B completion rows, then B KL rows, each record's prompt with the
completion of the record before it, and each record's index, whose label the split holds).

TRL's KTOTrainer, loss_type "kto" (trl 1.16, trainer/kto_trainer.py, _compute_loss), from per-row sums of the
completions' token log-probs:
  z      = mean over the batch's KL rows of (pi - ref), averaged over the ranks, clamped at 0, no gradient
  loss_i = desirable_weight * (1 - sig(beta (pi_i - ref_i - z)))     for a record labelled true
           undesirable_weight * (1 - sig(beta (z - (pi_i - ref_i))))  for a record labelled false
  loss   = the mean over the batch's records
Rewards beta * (pi - ref), the chosen one the mean over the desirable records, the rejected one over the
undesirable ones, the margin their difference (TRL's rewards/margins); kl the mean z. The reference is DPO's
(Preference.reference: the base with the adapters off under LoRA, the starting weights' table otherwise),
for both rows. tests/test_kto_simpo_trl.py checks the loss and figures against TRL's own _compute_loss.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from shardconsole.backends.data import preference as pairs_data
from shardconsole.backends.data.batches import Batch
from shardconsole.backends.objective.base import Forward, all_summed
from shardconsole.backends.objective.preference import Preference, row_logps

FIGURES = ("reward_chosen", "reward_rejected", "reward_margin", "kl")


def kl_estimate(pol_kl: torch.Tensor, ref_kl: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """z: the mean of the KL rows' log-ratios over every rank's records, clamped at 0, without gradient (a
    collective when distributed: every rank calls it once a micro-batch)."""
    ratio = (pol_kl.detach() - ref_kl.detach()).double()
    sums = torch.stack([torch.where(valid, ratio, torch.zeros_like(ratio)).sum(), valid.double().sum()])
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(sums)
    return (sums[0] / sums[1].clamp(min=1)).clamp(min=0).to(pol_kl.dtype)


def kto_losses(pol: torch.Tensor, ref: torch.Tensor, labels: torch.Tensor, kl: torch.Tensor, beta: float,
               desirable_weight: float, undesirable_weight: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss per record, reward per record) from the records' summed completion log-probs [B] under the
    policy and the reference, their labels [B] bool and z."""
    ratio = pol - ref
    chosen = desirable_weight * (1 - torch.sigmoid(beta * (ratio - kl)))
    rejected = undesirable_weight * (1 - torch.sigmoid(beta * (kl - ratio)))
    return torch.where(labels, chosen, rejected), beta * ratio.detach()


class KtoTally:
    """Sums since the last line: loss, records, desirable reward and count, undesirable reward and count,
    z over micro-batches and their count, completion tokens under loss."""

    def __init__(self) -> None:
        self.sums: torch.Tensor | None = None

    def add(self, per_record: torch.Tensor, rewards: torch.Tensor, labels: torch.Tensor, valid: torch.Tensor,
            kl: torch.Tensor, tokens: torch.Tensor) -> None:
        zero = torch.zeros((), dtype=torch.float64, device=rewards.device)

        def total(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
            return torch.where(mask, x.detach().double(), zero).sum()
        one = torch.ones_like(rewards, dtype=torch.float64)
        row = torch.stack([total(per_record, valid), total(one, valid), total(rewards, valid & labels),
                           total(one, valid & labels), total(rewards, valid & ~labels), total(one, valid & ~labels),
                           kl.detach().double(), torch.ones((), dtype=torch.float64, device=rewards.device),
                           total(tokens, valid)])
        self.sums = row if self.sums is None else self.sums + row

    def reduce(self) -> dict[str, Any]:
        """The figures over every rank's records since the last call; {} when none (a collective)."""
        if self.sums is None:
            return {}
        sums, self.sums = self.sums, None
        loss, n, c, nc, r, nr, kl, batches, tokens = all_summed(sums)
        if not n:
            return {}
        rc = c / nc if nc else None
        rr = r / nr if nr else None
        return {"loss": loss / n, "reward_chosen": rc, "reward_rejected": rr,
                "reward_margin": None if rc is None or rr is None else rc - rr, "kl": kl / batches,
                "pref_accuracy": None, "pairs": int(n), "tokens": int(tokens)}


class Kto(Preference):
    """KTO as an Objective: Preference's reference (adapters off, or the table), its own loss and figures."""

    def __init__(self, r: Any) -> None:
        super().__init__(r)
        self.kto_tally = KtoTally()
        self.labels: dict[str, torch.Tensor] = {}

    def labels_of(self, batch: Batch, split: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(each record's label, whether it is a record: eval's padding is not)."""
        if split not in self.labels:
            entry = pairs_data.pair_entry(self.r)
            source = entry.train if split == "train" else entry.eval
            if source is None or source.labels is None:
                raise RuntimeError("kto: the data's cache entry holds no labels (not KTO records)")
            self.labels[split] = torch.from_numpy(source.labels.copy()).to(self.r.device)
        assert batch.pairs is not None         # record batches carry their records' indices
        return self.labels[split][batch.pairs.clamp(min=0)], batch.pairs >= 0

    def kto_step(self, model: Forward, batch: Batch, split: str = "train"
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                            torch.Tensor]:
        """(loss to backward, per record loss, reward, labels, valid, z, completion tokens)."""
        B = batch.inputs.shape[0] // 2
        labels, valid = self.labels_of(batch, split)
        ref, ref_kl = self.reference(model, batch, split)
        sums, counts = row_logps(model, batch)
        kl = kl_estimate(sums[B:], ref_kl.to(sums.dtype), valid)
        per_record, rewards = kto_losses(sums[:B], ref.to(sums.dtype), labels, kl, self.pref.beta,
                                         self.pref.desirable_weight, self.pref.undesirable_weight)
        loss = torch.where(valid, per_record, torch.zeros_like(per_record)).sum() / valid.sum().clamp(min=1)
        return loss, per_record, rewards, labels, valid, kl, counts[:B].detach()

    def micro_loss(self, model: Forward, batch: Batch) -> torch.Tensor:
        loss, per_record, rewards, labels, valid, kl, tokens = self.kto_step(model, batch)
        self.kto_tally.add(per_record, rewards, labels, valid, kl, tokens)
        return loss

    def figures(self) -> dict[str, float]:
        out = self.kto_tally.reduce()
        return {k: out[k] for k in FIGURES if out.get(k) is not None}

    @torch.no_grad()
    def evaluate(self, model: Forward, source: pairs_data.EvalPairs, micro_batch: int,
                 device: torch.device) -> dict[str, float]:
        tally = KtoTally()
        was_training = model.training
        model.train(False)
        try:
            for batch in source.batches(micro_batch):
                _, per_record, rewards, labels, valid, kl, tokens = self.kto_step(model, batch.to(device), "eval")
                tally.add(per_record, rewards, labels, valid, kl, tokens)
        finally:
            model.train(was_training)
        return tally.reduce()
