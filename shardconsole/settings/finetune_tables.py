"""The fine-tuning tables of the settings: [lora] (train.method lora / qlora) and [preference]
(train.objective dpo / orpo). Part of tables.py's RunConfig; apart only to keep that module short."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from shardconsole.settings.field_meta import setting


@dataclass
class LoraSettings:
    """train.method = "lora" or "qlora": peft's LoraConfig, in its own names where they are short."""
    rank: int = setting(16, "LoRA rank r: the inner size of each adapter's two matrices", min=1, max=4096)
    alpha: float = setting(32.0, "LoRA alpha: the adapter's output is scaled by alpha / rank", min=0.0)
    dropout: float = setting(0.0, "dropout on the adapter's input while training", min=0.0, max=0.9)
    target_modules: str = setting(
        "all-linear", "the linear layers that get adapters: all-linear (every linear layer but the output "
        "head) or comma-separated module names, e.g. q_proj,v_proj")
    modules_to_save: str = setting(
        "", "comma-separated modules trained fully beside the adapters, e.g. embed_tokens,lm_head "
        "(new tokens, a new chat template)")
    allow_changed_base: bool = setting(False, "resume even though the base model folder's weights changed since the "
                                         "checkpoint (the adapters then train on from the new weights)")

    def target_list(self) -> list[str] | str:
        """peft's target_modules: the string "all-linear" or the list of names."""
        names = [n.strip() for n in self.target_modules.split(",") if n.strip()]
        return "all-linear" if names == ["all-linear"] else names

    def saved_list(self) -> list[str]:
        return [n.strip() for n in self.modules_to_save.split(",") if n.strip()]


@dataclass
class PreferenceSettings:
    """train.objective = "dpo", "orpo", "simpo" or "kto": the preference loss, in TRL's names and defaults."""
    beta: float = setting(0.1, "DPO: how far the model may move from the reference (higher: less); for \"ipo\" the "
                     "regularisation tau", min=1e-6)
    loss: Literal["sigmoid", "ipo"] = setting(
        "sigmoid", "the DPO loss: sigmoid (the DPO paper's) or ipo (squared, on per-token mean log-ratios)")
    label_smoothing: float = setting(
        0.0, "sigmoid DPO: the share of pairs assumed mislabelled (conservative DPO); 0 is plain DPO",
        min=0.0, max=0.49)
    orpo_lambda: float = setting(0.1, "ORPO: the weight of the odds-ratio term beside the chosen answer's NLL "
                            "(TRL's beta)", min=0.0)
    # SimPO as TRL's CPOTrainer with loss_type="simpo" (trl/experimental/cpo): beta above is its beta
    simpo_gamma: float = setting(0.5, "SimPO: the target reward margin gamma (TRL's simpo_gamma; the loss is "
                            "-log sig(beta * (mean log-prob chosen - rejected) - gamma))", min=0.0)
    cpo_alpha: float = setting(1.0, "SimPO: the weight of the chosen answer's NLL beside the SimPO loss (TRL's "
                          "cpo_alpha, default 1.0 as TRL's; 0 is the SimPO paper's loss)", min=0.0)
    # KTO as TRL's KTOTrainer (trl/trainer/kto_trainer.py, loss_type "kto"): beta above is its beta
    desirable_weight: float = setting(1.0, "KTO: the weight of the losses of records labelled true (desirable)",
                                 min=0.0)
    undesirable_weight: float = setting(1.0, "KTO: the weight of the losses of records labelled false (undesirable)",
                                   min=0.0)


@dataclass
class GrpoSettings:
    """train.objective = "grpo": online RL with the user's reward functions, in TRL's GRPOTrainer's names."""
    reward: str = setting(
        "", "the reward functions, comma-separated FILE.py:FUNCTION, each TRL's f(prompts, completions, **columns) "
        "-> list[float] (the data's other columns passed as keyword lists)")
    reward_weights: str = setting(
        "", "comma-separated weights, one per reward function, for their weighted sum (empty: 1 each)")
    generations: int = setting(4, "completions sampled per prompt (a group; advantages are relative to its mean)",
                          min=2, max=256)
    max_new_tokens: int = setting(64, "the most tokens a completion gets (TRL's max_completion_length)", min=1,
                             max=32768)
    temperature: float = setting(1.0, "the sampling temperature (the loss's log-probs are divided by it too, as TRL's)",
                            min=0.01, max=10.0)
    top_p: float = setting(1.0, "nucleus sampling: sample from the smallest set of tokens of this much probability",
                      min=0.01, max=1.0)
    beta: float = setting(0.0, "the KL penalty to the reference (k3 estimator); 0 skips the reference", min=0.0)
    epsilon: float = setting(0.2, "the clip of the probability ratio: [1 - epsilon, 1 + epsilon]", min=0.0, max=1.0)
    loss: Literal["grpo", "dr_grpo", "dapo"] = setting(
        "dapo", "how token losses are averaged, in TRL's names: grpo (per completion, then over completions), "
        "dr_grpo (sum / (completions x max_new_tokens), advantages without the std), dapo (over all tokens)")

    def reward_specs(self) -> list[tuple[str, str]]:
        """[(file, function)] from `reward`; a malformed item is left to rules.py to refuse."""
        out = []
        for item in (s.strip() for s in self.reward.split(",")):
            if item:
                path, _, fn = item.rpartition(":")
                out.append((path, fn))
        return out

    def weights(self) -> list[float]:
        parts = [s.strip() for s in self.reward_weights.split(",") if s.strip()]
        return [float(p) for p in parts] if parts else [1.0] * len(self.reward_specs())
