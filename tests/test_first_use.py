"""Issue 49: what a new user trips on, outside the console (the CLI's chat, attach, tune, data, resume,
the launch's hints). Each test fails without its fix; runs are real 2-rank CPU runs."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import shardconsole
from tests.hf_fixtures import make_hf_model


def _mute(folder: Path) -> Path:
    """A model whose every logit is 0: greedy decoding takes token 0, the tokenizer's end-of-sequence,
    first, so every answer is empty (a LoRA run or a small base that learned to stop at once)."""
    import torch
    from transformers import AutoModelForCausalLM
    lm = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    assert lm.config.eos_token_id == 0
    with torch.no_grad():
        lm.lm_head.weight.zero_()
    lm.save_pretrained(folder, safe_serialization=True)
    return folder


@pytest.fixture(scope="module")
def mute_model(tmp_path_factory) -> Path:
    return _mute(make_hf_model(tmp_path_factory.mktemp("mute") / "model", chat_template=True))


def test_chat_says_so_when_the_model_answers_nothing(mute_model, tmp_path):
    out = shardconsole("chat", str(mute_model), "--prompt", "hi", "--device", "cpu")
    assert out.returncode == 0, out.stderr
    assert "nothing: the model ended its turn at once" in out.stdout, out.stdout
    # --base: both answers; the base (the same mute folder) says so too
    out = shardconsole("chat", str(mute_model), "--prompt", "hi", "--device", "cpu", "--base", str(mute_model))
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert [ln.split("> ")[0] for ln in lines] == ["model", "base"], out.stdout
    assert all("ended its turn at once" in ln for ln in lines), out.stdout


def test_interactive_chat_says_so_too(mute_model):
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-m", "shardconsole", "chat", str(mute_model), "--device", "cpu"],
                         input="hi\n", capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr
    assert "model> (nothing: the model ended its turn at once" in out.stdout, out.stdout


def _files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_attach_leaves_a_finished_run_as_it_was(fsdp_tiny_run, tmp_path):
    """Item 2 (and issue 45): attach replays a finished run and writes nothing into it: no machine sample
    after its `finished` line, no detached note, its TensorBoard file not rewritten."""
    import shutil
    assert fsdp_tiny_run.res.returncode == 0, fsdp_tiny_run.res.stderr[-2000:]
    run = tmp_path / fsdp_tiny_run.run.name
    shutil.copytree(fsdp_tiny_run.run, run)
    before = _files(run)
    out = shardconsole("attach", str(run), "--headless")
    assert out.returncode == 0, out.stderr
    assert "finished: 12 steps" in out.stderr and [ln for ln in out.stdout.splitlines() if ln.startswith("step ")]
    assert _files(run) == before
