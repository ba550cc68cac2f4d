"""DPO with real 2-rank CPU runs (issue 47): FSDP2 and DeepSpeed ZeRO-3, full fine-tuning and LoRA, on a model
folder and a preference set made here, whose chosen answers follow a rule a model can learn (a kind word
after "It is", the rejected an unkind one, the words drawn at random for each prompt, then four random words).

Each run: 8 steps, an eval of the held-out pairs every 2 and a checkpoint at 4 and 8. Checked: the held-out
preference accuracy rises and the reward margin grows between the first and the last eval; the step lines
carry the figures; full DPO's reference pass is reported (computed, then read back from its cache by the
resume); the step-8 checkpoint is removed and the run resumed from step 4, replaying steps 5-8 exactly
(loss and rewards); the result exports and loads with transformers (merged under LoRA).

Needs the engines to call the objective (backends/objective/preference.make, prepare, micro_loss, figures):
the lead's Engine contract (issue 44). Until it lands on this branch these runs train SFT's loss on the
pairs' rows and fail at the first figure they look for.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.conftest import messages, of_kind, shardconsole
from tests.hf_fixtures import make_hf_model

RUN_TIMEOUT = 600
KIND, UNKIND = [" good", " great", " fine", " nice"], [" bad", " awful", " poor", " sad"]
# Random words after the kind or unkind one: each pair's margin is noisy at first, so the held-out accuracy
# starts below 100% (87.5% at step 2 measured for FSDP2 full) and rises as the rule wins over the noise.
FILL = [" the", " fox", " dog", " jumps", " over", " quick", " brown", " lazy", " model", " checkpoint", " host",
        " ranks"]
SETS = ["train.objective=dpo", "data.seq_len=64", "data.eval_fraction=0.25", "train.eval_every=2", "train.steps=8",
        "train.log_every=1", "train.micro_batch=2", "train.checkpoint_every=4", "train.keep_checkpoints=0",
        "train.warmup_steps=0", "preference.beta=0.1"]
METHODS = {"full": ["train.lr=3e-4"], "lora": ["train.method=lora", "lora.rank=8", "train.lr=3e-3"]}
ENGINES = {"fsdp": [], "zero3": ["parallel.backend=deepspeed", "deepspeed.stage=3"]}


def preference_records(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)

    def answer(words: list[str]) -> str:
        return "It is" + rng.choice(words) + "".join(rng.choice(FILL) for _ in range(4)) + "."
    return [{"prompt": [{"role": "user", "content": f"Question {i}: how is it?"}],
             "chosen": [{"role": "assistant", "content": answer(KIND)}],
             "rejected": [{"role": "assistant", "content": answer(UNKIND)}]} for i in range(n)]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("dpo")
    model = make_hf_model(root / "model", chat_template=True)
    data = root / "pairs.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in preference_records(64)))
    return SimpleNamespace(root=root, model=model, data=data, env={
        "SHARDCONSOLE_CACHE_DIR": str(root / "cache"), "SHARDCONSOLE_RUNS_ROOT": str(root / "runs"),
        "DS_ACCELERATOR": "cpu"})


def _sets(*sets: str) -> list[str]:
    return [a for s in sets for a in ("--set", s)]


def dpo_run(folder, engine: str, method: str) -> SimpleNamespace:
    name = f"{engine}-{method}"
    run = folder.root / name
    res = shardconsole("--preset", "tiny-cpu", "--headless", "--run-dir", str(run),
                       *_sets(f"model.name={folder.model}", f"data.path={folder.data}", *SETS, *METHODS[method],
                              *ENGINES[engine]), timeout=RUN_TIMEOUT, env=folder.env)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    first_msgs = messages(run)
    shutil.rmtree(run / "checkpoints" / "step_00000008")          # resume from step 4, replaying 5..8
    again = shardconsole("resume", str(run), timeout=RUN_TIMEOUT, env=folder.env)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    out = folder.root / f"{name}-export"
    exported = shardconsole("export-model", str(run), "-o", str(out), timeout=300, env=folder.env)
    assert exported.returncode == 0, exported.stderr[-3000:]
    return SimpleNamespace(run=run, stdout=res.stdout, first=first_msgs, all=messages(run), export=out, method=method)


@pytest.fixture(scope="module", params=[(e, m) for e in ENGINES for m in METHODS], ids=lambda p: "-".join(p))
def dpo(folder, request):
    return dpo_run(folder, *request.param)


def test_dpo_learns_the_rule_resumes_exactly_and_exports(dpo):
    first_steps = {m.step: m for m in of_kind(dpo.first, "step")}
    assert sorted(first_steps) == list(range(1, 9))
    assert all(s.pref_accuracy is not None and s.reward_margin is not None for s in first_steps.values())
    # the held-out pairs: accuracy rises and the margin grows
    evals = [e for e in of_kind(dpo.first, "eval")]
    assert [e.step for e in evals] == [2, 4, 6, 8] and all(e.pairs == 16 for e in evals)
    assert evals[-1].pref_accuracy > evals[0].pref_accuracy, [(e.step, e.pref_accuracy) for e in evals]
    assert evals[-1].reward_margin > evals[0].reward_margin > 0, [(e.step, e.reward_margin) for e in evals]
    assert evals[-1].loss < evals[0].loss < 0.6932
    # the headless step and eval lines carry the figures
    assert " acc " in dpo.stdout.split("step 8/8")[1].splitlines()[0] and "pairs" in dpo.stdout
    # full DPO's reference pass: computed once, then read from its cache by the resumed session
    infos = [m.detail for m in of_kind(dpo.all, "event") if m.name == "info" and "reference log-probs" in m.detail]
    if dpo.method == "full":
        assert "computed with the starting weights" in infos[0] or "read from the cache" in infos[0]
        assert "read from the cache" in infos[-1] and len(infos) == 2, infos
    else:
        assert infos == []                 # LoRA's reference is the base with the adapters off
    # exact resume: steps 5..8 replayed from step 4's checkpoint give the same loss and rewards
    steps = of_kind(dpo.all, "step")
    replayed = {m.step: m for m in steps if m.run != steps[0].run}
    assert sorted(replayed) == [5, 6, 7, 8]
    for s, m in replayed.items():
        was = first_steps[s]
        assert (m.loss, m.reward_chosen, m.reward_margin) == pytest.approx(
            (was.loss, was.reward_chosen, was.reward_margin), abs=1e-5), s
        assert m.tokens == was.tokens < s * 4 * 2 * 64, s     # real tokens, counted from the start on resume
    readme = (dpo.export / "README.md").read_text()
    assert f"mean over 16 held-out pairs, {evals[-1].tokens:,} answer tokens under loss" in readme, readme
    # the export loads as a transformers model
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(dpo.export)
    assert sum(p.numel() for p in model.parameters()) > 0
    assert_tensorboard_has_the_figures(dpo.run)


def assert_tensorboard_has_the_figures(run: Path, kto: bool = False) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    res = shardconsole("runs", "--tensorboard", str(run))
    assert res.returncode == 0, res.stderr
    acc = EventAccumulator(str(run))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    want = ({"rewards/train_kl", "rewards/eval_kl"} if kto else {"rewards/train_accuracy_pct", "rewards/eval_accuracy_pct"})
    assert {"rewards/train_chosen", "rewards/train_margin", "rewards/eval_margin"} | want <= tags, tags


# ---------------------------------------------------------------------------------------------------
# ORPO under LoRA (issue 65): one run, 11 steps of 4 pairs = one epoch of its 44 training pairs, 14 held out
# (eval_fraction 0.25 of 58: 7 a rank, so the last eval batch of each rank is padded with an empty pair)

ORPO_SETS = ["train.objective=orpo", "train.method=lora", "lora.rank=8", "train.lr=3e-3", "data.seq_len=64",
             "data.eval_fraction=0.25", "train.seed=7", "train.eval_every=4", "train.steps=11", "train.log_every=1",
             "train.micro_batch=2", "train.warmup_steps=0"]
ORPO_RECORDS, ORPO_HELD, SEQ = 58, 14, 64


@pytest.fixture(scope="module")
def orpo(folder):
    data = folder.root / "orpo-pairs.jsonl"
    records = preference_records(ORPO_RECORDS, seed=1)
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    run = folder.root / "orpo-lora"
    res = shardconsole("--preset", "tiny-cpu", "--headless", "--run-dir", str(run),
                       *_sets(f"model.name={folder.model}", f"data.path={data}", *ORPO_SETS),
                       timeout=RUN_TIMEOUT, env=folder.env)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    out = folder.root / "orpo-lora-export"
    exported = shardconsole("export-model", str(run), "-o", str(out), timeout=300, env=folder.env)
    assert exported.returncode == 0, exported.stderr[-3000:]
    return SimpleNamespace(run=run, stdout=res.stdout, msgs=messages(run), export=out, records=records)


def token_lengths(model: Path, records: list[dict]) -> list[tuple[int, int, int]]:
    """(prompt, chosen answer, rejected answer) token counts of each record, with transformers' tokenizer and
    chat template: the prompt rendered with the generation prompt, an answer the rest of its conversation,
    then EOS."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(model)

    def n(text: str) -> int:
        return len(tok(text, add_special_tokens=False)["input_ids"])
    out = []
    for r in records:
        head = tok.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=False)
        answers = [tok.apply_chat_template(r["prompt"] + r[k], tokenize=False)[len(head):] for k in ("chosen", "rejected")]
        out.append((n(head), n(answers[0]) + 1, n(answers[1]) + 1))
    return out


