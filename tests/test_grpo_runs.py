"""GRPO with real 2-rank CPU runs (issue 61) on a model folder made here.

Learning: a short SFT run teaches the folder a task ("Say cat:" -> " cat", eight words), weakly; GRPO then
starts from its export with a partial-credit reward file written here (the share of the answer's letters the
completion gets right, in place) and raises the mean reward: the last steps' mean above the first steps'.
The step lines carry every GRPO figure, the headless lines print them.
With a KL term, LoRA on DeepSpeed ZeRO-3 (the reference: the base with the adapters off) and full fine-tuning
on FSDP2, ZeRO-2 and ZeRO-3 (a frozen copy of the starting weights) run to the end, the KL 0 at the first step (the
policy starts as the reference) and above 0 after.
Refusals: a missing reward file, a function the file lacks, a function without **kwargs: one line before
launch, no run folder made; a reward returning the wrong count stops the run with a verdict naming the
function and the record.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.conftest import messages, of_kind, shardconsole
from tests.hf_fixtures import make_hf_model

RUN_TIMEOUT = 600
WORDS = ["cat", "dog", "sun", "red", "big", "car", "hat", "pen"]
REWARDS = '''
def partial(prompts, completions, answer, **kwargs):
    """The share of the answer's letters the completion has in place."""
    return [sum(1.0 for x, y in zip(c.strip(), a) if x == y) / len(a) for c, a in zip(completions, answer)]


def wrong_count(prompts, completions, **kwargs):
    return [0.0]


def no_kwargs(prompts, completions):
    return [0.0] * len(completions)
