"""Our preference losses against TRL's own code (the field's reference implementation, a test-only
dependency): the same tiny Llama, the same pairs, fp32; the loss and the rewards agree to 1e-5.

DPO: TRL's DPOTrainer._compute_loss on a real DPOTrainer (its fused log-prob head, its loss, its metrics),
with a perturbed copy of the model as TRL's ref_model and as ours. Conservative DPO (label smoothing on the
sigmoid loss) is no longer TRL's "sigmoid" (trl 1.16 ignores label_smoothing there): its formula is TRL's
"aot" loss on a batch of one pair, where aot's sort is the identity. ORPO: TRL's ORPOTrainer.odds_ratio_loss
and get_batch_logps on the model's logits; the NLL term over the chosen answer's tokens (the ORPO paper's
L_SFT; TRL's trainer adds the prompt's tokens to it).
"""

from __future__ import annotations

import copy
import types

import pytest
import torch
from hf_fixtures import policy_and_reference, train_tokenizer

from shardconsole.backends.model import modeling
from shardconsole.backends.objective import preference as pref

TOL = 1e-5


@pytest.fixture(scope="module")
def models():
    tok = train_tokenizer()
    policy, ref = policy_and_reference(tok)
    return tok, policy, ref


def pairs_batch(vocab: int, B: int, S: int = 16, seed: int = 1):
    """[2B, S] ids (chosen rows, then rejected rows), TRL's completion_mask and attention_mask, and our
    labels (labels[t] = ids[t + 1] where token t + 1 is an answer's)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, vocab, (2 * B, S), generator=g)
    completion = torch.zeros(2 * B, S, dtype=torch.long)
    attention = torch.ones(2 * B, S, dtype=torch.long)
    for row in range(2 * B):
        start, end = 3 + row % 3, S - 1 - (row * 5) % 6       # answers and padding of other lengths
        completion[row, start:end] = 1
        attention[row, end:] = 0
    labels = torch.where(completion[:, 1:] == 1, ids[:, 1:], -100)
    labels = torch.cat([labels, torch.full((2 * B, 1), -100)], dim=1)
    return ids, completion, attention, labels


def trl_dpo(tok, policy, ref, loss_type: str, beta: float, label_smoothing: float, batch):
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer
    args = DPOConfig(output_dir="/tmp/shardconsole-trl-dpo", beta=beta, loss_type=[loss_type],
                     label_smoothing=label_smoothing, report_to=[], use_cpu=True, bf16=False, fp16=False)
    data = Dataset.from_list([{"prompt": "a b", "chosen": " c", "rejected": " d"}] * 2)
    trainer = DPOTrainer(model=copy.deepcopy(policy), ref_model=copy.deepcopy(ref), args=args,
                         train_dataset=data, processing_class=tok)
    ids, completion, attention, _ = batch
    loss = trainer._compute_loss(trainer.model, {"input_ids": ids, "attention_mask": attention,
                                                 "completion_mask": completion}, False)
    m = trainer._metrics["train"]
    return float(loss.detach()), {k: m[f"rewards/{k}"][-1] for k in ("chosen", "rejected", "margins", "accuracies")}


def ours_dpo(policy, ref, loss: str, beta: float, label_smoothing: float, batch):
    ids, _, _, labels = batch
    B = ids.shape[0] // 2
    with torch.no_grad():
        rs, _ = modeling.CausalLMLoss(ref)(ids, labels, reduction="row")
    s, n = modeling.CausalLMLoss(policy)(ids, labels, reduction="row")
    per_pair, rc, rr = pref.dpo_losses(s[:B], s[B:], rs[:B], rs[B:], n[:B], n[B:], beta, loss, label_smoothing)
    tally = pref.Tally()
    tally.add(per_pair, rc, rr, torch.ones(B, dtype=torch.bool))
    return float(per_pair.mean()), tally.reduce()


@pytest.mark.parametrize("loss,trl_loss,beta,smoothing,B", [
    ("sigmoid", "sigmoid", 0.1, 0.0, 3),
    ("sigmoid", "sigmoid", 2.0, 0.0, 3),
    ("ipo", "ipo", 0.1, 0.0, 3),
    ("sigmoid", "aot", 0.5, 0.2, 1),       # conservative DPO = TRL's aot on one pair (its sort is the identity)
])
def test_dpo_equals_trl(models, loss, trl_loss, beta, smoothing, B):
    tok, policy, ref = models
    batch = pairs_batch(len(tok), B)
    theirs, metrics = trl_dpo(tok, policy, ref, trl_loss, beta, smoothing, batch)
    ours, figures = ours_dpo(policy, ref, loss, beta, smoothing, batch)
    assert abs(theirs) > 1e-3                      # a loss that says something: the reference differs
    assert ours == pytest.approx(theirs, abs=TOL)
    assert figures["reward_chosen"] == pytest.approx(metrics["chosen"], abs=TOL)
    assert figures["reward_rejected"] == pytest.approx(metrics["rejected"], abs=TOL)
    assert figures["reward_margin"] == pytest.approx(metrics["margins"], abs=TOL)
    assert figures["pref_accuracy"] == pytest.approx(metrics["accuracies"], abs=TOL)


def test_orpo_equals_trl(models):
    from trl.experimental.orpo.orpo_trainer import ORPOTrainer
    tok, policy, _ = models
    lam = 0.25
    ids, completion, _, labels = pairs_batch(len(tok), 3)
    B = ids.shape[0] // 2
    # TRL's pieces: get_batch_logps(average_log_prob=True) on the logits, labels masked to the answers
    # (TRL's concatenated_labels), then odds_ratio_loss; NLL over the chosen answers' tokens.
    logits = policy(ids).logits.float()
    trl_labels = torch.where(completion == 1, ids, -100)
    mean_logps = ORPOTrainer.get_batch_logps(logits, trl_labels, average_log_prob=True)
    fake = types.SimpleNamespace(beta=lam, accelerator=types.SimpleNamespace(device=torch.device("cpu")))
    ratio, rc, rr, _, _ = ORPOTrainer.odds_ratio_loss(fake, mean_logps[:B], mean_logps[B:])
    nll = torch.nn.functional.cross_entropy(logits[:B, :-1].reshape(-1, logits.shape[-1]),
                                            trl_labels[:B, 1:].reshape(-1), ignore_index=-100)
    theirs = float(nll - ratio.mean())

    s, n = modeling.CausalLMLoss(policy)(ids, labels, reduction="row")
    our_nll, our_ratio, our_rc, our_rr = pref.orpo_losses(s[:B], s[B:], n[:B], n[B:], lam)
    assert float(our_nll - our_ratio.mean()) == pytest.approx(theirs, abs=TOL)
    assert torch.allclose(our_rc, rc, atol=TOL) and torch.allclose(our_rr, rr, atol=TOL)


def test_row_reduction_is_chunk_free(models):
    """The chunked path (long batches: one chunk's logits at a time) sums the same per row, gradients too."""
    tok, policy, _ = models
    ids, _, _, labels = pairs_batch(len(tok), 2, S=24)
    lm = modeling.CausalLMLoss(policy)
    hidden = policy.model(input_ids=ids).last_hidden_state
    whole, n1 = modeling.chunked_row_logps(hidden, policy.lm_head.weight, labels)
    parts, n2 = modeling.chunked_row_logps(hidden, policy.lm_head.weight, labels, chunk_tokens=7)
    assert torch.equal(n1, n2) and torch.allclose(whole, parts, atol=1e-5)
    # and the mean it implies is the model's own next-token loss
    mean = -whole.sum() / n1.sum()
    assert float(mean) == pytest.approx(float(lm(ids, labels)), abs=1e-5)
