"""Preference records (train.objective dpo / orpo): a prompt with a chosen and a rejected answer, in TRL's two
conventions, checked field by field. The check before launch (data_scan) and the ranks (backends/data/
preference.py) read records through `pair_of`, so both find the same bad record and say it the same way.
Standard library only.

  strings         {"prompt": str, "chosen": str, "rejected": str}: the text as it is (no chat template, as
                  TRL's standard form and our prompt/completion SFT records); loss on each answer.
  conversational  "chosen" / "rejected" as message lists ({role, content}), with
                  - an explicit prompt: "prompt" a message list (or a string, read as one user turn), each
                    answer the assistant turn(s) after it; or
                  - an implicit prompt (no "prompt", or answers of several turns, as UltraFeedback's
                    binarized sets): every turn but the last is the prompt and must be the same in both.
                  The model's chat template renders them; loss on the answer's turn(s) only.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shardconsole.settings.data import data_scan
from shardconsole.settings.data.data_scan import ScanError

PAIR_FIELDS = ("chosen", "rejected")


def is_pairs(columns: Any) -> bool:
    """The columns (or a record's keys) of preference records."""
    return set(PAIR_FIELDS) <= set(columns)


def no_pairs(columns: Any, where: str) -> str:
    return (f"{where}: train.objective needs preference records: 'prompt', 'chosen' and 'rejected' (strings or "
            f"message lists); the columns are {sorted(columns)}")


@dataclass(frozen=True)
class Pair:
    """A record read: strings (prompt, chosen, rejected: str) or message lists (conversational)."""
    prompt: Any
    chosen: Any
    rejected: Any
    conversational: bool


def pair_of(rec: dict[str, Any], where: str) -> Pair:
    """The pair a record holds; ScanError names the record (file:line) and the field."""
    for name in PAIR_FIELDS:
        if rec.get(name) is None:
            raise ScanError(f"{where}: field {name!r}: missing")
    chosen, rejected = rec["chosen"], rec["rejected"]
    for name in PAIR_FIELDS:
        _of_type(name, rec[name], where)
    if isinstance(chosen, str) and isinstance(rejected, str) and not _looks_like_json_list(chosen):
        prompt = data_scan.string(rec, "prompt", where)
        for name, text in (("chosen", chosen), ("rejected", rejected)):
            if not text.strip():
                raise ScanError(f"{where}: field {name!r}: empty answer, so no token would be under loss")
        return Pair(prompt, chosen, rejected, conversational=False)
    c = _turns(("chosen", chosen), where)
    r = _turns(("rejected", rejected), where)
    if len(c) > 1 or len(r) > 1 or rec.get("prompt") is None:
        return _implicit(c, r, where)
    prompt = rec["prompt"]
    if isinstance(prompt, str) and not _looks_like_json_list(prompt):
        p = [{"role": "user", "content": prompt}]
    else:
        p = _turns(("prompt", prompt), where, answer=False)
    for name, turns in (("chosen", c), ("rejected", r)):
        _answer(name, turns, 0, where)
    return Pair(p, c, r, conversational=True)


def check(rec: dict[str, Any], where: str) -> None:
    """data_scan's record rule for preference records."""
    pair_of(rec, where)


class PairCount:
    """data_scan's record rule for preference records that also counts the pairs whose two answers are the
    same. DPO learns from the gap between chosen and rejected: such a pair gives it nothing (its loss is
    log 2 = 0.6931 whatever the weights, its gradient 0), and a file of only those trained nothing and
    exited 0. ORPO still trains on the chosen answer (its NLL term), its odds term is 0 there."""

    def __init__(self) -> None:
        self.pairs = 0
        self.same = 0
        self.first_same = ""

    def __call__(self, rec: dict[str, Any], where: str) -> None:
        pair = pair_of(rec, where)
        self.pairs += 1
        if pair.chosen == pair.rejected:
            self.same += 1
            self.first_same = self.first_same or where

    def verdict(self, where: str, objective: str) -> str:
        """ScanError when every pair read has chosen equal to rejected under DPO; a warning line (the share,
        the first such record) when some have; "" when none."""
        if not self.same:
            return ""
        if self.same == self.pairs and objective == "dpo":
            raise ScanError(f"{where}: 'chosen' equals 'rejected' in all {self.pairs} pairs read: DPO learns from "
                            f"the difference between them, so it would train nothing (loss 0.6931, gradient 0); "
                            f"give pairs whose answers differ")
        return (f"{where}: 'chosen' equals 'rejected' in {self.same} of {self.pairs} pairs read "
                f"({100 * self.same / self.pairs:.0f}%, the first at {self.first_same}): "
                + ("DPO learns nothing from those" if objective == "dpo" else
                   f"{objective.upper()}'s preference term learns nothing from those, only its NLL term on the "
                   f"chosen answer" if objective == "simpo" else
                   "ORPO's odds term learns nothing from those, only its NLL term on the chosen answer"))


SCAN_ROWS = 200_000      # a columnar file's rows checked before launch (the ranks check the rest as they read)


def scan_columnar(path: Path, kind: str, count: Any = None, fits: Any = is_pairs, refuse: Any = no_pairs) -> int:
    """The preference records of a .parquet file or a save_to_disk folder (its train split), up to SCAN_ROWS,
    read with pyarrow (no datasets, no torch: this runs in the front end); the count checked. ScanError
    names the record as the ranks do (`file: record N`). `fits` / `refuse`: the columns' rule (KTO's records
    pass kto_records')."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    if kind == "saved":
        split = path / "train" if (path / "dataset_dict.json").is_file() and (path / "train").is_dir() else path
        files = sorted(split.glob("data-*.arrow"))
        tables = (pa.ipc.open_stream(pa.memory_map(str(f))).read_all() for f in files)
        batches = (b for t in tables for b in t.to_batches())
        where_file = split
    else:
        pf = pq.ParquetFile(path)
        if not fits(pf.schema_arrow.names):
            raise ScanError(refuse(pf.schema_arrow.names, str(path)))
        batches = pf.iter_batches(batch_size=4096)
        where_file = path
    n = 0
    for batch in batches:
        if n == 0 and not fits(batch.schema.names):
            raise ScanError(refuse(batch.schema.names, str(where_file)))
        for rec in batch.to_pylist():
            n += 1
            (count or pair_of)(rec, f"{where_file}: record {n}")
            if n >= SCAN_ROWS:
                return n
    return n


def _looks_like_json_list(text: str) -> bool:
    """A CSV cell or a string column holding a message list as JSON (data_scan.turns reads those)."""
    return text.lstrip().startswith("[{")


def _turns(raw: tuple[str, Any], where: str, answer: bool = True) -> list[dict[str, str]]:
    name, value = raw
    _of_type(name, value, where)
    if isinstance(value, list) and not value:
        raise ScanError(f"{where}: field {name!r}: an empty list of turns")
    try:
        return data_scan.turns(raw, where)
    except ScanError as e:
        # data_scan.turns wants an assistant turn in a chat; a prompt has none, and its error says so
        if not answer and "no assistant turn" in str(e):
            return _plain_turns(value)
        raise


def _of_type(name: str, value: Any, where: str) -> None:
    # "chosen": 12345 was answered "expected a non-empty list of turns", which hid that a string works too
    if not isinstance(value, (str, list)):
        raise ScanError(f"{where}: field {name!r}: got {type(value).__name__} {str(value)[:40]}; expected a string "
                        f"or a list of turns ({{role, content}})")


def _plain_turns(value: list) -> list[dict[str, str]]:
    return [{"role": m["role"], "content": m["content"]} for m in value]


def _answer(name: str, turns: list[dict[str, str]], start: int, where: str) -> None:
    """The answer's turns (from `start`) end with a non-empty assistant turn."""
    last = turns[-1]
    if last["role"] != "assistant":
        raise ScanError(f"{where}: field {name!r}[{len(turns) - 1}].role: the answer's last turn is "
                        f"{last['role']!r}, not 'assistant'")
    if not last["content"].strip():
        raise ScanError(f"{where}: field {name!r}[{len(turns) - 1}].content: empty answer, so no token would be "
                        f"under loss")
    if start >= len(turns):      # pragma: no cover (guarded by the callers)
        raise ScanError(f"{where}: field {name!r}: no answer after the prompt")


def _implicit(c: list[dict[str, str]], r: list[dict[str, str]], where: str) -> Pair:
    """Every turn but the last is the prompt, the same in both answers."""
    if len(c) != len(r):
        raise ScanError(f"{where}: field 'rejected': {len(r)} turns, 'chosen' has {len(c)}: the prompt (every turn "
                        f"but the last) must be the same in both")
    for j, (a, b) in enumerate(zip(c[:-1], r[:-1])):
        if a != b:
            raise ScanError(f"{where}: field 'rejected'[{j}]: differs from 'chosen'[{j}]: the prompt (every turn but "
                            f"the last) must be the same in both")
    _answer("chosen", c, len(c) - 1, where)
    _answer("rejected", r, len(r) - 1, where)
    return Pair(c[:-1], c[-1:], r[-1:], conversational=True)
