"""Preference records to token ids (train.objective dpo / orpo / kto): a record's prompt, chosen and rejected
answer rendered to text (strings as they are, message lists through the chat template) and tokenized, and a pair
cut to fit its rows. The pair cache (backends/data/preference.py) and the data preview (tryout/preview.py) both
read records through here, so the preview shows the tokens the ranks train on.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator

from shardconsole.backends.data import corpus
from shardconsole.backends.data.corpus import DataError
from shardconsole.settings.data import kto_records, pair_records
from shardconsole.settings.data.data_scan import ScanError


@dataclass
class PairTokens:
    prompt: list[int]
    chosen: list[int]       # the answer, EOS included
    rejected: list[int]     # KTO: the completion of the record before it in its split (the KL row's)
    label: bool | None = None     # KTO's label (desirable: true); None for a pair


RAW_PAIRS_NOTE = ("string pairs train as plain text, the prompt then the answer, with no chat template "
                  "(TRL's standard form); chat gives such a model what you type as text to continue")


class PairRenderer:
    """A record -> (prompt text, chosen text, rejected text): strings as they are, message lists through the
    chat template (the prompt rendered with the generation prompt, each answer the rest of its conversation).

    String pairs stay raw, as TRL trains its standard form: a prompt already rendered by hand (a template's
    markers, "Human: ... Assistant:") would be wrapped twice by a template. What was rendered how is counted,
    so the data line, the preview and the export say the format the tokens really had (they named the chat
    template over raw string pairs, and chat then prompted a model through a template it never saw)."""

    def __init__(self, tokenizer) -> None:
        self.chat = corpus.Renderer("chat", "text", tokenizer)
        self.strings = self.conversations = 0

    @property
    def template_name(self) -> str:
        """The chat template the pairs were rendered with: "" when none was (string pairs only)."""
        return self.chat.template_name if self.conversations else ""

    def label(self, rec: dict[str, Any], where: str) -> bool | None:
        """A KTO record's label (settings/data/kto_records.py); None for a pair."""
        if not kto_records.is_kto(rec.keys()):
            return None
        try:
            return kto_records.label_of(rec, where)
        except ScanError as e:
            raise DataError(str(e)) from None

    def texts(self, rec: dict[str, Any], where: str) -> tuple[str, str, str]:
        try:
            pair = (kto_records.kto_of(rec, where)[0] if kto_records.is_kto(rec.keys())
                    else pair_records.pair_of(rec, where))
        except ScanError as e:
            raise DataError(str(e)) from None
        if not pair.conversational:
            self.strings += 1
            return pair.prompt, pair.chosen, pair.rejected
        self.conversations += 1
        try:
            head = self.chat._render(pair.prompt, True)
            out = [head]
            for name, answer in (("chosen", pair.chosen), ("rejected", pair.rejected)):
                full = self.chat._render(pair.prompt + answer, False)
                if not full.startswith(head):
                    raise DataError(f"{where}: field {name!r}: the chat template renders the prompt otherwise with "
                                    f"this answer after it, so the answer's tokens cannot be found")
                out.append(full[len(head):])
        except DataError:
            raise
        except Exception as e:   # the template's own raise_exception, jinja errors
            raise DataError(f"{where}: field 'chosen': the chat template fails on it: {str(e)[:160]}") from None
        return out[0], out[1], out[2]


def tokenize_pairs(records: Iterator[tuple[int, dict]], renderer: PairRenderer, enc: corpus.Encoder, where,
                   chunk: int = 256) -> Iterator[tuple[int, PairTokens]]:
    """(record index, PairTokens), a chunk of records per tokenizer call. The prompt is tokenized apart from
    the answers, so both rows of a pair hold the same prompt tokens."""
    batch: list[tuple[int, tuple[str, str, str], bool | None]] = []

    def flush() -> Iterator[tuple[int, PairTokens]]:
        ids = iter(enc.encode([t for _, texts, _ in batch for t in texts]))
        for i, _, label in batch:
            p, c, r = next(ids), next(ids), next(ids)
            yield i, PairTokens(list(p), list(c) + [enc.eos], list(r) + [enc.eos], label)
        batch.clear()

    for i, rec in records:
        batch.append((i, renderer.texts(rec, where(i)), renderer.label(rec, where(i))))
        if len(batch) >= chunk:
            yield from flush()
    yield from flush()


def fit(t: PairTokens, seq_len: int) -> tuple[PairTokens, bool]:
    """The pair cut to rows of seq_len + 1 tokens (inputs and next-token labels): answers keep their start,
    the prompt its end. True when something was cut."""
    room = seq_len + 1
    c, r = t.chosen[:room - 1], t.rejected[:room - 1]
    keep = room - max(len(c), len(r))
    p = t.prompt[len(t.prompt) - keep:] if keep < len(t.prompt) else t.prompt
    cut = len(c) < len(t.chosen) or len(r) < len(t.rejected) or len(p) < len(t.prompt)
    return PairTokens(p, c, r), cut