'''
GRPO = ["train.objective=grpo", "data.seq_len=32", "grpo.max_new_tokens=6", "train.log_every=1",
        "train.warmup_steps=0"]


def _sets(*sets: str) -> list[str]:
    return [a for s in sets for a in ("--set", s)]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("grpo")
    model = make_hf_model(root / "model")
    (root / "sft.jsonl").write_text("".join(json.dumps({"prompt": f"Say {w}:", "completion": f" {w}"}) + "\n"
                                            for w in WORDS for _ in range(8)))
    (root / "prompts.jsonl").write_text("".join(json.dumps({"prompt": f"Say {w}:", "answer": w}) + "\n"
                                                for w in WORDS for _ in range(4)))
    (root / "rewards.py").write_text(REWARDS)
    env = {"SHARDCONSOLE_CACHE_DIR": str(root / "cache"), "SHARDCONSOLE_RUNS_ROOT": str(root / "runs"),
           "DS_ACCELERATOR": "cpu"}
    return SimpleNamespace(root=root, model=model, env=env, prompts=root / "prompts.jsonl",
                           rewards=root / "rewards.py")


@pytest.fixture(scope="module")
def sft_export(folder):
    """The folder after 60 SFT steps (the task half learnt: loss about 0.45 from 5.9), exported."""
    out = folder.root / "sft-export"
    res = shardconsole("--preset", "tiny-cpu", "--headless", "--run-dir", str(folder.root / "sft"),
                       *_sets(f"model.name={folder.model}", f"data.path={folder.root / 'sft.jsonl'}", "train.steps=60",
                              "train.log_every=20", "data.seq_len=32", "train.micro_batch=4", "train.lr=3e-3",
                              f"train.export_dir={out}"), timeout=RUN_TIMEOUT, env=folder.env)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return out


def grpo(folder, run: Path, model: Path, *sets: str):
    return shardconsole("--preset", "tiny-cpu", "--headless", "--run-dir", str(run),
                        *_sets(f"model.name={model}", f"data.path={folder.prompts}", *GRPO, *sets),
                        timeout=RUN_TIMEOUT, env=folder.env)


def test_grpo_after_sft_raises_the_mean_reward(folder, sft_export):
    run = folder.root / "grpo"
    res = grpo(folder, run, sft_export, f"grpo.reward={folder.rewards}:partial", "train.steps=30",
               "grpo.generations=8", "train.micro_batch=4", "train.lr=2e-3")
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    steps = of_kind(messages(run), "step")
    assert len(steps) == 30
    first, last = [s.reward_mean for s in steps[:6]], [s.reward_mean for s in steps[-6:]]
    # measured: 0.42 -> 0.68 (the SFT start gets about 40% of the letters; the reward is the run's only signal)
    assert sum(last) / 6 > sum(first) / 6 + 0.1, [round(s.reward_mean, 3) for s in steps]
    s = steps[-1]
    assert s.rewards == {f"{folder.rewards}:partial": pytest.approx(s.reward_mean)}
    assert 1 <= s.completion_len <= 6 and s.kl is None and 0 <= s.clip_ratio <= 1
    assert 0 < s.generate_s < s.step_s
    lines = [line for line in res.stdout.splitlines() if line.startswith("step 30/30")]
    assert lines and " reward " in lines[0] and " len " in lines[0] and " gen " in lines[0], res.stdout[-2000:]


@pytest.mark.parametrize("sets", [
    ("train.method=lora", "lora.rank=8", "parallel.backend=deepspeed", "deepspeed.stage=3"),
    ("parallel.backend=fsdp", "train.grad_accum=2"),          # the window sampled first (grpo.start_step)
    ("parallel.backend=deepspeed", "deepspeed.stage=2", "train.grad_accum=2"),
    ("parallel.backend=deepspeed", "deepspeed.stage=3"),
], ids=["lora-zero3", "full-fsdp2", "full-zero2", "full-zero3"])
def test_grpo_with_a_kl_runs_to_the_end_its_kl_zero_at_the_start(folder, sft_export, sets):
    """The reference: the base with the adapters off (LoRA), or a frozen copy of the starting weights sharded
    as the policy (full fine-tuning: engine/frozen_copy.py); the policy starts equal to it either way."""
    run = folder.root / f"kl-{'-'.join(s.split('=')[1] for s in sets)}"
    res = grpo(folder, run, sft_export, f"grpo.reward={folder.rewards}:partial", "train.steps=3",
               "train.micro_batch=2", "grpo.beta=0.04", "train.lr=3e-3", *sets)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    steps = of_kind(messages(run), "step")
    assert [s.step for s in steps] == [1, 2, 3]
    assert steps[0].kl == pytest.approx(0.0, abs=1e-6) and steps[-1].kl > 1e-5, [s.kl for s in steps]
    assert all(s.reward_mean is not None for s in steps)


@pytest.mark.parametrize("reward,said", [
    ("missing.py:partial", "no file"),
    ("{rewards}:nope", "defines no function 'nope'"),
    ("{rewards}:no_kwargs", "takes no **kwargs"),
])
def test_a_bad_reward_is_refused_before_launch_in_one_line(folder, reward, said):
    run = folder.root / f"refused-{said.split()[0]}"
    res = grpo(folder, run, folder.model, f"grpo.reward={reward.format(rewards=folder.rewards)}", "train.steps=1")
    assert res.returncode == 2, res.stdout[-2000:] + res.stderr[-2000:]
    err = res.stderr.strip().splitlines()
    assert len(err) == 1 and "grpo.reward" in err[0] and said in err[0], res.stderr
    assert not run.exists()


def test_a_reward_of_the_wrong_count_stops_the_run_naming_it_and_the_record(folder):
    run = folder.root / "wrong-count"
    res = grpo(folder, run, folder.model, f"grpo.reward={folder.rewards}:wrong_count", "train.steps=2",
               "train.micro_batch=1")
    assert res.returncode != 0
    failed = of_kind(messages(run), "failed")
    assert failed, res.stdout[-2000:]
    msg = failed[0].message
    assert "wrong_count" in msg and "returned 1 values for 4 completions" in msg and "prompts.jsonl:" in msg, msg


def test_a_grpo_run_resumed_from_another_directory_goes_on(folder, tmp_path):
    """Started from its folder with relative data and reward paths (preset.toml records them absolute), stopped
    after its step-2 checkpoint, resumed from elsewhere: steps 3 and 4 follow with their rewards, and the real
    tokens go on from the checkpoint's count instead of restarting."""
    run = folder.root / "resumed"
    res = shardconsole("--preset", "tiny-cpu", "--headless", "--run-dir", str(run),
                       *_sets(f"model.name={folder.model}", "data.path=prompts.jsonl", "grpo.reward=rewards.py:partial",
                              *GRPO, "train.steps=2", "train.micro_batch=2"),
                       timeout=RUN_TIMEOUT, env=folder.env, cwd=folder.root)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert f'reward = "{folder.rewards}:partial"' in (run / "preset.toml").read_text()
    res = shardconsole("resume", str(run), "--set", "train.steps=4", timeout=RUN_TIMEOUT, env=folder.env,
                       cwd=tmp_path)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    steps = of_kind(messages(run), "step")
    assert [s.step for s in steps] == [1, 2, 3, 4]
    assert all(s.reward_mean is not None and s.completion_len for s in steps)
    # each step trains 2 prompts x 4 completions of at most 32 tokens: the count grows by 1..256 a step
    grown = [b.tokens - a.tokens for a, b in zip(steps, steps[1:])]
    assert all(0 < g <= 256 for g in grown), [s.tokens for s in steps]
