"""Issue 65 item 3: records given as plain strings (string preference pairs, prompt/completion SFT records)
train as plain text, the prompt then the answer, with no chat template (TRL's standard form). What says how
they were formatted says that (the data line, the preview, the export's README), and `chat` on the export
gives the model its prompt the way it trained: the data line named "the tokenizer's chat template" over
raw pairs, and chat wrapped the prompt in that template, so FINETUNE.md's DPO model answered nothing.

Real 2-rank CPU runs on a model folder with a chat template, made here (tests/hf_fixtures.py)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.conftest import shardconsole
from tests.hf_fixtures import make_hf_model, tokenizer_folder

PROMPT = "what is 3 plus 3?"
QUICK = ["data.seq_len=32", "train.steps=2", "train.log_every=1", "train.checkpoint_every=2",
         "train.warmup_steps=0", "train.micro_batch=2"]


def _sets(*sets: str) -> list[str]:
    return [a for s in sets for a in ("--set", s)]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("prompts")
    model = make_hf_model(root / "model", chat_template=True)
    pairs, completions = root / "pairs.jsonl", root / "completions.jsonl"
    # as FINETUNE.md's walkthrough makes its pairs (tests/test_readme_examples.py)
    pairs.write_text("".join(json.dumps({"prompt": f"what is {i} plus {i}?", "chosen": f" {2 * i}.",
                                         "rejected": f" {2 * i + 1}."}) + "\n" for i in range(16)))
    completions.write_text("".join(json.dumps({"prompt": f"what is {i} plus {i}?", "completion": f" {2 * i}."})
                                   + "\n" for i in range(16)))
    return SimpleNamespace(root=root, model=model, pairs=pairs, completions=completions, env={
        "SHARDCONSOLE_CACHE_DIR": str(root / "cache"), "SHARDCONSOLE_RUNS_ROOT": str(root / "runs"),
        "DS_ACCELERATOR": "cpu"})


def _trained_and_exported(folder, name: str, *sets: str) -> SimpleNamespace:
    run, out = folder.root / name, folder.root / f"{name}-export"
    res = shardconsole("--preset", "tiny-cpu", "--headless", "--run-dir", str(run),
                       *_sets(f"model.name={folder.model}", *QUICK, *sets), timeout=600, env=folder.env)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    exported = shardconsole("export-model", str(run), "-o", str(out), timeout=300, env=folder.env)
    assert exported.returncode == 0, exported.stderr[-3000:]
    return SimpleNamespace(stdout=res.stdout, export=out, readme=(out / "README.md").read_text())


def _prompt_ids(folder, data: Path, *sets: str) -> list[int]:
    """The prompt's token ids as the ranks train them: the first row of `data --preview`, its tokens before
    the first one under loss."""
    res = shardconsole("data", "--preview", "1", "--json", "--preset", "tiny-cpu",
                       *_sets(f"model.name={folder.model}", f"data.path={data}", *sets), timeout=300, env=folder.env)
    assert res.returncode == 0, res.stderr[-2000:]
    row = json.loads(res.stdout)["records"][0]
    return row["ids"][:next(i for i, f in enumerate(row["flags"]) if f & 1)]


def _chat_ids(export: Path, text: str) -> list[int]:
    from shardconsole.tryout.chat import ChatModel
    return ChatModel(export, "cpu").prompt_ids([{"role": "user", "content": text}])[0].tolist()


def test_string_pairs_train_say_and_chat_as_plain_text(folder):
    dpo = _trained_and_exported(folder, "dpo", f"data.path={folder.pairs}", "train.objective=dpo")
    data_line = next(line for line in dpo.stdout.splitlines() if line.startswith("data: "))
    assert "template" not in data_line, data_line            # it named "tokenizer's chat template"
    assert "string pairs train as plain text" in dpo.stdout
    assert "prompt format: plain text" in dpo.readme, dpo.readme
    # chat gives the exported model its prompt as training did: the ids are the very same
    trained = _prompt_ids(folder, folder.pairs, "train.objective=dpo")
    assert _chat_ids(dpo.export, "what is 0 plus 0?") == trained
    # and the command line says so, then answers
    said = shardconsole("chat", str(dpo.export), "--prompt", PROMPT, "--max-new-tokens", "4", "--device", "cpu",
                        timeout=300, env=folder.env)
    assert said.returncode == 0, said.stderr[-2000:]
    assert "prompt format plain text" in said.stderr, said.stderr


def test_prompt_completion_records_chat_as_plain_text(folder):
    """export-model's folder and the end of run's (train.export_dir) alike."""
    at_end = folder.root / "sft-at-end"
    sft = _trained_and_exported(folder, "sft", f"data.path={folder.completions}", f"train.export_dir={at_end}")
    assert "prompt format: plain text" in sft.readme, sft.readme
    trained = _prompt_ids(folder, folder.completions)
    for export in (sft.export, at_end):
        assert _chat_ids(export, "what is 0 plus 0?") == trained, export


def test_the_preview_says_string_pairs_have_no_template(folder):
    res = shardconsole("data", "--preview", "1", "--preset", "tiny-cpu", *_sets(
        f"model.name={folder.model}", f"data.path={folder.pairs}", "train.objective=dpo"), timeout=300, env=folder.env)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "template -" in res.stdout.splitlines()[0], res.stdout[:400]
    assert "string pairs train as plain text" in res.stdout


def test_message_pairs_keep_the_template(tmp_path):
    from shardconsole.backends.data.pair_tokens import PairRenderer
    tok = tokenizer_folder(tmp_path / "tok", chat_template=True)
    renderer = PairRenderer(tok)
    renderer.texts({"prompt": "hi", "chosen": " a", "rejected": " b"}, "r1")
    assert renderer.template_name == ""
    prompt, _, _ = renderer.texts({"prompt": [{"role": "user", "content": "hi"}],
                                   "chosen": [{"role": "assistant", "content": "a"}],
                                   "rejected": [{"role": "assistant", "content": "b"}]}, "r2")
    assert renderer.template_name == "tokenizer's chat template" and "<|im_start|>" in prompt
