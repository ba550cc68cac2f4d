"""GRPO's sampler on the training ranks: a KV-cached loop of forwards through the engine's model (FSDP2's
root module, DeepSpeed's engine), so each forward gathers the shards as a training forward does.

Every rank runs the same number of forwards: under FSDP2 and ZeRO-3 a forward is a collective, so a rank
whose completions have all ended keeps stepping (its rows padded) until every rank's have, or until
max_new_tokens; one all-reduce of a flag a token decides it. Positions are 0..S-1 with the prompt's left
padding masked out, as TRL's GRPOTrainer computes the loss's log-probs (the sampled tokens are then the
ones the loss scores, on-policy to the bit)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from shardconsole.backends.objective.base import Forward


@dataclass
class Completions:
    ids: torch.Tensor        # [N, T] sampled tokens, pad after the first EOS
    mask: torch.Tensor       # [N, T] 1 up to and including the first EOS


def pick(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """One token a row from fp32 logits [N, V]: temperature, then nucleus (top-p) sampling."""
    probs = torch.softmax(logits / temperature, dim=-1)
    if top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        # keep the smallest prefix whose mass reaches top_p (the first token always)
        drop = sorted_p.cumsum(dim=-1) - sorted_p >= top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_p)
    return torch.multinomial(probs, 1).squeeze(-1)


def _any_running(done: torch.Tensor) -> bool:
    """Whether a row of any rank is still sampling: a one-int all-reduce (a host sync a token)."""
    running = (~done).any().to(torch.int32).reshape(1)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(running, op=dist.ReduceOp.MAX)
    return bool(running.item())


@torch.no_grad()
def sample(model: Forward, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, max_new_tokens: int,
           temperature: float, top_p: float, eos: list[int], pad: int) -> Completions:
    """Completions of prompts padded on the left [N, P]; the model in eval mode meanwhile (dropout off)."""
    from transformers import DynamicCache
    cache = DynamicCache()
    was_training = model.training
    model.train(False)
    try:
        mask = prompt_mask
        logits = model(prompt_ids, None, None, reduction="next", attention_mask=mask, cache=cache)
        eos_ids = torch.tensor(eos, device=prompt_ids.device)
        done = torch.zeros(prompt_ids.shape[0], dtype=torch.bool, device=prompt_ids.device)
        out, keep = [], []
        for t in range(max_new_tokens):
            tok = pick(logits, temperature, top_p)
            keep.append(~done)
            tok = torch.where(done, torch.full_like(tok, pad), tok)
            out.append(tok)
            done = done | torch.isin(tok, eos_ids)
            if t == max_new_tokens - 1 or not _any_running(done):
                break
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
            logits = model(tok[:, None], None, None, reduction="next", attention_mask=mask, cache=cache)
    finally:
        model.train(was_training)
    return Completions(torch.stack(out, dim=1), torch.stack(keep, dim=1).to(torch.int64))
