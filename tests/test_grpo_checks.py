"""GRPO's pieces that need no run: the reward file check before launch (grpo_rules: read, not run), the
prompt records' rule, the reward call's verdicts (rewards.score with real functions), nucleus sampling's cut
(sampler.pick), the settings' refusals through the real config path, and the data preview of prompts."""

from __future__ import annotations

import json

import pytest
import torch

from shardconsole.backends.objective import rewards, sampler
from shardconsole.backends.rank.errors import RewardError
from shardconsole.settings import config as C
from shardconsole.settings import grpo_rules
from shardconsole.settings.data import prompt_records
from shardconsole.settings.data.data_scan import ScanError
from tests.conftest import shardconsole

REWARDS = '''
import sys
def ok(prompts, completions, **kwargs):
    return [float(len(c)) for c in completions]
def raises(prompts, completions, **kwargs):
    raise KeyError("answer")
def nan(prompts, completions, **kwargs):
    return [float("nan")] * len(completions)
def short(prompts, completions, **kwargs):
    return [1.0]
def positional(prompts, completions, /, **kwargs):
    return []
async def later(prompts, completions, **kwargs):
    return []
scaled = ok
'''


@pytest.fixture()
def reward_file(tmp_path):
    f = tmp_path / "r.py"
    f.write_text(REWARDS)
    return f


@pytest.mark.parametrize("fn,said", [("ok", ""), ("scaled", ""), ("missing", "defines no function 'missing'"),
                                     ("positional", "positional-only"), ("later", "is async")])
def test_the_reward_check_reads_the_file(reward_file, fn, said):
    got = grpo_rules.problem(str(reward_file), fn)
    assert (said in got and got) if said else got == ""


def test_the_reward_check_runs_nothing(tmp_path):
    f = tmp_path / "boom.py"
    f.write_text("raise SystemExit('ran')\ndef f(prompts, completions, **kw):\n    return []\n")
    assert grpo_rules.problem(str(f), "f") == ""
    assert "expected FILE.py:FUNCTION" in grpo_rules.problem("rewards", "f")
    bad = tmp_path / "bad.py"
    bad.write_text("def f(:\n")
    assert "does not parse" in grpo_rules.problem(str(bad), "f")


def test_prompt_records():
    assert prompt_records.prompt_of({"prompt": "2+2="}, "x:1") == "2+2="
    turns = [{"role": "user", "content": "hi"}]
    assert prompt_records.prompt_of({"prompt": turns, "answer": 1}, "x:1") == turns
    assert prompt_records.prompt_of({"prompt": json.dumps(turns)}, "x:1") == turns      # a CSV cell
    for rec, said in [({"question": "q"}, "missing"), ({"prompt": ""}, "empty"), ({"prompt": 3}, "got int"),
                      ({"prompt": [{"role": "robot", "content": "x"}]}, r"'prompt'\[0\]")]:
        with pytest.raises(ScanError, match=said):
            prompt_records.prompt_of(rec, "x:1")


def test_reward_verdicts_name_the_function_and_the_record(reward_file):
    funcs = rewards.load([(str(reward_file), n) for n in ("ok", "raises", "nan", "short")])
    args = (["p", "p"], ["ab", "abc"], [[1], [1, 2]], {"answer": ["x", "x"]}, ["d.jsonl:3", "d.jsonl:3"])
    assert rewards.score(funcs[:1], *args).tolist() == [[2.0], [3.0]]
    for f, said in zip(funcs[1:], ["raised KeyError", "returned nan (not a finite number)", "returned 1 values for 2"]):
        with pytest.raises(RewardError) as e:
            rewards.score([f], *args)
        assert said in str(e.value) and f[0] in str(e.value) and "d.jsonl:3" in str(e.value)


def test_top_p_keeps_the_smallest_set_of_that_mass():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])).repeat(2000, 1)
    torch.manual_seed(0)
    picked = sampler.pick(logits, 1.0, 0.7)
    assert set(picked.tolist()) == {0, 1}          # 0.5 < 0.7 <= 0.8: the first two tokens, never the rest
    share = (picked == 0).float().mean().item()
    assert abs(share - 0.5 / 0.8) < 0.04           # renormalised over what is kept
    assert set(sampler.pick(logits, 1.0, 1.0).tolist()) == {0, 1, 2, 3}


def _cfg(tmp_path, reward_file, *sets: str) -> C.RunConfig:
    data = tmp_path / "p.jsonl"
    data.write_text(json.dumps({"prompt": "2+2=", "answer": "4"}) + "\n")
    cfg = C.RunConfig()
    cfg.train.objective, cfg.data.path, cfg.grpo.reward = "grpo", str(data), f"{reward_file}:ok"
    for s in sets:
        key, value = s.split("=")
        table, name = key.split(".")
        setattr(getattr(cfg, table), name, type(getattr(getattr(cfg, table), name))(value))
    return cfg


@pytest.mark.parametrize("sets,key,said", [
    (["grpo.reward_weights=1,2"], "reward_weights", "2 finite weight(s) for 1"),
    (["grpo.max_new_tokens=4096"], "max_new_tokens", "not below data.seq_len"),
    (["grpo.beta=0.1", "fsdp.cpu_offload=True"], "beta", "fsdp.cpu_offload on"),
    (["grpo.reward="], "reward", "is empty"),
])
def test_bad_values_are_refused(tmp_path, reward_file, sets, key, said):
    cfg = _cfg(tmp_path, reward_file, *sets)
    with pytest.raises(C.ConfigError) as e:
        C.validate(cfg)
    assert said in str(e.value) and key in str(e.value)


def test_a_kl_is_accepted_with_lora_and_fully_fine_tuned(tmp_path, reward_file):
    C.validate(_cfg(tmp_path, reward_file, "grpo.beta=0.1", "train.method=lora"))
    C.validate(_cfg(tmp_path, reward_file, "grpo.beta=0.1"))      # a frozen copy (engine/frozen_copy.py)


def test_the_preview_shows_the_prompt_and_no_window(tmp_path, reward_file):
    data = tmp_path / "p.jsonl"
    data.write_text(json.dumps({"prompt": "Say cat:", "answer": "cat"}) + "\n")
    res = shardconsole("data", "--preview", "1", "--preset", "tiny-cpu", "--set", f"data.path={data}",
                       "--set", "train.objective=grpo", "--set", f"grpo.reward={reward_file}:ok")
    assert res.returncode == 0, res.stderr
    assert "Say cat:" in res.stdout and "completed 4 times" in res.stdout and "first window" not in res.stdout
