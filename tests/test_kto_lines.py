"""KTO's words in the data and eval lines (issue 66): its records are unpaired prompt/completion/label
records, so the headless data line, the console's log and the exported model card count records, and
the data line splits them into desirable and undesirable; DPO's lines still count pairs.

The DataSummary comes from the token cache's own writer and summary (backends/data/preference.py), not
built by hand, so the desirable count is the one the labels give."""

from __future__ import annotations

import dataclasses

import numpy as np

from shardconsole.backends.data import preference as pairs_data
from shardconsole.backends.data.pair_tokens import PairTokens
from shardconsole.console.runview import log_line
from shardconsole.headless import data_line, eval_line
from shardconsole.runlog import protocol as P
from shardconsole.settings import config as C


def _entry(tmp_path, labels: list[bool | None]) -> pairs_data.PairEntry:
    kto = labels[0] is not None
    writer = (pairs_data._KtoWriter if kto else pairs_data._Writer)(tmp_path, "train", np.dtype(np.uint16), 16)
    for j, label in enumerate(labels):
        writer.add(PairTokens([1, 2], [10 + j, 11], [20 + j], label))
    info = writer.close()
    labels_file = tmp_path / "train.labels"
    split = pairs_data.PairSplit(np.fromfile(tmp_path / "train.ids", dtype=np.uint16),
                                 np.fromfile(tmp_path / "train.index", dtype=np.int64).reshape(-1, 4),
                                 np.fromfile(labels_file, dtype=np.uint8).astype(bool) if kto else None)
    meta = {"format": "kto" if kto else "preference", "splits": {"train": info}, "template": "chatml",
            "tokenizer": "tok"}
    return pairs_data.PairEntry(tmp_path, meta, split, None, True)


def _summary(tmp_path, labels) -> P.DataSummary:
    cfg = C.RunConfig()
    cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, path=str(tmp_path / "d.jsonl"), seq_len=16))
    return pairs_data.summary(cfg, 1, _entry(tmp_path, labels))


def test_kto_data_line_counts_desirable_and_undesirable_records(tmp_path):
    d = _summary(tmp_path, [True, False, True, True, False])
    line = data_line(d)
    assert "(kto)" in line and "5 records (3 desirable, 2 undesirable)" in line, line
    assert "pair" not in line.split("note:")[0] and "(preference)" not in line, line
    console = log_line(d)
    assert "data: kto from" in console and "5 records (3 desirable, 2 undesirable)" in console, console
    assert "sample" not in console.split(";")[0], console


def test_dpo_data_line_still_counts_pairs(tmp_path):
    d = _summary(tmp_path, [None, None, None])
    assert "(preference)" in data_line(d) and "3 pairs" in data_line(d), data_line(d)
    assert "desirable" not in data_line(d)


def test_kto_eval_lines_count_records_dpo_pairs():
    kto = P.Eval(step=4, loss=0.6, tokens=50, pairs=12, reward_chosen=0.1, reward_rejected=-0.1,
                 reward_margin=0.2, kl=0.01)
    dpo = dataclasses.replace(kto, kl=None, pref_accuracy=0.75)
    for line in (eval_line(kto), log_line(kto)):
        assert "12 records" in line and "pair" not in line, line
    for line in (eval_line(dpo), log_line(dpo)):
        assert "12 pairs" in line and "record" not in line, line
