"""GRPO's loss against TRL's own code (trl's GRPOTrainer._compute_loss on a real GRPOTrainer, a test-only
dependency): the same tiny Llama, the same prompts (padded on the left, of other lengths), the same sampled
completions (of other lengths, ended by EOS) and rewards, fp32, a sampling temperature that is not 1; the loss
and its gradient agree to 1e-5 for each loss type, with and without the KL term (a perturbed copy of the model
as the reference). The advantages are checked against TRL's formula on TRL's nanstd."""

from __future__ import annotations

import copy

import pytest
import torch
from hf_fixtures import policy_and_reference, train_tokenizer

from shardconsole.backends.model import modeling
from shardconsole.backends.objective import grpo, grpo_loss, sampler

TOL = 1e-5
G, PROMPTS, P, T, TEMPERATURE = 4, 2, 6, 7, 0.7


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    tok = train_tokenizer()
    policy, ref = policy_and_reference(tok)
    # TRL builds its own reference from the model's folder when beta > 0 (its ref_per_token_logps are given here)
    folder = tmp_path_factory.mktemp("grpo-policy")
    policy.save_pretrained(folder)
    policy.name_or_path = policy.config._name_or_path = str(folder)
    return tok, policy, ref


@pytest.fixture(scope="module")
def batch(models):
    """PROMPTS prompts each G times, left padded; completions ending in EOS at other lengths, pad after."""
    tok = models[0]
    g = torch.Generator().manual_seed(3)
    vocab, pad, eos = len(tok), tok.pad_token_id, tok.eos_token_id
    N = PROMPTS * G
    ids = torch.full((N, P), pad)
    pmask = torch.zeros(N, P, dtype=torch.long)
    for k in range(PROMPTS):
        n = P - 2 * k
        prompt = torch.randint(5, vocab, (n,), generator=g)
        ids[k * G:(k + 1) * G, P - n:] = prompt
        pmask[k * G:(k + 1) * G, P - n:] = 1
    cids = torch.randint(5, vocab, (N, T), generator=g)
    cmask = torch.ones(N, T, dtype=torch.long)
    for row in range(N):
        end = 2 + row % (T - 2)
        if end < T:
            cids[row, end] = eos
            cids[row, end + 1:] = pad
            cmask[row, end + 1:] = 0
    rewards = torch.rand(N, generator=g) * 2 - 0.5
    return ids, pmask, sampler.Completions(cids, cmask), rewards


def trl_advantages(rewards: torch.Tensor, scale: bool) -> torch.Tensor:
    """trl 1.16 grpo_trainer._generate_and_score_completions, scale_rewards "group" or "none"."""
    from trl.trainer.utils import nanstd
    mean = torch.nanmean(rewards.view(-1, G), dim=1).repeat_interleave(G, dim=0)
    std = nanstd(rewards.view(-1, G), dim=1).repeat_interleave(G, dim=0)
    adv = rewards - mean
    return adv / (std + 1e-4) if scale else adv


def trl_loss(tok, policy, ref, loss_type: str, beta: float, batch, adv):
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer
    args = GRPOConfig(output_dir="/tmp/shardconsole-trl-grpo", loss_type=loss_type, beta=beta, epsilon=0.2,
                      num_generations=G, per_device_train_batch_size=G, max_completion_length=T,
                      temperature=TEMPERATURE, report_to=[], use_cpu=True, bf16=False, fp16=False)
    data = Dataset.from_list([{"prompt": "a b"}] * 4)
    trainer = GRPOTrainer(model=policy.config._name_or_path, reward_funcs=lambda completions, **kw: [0.0] * len(completions),
                          args=args, train_dataset=data, processing_class=tok)
    trainer.current_gradient_accumulation_steps = 1
    ids, pmask, done, _ = batch
    inputs = {"prompt_ids": ids, "prompt_mask": pmask, "completion_ids": done.ids, "completion_mask": done.mask,
              "advantages": adv, "num_items_in_batch": done.mask.sum()}
    if beta:
        with torch.no_grad():
            trainer.ref_model.load_state_dict(ref.state_dict())       # TRL's reference, with our perturbed weights
            inputs["ref_per_token_logps"], _, _ = trainer._get_per_token_logps_and_entropies(
                trainer.ref_model, torch.cat([ids, done.ids], 1), torch.cat([pmask, done.mask], 1), T)
    trainer.model.train()
    loss = trainer._compute_loss(trainer.model, inputs)
    loss.backward()
    return loss.detach(), trainer.model.lm_head.weight.grad.clone(), inputs.get("ref_per_token_logps")


def ours(policy, ref, loss_type: str, beta: float, batch, adv):
    ids, pmask, done, _ = batch
    model = modeling.CausalLMLoss(copy.deepcopy(policy))
    ref_logps = None
    if beta:
        with torch.no_grad():
            ref_logps = grpo.completion_logps(modeling.CausalLMLoss(ref), ids, pmask, done, TEMPERATURE)
    logps = grpo.completion_logps(model, ids, pmask, done, TEMPERATURE)
    tl = grpo_loss.token_loss(logps, adv, ref_logps, beta, 0.2)
    loss = grpo_loss.reduce(tl.per_token, done.mask, loss_type, T, done.mask.sum())
    loss.backward()
    return loss.detach(), model.lm.lm_head.weight.grad.clone(), ref_logps


