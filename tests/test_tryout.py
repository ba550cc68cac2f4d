"""Issue 37: see the data before (`shardconsole data --preview`), try the model after (`shardconsole chat`).

- The preview's tokens and loss marks are the ranks' own: equal to what the token cache (the rank's
  tokenizing path) holds for the same records, for chat, prompt/completion and text records; and the
  tokens it marks are the ones the record's format puts under loss (checked against the tokenizer alone).
- A chat with a model folder streams its answer, and greedy decoding gives what transformers' own
  `generate` gives for the same prompt; Ctrl-C ends a generation, not the chat.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import shardconsole
from tests.hf_fixtures import make_hf_model

RECORDS = {
    "chat": [{"messages": [{"role": "user", "content": f"what is {i} plus {i}?"},
                           {"role": "assistant", "content": f"{2 * i}."}]} for i in range(6)],
    "prompt_completion": [{"prompt": f"Question: name colour {i}.", "completion": " Answer: blue."}
                          for i in range(6)],
    "text": [{"text": f"The quick brown fox {i} jumps over the lazy dog."} for i in range(6)],
}


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return make_hf_model(tmp_path_factory.mktemp("tryout") / "model", chat_template=True, seed=3)


def _write(folder: Path, fmt: str) -> Path:
    path = folder / f"{fmt}.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in RECORDS[fmt]))
    return path


def _preview_json(model: Path, data: Path, n: int) -> dict:
    out = shardconsole("data", "--preview", str(n), "--json", "--set", f"model.name={model}",
                       "--set", f"data.path={data}", "--set", "data.seq_len=32")
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


@pytest.mark.parametrize("fmt", ["chat", "prompt_completion", "text"])
def test_preview_marks_the_tokens_the_ranks_train_on(model, tmp_path, fmt):
    from shardconsole.backends.data import corpus, token_cache
    from shardconsole.settings import config as C
    from shardconsole.settings.models import resolve
    data = _write(tmp_path, fmt)
    pv = _preview_json(model, data, 3)
    assert pv["format"] == fmt and [r["index"] for r in pv["records"]] == [0, 1, 2]
    # The rank's path: the token cache of the same settings, records in file order (no eval split).
    cfg = C.build({"model": {"name": str(model)}, "data": {"path": str(data), "seq_len": 32}})
    spec = resolve(str(model))
    entry = token_cache.open_entry(cfg.data, cfg.train.seed, spec.path, spec.has_tokenizer, spec.vocab, lambda _: None)
    ids, flags = entry.train.ids.tolist(), entry.train.flags.tolist()
    at = 0
    for rec in pv["records"]:
        n = rec["tokens"]
        assert rec["ids"] == ids[at:at + n]
        assert [f & corpus.LOSS for f in rec["flags"]] == [f & corpus.LOSS for f in flags[at:at + n]]
        assert rec["loss_tokens"] == sum(1 for f in flags[at:at + n] if f & corpus.LOSS)
        at += n
    # What the format puts under loss, from the tokenizer alone.
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(model)
    first = pv["records"][0]
    marked = "".join(p["text"] for p in first["pieces"] if p["loss"])
    want = {"chat": "0.<|im_end|>\n<|endoftext|>", "prompt_completion": " Answer: blue.<|endoftext|>",
            # a record's first token starts a document and is never under loss: nothing comes before it
            "text": RECORDS["text"][0]["text"].removeprefix("The") + "<|endoftext|>"}[fmt]
    assert marked == want
    assert first["tokens"] == len(first["ids"]) and tok.decode(first["ids"]).endswith("<|endoftext|>")


def test_preview_in_plain_text_marks_loss_and_shows_the_window(model, tmp_path):
    data = _write(tmp_path, "prompt_completion")
    out = shardconsole("data", "--preview", "2", "--plain", "--set", f"model.name={model}",
                       "--set", f"data.path={data}", "--set", "data.seq_len=16")
    assert out.returncode == 0, out.stderr
    assert "Question: name colour 0.⟦ Answer: blue.<|endoftext|>⟧" in out.stdout
    assert "the first window (17 tokens" in out.stdout and "record 1 [" in out.stdout


def test_preview_of_synthetic_data_is_one_line(tmp_path):
    out = shardconsole("data", "--preview", "2", "--preset", "tiny-cpu")
    assert out.returncode == 2 and "no records to preview" in out.stderr and "Traceback" not in out.stderr


def test_a_run_without_a_tokenizer_is_refused_before_its_export(fsdp_tiny_run):
    """tiny-cpu trains a catalog size on token ids: nothing to chat in. One line, before export-model
    copies a checkpoint (minutes at 7B) only for the tokenizer load to fail with transformers' words."""
    out = shardconsole("chat", str(fsdp_tiny_run.run), "--prompt", "hi")
    assert out.returncode == 2, out.stderr
    line = out.stderr.strip()
    assert "catalog size 'tiny'" in line and "there is no tokenizer to turn a message into tokens" in line, line
    assert "wrote " not in line and "Traceback" not in line and len(line.splitlines()) == 1, line


def test_chat_on_a_folder_that_is_neither_says_it_takes_a_model_folder_too(tmp_path):
    """A folder that is no run folder and no model folder: the line says chat also takes an export (issue 65),
    not only that it is no run."""
    out = shardconsole("chat", str(tmp_path), "--prompt", "hi")
    line = out.stderr.strip()
    assert out.returncode == 2 and len(line.splitlines()) == 1 and "Traceback" not in line, out.stderr
    assert "not a run folder" in line and "model folder" in line and "export-model" in line, line


