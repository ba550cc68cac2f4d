"""Preference pairs for the ranks (train.objective dpo / orpo): records with a prompt, a chosen and a rejected
answer (settings/data/pair_records.py: TRL's string and conversational forms), tokenized once per machine
(backends/data/pair_tokens.py) into a cache beside the token cache, and served a pair at a time.

A pair is never split: it becomes two rows of seq_len tokens, the prompt followed by the chosen answer and
the prompt followed by the rejected one, each padded at the end (right padding under a causal mask: the
pad tokens change no real token's log-probability, and carry no label). Labels only on the answer's tokens
(its text, the template's end of turn for a chat, and EOS). Too long a pair is cut: each answer keeps its
first seq_len tokens, then the prompt keeps as many of its last tokens as both rows still hold (cut from
the left, as TRL's keep_end for prompts); the data summary counts the pairs cut.

A Batch of micro_batch pairs holds the chosen rows first, then the rejected rows ([2B, S]), and `pairs`, each
pair's index in its split (the reference log-probs' cache key, backends/objective/preference.py). The
order of the pairs is that of batches.PackedWindows: global sample g is pair perm_e[g mod n], so seek(n)
resumes exactly on any rank count.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import torch

from shardconsole.backends.data import corpus, token_cache
from shardconsole.backends.data.batches import IGNORE, Batch, GlobalCursor, shuffled
from shardconsole.backends.data.corpus import DataError
from shardconsole.backends.data.pair_tokens import RAW_PAIRS_NOTE, PairRenderer, PairTokens, fit, tokenize_pairs
from shardconsole.runlog import protocol as P
from shardconsole.settings.data import kto_records, pair_records
from shardconsole.settings.data.data_check import tokenizer_dir

FORMAT_VERSION = 2         # 2: meta["template"] is "" for string pairs and meta["raw_pairs"] counts them
META = "meta.json"


# ---------------------------------------------------------------------------------------------------
# The cache: per split, the ids of every pair back to back (prompt, chosen, rejected) and an index of
# (start, prompt length, chosen length, rejected length) per pair, memory-mapped by every rank.

@dataclass
class PairSplit:
    ids: np.ndarray
    index: np.ndarray        # [n, 4] int64
    labels: np.ndarray | None = None     # KTO: [n] bool, each record's label

    @property
    def n(self) -> int:
        return len(self.index)


@dataclass
class PairEntry:
    folder: Path
    meta: dict
    train: PairSplit
    eval: PairSplit | None
    built_here: bool


def cache_key(d, seed: int, model_path: str | None, vocab: int) -> str:
    """The token cache's key (data, eval data, tokenizer and template, seq_len, split) for pairs."""
    base = token_cache.cache_key(d, seed, model_path, vocab)
    return "pairs-" + hashlib.sha256(f"{base}:{FORMAT_VERSION}".encode()).hexdigest()[:26]


def open_entry(d, seed: int, model_path: str | None, has_tokenizer: bool, vocab: int,
               log: Callable[[str], None]) -> PairEntry:
    """The pairs' cache entry: built by the first rank to take its lock, memory-mapped by all."""
    model_path = tokenizer_dir(d, model_path, has_tokenizer)
    has_tokenizer = model_path is not None
    folder, built = token_cache.built_once(cache_key(d, seed, model_path, vocab),
                                           lambda f: _build(f, d, seed, model_path, has_tokenizer, vocab, log), log)
    meta = json.loads((folder / META).read_text())
    dtype = np.dtype(meta["dtype"])

    def split(name: str) -> PairSplit | None:
        info = meta["splits"].get(name)
        if info is None:
            return None
        index = np.fromfile(folder / f"{name}.index", dtype=np.int64).reshape(-1, 4)
        labels = (np.fromfile(folder / f"{name}.labels", dtype=np.uint8).astype(bool)
                  if (folder / f"{name}.labels").is_file() else None)
        if not info["tokens"]:      # np.memmap refuses an empty file; an empty split has no tokens to map
            return PairSplit(np.zeros(0, dtype), index, labels)
        ids = np.memmap(folder / f"{name}.ids", dtype=dtype, mode="r", shape=(info["tokens"],))
        return PairSplit(ids, index, labels)
    train = split("train")
    if train is None:       # written by every build: a cache entry edited by hand
        raise DataError(f"{folder}: a pair cache entry without its train split; remove the folder to rebuild it")
    return PairEntry(folder, meta, train, split("eval"), built)


