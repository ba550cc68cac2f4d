"""The first (or a random few) records of a run's data as the model will see them.

The ranks' own code turns each record into tokens (backends/data/corpus.py: the format detected from the
columns, the renderer with the chat template, the tokenizer, the loss flags), so what is shown is what
trains: the text with the template applied and special tokens visible, which tokens are under loss,
the token count of each record, and how the records pack into the first window of data.seq_len + 1
tokens (where documents join, each ending with the EOS). The first N records are streamed; `random`
reads the whole file (a reservoir sample), as the ranks do.
"""

from __future__ import annotations

import os
import random as _random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from shardconsole.backends.data import corpus
from shardconsole.settings import config as C
from shardconsole.settings.data.data_check import locate
from shardconsole.settings.data.data_scan import text_records
from shardconsole.settings.models import ModelSpec


@dataclass
class Piece:
    text: str            # decoded text of a run of tokens, special tokens visible
    loss: bool           # under loss
    tokens: int


@dataclass
class RecordView:
    index: int           # the record's index in the file (0-based)
    where: str           # file:line or file: record N
    pieces: list[Piece]
    tokens: int
    loss_tokens: int
    ids: list[int] = field(repr=False, default_factory=list)
    flags: list[int] = field(repr=False, default_factory=list)    # corpus.LOSS / DOC_START bits
    row: str = ""        # a preference pair's row: "chosen" or "rejected" (the prompt, then the answer); a KTO
    #                      record's: "desirable" or "undesirable"


@dataclass
class Preview:
    source: str
    format: str
    tokenizer: str
    template: str
    records: list[RecordView]
    seq_len: int
    window: list[tuple[int, int, int]]   # (record index, first token, tokens of it) in the first window
    notes: list[str]


def _stream(path: Path, kind: str, text_key: str, text_split: str) -> Iterator[dict[str, Any]]:
    """The file's records in order, without reading the whole file (datasets' streaming reader, or the
    ranks' own .txt splitter)."""
    if kind == "text":
        with path.open(encoding="utf-8", newline="") as fh:
            for text in text_records(fh, text_split):
                yield {text_key: text}
        return
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import datasets
    datasets.disable_progress_bars()
    if kind == "saved":
        ds = datasets.load_from_disk(str(path))
        if isinstance(ds, datasets.DatasetDict):
            ds = ds["train"] if "train" in ds else ds[next(iter(ds))]
        yield from ds
        return
    yield from datasets.load_dataset(kind, data_files=str(path), split="train", streaming=True)


def _pick(records: Iterator[dict[str, Any]], n: int, rnd: bool, seed: int) -> list[tuple[int, dict[str, Any]]]:
    if not rnd:
        out = []
        for i, rec in enumerate(records):
            if i >= n:
                break
            out.append((i, rec))
        return out
    rng = _random.Random(seed)
    sample: list[tuple[int, dict[str, Any]]] = []
    for i, rec in enumerate(records):         # reservoir sampling: one pass, n records held
        if i < n:
            sample.append((i, rec))
        elif (j := rng.randrange(i + 1)) < n:
            sample[j] = (i, rec)
    return sorted(sample, key=lambda x: x[0])


def _pieces(enc: corpus.Encoder, ids: np.ndarray, flags: np.ndarray) -> list[Piece]:
    """Runs of tokens of one loss state, decoded; the EOS and other special tokens stay visible."""
    out: list[Piece] = []
    start = 0
    loss = (flags & corpus.LOSS).astype(bool)
    for k in range(1, len(ids) + 1):
        if k == len(ids) or loss[k] != loss[start]:
            out.append(Piece(_decode(enc, ids[start:k]), bool(loss[start]), k - start))
            start = k
    return out


def _decode(enc: corpus.Encoder, ids: np.ndarray) -> str:
    if enc.tokenizer is None:                 # UTF-8 bytes; byte 0 is the EOS
        return "".join("<eos>" if b == corpus.BYTES_EOS else chr(b) if b < 128 else f"<0x{b:02X}>"
                       for b in ids.tolist())
    return enc.tokenizer.decode(ids.tolist(), skip_special_tokens=False, clean_up_tokenization_spaces=False)


def preview(cfg: C.RunConfig, spec: ModelSpec, n: int = 3, *, rnd: bool = False, seed: int = 0) -> Preview:
    """The first n records of data.path (a random n with rnd) as the ranks tokenize them."""
    d = cfg.data
    if not d.path or d.source in ("synthetic", "tokens"):
        raise C.ConfigError("[data] path: no records to preview: the run trains on "
                            f"{'a token file' if d.source == 'tokens' else 'synthetic tokens'}")
    path, kind = locate(d.path, "path")
    where = corpus.record_where(path, kind)
    try:
        enc = corpus.load_encoder(spec.path, spec.has_tokenizer, int(spec.config.get("vocab_size", 0)))
        picked = _pick(_stream(path, kind, d.text_key, d.text_split), n, rnd, seed)
        if not picked:
            raise C.ConfigError(f"[data] path: {path}: no records")
        if getattr(cfg.train, "objective", "sft") == "grpo":
            return _prompts(path, picked, enc, where, d.seq_len - cfg.grpo.max_new_tokens, cfg.grpo.generations)
        if getattr(cfg.train, "objective", "sft") != "sft":
            return _pairs(path, picked, enc, where, d.seq_len)
        fmt = corpus.detect_format(list(picked[0][1].keys()), d.text_key, str(path))
        renderer = corpus.Renderer(fmt, d.text_key, enc.tokenizer)
        views = []
        for i, ids, flags in corpus.tokenize_records(iter(picked), renderer, enc, where):
            views.append(RecordView(i, where(i), _pieces(enc, ids, flags), len(ids),
                                    int((flags & corpus.LOSS).astype(bool).sum()), ids.tolist(), flags.tolist()))
    except corpus.DataError as e:
        raise C.ConfigError(str(e)) from None
    return Preview(str(path), fmt, enc.name, renderer.template_name or "-", views, d.seq_len,
                   _first_window(views, d.seq_len + 1), _notes(views, d.seq_len, rnd))


