"""Paths the user gives that are not what they seem (issue 31 items 5 and 8): a FIFO, a device, a folder
where a file goes, a path of thousands of characters. Each is one line and exit 2 before anything
opens it: never a hang in open(), never a traceback."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest

from conftest import shardconsole
from shardconsole.cli.main import main

LONG = "a" * 5000         # one component past NAME_MAX: ENAMETOOLONG from the first stat()


def model_folder(folder: Path, *, tokenizer: bool = True, vocab_size: int = 384) -> Path:
    """A Hugging Face model folder as the launch checks see it (config.json of a tiny Llama, a
    model.safetensors, the tokenizer files of a BPE tokenizer trained here), written without torch:
    the checks before launch never load the weights."""
    import json
    import numpy as np
    from safetensors.numpy import save_file
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(dict(
        model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, intermediate_size=176, vocab_size=vocab_size,
        max_position_embeddings=1024)))
    save_file({"lm_head.weight": np.zeros((vocab_size, 64), np.float32)}, str(folder / "model.safetensors"))
    if tokenizer:
        from hf_fixtures import train_tokenizer
        train_tokenizer(vocab_size).save_pretrained(folder)
    return folder


def _one_line_exit_2(capsys, argv: list[str]) -> str:
    rc = main(argv)
    err = capsys.readouterr().err.strip()
    assert rc == 2, err
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    return err


def test_special_files_are_refused_before_any_open(tmp_path):
    """A FIFO has no writer: open() would block for ever. Refused from stat() alone, naming what it is;
    the same for a FIFO as eval_path, as a model's config.json or tokenizer.json, and as a preset."""
    fifo = tmp_path / "corpus.jsonl"
    os.mkfifo(fifo)
    (tmp_path / "good.jsonl").write_text('{"text": "hello"}\n')
    model = tmp_path / "model"
    model.mkdir()
    os.mkfifo(model / "config.json")
    tok_model = model_folder(tmp_path / "tok-model", tokenizer=False)
    os.mkfifo(tok_model / "tokenizer.json")
    preset = tmp_path / "p.toml"
    os.mkfifo(preset)
    base = ["--preset", "tiny-cpu", "--headless", "--run-dir", str(tmp_path / "r")]
    cases = [
        (base + ["--set", f"data.path={fifo}"], "is a FIFO, not a regular file"),
        (base + ["--set", "data.path=/dev/zero"], "is a character device"),
        (base + ["--set", f"data.path={tmp_path / 'good.jsonl'}", "--set", "data.eval_path=/dev/null"],
         "data.eval_path"),
        (base + ["--set", "data.source=tokens", "--set", f"data.path={fifo}"], "is a FIFO"),
        (base + ["--set", f"model.name={model}"], "config.json: is a FIFO"),
        (base + ["--set", f"data.path={tmp_path / 'good.jsonl'}", "--set", f"model.name={tok_model}"],
         "tokenizer.json: is a FIFO"),
        (["--preset", str(preset), "--headless"], "is a FIFO"),
    ]
    for argv, words in cases:
        out = shardconsole(*argv, timeout=60)      # a hang is a TimeoutExpired: the test fails, not stalls
        assert out.returncode == 2, (argv, out.stderr)
        line = out.stderr.strip()
        assert "Traceback" not in line and len(line.splitlines()) == 1 and words in line, (argv, line)
    assert not (tmp_path / "r" / "metrics.jsonl").exists()


@pytest.mark.parametrize("argv", [
    ["--preset", "tiny-cpu", "--headless", "--set", f"model.name={LONG}"],
    ["--preset", "tiny-cpu", "--headless", "--set", f"data.path={LONG}.jsonl"],
    ["--preset", "tiny-cpu", "--headless", "--set", f"data.path=x.jsonl", "--set", f"data.eval_path={LONG}"],
    ["--preset", LONG, "--headless"],
    ["--preset", f"{LONG}.toml", "--headless"],
    ["attach", LONG], ["stop", LONG], ["resume", LONG], ["export-model", LONG, "-o", "out"],
    ["runs", LONG], ["compare", LONG, LONG], ["plan", "--preset", "tiny-cpu", "--set", f"model.name={LONG}"],
])
def test_a_path_too_long_is_one_line_exit_2(argv, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "x.jsonl").write_text('{"text": "hi"}\n')
    line = _one_line_exit_2(capsys, argv)
    assert "File name too long" in line and "(5" in line and len(line) < 400, line   # the path shortened


def test_the_console_data_check_runs_off_the_ui_thread_with_a_timeout(tmp_path, monkeypatch):
    """A check that blocks (a stalled network mount: here a read that waits on an event) never holds the
    asking thread past wait_s, says "checking" and then, past timeout_s, that it is stuck; its answer,
    when it comes, is told to on_done and shown by the next ask."""
    from shardconsole.console.data_field import DataCheck
    from shardconsole.session import preflight
    from shardconsole.settings import resolve as settings
    release = threading.Event()
    real = preflight.check_data

    def stalled(resolved):
        release.wait(30)
        real(resolved)
    monkeypatch.setattr(preflight, "check_data", stalled)
    told = threading.Event()
    check = DataCheck(on_done=told.set, wait_s=0.05, timeout_s=0.3)
    resolved = settings.resolve("tiny-cpu", [f"data.path={tmp_path / 'none.txt'}"])
    asker = threading.current_thread()
    first = check.problem(resolved)
    assert first == ("data.path", "checking the data file...")
    assert told.wait(10)                          # the timeout is told without a keystroke
    told.clear()
    assert "did not finish in 0.3 s" in check.problem(resolved)[1]
    release.set()
    assert told.wait(10)
    assert check.problem(resolved) == ("data.path", f"{tmp_path / 'none.txt'}: no such file or folder")
    assert threading.current_thread() is asker


def test_the_console_refuses_a_fifo_typed_at_the_data_field_and_stays_responsive(tmp_path):
    """Today's console froze on the field's check (open() of the FIFO on the UI thread); now the field
    names the FIFO and ctrl+q still ends the app."""
    import asyncio
    from test_console import make_app, show_table, wait_for
    from textual.widgets import Input, Select
    from shardconsole.console.widgets.setting_field import SettingField
    fifo = tmp_path / "pipe.jsonl"
    os.mkfifo(fifo)

    async def go() -> None:
        app = make_app(tmp_path)
        async with app.run_test(size=(120, 40)) as pilot:
            setup = app.setup_screen
            await wait_for(pilot, lambda: setup.machine.detected)
            await show_table(pilot, setup, "data")
            setup.query_one("#field-data-source", SettingField).query_one(Select).value = "auto"
            field = setup.query_one("#field-data-path", SettingField)
            field.query_one(Input).value = str(fifo)
            await wait_for(pilot, lambda: "is a FIFO" in field.error, what="the FIFO named at the field")
            await pilot.press("ctrl+q")

    # On a console that opens the FIFO on its UI thread nothing else could ever run: a watchdog plays the
    # missing writer after a deadline, so such a console fails this test instead of hanging the suite.
    unblocked = []

    def writer() -> None:
        if not done.wait(60):
            unblocked.append(True)
            with open(fifo, "w"):
                pass
    done = threading.Event()
    threading.Thread(target=writer, daemon=True).start()
    try:
        asyncio.run(go())
    finally:
        done.set()
    assert not unblocked, "the console blocked on the FIFO until a writer came"