class _Writer:
    def __init__(self, folder: Path, name: str, dtype, seq_len: int) -> None:
        self.ids = open(folder / f"{name}.ids", "wb")
        self.rows: list[tuple[int, int, int, int]] = []
        self.folder, self.name, self.dtype, self.seq_len = folder, name, dtype, seq_len
        self.tokens = self.loss_tokens = self.cut = 0

    def add(self, t: PairTokens) -> None:
        t, cut = fit(t, self.seq_len)
        self.cut += cut
        self.rows.append((self.tokens, len(t.prompt), len(t.chosen), len(t.rejected)))
        for part in (t.prompt, t.chosen, t.rejected):
            self.ids.write(np.asarray(part, dtype=self.dtype).tobytes())
        self.tokens += len(t.prompt) + len(t.chosen) + len(t.rejected)
        self.loss_tokens += len(t.chosen) + len(t.rejected)

    def close(self) -> dict:
        self.ids.close()
        np.asarray(self.rows, dtype=np.int64).reshape(-1, 4).tofile(self.folder / f"{self.name}.index")
        return {"records": len(self.rows), "tokens": self.tokens, "loss_tokens": self.loss_tokens, "cut": self.cut}


class _KtoWriter(_Writer):
    """KTO's records as pairs (completion, KL completion), with their labels. The KL row is TRL's mismatched
    pair: its prompt with the completion of the record before it (the first: the last one's), TRL's +1
    rotation (trainer/kto_trainer.py, add_kl_completion_ids) over the whole split rather than per batch of
    per_device_train_batch_size, so a record's KL row is fixed and full fine-tuning's reference table holds it.
    Buffered: a record's KL completion is known once its neighbour is read."""

    def __init__(self, folder: Path, name: str, dtype, seq_len: int) -> None:
        super().__init__(folder, name, dtype, seq_len)
        self.held: list[PairTokens] = []

    def add(self, t: PairTokens) -> None:
        self.held.append(t)

    def close(self) -> dict:
        held, self.held = self.held, []
        for k, t in enumerate(held):
            super().add(PairTokens(t.prompt, t.chosen, held[k - 1].chosen, t.label))
        np.asarray([bool(t.label) for t in held], dtype=np.uint8).tofile(self.folder / f"{self.name}.labels")
        out = super().close()
        out["desirable"] = sum(bool(t.label) for t in held)
        return out


def _build(folder: Path, d, seed: int, model_path: str | None, has_tokenizer: bool, vocab: int,
           log: Callable[[str], None]) -> None:
    scratch = Path(tempfile.mkdtemp(dir=folder.parent, prefix=f".{folder.name}."))
    try:
        out = scratch / "out"
        out.mkdir()
        enc = corpus.load_encoder(model_path, has_tokenizer, vocab)
        dtype = np.dtype(np.uint16 if vocab <= 1 << 16 else np.uint32)
        renderer = PairRenderer(enc.tokenizer)
        ds, path, where = corpus.load_records(d.path, "path", d.text_key, scratch / "hf", d.text_split)
        n = len(ds)
        kto = kto_records.is_kto(ds.column_names)        # KTO's unpaired records: what train.objective checks
        writer = _KtoWriter if kto else _Writer
        if not kto and not pair_records.is_pairs(ds.column_names):
            raise DataError(pair_records.no_pairs(ds.column_names, f"[data] path: {path}"))
        if n == 0:
            raise DataError(f"[data] path: {path}: no records")
        held = np.zeros(n, dtype=bool)
        train, evalw = writer(out, "train", dtype, d.seq_len), None
        if d.eval_fraction:
            k = max(1, round(n * d.eval_fraction))
            if n - k < 1:
                raise DataError(f"[data] eval_fraction: {path}: {n} pair(s), too few to hold out {d.eval_fraction} "
                                f"of them and train on the rest")
            held[np.random.default_rng(seed).permutation(n)[:k]] = True
            evalw = writer(out, "eval", dtype, d.seq_len)
        log(f"data: tokenizing {path} ({n} preference pairs) with {enc.name}")
        _tokenize_into(ds, renderer, enc, where, lambda i: evalw if held[i] else train)
        if d.eval_path:
            eds, epath, ewhere = corpus.load_records(d.eval_path, "eval_path", d.text_key, scratch / "hf",
                                                     d.text_split)
            if kto_records.is_kto(eds.column_names) != kto or not (kto or pair_records.is_pairs(eds.column_names)):
                refuse = kto_records.no_kto if kto else pair_records.no_pairs
                raise DataError(refuse(eds.column_names, f"[data] eval_path: {epath}"))
            evalw = writer(out, "eval", dtype, d.seq_len)
            _tokenize_into(eds, renderer, enc, ewhere, lambda i: evalw)
        splits = {"train": train.close(), **({"eval": evalw.close()} if evalw else {})}
        meta = {"version": FORMAT_VERSION, "source": str(path), "format": "kto" if kto else "preference",
                "data_sha256": token_cache.content_hash(path), "records": n, "tokenizer": enc.name,
                "template": renderer.template_name, "raw_pairs": renderer.strings, "dtype": dtype.name,
                "seq_len": d.seq_len, "splits": splits}
        (out / META).write_text(json.dumps(meta, indent=1))
        try:
            os.rename(out, folder)
        except OSError:
            if not (folder / META).is_file():
                raise
        log(f"data: pair cache written to {folder}")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _tokenize_into(ds, renderer: PairRenderer, enc: corpus.Encoder, where, writer_of) -> None:
    for i, t in tokenize_pairs(enumerate(ds), renderer, enc, where):
        top = max(t.prompt + t.chosen + t.rejected)
        if top >= 1 << (8 * writer_of(i).dtype.itemsize):
            raise DataError(f"{where(i)}: token id {top} does not fit the cache's {writer_of(i).dtype}")
        writer_of(i).add(t)


