"""How a .txt file becomes records (issue 36 item 3): data.text_split = "blank_line" | "line" | "file",
counted alike before launch and on the ranks; a file of too few records for data.eval_fraction holds
out whole packed windows instead of failing; the data summary says how the file was split."""

from __future__ import annotations

import numpy as np
import pytest

from shardconsole.backends.data import token_cache
from shardconsole.backends.data.batches import PackedWindows, summary
from shardconsole.settings import config as C
from shardconsole.settings.data.data_check import check_data

DOCS = [f"document {i}: the quick brown fox jumps over the lazy dog." for i in range(30)]


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SHARDCONSOLE_CACHE_DIR", str(tmp_path / "cache"))


def cfg_for(path, **data) -> C.RunConfig:
    return C.build({"data": {"path": str(path), "seq_len": 32, **data}}, "p.toml", gpu_count=0)


def entry(cfg: C.RunConfig):
    return token_cache.open_entry(cfg.data, cfg.train.seed, None, False, 512, lambda s: None)


def test_each_text_split_counts_the_same_before_launch_and_on_the_ranks(tmp_path):
    f = tmp_path / "docs.txt"
    f.write_text("\n".join(DOCS[:10]) + "\n\n  \n" + "\n".join(DOCS[10:]) + "\n")
    for split, n in (("line", 30), ("blank_line", 2), ("file", 1)):
        cfg = cfg_for(f, text_split=split)
        assert check_data(cfg).records == n, split
        e = entry(cfg)
        assert e.train.records == n, split
    e = entry(cfg_for(f, text_split="line"))
    ids = np.asarray(e.train.ids).tolist()
    assert bytes(ids[:ids.index(0)]).decode() == DOCS[0]          # one line, without its line break


def test_too_few_records_hold_out_packed_windows_and_the_summary_says_so(tmp_path):
    """One document per line, read the default way, is one record: 0.1 of it used to leave nothing
    ("0.1 of 1 record(s) leaves none to train on", on a rank). Now the last windows are held out."""
    f = tmp_path / "one.txt"
    f.write_text("\n".join(DOCS) + "\n")
    cfg = cfg_for(f, eval_fraction=0.1)
    assert check_data(cfg).records == 1
    e = entry(cfg)
    assert e.meta["eval_split"] == "windows" and e.train.records == 1 and e.eval is not None
    total = len("\n".join(DOCS).encode()) + 1
    windows = (total - 1) // 32
    k = max(1, round(windows * 0.1))
    assert len(e.eval.ids) == total - ((windows - k) * 32 + 1) and len(e.train.ids) == (windows - k) * 32 + 1
    whole = np.concatenate([np.asarray(e.train.ids), np.asarray(e.eval.ids)])
    assert bytes(whole[:-1].tolist()).decode() == "\n".join(DOCS)    # nothing lost, nothing repeated
    src = PackedWindows(e.train.ids, e.train.flags, 32, 1, 0, 1, "x")
    note = summary(cfg, 1, src, e).note
    assert "one.txt: split on blank lines into 1 record(s)" in note and '"line"' in note
    assert f"the last {k} packed window(s)" in note
    # Too little for even that: one line, on the rank (what the check before launch cannot count).
    tiny = tmp_path / "tiny.txt"
    tiny.write_text("short\n")
    from shardconsole.backends.data.corpus import DataError
    with pytest.raises(DataError, match=r"eval_fraction: .*tiny.txt: 1 record\(s\), 6 tokens make 0 window"):
        entry(cfg_for(tiny, eval_fraction=0.1))
