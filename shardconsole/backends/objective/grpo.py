"""GRPO (train.objective grpo, [grpo]) as an Objective: each micro-batch is a few prompts (data/prompts.py);
start_step samples grpo.generations completions of each prompt of the step's micro-batches on the training
ranks (sampler.py) and scores them with the user's reward functions (rewards.py), as TRL generates its whole
generation batch first; micro_loss returns TRL's GRPO loss of one micro-batch's (grpo_loss.py). The weights do
not change within the window, so sampling it first gives the completions sampling each micro-batch in turn
would; DAPO needs it: its divisor is the window's completion tokens. To both engines this is one more loss.

The reference (beta > 0): the base with the adapters switched off (LoRA / QLoRA), or, fully fine-tuned, a
frozen copy of the starting weights sharded as the policy is (engine/frozen_copy.py, built by prepare); one
forward without grad per micro-batch. beta = 0 (TRL's default) needs no reference."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist

from shardconsole.backends.data import prompts as prompt_data
from shardconsole.backends.data.batches import IGNORE, Batch
from shardconsole.backends.model import adapters
from shardconsole.backends.objective import grpo_loss, rewards, sampler
from shardconsole.backends.objective.base import Forward

@dataclass
class Rollout:
    """A micro-batch's prompts (each grpo.generations times), their completions, rewards and advantages."""
    ids: torch.Tensor
    pmask: torch.Tensor
    done: sampler.Completions
    reward: torch.Tensor
    per_func: torch.Tensor
    adv: torch.Tensor


FIGURES = ("reward_mean", "reward_std", "rewards", "completion_len", "kl", "clip_ratio", "generate_s")


def end_ids(ps: prompt_data.PromptSet, model_path: str | None) -> list[int]:
    """The tokens that end a completion: the tokenizer's EOS and generation_config.json's eos_token_id(s)
    (a chat model's end of turn)."""
    ids = {ps.encoder.eos}
    if model_path:
        import json
        from pathlib import Path
        gen = Path(model_path).expanduser() / "generation_config.json"
        if gen.is_file():
            eos = json.loads(gen.read_text()).get("eos_token_id")
            ids.update(eos if isinstance(eos, list) else [eos] if isinstance(eos, int) else [])
    return sorted(ids)


class Tally:
    """Sums since the last step line: reward, reward^2, each function's reward, completions, completion
    tokens, KL over tokens, clipped tokens; and the seconds sampling."""

    def __init__(self, functions: int) -> None:
        self.functions = functions
        self.sums: torch.Tensor | None = None
        self.generate_s = 0.0

    def add(self, rewards: torch.Tensor, per_func: torch.Tensor, mask: torch.Tensor, kl: torch.Tensor | None,
            clipped: torch.Tensor) -> None:
        m = mask.double()
        tokens = m.sum()
        kl_sum = (kl.detach().double() * m).sum() if kl is not None else torch.zeros((), dtype=torch.float64,
                                                                                       device=m.device)
        r = rewards.to(m.device, torch.float64)
        row = torch.cat([torch.stack([r.sum(), (r * r).sum(), torch.tensor(float(r.numel()), dtype=torch.float64,
                                                                             device=m.device),
                                      tokens, kl_sum, (clipped.double() * m).sum()]),
                         per_func.to(m.device, torch.float64).sum(dim=0)])
        self.sums = row if self.sums is None else self.sums + row

    def reduce(self, names: list[str], has_kl: bool) -> dict[str, Any]:
        """The figures over every rank's completions since the last call (a collective)."""
        if self.sums is None:
            return {}
        sums, self.sums = self.sums, None
        gen = torch.tensor([self.generate_s], dtype=torch.float64, device=sums.device)
        self.generate_s = 0.0
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(sums)
            dist.all_reduce(gen, op=dist.ReduceOp.MAX)
        vals = sums.tolist()
        s, s2, n, tokens, kl, clipped = vals[:6]
        if not n:
            return {}
        mean = s / n
        return {"reward_mean": mean, "reward_std": max(0.0, s2 / n - mean * mean) ** 0.5,
                "rewards": {name: v / n for name, v in zip(names, vals[6:])},
                "completion_len": tokens / n, "kl": kl / max(1.0, tokens) if has_kl else None,
                "clip_ratio": clipped / max(1.0, tokens), "generate_s": float(gen.item())}


