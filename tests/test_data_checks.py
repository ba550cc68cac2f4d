"""Data problems found before launch, over the whole file, by file and line (issue 31 item 9, issue 36
items 1 and 2): what a rank used to find 50-100 s after the launch, or never."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
import pytest

from conftest import shardconsole
from shardconsole.settings import config as C
from shardconsole.settings.data.data_check import check_data
from test_data_paths import model_folder

CHAT = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SHARDCONSOLE_CACHE_DIR", str(tmp_path / "cache"))


def cfg_for(path: Path, **data) -> C.RunConfig:
    cfg = C.RunConfig()
    cfg.data.path = str(path)
    for k, v in data.items():
        setattr(cfg.data, k, v)
    return cfg


def refused(cfg: C.RunConfig) -> str:
    with pytest.raises(C.ConfigError) as e:
        check_data(cfg)
    line = str(e.value)
    assert len(line.splitlines()) == 1, line
    return line


def jsonl(path: Path, records) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_every_line_of_the_file_is_checked_before_launch(tmp_path):
    good = [{"text": f"record {i} " + "x" * 60} for i in range(2000)]      # ~150 KB, past the old 64 KiB head
    # Bytes that are not UTF-8 far past the first 64 KiB: named by line.
    bad = tmp_path / "latin1.jsonl"
    jsonl(bad, good)
    with bad.open("ab") as fh:
        fh.write('{"text": "caf\u00e9"}\n'.encode("latin-1"))
    assert f"latin1.jsonl:2001: not UTF-8 text" in refused(cfg_for(bad))
    # Text and chat records mixed: named as mixed, at the first record of the second format.
    mixed = jsonl(tmp_path / "mixed.jsonl", good[:5] + [CHAT] + good[:3])
    line = refused(cfg_for(mixed))
    assert "mixed.jsonl:6: a chat record in a file of text records" in line and "mixed record formats" in line
    # A field of the wrong type deep in the file (datasets said only that Arrow could not cast).
    typed = jsonl(tmp_path / "typed.jsonl", good + [{"text": 5}])
    assert "typed.jsonl:2001: field 'text': expected a string, got int" in refused(cfg_for(typed))
    # A record nested 200k deep: the datasets reader crashed the rank on it.
    deep = tmp_path / "deep.jsonl"
    deep.write_text(json.dumps(good[0]) + "\n" + '{"text": "a", "x": ' + "[" * 200_000 + "]" * 200_000 + "}\n")
    assert "deep.jsonl:2: a record nested too deep" in refused(cfg_for(deep))
    # Empty things: nothing to train on, said so (not StopIteration, not datasets' internals).
    (tmp_path / "empty.jsonl").write_text("")
    assert "empty.jsonl: no records: there is nothing to train on" in refused(cfg_for(tmp_path / "empty.jsonl"))
    (tmp_path / "blank.txt").write_text("\n\n  \n")
    assert "blank.txt: no text" in refused(cfg_for(tmp_path / "blank.txt"))
    (tmp_path / "head.csv").write_text("prompt,completion\n")
    assert "head.csv: a header and no rows" in refused(cfg_for(tmp_path / "head.csv"))
    (tmp_path / "ev.jsonl").write_text("\n")
    line = refused(cfg_for(jsonl(tmp_path / "ok.jsonl", good[:3]), eval_path=str(tmp_path / "ev.jsonl")))
    assert "[data] eval_path" in line and "no records" in line
    assert check_data(cfg_for(tmp_path / "ok.jsonl")).records == 3


def test_a_csv_messages_column_of_json_strings_is_read_as_json(tmp_path):
    """A CSV cell holds text: chats in a CSV are JSON strings. The ranks read them as JSON (they said
    "expected a non-empty list of turns"); a cell that is not JSON is named before launch."""
    from shardconsole.backends.data import token_cache
    tok = model_folder(tmp_path / "model")
    f = tmp_path / "chats.csv"
    with f.open("w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["messages"])
        for i in range(4):
            w.writerow([json.dumps(CHAT["messages"])])
    assert check_data(cfg_for(f)).records == 4
    e = token_cache.open_entry(C.DataSettings(path=str(f)), 1, str(tok), True, 384, lambda s: None)
    assert (e.meta["format"], e.train.records) == ("chat", 4)
    with f.open("a", newline="") as fh:
        csv.writer(fh).writerow(["[{'role': 'user'"])
    assert "chats.csv:6: field 'messages': a string that is not JSON" in refused(cfg_for(f))


def test_a_model_folder_without_a_tokenizer_is_refused_unless_bytes_are_asked_for(tmp_path):
    from shardconsole.backends.data import token_cache
    from shardconsole.backends.data.corpus import DataError
    data = jsonl(tmp_path / "d.jsonl", [{"text": "hello world"}] * 4)
    bare = model_folder(tmp_path / "bare", tokenizer=False, vocab_size=384)
    cfg = cfg_for(data)
    cfg.model.name = str(bare)
    line = refused(cfg)
    assert "[model] name" in line and "no tokenizer files" in line and "data.tokenizer" in line
    with pytest.raises(DataError, match="no tokenizer files"):      # the ranks agree (never silently bytes)
        token_cache.open_entry(cfg.data, 1, str(bare), False, 384, lambda s: None)
    cfg.data.tokenizer = "bytes"
    check_data(cfg)
    e = token_cache.open_entry(cfg.data, 1, str(bare), False, 384, lambda s: None)
    assert e.meta["tokenizer"] == "bytes"
    # Another folder's tokenizer, named: used, and its size checked against the model's vocabulary.
    cfg.data.tokenizer = str(model_folder(tmp_path / "tok"))
    check_data(cfg)
    e = token_cache.open_entry(cfg.data, 1, str(bare), False, 384, lambda s: None)
    assert e.meta["tokenizer"].startswith(cfg.data.tokenizer)
    cfg.data.tokenizer = str(tmp_path)
    assert "[data] tokenizer" in refused(cfg) and "not a folder with tokenizer files" in refused(cfg)
    # Bytes need 256 token ids: a smaller vocabulary is refused before launch, not on a rank.
    small = model_folder(tmp_path / "small", tokenizer=False, vocab_size=128)
    cfg.model.name, cfg.data.tokenizer = str(small), "bytes"
    assert "needs vocab_size >= 256 (the model has 128)" in refused(cfg)
    cfg.data.tokenizer = str(tmp_path / "tok")
    assert "the tokenizer has 384 tokens but the model's vocab_size is 128" in refused(cfg)


def test_the_headless_launch_refuses_a_mixed_file_before_any_rank(tmp_path):
    mixed = jsonl(tmp_path / "mixed.jsonl", [{"text": "a"}] * 3 + [CHAT])
    out = shardconsole("--preset", "tiny-cpu", "--headless", "--run-dir", str(tmp_path / "run"),
                       "--set", f"data.path={mixed}", timeout=60)
    assert out.returncode == 2 and "mixed.jsonl:4: a chat record in a file of text records" in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