def _reference(model: Path, prompt: str, n: int) -> str:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(model)
    lm = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)["input_ids"]
    with torch.inference_mode():
        out = lm.generate(ids, max_new_tokens=n, do_sample=False, pad_token_id=tok.pad_token_id)
    return tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


def test_greedy_chat_answers_as_transformers_generate(model):
    out = shardconsole("chat", str(model), "--prompt", "what is two plus two?", "--max-new-tokens", "24",
                       "--device", "cpu")
    assert out.returncode == 0, out.stderr
    assert out.stdout == _reference(model, "what is two plus two?", 24) + "\n"


def test_ctrl_c_ends_a_generation_not_the_chat(model):
    proc = subprocess.Popen([sys.executable, "-m", "shardconsole", "chat", str(model), "--max-new-tokens", "4000",
                             "--device", "cpu"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, bufsize=1, env={**os.environ})
    try:
        proc.stdin.write("tell me a long story\n")
        proc.stdin.flush()
        seen = ""
        deadline = time.monotonic() + 120
        while "model> " not in seen or len(seen.split("model> ", 1)[1]) < 2:    # the answer is streaming
            assert time.monotonic() < deadline and proc.poll() is None
            seen += proc.stdout.read(1)
        proc.send_signal(signal.SIGINT)
        proc.stdin.write("/reset\n")
        proc.stdin.close()
        rest = proc.stdout.read()
        assert proc.wait(timeout=120) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    assert "[stopped]" in rest and "(conversation reset)" in rest


async def test_ctrl_d_in_the_console_shows_the_preview(model, tmp_path):
    """The console's data preview runs the CLI's in a child process (the console imports no tokenizer)
    and shows the records with the tokens under loss styled; the UI keeps answering meanwhile."""
    from shardconsole.console.screens.dialogs import ReportScreen
    from tests.test_console import make_app, wait_for
    data = _write(tmp_path, "prompt_completion")
    app = make_app(tmp_path, overrides=[f"model.name={model}", f"data.path={data}", "data.seq_len=32"])
    async with app.run_test(size=(120, 40)) as pilot:
        setup = app.setup_screen
        await wait_for(pilot, lambda: setup.machine.detected)
        await pilot.press("ctrl+d")
        await wait_for(pilot, lambda: isinstance(app.screen, ReportScreen), timeout=240, what="the preview")
        body = app.screen.body
        assert "record 1" in body.plain and " Answer: blue.<|endoftext|>" in body.plain
        styled = {body.plain[s.start:s.end] for s in body.spans if "green" in str(s.style)}
        assert " Answer: blue.<|endoftext|>" in styled and "Question: name colour 0." not in styled
        await pilot.press("escape")
        await wait_for(pilot, lambda: not isinstance(app.screen, ReportScreen))


def test_a_prompt_longer_than_the_models_positions_is_refused_and_an_answer_cut_where_they_end(tmp_path):
    """A 256-position model: a 1 MB message is refused in one line and the chat goes on (it ran 147 s and
    printed garbage); a short message asking 4000 new tokens is answered up to the last position, said."""
    short = make_hf_model(tmp_path / "short", chat_template=True, positions=256)
    proc = subprocess.Popen([sys.executable, "-m", "shardconsole", "chat", str(short), "--max-new-tokens", "4000",
                             "--device", "cpu"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    out, err = proc.communicate("the quick brown fox " * 52_429 + "\nhello\n", timeout=180)
    assert proc.returncode == 0, err[-2000:]
    refusals = [ln for ln in err.splitlines() if "max_position_embeddings" in ln]
    assert len(refusals) == 1 and "reads at most 256" in refusals[0] and "Traceback" not in err, err[-2000:]
    lines = out.splitlines()      # the refused message answers nothing; the next one up to position 256
    assert lines[0] == "you> model> " and lines[1].endswith(" [cut: the model's 256 positions end here]"), out
    assert lines[1] != "you> model>  [cut: the model's 256 positions end here]"      # it answered something


def test_a_model_without_a_chat_template_is_said_to_continue_text_and_raw_does(tmp_path):
    """A run on plain text exports no chat template: chat says that (it said "export the run again"),
    and --raw gives the message to the model as text to continue, as transformers' generate does."""
    plain = make_hf_model(tmp_path / "plain", chat_template=False, seed=3)
    out = shardconsole("chat", str(plain), "--prompt", "hi", "--device", "cpu")
    line = out.stderr.strip().splitlines()[-1]      # after "loading FOLDER ..."
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert "has no chat template" in line and "--raw" in line and "export" not in line, line
    out = shardconsole("chat", str(plain), "--raw", "--prompt", "The quick brown", "--max-new-tokens", "12",
                       "--device", "cpu")
    assert out.returncode == 0, out.stderr
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(plain)
    lm = AutoModelForCausalLM.from_pretrained(plain, dtype=torch.float32).eval()
    ids = tok("The quick brown", return_tensors="pt")["input_ids"]
    with torch.inference_mode():
        want = lm.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=tok.pad_token_id)
    assert out.stdout == tok.decode(want[0, ids.shape[1]:], skip_special_tokens=True) + "\n"