class Grpo:
    """GRPO with the [grpo] settings, as an Objective (backends/objective/base.py)."""

    name = "grpo"

    def __init__(self, r: Any) -> None:
        self.r, self.g = r, r.cfg.grpo
        self.funcs = rewards.load(self.g.reward_specs())
        self.weights = torch.tensor(self.g.weights(), dtype=torch.float64)
        self.tally = Tally(len(self.funcs))
        self.lora_reference = bool(self.g.beta) and r.cfg.adapters
        # full fine-tuning with beta > 0: the engine's room sets what builds the frozen copy (select.objective)
        self.reference_builder: Callable[[], Forward] | None = None
        self.reference: Forward | None = None
        # prompt and completion tokens trained on, this rank, not yet counted by real_tokens (on the device)
        self.pending: torch.Tensor | None = None
        self.counted = 0
        self.window: list[tuple[Batch, Rollout]] = []     # the step's micro-batches, sampled (start_step)
        self.dapo_norm: torch.Tensor | None = None

    def prepare(self, model: Forward) -> None:
        """Before the load of a resume: the frozen copy is the starting weights', as at a first session."""
        if self.reference_builder is not None and self.reference is None:
            self.reference = self.reference_builder()

    def start_step(self, model: Forward, batches: list[Batch]) -> None:
        """Samples and scores the step's micro-batches before its first backward; DAPO's divisor is their
        completion tokens on every rank (TRL's num_items_in_batch over its generation batch)."""
        self.window = [(b, self.rollout(model, b)) for b in batches]
        self.dapo_norm = self.window_norm([ro.done for _, ro in self.window]) if self.g.loss == "dapo" else None

    def micro_loss(self, model: Forward, batch: Batch) -> torch.Tensor:
        sampled, ro = self.window.pop(0)
        assert sampled is batch, "micro_loss takes the micro-batches start_step sampled, in order"
        loss, tl = self.loss_of(model, ro.ids, ro.pmask, ro.done, ro.adv, self.dapo_norm)
        self.tally.add(ro.reward, ro.per_func, ro.done.mask, tl.kl, tl.clipped)
        real = ro.pmask.sum() + ro.done.mask.sum()
        self.pending = real if self.pending is None else self.pending + real
        return loss

    def rollout(self, model: Forward, batch: Batch) -> Rollout:
        g = self.g
        ps = prompt_data.load(self.r)
        assert batch.mask is not None and batch.pairs is not None      # prompt batches carry both
        t0 = time.perf_counter()
        ids = batch.inputs.repeat_interleave(g.generations, dim=0)
        pmask = batch.mask.repeat_interleave(g.generations, dim=0)
        done = sampler.sample(model, ids, pmask, g.max_new_tokens, g.temperature, g.top_p,
                              end_ids(ps, self.r.spec.path), ps.encoder.eos)
        per_func = self.score(ps, batch.pairs.tolist(), done)
        self.tally.generate_s += time.perf_counter() - t0
        reward = (per_func * self.weights).sum(dim=1).to(ids.device, torch.float32)
        adv, _ = grpo_loss.advantages(reward, g.generations, scale=g.loss != "dr_grpo")
        return Rollout(ids, pmask, done, reward, per_func, adv)

    def window_norm(self, done: list[sampler.Completions]) -> torch.Tensor:
        tokens = sum((d.mask.sum() for d in done), torch.zeros((), dtype=torch.int64, device=done[0].mask.device))
        tokens = tokens.to(torch.float32)
        if dist.is_available() and dist.is_initialized() and self.r.world > 1:
            dist.all_reduce(tokens)
        return grpo_loss.dapo_norm(tokens, self.r.world, len(done))

    def real_tokens(self) -> int:
        """The prompt and completion tokens trained on so far by every rank, since the run's first step (a resume
        goes on from its checkpoint's count, resume_tokens): what the step line's tokens and tokens/s count, the
        rows' padding left out (a collective: observe/metrics.StepMeter and the saves call it on every rank)."""
        pending = torch.zeros((), dtype=torch.int64) if self.pending is None else self.pending.to(torch.int64)
        self.pending = None
        if dist.is_available() and dist.is_initialized():
            pending = pending.to(self.r.device)
            dist.all_reduce(pending)
        self.counted += int(pending.item())
        return self.counted

    def resume_tokens(self, tokens: int | None) -> None:
        """After a resume's load (engine/loop.py): the count its checkpoint recorded (None: a checkpoint from
        before GRPO's count was saved, counted from this session's start)."""
        self.counted = tokens or 0

    def loss_of(self, model: Forward, ids: torch.Tensor, pmask: torch.Tensor, done: sampler.Completions,
                adv: torch.Tensor, dapo_norm: torch.Tensor | None) -> tuple[torch.Tensor, grpo_loss.TokenLoss]:
        g = self.g
        ref = None
        if self.lora_reference:
            with torch.no_grad(), adapters.disabled(model):
                ref = completion_logps(model, ids, pmask, done, g.temperature)
        elif self.reference is not None:
            with torch.no_grad():
                ref = completion_logps(self.reference, ids, pmask, done, g.temperature)
        logps = completion_logps(model, ids, pmask, done, g.temperature)
        tl = grpo_loss.token_loss(logps, adv, ref, g.beta, g.epsilon)
        return grpo_loss.reduce(tl.per_token, done.mask, g.loss, g.max_new_tokens, dapo_norm), tl

    def score(self, ps: prompt_data.PromptSet, index: list[int], done: sampler.Completions) -> torch.Tensor:
        """[N, functions] rewards of the completions of the records `index` (each generations times)."""
        G = self.g.generations
        rows = [i for i in index for _ in range(G)]
        ids = [row[:int(m.sum())] for row, m in zip(done.ids.tolist(), done.mask)]
        tok = ps.encoder.tokenizer
        texts = [tok.decode(x, skip_special_tokens=True) if tok is not None else bytes(
            [b for b in x if b < 256]).decode("utf-8", errors="replace") for x in ids]
        prompts = [ps.prompts[i] for i in rows]
        completions: list[Any] = [t if isinstance(p, str) else [{"role": "assistant", "content": t}]
                                  for p, t in zip(prompts, texts)]
        columns = {k: [ps.records[i].get(k) for i in rows] for k in ps.records[index[0]] if k != "prompt"}
        return rewards.score(self.funcs, prompts, completions, ids, columns, [ps.where(i) for i in rows])

    def evaluate(self, model: Forward, source: Any, micro_batch: int, device: torch.device) -> dict[str, Any] | None:
        return None     # no held-out prompts: data.eval_path / eval_fraction are refused before launch

    def figures(self) -> dict[str, Any]:
        return self.tally.reduce([n for n, _ in self.funcs], self.lora_reference or self.reference is not None)


def completion_logps(model: Forward, ids: torch.Tensor, pmask: torch.Tensor, done: sampler.Completions,
                     temperature: float) -> torch.Tensor:
    """[N, T] log-probs of the completion tokens (0 past the end) under logits / temperature."""
    P, T = ids.shape[1], done.ids.shape[1]
    inputs = torch.cat([ids, done.ids], dim=1)
    attn = torch.cat([pmask, done.mask], dim=1)
    labels = torch.full_like(inputs, IGNORE)
    labels[:, P - 1:P + T - 1] = torch.where(done.mask.bool(), done.ids, torch.full_like(done.ids, IGNORE))
    out: torch.Tensor = model(inputs, labels, None, reduction="token", attention_mask=attn, temperature=temperature)
    return out[:, P - 1:P + T - 1]