def _pairs(path: Path, picked: list[tuple[int, dict[str, Any]]], enc: corpus.Encoder, where,
           seq_len: int) -> Preview:
    """Preference records (train.objective dpo / orpo) as the ranks make them rows (backends/data/
    preference.py): per pair a chosen and a rejected row, the same prompt tokens, loss on the answer."""
    from shardconsole.backends.data import pair_tokens as pairs
    renderer = pairs.PairRenderer(enc.tokenizer)
    views, notes = [], []
    for i, t in pairs.tokenize_pairs(iter(picked), renderer, enc, where):
        fitted, cut = pairs.fit(t, seq_len)
        if cut:
            notes.append(f"record {i + 1}: longer than data.seq_len + 1 = {seq_len + 1} tokens a row: the answers "
                         f"keep their start, the prompt its last {len(fitted.prompt)} of {len(t.prompt)} tokens")
        rows = (("chosen", fitted.chosen), ("rejected", fitted.rejected)) if t.label is None else \
            (("desirable" if t.label else "undesirable", fitted.chosen),)      # KTO: its KL row is a neighbour's
        for row, answer in rows:
            ids = np.asarray(fitted.prompt + answer, dtype=np.int64)
            flags = np.asarray([0] * len(fitted.prompt) + [corpus.LOSS] * len(answer), dtype=np.uint8)
            views.append(RecordView(i, where(i), _pieces(enc, ids, flags), len(ids), len(answer), ids.tolist(),
                                    flags.tolist(), row=row))
    if any(v.row in ("desirable", "undesirable") for v in views):
        notes.append("each KTO record trains as two rows of data.seq_len tokens: its completion under its label, "
                     "and its prompt with the previous record's completion for the KL estimate")
    else:
        notes.append("each pair trains as two rows of data.seq_len tokens, padded at the end (never packed, never "
                     "split)")
    if renderer.strings:        # said as the data line says it: string pairs have no template
        notes.append(pairs.RAW_PAIRS_NOTE)
    return Preview(str(path), "preference", enc.name, renderer.template_name or "-", views, seq_len, [], notes)


def _prompts(path: Path, picked: list[tuple[int, dict[str, Any]]], enc: corpus.Encoder, where, keep: int,
             generations: int) -> Preview:
    """GRPO's prompt records as the ranks render and cut them (backends/data/prompts.py): no token under loss
    (the loss is on the completions the run samples)."""
    from shardconsole.settings.data import prompt_records
    from shardconsole.settings.data.data_scan import ScanError
    chat = corpus.Renderer("chat", "text", enc.tokenizer)
    views, notes = [], []
    for i, rec in picked:
        try:
            prompt = prompt_records.prompt_of(rec, where(i))
        except ScanError as e:
            raise corpus.DataError(str(e)) from None
        full = enc.encode([prompt if isinstance(prompt, str) else chat._render(prompt, True)])[0]
        if len(full) > keep:
            notes.append(f"record {i + 1}: {len(full)} tokens, more than data.seq_len - grpo.max_new_tokens = {keep}: "
                         f"the prompt keeps its last {keep}")
        ids = np.asarray(full[-keep:], dtype=np.int64)
        flags = np.zeros(len(ids), dtype=np.uint8)
        views.append(RecordView(i, where(i), _pieces(enc, ids, flags), len(ids), 0, ids.tolist(), flags.tolist()))
    notes.append(f"each prompt is completed {generations} times by the model during the run; the loss is on those "
                 f"completions, scored by the reward functions")
    return Preview(str(path), "prompts", enc.name, chat.template_name or "-", views, keep, [], notes)


def _first_window(views: list[RecordView], size: int) -> list[tuple[int, int, int]]:
    """How the shown records pack into the first window (records in file order, as packing joins them)."""
    out, used = [], 0
    for v in views:
        if used >= size:
            break
        take = min(v.tokens, size - used)
        out.append((v.index, used, take))
        used += take
    return out


def _notes(views: list[RecordView], seq_len: int, rnd: bool) -> list[str]:
    notes = []
    for v in views:
        if v.tokens > seq_len + 1:
            notes.append(f"record {v.index + 1} ({v.tokens} tokens) is longer than a window of {seq_len + 1}: "
                         f"packing carries it on into the next window (nothing is cut)")
        if v.loss_tokens == 0:
            notes.append(f"record {v.index + 1}: no token under loss (it trains nothing)")
    if rnd:
        notes.append("a random sample: the window below joins the shown records, not neighbours in the file")
    return notes
