"""Preference losses (train.objective dpo / orpo / simpo, [preference]) over a Batch of pairs (backends/data/
preference.py: B chosen rows, then B rejected rows, and each pair's index).

From per-row sums of the answers' token log-probs (modeling.CausalLMLoss, reduction="row"):
  dpo, loss "sigmoid"  -(1-e) log sig(beta d) - e log sig(-beta d), d = (pi_c - ref_c) - (pi_r - ref_r), e the
                       label smoothing (conservative DPO; e = 0 is the DPO paper's and TRL's "sigmoid")
  dpo, loss "ipo"      ((pi_c - ref_c) / n_c - (pi_r - ref_r) / n_r - 1 / (2 beta))^2, on per-token means as
                       TRL's "ipo" (n: the answer's labelled tokens)
  simpo                -(1-e) log sig(z) - e log sig(-z), z = beta (m_c - m_r) - gamma on the answers' mean token
                       log-probs m, plus cpo_alpha times the chosen answers' NLL (TRL's CPOTrainer, "simpo")
  orpo                 NLL of the chosen answers (their tokens pooled) - lambda * mean log sig(log odds), with the
                       odds from each answer's mean token log-prob (TRL's ORPOTrainer.odds_ratio_loss)
Rewards: beta * (pi - ref) per answer (ORPO: lambda * mean token log-prob, SimPO: beta * mean token log-prob,
as TRL logs); margin their
difference; accuracy the share of pairs whose chosen reward is above the rejected one. tests/test_preference.py
checks each against TRL's own code on the same model and batch.

The reference (DPO only):
  LoRA / QLoRA  the base with the adapters switched off (adapters.disabled), one forward without grad per
                micro-batch, before the policy's forward (no second copy of the weights anywhere).
  full          the starting weights' log-probs of every pair, computed once in `prepare` (a pass over the
                pairs before the first step, and before a checkpoint is loaded) and kept in memory as a
                table indexed by the pair; written beside the pair cache, keyed by the model, the data
                (its cache key: content, tokenizer and template, seq_len, split) and the compute dtype,
                so a second run (or a resume) reads it back instead of recomputing.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from shardconsole.backends.data import preference as pairs_data
from shardconsole.backends.data.batches import Batch
from shardconsole.backends.model import adapters
from shardconsole.backends.objective.base import Forward, NextToken, Objective, all_summed

FIGURES = ("reward_chosen", "reward_rejected", "reward_margin", "pref_accuracy")


# ---------------------------------------------------------------------------------------------------
# The losses, per pair

def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x < 0, without cancellation on either side of -ln 2."""
    return torch.where(x < -0.6931471805599453, torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


def dpo_losses(pol_c: torch.Tensor, pol_r: torch.Tensor, ref_c: torch.Tensor, ref_r: torch.Tensor,
               n_c: torch.Tensor, n_r: torch.Tensor, beta: float, loss: str = "sigmoid",
               label_smoothing: float = 0.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss per pair, chosen reward, rejected reward) from summed answer log-probs [B] of the policy and
    the reference, and the answers' labelled-token counts [B]."""
    chosen, rejected = pol_c - ref_c, pol_r - ref_r
    if loss == "ipo":
        delta = chosen / n_c.clamp(min=1) - rejected / n_r.clamp(min=1)
        per_pair = (delta - 1 / (2 * beta)) ** 2
    else:
        z = beta * (chosen - rejected)
        per_pair = -(1 - label_smoothing) * F.logsigmoid(z) - label_smoothing * F.logsigmoid(-z)
    return per_pair, beta * chosen.detach(), beta * rejected.detach()


def simpo_losses(sum_c: torch.Tensor, sum_r: torch.Tensor, n_c: torch.Tensor, n_r: torch.Tensor, beta: float,
                 gamma: float, label_smoothing: float = 0.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(SimPO loss per pair, chosen reward, rejected reward): TRL's CPOTrainer.cpo_loss with loss_type "simpo",
    on each answer's mean token log-prob; the rewards beta times those means, as TRL logs them."""
    mean_c, mean_r = sum_c / n_c.clamp(min=1), sum_r / n_r.clamp(min=1)
    z = beta * (mean_c - mean_r) - gamma          # TRL: beta * (logits - gamma / beta)
    per_pair = -(1 - label_smoothing) * F.logsigmoid(z) - label_smoothing * F.logsigmoid(-z)
    return per_pair, beta * mean_c.detach(), beta * mean_r.detach()


def orpo_losses(sum_c: torch.Tensor, sum_r: torch.Tensor, n_c: torch.Tensor, n_r: torch.Tensor,
                lam: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(the chosen answers' NLL, pooled over their tokens; the odds-ratio term per pair, lambda *
    log sig(log odds), subtracted from it; chosen reward; rejected reward)."""
    mean_c, mean_r = sum_c / n_c.clamp(min=1), sum_r / n_r.clamp(min=1)
    log_odds = (mean_c - mean_r) - (log1mexp(mean_c) - log1mexp(mean_r))
    nll = -sum_c.sum() / n_c.sum().clamp(min=1)
    return nll, lam * F.logsigmoid(log_odds), lam * mean_c.detach(), lam * mean_r.detach()


# ---------------------------------------------------------------------------------------------------
# Figures: summed on the device, one all-reduce and one host sync per step line

class Tally:
    """Sums over pairs: loss, chosen reward, rejected reward, pairs ordered right, pairs, answer tokens."""

    def __init__(self) -> None:
        self.sums: torch.Tensor | None = None

    def add(self, per_pair: torch.Tensor, rc: torch.Tensor, rr: torch.Tensor, valid: torch.Tensor,
            tokens: torch.Tensor | None = None) -> None:
        """`valid`: the pairs to count (eval's padding pairs are not); `tokens`: each pair's answer tokens
        under loss, chosen and rejected."""
        def kept(x: torch.Tensor) -> torch.Tensor:
            # where, not a product with the mask: an empty padding pair's ORPO loss is NaN (log1mexp(0) on
            # a mean over no token), and NaN * 0 is NaN
            return torch.where(valid, x.detach().double(), torch.zeros((), dtype=torch.float64, device=x.device))
        n_tok = torch.zeros_like(rc) if tokens is None else tokens
        row = torch.stack([kept(per_pair).sum(), kept(rc).sum(), kept(rr).sum(), kept((rc > rr).double()).sum(),
                           kept(torch.ones_like(rc)).sum(), kept(n_tok).sum()])
        self.sums = row if self.sums is None else self.sums + row

    def reduce(self) -> dict[str, float]:
        """The means over every rank's pairs since the last call; {} when none. A collective: every rank calls it."""
        if self.sums is None:
            return {}
        sums, self.sums = self.sums, None
        loss, c, r, right, n, tokens = all_summed(sums)
        if not n:
            return {}
        return {"loss": loss / n, "reward_chosen": c / n, "reward_rejected": r / n, "reward_margin": (c - r) / n,
                "pref_accuracy": right / n, "pairs": int(n), "tokens": int(tokens)}


# ---------------------------------------------------------------------------------------------------
# The objective

def row_logps(model: Forward, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    sums, counts = model(batch.inputs, batch.labels, batch.positions, reduction="row")
    return sums, counts


class Preference:
    """DPO (sigmoid, ipo), SimPO or ORPO, as an Objective (backends/objective/base.py)."""

    def __init__(self, r: Any) -> None:
        self.r, self.cfg = r, r.cfg
        self.name = r.cfg.train.objective
        self.pref = r.cfg.preference
        self.tally = Tally()
        self.table: ReferenceTable | None = None
        self.with_reference = self.name in ("dpo", "kto")      # simpo and orpo have none
        self.lora_reference = self.with_reference and r.cfg.adapters

    def prepare(self, model: Forward) -> None:
        """Full DPO: the reference log-probs of every pair with the weights as they are now (the starting
        ones: call before a checkpoint is loaded), or from the cache."""
        if self.with_reference and not self.lora_reference:
            self.table = ReferenceTable(self.r)
            self.table.prepare(model)

    def start_step(self, model: Forward, batches: list[Batch]) -> None:
        return None       # each pair's loss is its own: nothing spans the accumulation window

    def reference(self, model: Forward, batch: Batch, split: str = "train") -> tuple[torch.Tensor, torch.Tensor]:
        """The reference's summed answer log-probs (chosen [B], rejected [B])."""
        B = batch.inputs.shape[0] // 2
        if self.lora_reference:
            with torch.no_grad(), adapters.disabled(model):
                sums, _ = row_logps(model, batch)
            return sums[:B], sums[B:]
        if self.table is None:
            raise RuntimeError("full DPO: Objective.prepare(model) must run before the first step")
        return self.table.lookup(batch.pairs, split)

    def losses(self, model: Forward, batch: Batch, split: str = "train"
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(loss to backward, per pair loss, chosen reward, rejected reward, per pair answer tokens under loss)."""
        B = batch.inputs.shape[0] // 2
        ref = self.reference(model, batch, split) if self.name == "dpo" else None
        sums, counts = row_logps(model, batch)
        pc, pr, nc, nr = sums[:B], sums[B:], counts[:B], counts[B:]
        tokens = (nc + nr).detach()
        if self.name == "simpo":
            per_pair, rc, rr = simpo_losses(pc, pr, nc, nr, self.pref.beta, self.pref.simpo_gamma,
                                            self.pref.label_smoothing)
            # TRL adds cpo_alpha times the chosen answers' NLL (their tokens pooled) to the mean SimPO loss
            nll = -pc.sum() / nc.sum().clamp(min=1) if self.pref.cpo_alpha else pc.new_zeros(())
            alpha = self.pref.cpo_alpha
            return per_pair.mean() + alpha * nll, per_pair.detach() + alpha * nll.detach(), rc, rr, tokens
        if ref is None:
            nll, ratio, rc, rr = orpo_losses(pc, pr, nc, nr, self.pref.orpo_lambda)
            return nll - ratio.mean(), nll.detach() - ratio.detach(), rc, rr, tokens
        per_pair, rc, rr = dpo_losses(pc, pr, ref[0].to(pc.dtype), ref[1].to(pr.dtype), nc, nr, self.pref.beta,
                                      self.pref.loss, self.pref.label_smoothing)
        return per_pair.mean(), per_pair, rc, rr, tokens

    def micro_loss(self, model: Forward, batch: Batch) -> torch.Tensor:
        loss, per_pair, rc, rr, _ = self.losses(model, batch)
        self.tally.add(per_pair, rc, rr, torch.ones_like(rc, dtype=torch.bool))
        return loss

    def figures(self) -> dict[str, float]:
        """The Step fields of the preference figures since the last step line (a collective)."""
        out = self.tally.reduce()
        return {k: out[k] for k in FIGURES if k in out}

    @torch.no_grad()
    def evaluate(self, model: Forward, source: pairs_data.EvalPairs, micro_batch: int,
                 device: torch.device) -> dict[str, float]:
        """The same figures, the mean preference loss over every held-out pair and their answer tokens under
        loss (all ranks call it)."""
        tally = Tally()
        was_training = model.training
        model.train(False)
        try:
            for batch in source.batches(micro_batch):
                b = batch.to(device)
                _, per_pair, rc, rr, tokens = self.losses(model, b, "eval")
                assert b.pairs is not None         # pair batches carry their pairs' indices
                tally.add(per_pair, rc, rr, b.pairs >= 0, tokens)
        finally:
            model.train(was_training)
        return tally.reduce()


def make(r: Any) -> Objective:
    """The run's objective from train.objective: NextToken for "sft", Preference for "dpo" / "orpo" / "simpo",
    Grpo for "grpo" (engine/select.py picks kto.Kto for "kto")."""
    if r.cfg.train.objective == "grpo":
        from shardconsole.backends.objective.grpo import Grpo
        return Grpo(r)
    return NextToken() if r.cfg.train.objective == "sft" else Preference(r)


# ---------------------------------------------------------------------------------------------------
# Full DPO's reference: a table of the starting weights' log-probs, cached

class ReferenceTable:
    """Per split, [pairs, 2] summed answer log-probs (chosen, rejected) on the device."""

    def __init__(self, r: Any) -> None:
        self.r = r
        self.tables: dict[str, torch.Tensor] = {}

    def path(self) -> Path:
        entry = pairs_data.pair_entry(self.r)
        return entry.folder / f"reference-{model_key(self.r)}.npz"

    def lookup(self, pairs: torch.Tensor | None, split: str) -> tuple[torch.Tensor, torch.Tensor]:
        if pairs is None:
            raise RuntimeError("full DPO: a batch without pair indices (not a preference batch)")
        rows = self.tables[split][pairs.clamp(min=0)]       # -1 (eval's padding) reads pair 0, weighted 0
        return rows[:, 0], rows[:, 1]

    def prepare(self, model: Forward) -> None:
        r = self.r
        path = self.path()
        if path.is_file():
            with np.load(path) as z:
                self.tables = {k: torch.from_numpy(z[k]).to(r.device) for k in z.files if k != "meta"}
                meta = json.loads(str(z["meta"]))
            if r.rank == 0:
                r.event("info", f"{r.cfg.train.objective}: reference log-probs of {meta['pairs']} pairs read from "
                                f"the cache {path} "
                                f"(computed once, in {meta['seconds']:.1f} s)")
            return
        r.phase("reference pass")
        t0 = time.perf_counter()
        entry = pairs_data.pair_entry(r)
        splits = {"train": entry.train, **({"eval": entry.eval} if entry.eval is not None and entry.eval.n else {})}
        for name, split in splits.items():
            self.tables[name] = self._pass(model, split)
        seconds = time.perf_counter() - t0
        n = sum(s.n for s in splits.values())
        if r.rank == 0:
            _write(path, {k: v.cpu().numpy() for k, v in self.tables.items()}, {"pairs": n, "seconds": seconds})
            r.event("info", f"{r.cfg.train.objective}: reference log-probs of {n} pairs computed with the "
                            f"starting weights in "
                            f"{seconds:.1f} s, cached in {path}")
        r.phase("training")

    @torch.no_grad()
    def _pass(self, model: Forward, split: pairs_data.PairSplit) -> torch.Tensor:
        """Every pair of the split once, each rank its share (EvalPairs' rule), gathered on every rank."""
        r = self.r
        source = pairs_data.EvalPairs(split, r.cfg.data.seq_len, r.rank, r.world)
        mine = []
        was_training = model.training
        model.train(False)
        try:
            for batch in source.batches(r.cfg.train.micro_batch):
                b = batch.to(r.device)
                sums, _ = row_logps(model, b)
                assert b.pairs is not None         # pair batches carry their pairs' indices
                B = b.pairs.shape[0]
                mine.append(torch.stack([b.pairs.double(), sums[:B].double(), sums[B:].double()], dim=1))
        finally:
            model.train(was_training)
        local = torch.cat(mine) if mine else torch.zeros((0, 3), dtype=torch.float64, device=r.device)
        parts = [local]
        if dist.is_available() and dist.is_initialized() and r.world > 1:
            parts = [torch.empty_like(local) for _ in range(r.world)]
            dist.all_gather(parts, local)       # every rank ran as many batches: the same shapes
        rows = torch.cat(parts)
        rows = rows[rows[:, 0] >= 0]
        table = torch.zeros((split.n, 2), dtype=torch.float64, device=r.device)
        table[rows[:, 0].long()] = rows[:, 1:]
        return table


def model_key(r: Any) -> str:
    """What the reference log-probs depend on besides the data: the starting weights (a model folder's
    weight files by name, size and mtime, not their content: hashing 14 GB per start is minutes; a catalog
    model's random init, drawn per rank and shard, by its seed and layout) and how they are computed."""
    cfg, spec = r.cfg, r.spec
    parts: dict[str, Any] = {"dtype": cfg.precision.dtype, "attn": cfg.model.attn_implementation}
    if spec.path is not None and spec.has_weights:
        folder = Path(spec.path).expanduser()
        parts["weights"] = sorted((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in folder.iterdir()
                                  if p.is_file() and p.suffix in (".safetensors", ".bin", ".json"))
    else:
        parts.update(model=cfg.model.name, seed=cfg.train.seed, world=r.world, backend=cfg.parallel.backend,
                     sharding=cfg.fsdp.sharding, master=cfg.precision.master_dtype)
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:24]


def _write(path: Path, tables: dict[str, np.ndarray], meta: dict) -> None:
    """Atomically (a reader never sees half a file); a failure costs the next run a reference pass."""
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".npz.tmp")
        with os.fdopen(fd, "wb") as fh:
            np.savez(fh, meta=np.array(json.dumps(meta)), **tables)
        os.replace(tmp, path)
    except OSError:
        pass
