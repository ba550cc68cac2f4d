"""KTO's records (train.objective kto): TRL's unpaired form, a prompt, one completion and a label saying whether
the completion is desirable (true) or not (false). The check before launch (data_check) and the ranks
(backends/data/preference.py) read records through `kto_of`, so both find the same bad record and say it
the same way. Standard library only.

  strings         {"prompt": str, "completion": str, "label": bool}: the text as it is (no chat template)
  conversational  "completion" a message list ending in the assistant's turn, "prompt" a message list (or a
                  string, one user turn), or no prompt: every turn of the completion but the last is the prompt

A record is read as a pair of the same completion twice (pair_records.pair_of), so both forms have exactly
the DPO records' rules, and the error says 'completion' where that says 'chosen'.
"""

from __future__ import annotations

from typing import Any

from shardconsole.settings.data import pair_records
from shardconsole.settings.data.data_scan import ScanError

KTO_FIELDS = ("completion", "label")


def is_kto(columns: Any) -> bool:
    """The columns (or a record's keys) of KTO records (and not of pairs: those name chosen and rejected)."""
    return set(KTO_FIELDS) <= set(columns) and not pair_records.is_pairs(columns)


def no_kto(columns: Any, where: str) -> str:
    return (f"{where}: train.objective = \"kto\" needs unpaired records: 'prompt', 'completion' (strings or message "
            f"lists) and 'label' (true: desirable, false: undesirable); the columns are {sorted(columns)}")


def label_of(rec: dict[str, Any], where: str) -> bool:
    """The record's label: true / false (JSON booleans, or 0 / 1)."""
    value = rec.get("label")
    if value is None:
        raise ScanError(f"{where}: field 'label': missing; KTO needs true (a desirable completion) or false "
                        f"(an undesirable one) on every record")
    if isinstance(value, bool) or (isinstance(value, int) and value in (0, 1)):
        return bool(value)
    raise ScanError(f"{where}: field 'label': got {type(value).__name__} {str(value)[:40]}; expected true or false")


def kto_of(rec: dict[str, Any], where: str) -> tuple[pair_records.Pair, bool]:
    """(the record as a pair whose chosen and rejected are its completion, its label)."""
    label = label_of(rec, where)
    if rec.get("completion") is None:
        raise ScanError(f"{where}: field 'completion': missing")
    as_pair = {"chosen": rec["completion"], "rejected": rec["completion"]}
    if rec.get("prompt") is not None:
        as_pair["prompt"] = rec["prompt"]
    try:
        return pair_records.pair_of(as_pair, where), label
    except ScanError as e:
        raise ScanError(str(e).replace("'chosen'", "'completion'").replace("'rejected'", "'completion'")) from None


class KtoCount:
    """data_scan's record rule for KTO records that counts each label. KTO learns to raise the desirable
    completions and lower the undesirable ones against a KL estimate: a file of one label is refused
    (half of the loss and of the reward figures would be empty), and an imbalance outside TRL's advice
    (desirable_weight * desirable / (undesirable_weight * undesirable) in [1, 4/3]) is a note."""

    def __init__(self) -> None:
        self.records = self.desirable = 0

    def __call__(self, rec: dict[str, Any], where: str) -> None:
        _, label = kto_of(rec, where)
        self.records += 1
        self.desirable += label

    def verdict(self, where: str, desirable_weight: float = 1.0, undesirable_weight: float = 1.0) -> str:
        """ScanError when every record read has one label; a note when the weighted balance is outside TRL's
        range; "" otherwise."""
        d, u = self.desirable, self.records - self.desirable
        if self.records and (d == 0 or u == 0):
            raise ScanError(f"{where}: field 'label': all {self.records} records read are {str(bool(d)).lower()}: "
                            f"KTO needs desirable (true) and undesirable (false) completions both")
        if not u or not undesirable_weight:
            return ""
        ratio = desirable_weight * d / (undesirable_weight * u)
        if 1 <= ratio <= 4 / 3:
            return ""
        return (f"{where}: {d} desirable and {u} undesirable records: desirable_weight * {d} / (undesirable_weight "
                f"* {u}) = {ratio:.2f}, outside TRL's advised 1 to 1.33; set preference.desirable_weight / "
                f"undesirable_weight to balance them")
