"""SimPO and KTO against TRL's own code (trl 1.16, a test-only dependency): the same tiny Llama and rows as
tests/test_preference_trl.py, fp32; the loss and the figures agree to 1e-5.

SimPO: a real CPOTrainer (loss_type "simpo") and its get_batch_loss_metrics: its forward, its length-normalised
log-probs, its cpo_loss and its cpo_alpha * NLL. KTO: a real KTOTrainer's _compute_loss, with a perturbed copy
of the model as its ref_model and as ours: TRL's rows are B completion rows and B KL rows (its collator's
KL_input_ids), ours the same rows stacked as our Batch stacks them.
"""

from __future__ import annotations

import copy

import pytest
import torch
from test_preference_trl import TOL, models, pairs_batch  # noqa: F401  (models: the module's fixture)

from shardconsole.backends.model import modeling
from shardconsole.backends.objective import kto, preference as pref


def trl_simpo(tok, policy, beta: float, gamma: float, alpha: float, smoothing: float, batch):
    from datasets import Dataset
    from trl.experimental.cpo import CPOConfig, CPOTrainer
    args = CPOConfig(output_dir="/tmp/shardconsole-trl-cpo", loss_type="simpo", beta=beta, simpo_gamma=gamma,
                     cpo_alpha=alpha, label_smoothing=smoothing, report_to=[], use_cpu=True, bf16=False, fp16=False)
    data = Dataset.from_list([{"prompt": "a b", "chosen": " c", "rejected": " d"}] * 2)
    trainer = CPOTrainer(model=copy.deepcopy(policy), args=args, train_dataset=data, processing_class=tok)
    ids, completion, attention, _ = batch
    B = ids.shape[0] // 2
    labels = torch.where(completion == 1, ids, -100)       # TRL's: the answer's tokens, unshifted
    trl_batch = {"chosen_input_ids": ids[:B], "chosen_attention_mask": attention[:B], "chosen_labels": labels[:B],
                 "rejected_input_ids": ids[B:], "rejected_attention_mask": attention[B:],
                 "rejected_labels": labels[B:]}
    loss, metrics = trainer.get_batch_loss_metrics(trainer.model, trl_batch)
    return float(loss.detach()), metrics


@pytest.mark.parametrize("beta,gamma,alpha,smoothing", [
    (0.1, 0.5, 1.0, 0.0),      # TRL's defaults (CPOConfig): beta 0.1, simpo_gamma 0.5, cpo_alpha 1.0
    (2.0, 1.0, 0.0, 0.0),      # the SimPO paper's: no NLL term, a larger beta
    (2.5, 0.3, 0.5, 0.1),      # with label smoothing
])
def test_simpo_equals_trl(models, beta, gamma, alpha, smoothing):
    tok, policy, _ = models
    batch = pairs_batch(len(tok), 3)
    theirs, metrics = trl_simpo(tok, policy, beta, gamma, alpha, smoothing, batch)
    ids, _, _, labels = batch
    B = ids.shape[0] // 2
    s, n = modeling.CausalLMLoss(policy)(ids, labels, reduction="row")
    per_pair, rc, rr = pref.simpo_losses(s[:B], s[B:], n[:B], n[B:], beta, gamma, smoothing)
    nll = -s[:B].sum() / n[:B].sum()
    assert float((per_pair.mean() + alpha * nll).detach()) == pytest.approx(theirs, abs=TOL)
    tally = pref.Tally()
    tally.add(per_pair, rc, rr, torch.ones(B, dtype=torch.bool))
    figures = tally.reduce()
    assert figures["reward_chosen"] == pytest.approx(metrics["rewards/chosen"], abs=TOL)
    assert figures["reward_rejected"] == pytest.approx(metrics["rewards/rejected"], abs=TOL)
    assert figures["reward_margin"] == pytest.approx(metrics["rewards/margins"], abs=TOL)
    assert figures["pref_accuracy"] == pytest.approx(metrics["rewards/accuracies"], abs=TOL)


