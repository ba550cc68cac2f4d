"""Data sources: synthetic, text/jsonl (bytes or the model folder's tokenizer), token files."""

from __future__ import annotations

import json

import numpy as np
import pytest

from shardconsole import config as C
from shardconsole.backends.data import DataError, SyntheticTokens, make_source


def cfg_for(**data) -> C.RunConfig:
    cfg = C.RunConfig()
    for k, v in data.items():
        setattr(cfg.data, k, v)
    return cfg


def test_synthetic_is_learnable_and_differs_per_rank():
    a, b = SyntheticTokens(256, 32, seed=1, rank=0), SyntheticTokens(256, 32, seed=1, rank=1)
    xa, xb = a.batch(4), b.batch(4)
    assert xa.shape == (4, 33) and int(xa.max()) < 256
    assert not (xa == xb).all()
    # The next token is a fixed function of the current one, the same on every rank.
    nxt = {}
    for row in list(xa) + list(xb):
        for cur, n in zip(row[:-1].tolist(), row[1:].tolist()):
            assert nxt.setdefault(cur, n) == n


def test_text_file_as_bytes_sharded_across_ranks(tmp_path):
    f = tmp_path / "corpus.txt"
    f.write_text("hello world, " * 400)
    cfg = cfg_for(source="text", path=str(f), seq_len=16)
    r0 = make_source(cfg, 256, None, rank=0, world=2).batch(3)
    r1 = make_source(cfg, 256, None, rank=1, world=2).batch(3)
    assert r0.shape == (3, 17)
    text = bytes(r0[0].tolist()).decode()
    assert text in "hello world, " * 400
    assert not any((r0[i] == r1[j]).all() and False for i in range(3) for j in range(3))


def test_jsonl_reads_the_text_key(tmp_path):
    f = tmp_path / "d.jsonl"
    f.write_text("\n".join(json.dumps({"text": f"doc {i} " * 20}) for i in range(50)))
    src = make_source(cfg_for(source="text", path=str(f), seq_len=8), 256, None, 0, 1)
    assert src.batch(2).shape == (2, 9)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"body": "x"}\n')
    with pytest.raises(DataError, match=r"bad.jsonl:1: no string field 'text'"):
        make_source(cfg_for(source="text", path=str(bad), seq_len=8), 256, None, 0, 1)


def test_token_file_memmap(tmp_path):
    f = tmp_path / "tok.bin"
    np.arange(1000, dtype=np.uint16).tofile(f)
    src = make_source(cfg_for(source="tokens", path=str(f), seq_len=10), 1000, None, 0, 2)
    row = src.batch(1)[0]
    assert (row[1:] - row[:-1] == 1).all()
    with pytest.raises(DataError, match="vocab_size is 500"):
        make_source(cfg_for(source="tokens", path=str(f), seq_len=10), 500, None, 0, 2)
    odd = tmp_path / "odd.bin"
    odd.write_bytes(b"\x00" * 7)
    with pytest.raises(DataError, match="multiple of 2 bytes"):
        make_source(cfg_for(source="tokens", path=str(odd), seq_len=2), 1000, None, 0, 1)


def test_binary_file_is_not_text(tmp_path):
    f = tmp_path / "weights.bin"
    f.write_bytes(bytes(range(256)) * 10)
    with pytest.raises(DataError, match="not a text file"):
        make_source(cfg_for(source="text", path=str(f), seq_len=8), 256, None, 0, 1)
    g = tmp_path / "latin.txt"
    g.write_bytes("café".encode("latin-1") * 100)
    with pytest.raises(DataError, match="not UTF-8"):
        make_source(cfg_for(source="text", path=str(g), seq_len=8), 256, None, 0, 1)


def test_too_little_data_for_the_ranks(tmp_path):
    f = tmp_path / "short.txt"
    f.write_text("tiny")
    with pytest.raises(DataError, match="fewer than the 2 ranks"):
        make_source(cfg_for(source="text", path=str(f), seq_len=8), 256, None, 0, 2)