@pytest.mark.parametrize("scale", [True, False])
def test_advantages_are_trls(batch, scale):
    rewards = batch[3]
    adv, _ = grpo_loss.advantages(rewards, G, scale=scale)
    assert torch.allclose(adv, trl_advantages(rewards, scale), atol=1e-6)


@pytest.mark.parametrize("beta", [0.0, 0.04])
@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "dapo"])
def test_loss_and_gradient_are_trls(models, batch, loss_type, beta):
    tok, policy, ref = models
    adv, _ = grpo_loss.advantages(batch[3], G, scale=loss_type != "dr_grpo")
    want, want_grad, want_ref = trl_loss(tok, policy, ref, loss_type, beta, batch, adv)
    got, got_grad, got_ref = ours(policy, ref, loss_type, beta, batch, adv)
    # the check compares something: the gradient always; the value too, except grpo without KL, whose on-policy
    # value is -mean(advantage) = 0 (each completion's tokens averaged, the group's advantages centred)
    assert want_grad.abs().max() > 1e-4 and (want.abs() > 1e-3 or (loss_type == "grpo" and not beta))
    assert abs(float(got) - float(want)) < TOL, (loss_type, beta, float(got), float(want))
    assert torch.allclose(got_grad, want_grad, atol=TOL), (got_grad - want_grad).abs().max()
    if beta:
        mask = batch[2].mask.bool()
        assert torch.allclose(got_ref[mask], want_ref[mask], atol=TOL)


def test_dapo_over_an_accumulation_window_is_trls(models, batch):
    """grad_accum 2 (one prompt group a micro-batch, their completions of other token counts): TRL divides each
    micro-batch's token sum by the window's completion tokens (num_items_in_batch over its generation batch) and
    not by the accumulation steps; ours divides by grpo_loss.dapo_norm and the engine by grad_accum. The summed
    loss and gradient agree; a divisor per micro-batch (ours before) does not."""
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer
    tok, policy, ref = models
    ids, pmask, done, rewards = batch
    adv, _ = grpo_loss.advantages(rewards, G, scale=True)
    halves = [slice(0, G), slice(G, 2 * G)]
    assert len({int(done.mask[h].sum()) for h in halves}) == 2       # the micro-batches' token counts differ
    window = done.mask.sum()
    args = GRPOConfig(output_dir="/tmp/shardconsole-trl-grpo", loss_type="dapo", beta=0.0, epsilon=0.2,
                      num_generations=G, per_device_train_batch_size=G, gradient_accumulation_steps=2,
                      steps_per_generation=2, max_completion_length=T, temperature=TEMPERATURE, report_to=[],
                      use_cpu=True, bf16=False, fp16=False)
    trainer = GRPOTrainer(model=policy.config._name_or_path, reward_funcs=lambda completions, **kw: [0.0] * len(completions),
                          args=args, train_dataset=Dataset.from_list([{"prompt": "a b"}] * 4), processing_class=tok)
    trainer.current_gradient_accumulation_steps = 2
    trainer.model.train()
    want = 0.0
    for h in halves:
        inputs = {"prompt_ids": ids[h], "prompt_mask": pmask[h], "completion_ids": done.ids[h],
                  "completion_mask": done.mask[h], "advantages": adv[h], "num_items_in_batch": window}
        loss = trainer._compute_loss(trainer.model, inputs)
        loss.backward()
        want += float(loss)
    want_grad = trainer.model.lm_head.weight.grad.clone()

    def ours(norm_of):
        model = modeling.CausalLMLoss(copy.deepcopy(policy))
        total = 0.0
        for h in halves:
            part = sampler.Completions(done.ids[h], done.mask[h])
            tl = grpo_loss.token_loss(grpo.completion_logps(model, ids[h], pmask[h], part, TEMPERATURE), adv[h],
                                      None, 0.0, 0.2)
            loss = grpo_loss.reduce(tl.per_token, part.mask, "dapo", T, norm_of(part))
            (loss / 2).backward()              # the engines' division by grad_accum
            total += float(loss) / 2
        return total, model.lm.lm_head.weight.grad.clone()

    got, got_grad = ours(lambda part: grpo_loss.dapo_norm(window.float(), 1, 2))
    assert want_grad.abs().max() > 1e-4 and abs(want) > 1e-3
    assert abs(got - want) < TOL, (got, want)
    assert torch.allclose(got_grad, want_grad, atol=TOL), (got_grad - want_grad).abs().max()
    per_micro, per_micro_grad = ours(lambda part: part.mask.sum().float())
    assert not torch.allclose(per_micro_grad, want_grad, atol=TOL)