def test_orpo_eval_loss_is_finite_and_tokens_are_real(orpo, folder):
    import math

    import numpy as np
    lengths = token_lengths(folder.model, orpo.records)
    assert all(p + max(c, r) <= SEQ for p, c, r in lengths)          # nothing cut: each row's tokens as counted
    held = set(np.random.default_rng(7).permutation(ORPO_RECORDS)[:ORPO_HELD].tolist())   # the split's rule, seed 7
    # the held-out loss: finite, over the held-out pairs' answer tokens (it was NaN over 0 tokens)
    evals = of_kind(orpo.msgs, "eval")
    eval_tokens = sum(c + r for i, (_, c, r) in enumerate(lengths) if i in held)
    assert [e.step for e in evals] == [4, 8, 11]
    assert all(math.isfinite(e.loss) and e.pairs == ORPO_HELD and e.tokens == eval_tokens for e in evals), evals
    assert f"over {ORPO_HELD} pairs, {eval_tokens} answer tokens" in orpo.stdout
    readme = (orpo.export / "README.md").read_text()
    assert f"mean over {ORPO_HELD} held-out pairs, {eval_tokens:,} answer tokens under loss" in readme, readme
    # tokens and tokens/s count the real tokens: one epoch of the training pairs, both rows, not the padding
    real = sum(2 * p + c + r for i, (p, c, r) in enumerate(lengths) if i not in held)
    padded = 11 * 4 * 2 * SEQ
    steps = of_kind(orpo.msgs, "step")
    assert steps[-1].tokens == real < padded and of_kind(orpo.msgs, "finished")[-1].tokens == real
    assert all(0 < s.padding < 1 for s in steps)
    assert "padding not counted" in orpo.stdout and "of the rows' tokens are padding" in orpo.stdout


def test_lora_runs_say_what_trains(orpo):
    # the headless start lines name the method and the trainable count, and `runs` the method and objective
    line = next(x for x in orpo.stdout.splitlines() if x.startswith("[info] lora:"))
    assert "trainable" in line and "objective orpo" in line, line
    table = shardconsole("runs", str(orpo.run))
    assert table.returncode == 0, table.stderr
    header, _, row = table.stdout.splitlines()[:3]
    assert header.split()[3] == "training" and row.split()[3] == "lora/orpo", table.stdout