def trl_kto(tok, policy, ref, beta: float, wd: float, wu: float, batch, labels: list[bool]):
    from datasets import Dataset
    from trl import KTOConfig, KTOTrainer
    args = KTOConfig(output_dir="/tmp/shardconsole-trl-kto", beta=beta, desirable_weight=wd, undesirable_weight=wu,
                     report_to=[], use_cpu=True, bf16=False, fp16=False, per_device_train_batch_size=2)
    data = Dataset.from_list([{"prompt": "a b", "completion": " c", "label": True},
                              {"prompt": "a b", "completion": " d", "label": False}])
    trainer = KTOTrainer(model=copy.deepcopy(policy), ref_model=copy.deepcopy(ref), args=args, train_dataset=data,
                         processing_class=tok)
    ids, completion, attention, _ = batch
    B = ids.shape[0] // 2
    inputs = {"input_ids": ids[:B], "attention_mask": attention[:B], "completion_mask": completion[:B],
              "KL_input_ids": ids[B:], "KL_attention_mask": attention[B:], "KL_completion_mask": completion[B:],
              "label": torch.tensor(labels)}
    loss = trainer._compute_loss(trainer.model, inputs, False)
    m = trainer._metrics["train"]
    return float(loss.detach()), {k: m[k][-1] for k in ("rewards/chosen", "rewards/rejected", "rewards/margins", "kl")}


@pytest.mark.parametrize("beta,wd,wu,labels", [
    (0.1, 1.0, 1.0, [True, False, True, False]),       # TRL's defaults (KTOConfig)
    (2.0, 1.0, 1.33, [True, True, True, False]),
    (0.5, 0.7, 1.0, [False, True, False, False]),
])
def test_kto_equals_trl(models, beta, wd, wu, labels):
    tok, policy, ref = models
    batch = pairs_batch(len(tok), len(labels), seed=len(labels) + int(10 * beta))
    theirs, metrics = trl_kto(tok, policy, ref, beta, wd, wu, batch, labels)
    ids, _, _, y = batch
    B = ids.shape[0] // 2
    with torch.no_grad():
        rs, _ = modeling.CausalLMLoss(ref)(ids, y, reduction="row")
    s, n = modeling.CausalLMLoss(policy)(ids, y, reduction="row")
    valid, lab = torch.ones(B, dtype=torch.bool), torch.tensor(labels)
    z = kto.kl_estimate(s[B:], rs[B:], valid)
    per_record, rewards = kto.kto_losses(s[:B], rs[:B], lab, z, beta, wd, wu)
    assert abs(theirs) > 1e-3
    assert float(per_record.mean().detach()) == pytest.approx(theirs, abs=TOL)
    tally = kto.KtoTally()
    tally.add(per_record, rewards, lab, valid, z, n[:B])
    f = tally.reduce()
    assert f["kl"] == pytest.approx(metrics["kl"], abs=TOL)
    # beta * a difference of two fp32 sums of ~10 log-probs: TRL's fused head and ours round apart by ~5e-6,
    # which beta = 2 doubles; the tolerance scales with beta above 1
    for ours, theirs_key in (("reward_chosen", "chosen"), ("reward_rejected", "rejected"), ("reward_margin", "margins")):
        assert f[ours] == pytest.approx(metrics[f"rewards/{theirs_key}"], abs=TOL * max(1.0, beta))


def test_kto_kl_is_clamped_and_without_gradient(models):
    """A negative mean log-ratio of the KL rows is clamped to 0 (TRL's .clamp(min=0)), and the loss's gradient
    does not flow through z (TRL's .detach())."""
    pol = torch.tensor([-3.0, -1.0], requires_grad=True)
    z = kto.kl_estimate(pol, torch.tensor([-1.0, 0.0]), torch.ones(2, dtype=torch.bool))
    assert float(z) == 0.0 and not z.requires_grad
    z = kto.kl_estimate(pol, torch.tensor([-4.0, -3.0]), torch.tensor([True, False]))
    assert float(z) == pytest.approx(1.0)       # the padding record (valid False) is not in the mean
