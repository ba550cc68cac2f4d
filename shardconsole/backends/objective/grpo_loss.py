"""GRPO's loss, as TRL's GRPOTrainer computes it (trl 1.16, trainer/grpo_trainer.py: _compute_loss and the
advantages of _generate_and_score_completions), on one micro-batch of prompt groups:

  advantage   A = r - mean(r of the prompt's group), divided by (std + 1e-4) (the unbiased std of the group:
              TRL's scale_rewards "group"); dr_grpo without the std (its paper: the std biases toward easy prompts)
  ratio       c = exp(logp - logp_old) with logp_old = logp.detach() (one update per generation: the ratio is 1,
              its gradient is the policy gradient's), clipped to [1 - eps, 1 + eps]
  per token   -min(c A, clip(c) A) + beta * c * (exp(ref - logp) - (ref - logp) - 1)   (the k3 KL estimator,
              times the ratio: TRL's default use_bias_correction_kl)
  loss        grpo: each completion's token mean, then the mean over completions;
              dr_grpo: the token sum / (completions x max_new_tokens);
              dapo: the token sum / the window's completion tokens on every rank, divided by the ranks (TRL's
              num_items_in_batch over its generation batch / num_processes): the window is the step's
              grad_accum micro-batches, sampled first (grpo.start_step), as TRL's steps_per_generation's.
tests/test_grpo_trl.py checks each against TRL's own _compute_loss on the same model and batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def advantages(rewards: torch.Tensor, generations: int, scale: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantage per completion [N], the std of its group [N]) from rewards [N], groups of `generations`
    consecutive completions."""
    groups = rewards.view(-1, generations)
    mean = groups.mean(dim=1).repeat_interleave(generations)
    std = groups.std(dim=1).repeat_interleave(generations)        # Bessel's correction, as TRL's nanstd
    adv = rewards - mean
    return (adv / (std + 1e-4) if scale else adv), std


@dataclass
class TokenLoss:
    per_token: torch.Tensor               # [N, T] the loss of each completion token (before the mask)
    kl: torch.Tensor | None               # [N, T] the k3 estimate, None without a reference
    clipped: torch.Tensor                 # [N, T] bool: the ratio was clipped where it mattered


def token_loss(logps: torch.Tensor, adv: torch.Tensor, ref_logps: torch.Tensor | None, beta: float,
               epsilon: float) -> TokenLoss:
    """logps [N, T] of the completion tokens under the policy (with grad), adv [N]."""
    a = adv.unsqueeze(1)
    coef_1 = torch.exp(logps - logps.detach())
    coef_2 = torch.clamp(coef_1, 1 - epsilon, 1 + epsilon)
    per_token = -torch.min(coef_1 * a, coef_2 * a)
    kl = None
    if beta != 0.0 and ref_logps is not None:
        kl = torch.exp(ref_logps - logps) - (ref_logps - logps) - 1
        # times the ratio (1 in value, not in gradient): the unbiased reverse-KL gradient, TRL's default
        # use_bias_correction_kl (trl 1.16, after DeepSeek-V3.2)
        per_token = per_token + beta * kl * coef_1
    # TRL's clip figure: the low side clipped with a negative advantage, the high side with a positive one
    clipped = ((coef_1 < 1 - epsilon) & (a < 0)) | ((coef_1 > 1 + epsilon) & (a > 0))
    return TokenLoss(per_token, kl, clipped)


def dapo_norm(window_tokens: torch.Tensor, world: int, grad_accum: int) -> torch.Tensor:
    """DAPO's divisor of a micro-batch's token sum: the window's completion tokens of every rank / the ranks,
    over grad_accum, since the engines divide each micro-batch's loss by grad_accum and TRL does not for DAPO
    (its loss is already a share of the window's)."""
    return window_tokens.clamp(min=1.0) / (world * grad_accum)      # TRL clamps its count at 1 too


def reduce(per_token: torch.Tensor, mask: torch.Tensor, loss: str, max_new_tokens: int,
           tokens_per_rank: torch.Tensor | float | None = None) -> torch.Tensor:
    """The micro-batch's loss (what goes to backward before the engine's division by grad_accum).
    tokens_per_rank (dapo): the completion tokens of every rank's micro-batch / the ranks."""
    m = mask.to(per_token.dtype)
    if loss == "grpo":
        return ((per_token * m).sum(-1) / m.sum(-1).clamp(min=1.0)).mean()
    if loss == "dr_grpo":
        return (per_token * m).sum() / (per_token.size(0) * max_new_tokens)
    if loss == "dapo":
        norm = m.sum().clamp(min=1.0) if tokens_per_rank is None else torch.as_tensor(tokens_per_rank)
        return (per_token * m).sum() / norm.to(per_token.dtype)
    raise ValueError(f"unknown GRPO loss {loss!r}")