# ---------------------------------------------------------------------------------------------------
# Pairs to rows

def rows(split: PairSplit, pairs: list[int], seq_len: int, pad: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(ids, labels) [2B, S] for these pair indices (-1: an empty pair, no label: eval's padding), the
    chosen rows first. labels[t] is ids[t + 1] where that token is under loss, else IGNORE."""
    B, S = len(pairs), seq_len
    ids = np.full((2 * B, S + 1), pad, dtype=np.int64)
    loss = np.zeros((2 * B, S + 1), dtype=bool)
    for j, k in enumerate(pairs):
        if k < 0:
            continue
        start, lp, lc, lr = (int(v) for v in split.index[k])
        prompt = np.asarray(split.ids[start:start + lp])
        for row, (a, n) in ((j, (start + lp, lc)), (B + j, (start + lp + lc, lr))):
            ids[row, :lp] = prompt
            ids[row, lp:lp + n] = split.ids[a:a + n]
            loss[row, lp:lp + n] = True
    labels = np.where(loss[:, 1:], ids[:, 1:], IGNORE)
    return ids[:, :-1], labels


def row_tokens(split: PairSplit, seq_len: int) -> np.ndarray:
    """Per pair, the real tokens of its two rows' inputs (prompt and answer, at most seq_len each: `rows`
    fills lp + n of seq_len + 1 and the inputs are the first seq_len); the rest of each row is padding."""
    lp, lc, lr = (split.index[:, i].astype(np.int64) for i in (1, 2, 3))
    return np.minimum(lp + lc, seq_len) + np.minimum(lp + lr, seq_len)


def to_batch(split: PairSplit, pairs: list[int], seq_len: int) -> Batch:
    ids, labels = rows(split, pairs, seq_len)
    return Batch(torch.from_numpy(np.ascontiguousarray(ids)), torch.from_numpy(labels), None,
                 pairs=torch.tensor(pairs, dtype=torch.int64))


class PairSource(GlobalCursor):
    """micro_batch pairs at a time in a per-epoch shuffled order (batches.PackedWindows' rule)."""

    def __init__(self, split: PairSplit, seq_len: int, seed: int, rank: int, world: int, name: str) -> None:
        super().__init__(rank, world)
        self.split, self.seq_len, self.seed, self.n = split, seq_len, seed, split.n
        self.real: np.ndarray | None = None      # row_tokens, on the first count
        if self.n < world:
            raise DataError(f"{name}: {self.n} preference pair(s), fewer than the {world} ranks; add data")

    def pair_of(self, g: int) -> int:
        epoch, i = divmod(g, self.n)
        return shuffled(i, self.n, self.seed * 1_000_003 + epoch)

    def batch(self, micro_batch: int) -> Batch:
        return to_batch(self.split, [self.pair_of(g) for g in self.take(micro_batch)], self.seq_len)

    def real_tokens(self, lo: int, hi: int) -> int:
        """The real (not padding) tokens of global samples [lo, hi), both rows of each pair: what the step
        lines count, as SFT's packed windows are all real. Whole epochs at once, so a resume's count from
        sample 0 costs at most an epoch of look-ups."""
        if self.real is None:
            self.real = row_tokens(self.split, self.seq_len)
        real = self.real
        first, last = -(-lo // self.n), hi // self.n       # the whole epochs inside [lo, hi)
        if first >= last:
            return int(sum(real[self.pair_of(g)] for g in range(lo, hi)))
        edges = list(range(lo, first * self.n)) + list(range(last * self.n, hi))
        return int((last - first) * real.sum() + sum(real[self.pair_of(g)] for g in edges))


class EvalPairs:
    """Every pair of a split once: pairs r, r + world, ... on rank r, in batches of the same count on every
    rank, the last ones padded with empty pairs (-1: no label; a sharded forward is a collective)."""

    def __init__(self, split: PairSplit, seq_len: int, rank: int, world: int) -> None:
        self.split, self.seq_len, self.rank, self.world = split, seq_len, rank, world
        self.n = split.n
        self.per_rank = -(-self.n // world)

    def samples(self) -> int:
        return self.n

    def batches(self, micro_batch: int) -> Iterator[Batch]:
        mine = [k if k < self.n else -1 for k in (self.rank + j * self.world for j in range(self.per_rank))]
        for b in range(0, len(mine), micro_batch):
            part = mine[b:b + micro_batch]
            yield to_batch(self.split, part + [-1] * (micro_batch - len(part)), self.seq_len)


# ---------------------------------------------------------------------------------------------------
# The rank's sources

def pair_entry(r) -> PairEntry:
    if r.data_state.entry is None:
        r.data_state.entry = open_entry(r.cfg.data, r.cfg.train.seed, r.spec.path, r.spec.has_tokenizer, r.spec.vocab, r.log)
        r.data_state.built = True
    return r.data_state.entry


def make_source(r) -> PairSource:
    """The rank's training pairs; rank 0 emits the data summary."""
    entry = pair_entry(r)
    src = PairSource(entry.train, r.cfg.data.seq_len, r.cfg.train.seed, r.rank, r.world, f"[data] path: {r.cfg.data.path}")
    if r.rank == 0:
        r.emit(dataclasses.replace(summary(r.cfg, r.world, entry), run=r.run_id, rank=r.rank))
    return src


def make_eval_source(r) -> EvalPairs | None:
    entry = pair_entry(r)
    if entry.eval is None or entry.eval.n == 0:
        return None
    return EvalPairs(entry.eval, r.cfg.data.seq_len, r.rank, r.world)


def summary(cfg, world: int, entry: PairEntry) -> P.DataSummary:
    t, m = cfg.train, entry.meta
    tr, ev = m["splits"]["train"], m["splits"].get("eval")
    notes = [f"{tr['records']} preference pairs, each two rows of {cfg.data.seq_len} tokens (chosen, rejected)"
             if m["format"] != "kto" else
             f"{tr['records']} KTO records ({tr['desirable']} desirable, {tr['records'] - tr['desirable']} "
             f"undesirable), each two rows of {cfg.data.seq_len} tokens (the completion, and the KL estimate's: "
             f"the prompt with the previous record's completion)"]
    padded = 2 * entry.train.n * cfg.data.seq_len
    if padded:
        pad = 1 - int(row_tokens(entry.train, cfg.data.seq_len).sum()) / padded
        notes.append(f"{100 * pad:.0f}% of the rows' tokens are padding (tokens and tok/s count the real ones)")
    cut = tr["cut"] + (ev["cut"] if ev else 0)
    if cut:
        notes.append(f"{cut} pair(s) longer than data.seq_len + 1: answers cut at the end, prompts from the left")
    if m["template"] == corpus.PLAIN_TEMPLATE_NAME:
        notes.append("the tokenizer has no chat template: chats use the plain \"User: ... / Assistant: ...\" template")
    if m.get("raw_pairs"):
        notes.append(RAW_PAIRS_NOTE if not m["template"] else f"{m['raw_pairs']} {RAW_PAIRS_NOTE}")
    pairs_per_step = t.micro_batch * t.grad_accum * world
    # This run's file, not m["source"] (the cache entry's builder's: entries are keyed by content).
    kto = m["format"] == "kto"
    return P.DataSummary(source=str(Path(cfg.data.path).expanduser()), format="kto" if kto else "preference",
                         desirable=tr["desirable"] if kto else 0,
                         tokenizer=m["tokenizer"], template=m["template"],
                         records=tr["records"], tokens=tr["tokens"], samples=tr["records"],
                         loss_share=round(tr["loss_tokens"] / max(1, tr["tokens"]), 4),
                         epochs=round(t.steps * pairs_per_step / max(1, tr["records"]), 3),
                         eval_records=ev["records"] if ev else 0, eval_samples=ev["records"] if ev else 0,
                         cross_document_attention=True, note="; ".join(notes))
