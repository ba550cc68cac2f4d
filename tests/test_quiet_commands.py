"""export-model and chat say their own lines only (issue 65 item 9): no DeepSpeed accelerator warning
(transformers imports DeepSpeed when it is installed), no transformers loading or writing bars."""

from __future__ import annotations

import pytest

from conftest import shardconsole
from tests.hf_fixtures import make_hf_model

NOISE = ("Setting accelerator to CPU", "Loading weights", "Writing model shards", "it/s]")


@pytest.mark.slow
def test_export_model_prints_its_line_and_nothing_else(tmp_path):
    run = tmp_path / "run"
    res = shardconsole("--preset", "tiny-cpu", "--headless", "--run-dir", str(run), "--set", "train.steps=2")
    assert res.returncode == 0, res.stderr[-2000:]
    res = shardconsole("export-model", str(run), "--out", str(tmp_path / "out"))
    assert res.returncode == 0, res.stderr[-2000:]
    said = (res.stdout + res.stderr).strip().splitlines()
    assert len(said) == 1 and said[0].startswith(f"wrote {tmp_path / 'out'}: LlamaForCausalLM"), said


def test_chat_prints_no_library_noise(tmp_path):
    model = make_hf_model(tmp_path / "model", chat_template=True)
    res = shardconsole("chat", str(model), "--prompt", "hello", "--max-new-tokens", "3", "--device", "cpu")
    assert res.returncode == 0, res.stderr[-2000:]
    said = res.stdout + res.stderr
    assert not [n for n in NOISE if n in said], said
    assert f"chat with {model} on cpu" in said
