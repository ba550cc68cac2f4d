"""The data line names the file this run reads (issue 65 item 9): the token cache is keyed by content,
so a run on a byte-identical copy reuses the entry another path built, and its data line named that
other path (another user's file, a folder since deleted)."""

from __future__ import annotations

import json
import shutil
from types import SimpleNamespace

from shardconsole.backends.data import batches, token_cache
from shardconsole.settings import config as C


def test_a_run_that_reuses_the_cache_names_its_own_file(tmp_path, monkeypatch):
    monkeypatch.setenv("SHARDCONSOLE_CACHE_DIR", str(tmp_path / "cache"))
    theirs = tmp_path / "theirs" / "d.jsonl"
    theirs.parent.mkdir()
    theirs.write_text("".join(json.dumps({"text": f"record {i}: the quick brown fox."}) + "\n" for i in range(20)))
    mine = tmp_path / "mine" / "copy.jsonl"
    mine.parent.mkdir()
    shutil.copyfile(theirs, mine)
    built = token_cache.open_entry(C.DataSettings(path=str(theirs), seq_len=32), 1, None, False, 512, lambda s: None)
    cfg = C.RunConfig()
    cfg.data.path, cfg.data.seq_len = str(mine), 32
    reused = token_cache.open_entry(cfg.data, 1, None, False, 512, lambda s: None)
    assert built.built_here and not reused.built_here and reused.folder == built.folder
    line = batches.summary(cfg, 2, SimpleNamespace(n=10), reused)
    assert line.source == str(mine)
