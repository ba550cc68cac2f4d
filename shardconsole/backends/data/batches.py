"""Batches for the ranks: synthetic tokens, the records of a data file (corpus.py reads them, token_cache.py
tokenizes them once per machine), or a pre-tokenized token file.

A rank's samples are a pure function of (seed, global sample index, rank, world): global sample g of
the run is window perm_e[g mod n] of epoch e = g // n (a fresh permutation of the n windows per epoch,
chosen by (seed, e) and computed per sample by shuffled()), and micro-batch j of a step on rank r holds
samples consumed + j*world + r.
source.seek(consumed) therefore resumes exactly, on any world size.

Documents (records) are packed back to back, each ending with EOS, into windows of seq_len + 1 tokens
(inputs and next-token labels). With data.cross_document_attention = false (the default) position ids
restart at 0 at each document start inside a window, which transformers turns into a block-diagonal
causal mask: a token never attends to another document. What that costs (benchmarks/packing_attention.py,
forward + backward tokens/s): with SDPA, 13-19% on an H200 (125m at 2048, 1b at 4096, bf16) and 15-19%
on 2 CPU cores (tiny at 512), since SDPA then takes an explicit mask instead of its causal fast path;
with model.attn_implementation = "flex_attention" nothing (1b at 4096: 60.2k tokens/s against SDPA
causal's 59.1k; benchmarks/data/packing_attention_h200.json). The first token of a document is never
under loss in either mode.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from shardconsole.runlog import protocol as P
from shardconsole.backends.data import token_cache
from shardconsole.backends.data.corpus import DOC_START, LOSS, DataError
from shardconsole.settings.data import data_hash
from shardconsole.settings.config import RunConfig

IGNORE = -100

__all__ = ["Batch", "DataError", "make_source", "make_eval_source", "next_batch"]


@dataclass
class Batch:
    inputs: torch.Tensor                 # [B, S] token ids
    labels: torch.Tensor                 # [B, S] next-token ids, IGNORE where not under loss
    positions: torch.Tensor | None       # [B, S] position ids restarting per document, or None (0..S-1)
    # Preference pairs (data/preference.py): the rows are B/2 chosen then B/2 rejected, and `pairs` [B/2]
    # holds each pair's index in its split (-1: an empty pair padding an eval batch); None for SFT.
    pairs: torch.Tensor | None = None
    # GRPO's prompts (data/prompts.py): `inputs` are prompts padded on the left, `mask` [B, S] 1 on their
    # tokens, `pairs` each record's index; None otherwise.
    mask: torch.Tensor | None = None

    def to(self, device: torch.device) -> "Batch":
        def move(t):
            if t is None:
                return None
            return (t.pin_memory() if device.type == "cuda" else t).to(device, non_blocking=True)
        return Batch(move(self.inputs), move(self.labels), move(self.positions), move(self.pairs), move(self.mask))


def _positions(flags: np.ndarray) -> np.ndarray:
    """Per row: index minus the index of the last document start at or before it (0 at the row start)."""
    idx = np.broadcast_to(np.arange(flags.shape[-1]), flags.shape)
    starts = np.where(flags & DOC_START, idx, 0)
    return idx - np.maximum.accumulate(starts, axis=-1)


def windows_to_batch(ids: np.ndarray, flags: np.ndarray, cross_doc: bool) -> Batch:
    """[B, S+1] ids and flags -> Batch: labels are the next token where it is under loss."""
    ids = ids.astype(np.int64)
    labels = np.where(flags[:, 1:] & LOSS, ids[:, 1:], IGNORE)
    pos = None if cross_doc else torch.from_numpy(np.ascontiguousarray(_positions(flags[:, :-1])))
    return Batch(torch.from_numpy(np.ascontiguousarray(ids[:, :-1])), torch.from_numpy(labels), pos)


_MASK64 = (1 << 64) - 1


def _mix(x: int) -> int:
    """splitmix64's finaliser: a well-spread 64-bit hash of x."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def shuffled(i: int, n: int, key: int) -> int:
    """Position i of a pseudo-random permutation of range(n) chosen by key, in O(1) memory: a 4-round
    Feistel network on the smallest even-bit power of two >= n, walked until it lands below n. A stored
    permutation would be 8 bytes per window on every rank, growing with the corpus."""
    half = max(1, (max(n - 1, 1).bit_length() + 1) // 2)
    lo_mask = (1 << half) - 1
    x = i
    while True:
        left, right = x >> half, x & lo_mask
        for rnd in range(4):
            left, right = right, left ^ (_mix((key << 3) ^ (rnd << 60) ^ right) & lo_mask)
        x = (left << half) | right
        if x < n:
            return x


class GlobalCursor:
    """The bookkeeping shared by every training source: which global samples a rank takes next."""

    def __init__(self, rank: int, world: int) -> None:
        self.rank, self.world, self.consumed = rank, world, 0

    def seek(self, consumed: int) -> None:
        self.consumed = int(consumed)

    def take(self, n: int) -> list[int]:
        g = [self.consumed + j * self.world + self.rank for j in range(n)]
        self.consumed += n * self.world
        return g


class SyntheticTokens(GlobalCursor):
    """Sequences a model can learn, so a falling loss means training works (not just "it ran").

    Each sequence reads a fixed random ordering of the vocabulary from a start drawn from (seed, global
    sample index): x[t] = perm[(start + t) mod vocab], so the next token is a fixed function of the
    current one. The loss starts near ln(vocab) and falls towards 0; the compute per token is that of
    any data, which is what memory and speed tuning need."""

    def __init__(self, vocab: int, seq_len: int, seed: int, rank: int, world: int = 1) -> None:
        super().__init__(rank, world)
        self.vocab, self.seq_len, self.seed = vocab, seq_len, seed
        self.perm = np.random.default_rng(seed).permutation(vocab)

    def windows(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        starts = np.array([np.random.default_rng([self.seed, g]).integers(self.vocab) for g in self.take(n)])
        ids = self.perm[(starts[:, None] + np.arange(self.seq_len + 1)) % self.vocab]
        flags = np.full(ids.shape, LOSS, dtype=np.uint8)
        return ids, flags

    def batch(self, micro_batch: int) -> Batch:
        return windows_to_batch(*self.windows(micro_batch), cross_doc=True)


class PackedWindows(GlobalCursor):
    """Windows of seq_len + 1 tokens over memory-mapped ids and flags, in a per-epoch shuffled order."""

    def __init__(self, ids: np.ndarray, flags: np.ndarray | None, seq_len: int, seed: int, rank: int,
                 world: int, name: str, cross_doc: bool = True) -> None:
        super().__init__(rank, world)
        self.ids, self.flags, self.seq_len, self.seed, self.cross_doc = ids, flags, seq_len, seed, cross_doc
        self.n = (len(ids) - 1) // seq_len if len(ids) else 0
        if self.n < world:
            raise DataError(f"{name}: {len(ids)} tokens make {self.n} samples of {seq_len + 1} tokens, fewer "
                            f"than the {world} ranks; lower data.seq_len or add data")

    def window_of(self, g: int) -> int:
        epoch, i = divmod(g, self.n)
        return shuffled(i, self.n, self.seed * 1_000_003 + epoch)

    def windows(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        S = self.seq_len
        ws = [self.window_of(g) for g in self.take(n)]
        ids = np.stack([np.asarray(self.ids[w * S: w * S + S + 1]) for w in ws])
        if self.flags is None:
            flags = np.full(ids.shape, LOSS, dtype=np.uint8)
        else:
            flags = np.stack([np.asarray(self.flags[w * S: w * S + S + 1]) for w in ws])
        return ids, flags

    def batch(self, micro_batch: int) -> Batch:
        return windows_to_batch(*self.windows(micro_batch), cross_doc=self.cross_doc)


class EvalWindows:
    """The whole held-out split, windows r, r + world, ... on rank r, in batches of the same count on
    every rank: the last ones padded with windows whose labels are all IGNORE (FSDP and ZeRO need
    every rank in every forward)."""

    def __init__(self, ids: np.ndarray, flags: np.ndarray, seq_len: int, rank: int, world: int,
                 cross_doc: bool) -> None:
        self.ids, self.flags, self.seq_len, self.cross_doc = ids, flags, seq_len, cross_doc
        self.rank, self.world = rank, world
        self.n = max(0, -(-(len(ids) - 1) // seq_len))     # every token under loss lands in one window
        self.per_rank = -(-self.n // world)

    def samples(self) -> int:
        return self.n

    def batches(self, micro_batch: int):
        S = self.seq_len
        mine = [self.rank + k * self.world for k in range(self.per_rank)]
        n_batches = -(-self.per_rank // micro_batch)
        for b in range(n_batches):
            ids = np.zeros((micro_batch, S + 1), dtype=np.int64)
            flags = np.zeros((micro_batch, S + 1), dtype=np.uint8)
            flags[:, 0] = DOC_START
            for j, k in enumerate(range(b * micro_batch, min((b + 1) * micro_batch, len(mine)))):
                w = mine[k]
                if w < self.n:
                    part = np.asarray(self.ids[w * S: w * S + S + 1])
                    ids[j, :len(part)] = part
                    flags[j, :len(part)] = self.flags[w * S: w * S + S + 1]
            yield windows_to_batch(ids, flags, self.cross_doc)


# ---------------------------------------------------------------------------------------------------
# Building the sources

def _token_file(cfg: RunConfig, vocab: int, rank: int, world: int) -> PackedWindows:
    d = cfg.data
    path = Path(d.path).expanduser()
    if not path.is_file():
        raise DataError(f"[data] path: {path}: no such file")
    dtype = np.uint16 if d.token_dtype == "uint16" else np.uint32
    if path.stat().st_size % np.dtype(dtype).itemsize:
        raise DataError(f"{path}: size is not a multiple of {np.dtype(dtype).itemsize} bytes "
                        f"({d.token_dtype} tokens); check data.token_dtype")
    tokens = np.memmap(path, dtype=dtype, mode="r")
    if len(tokens) and int(tokens.max() if len(tokens) < 50_000_000 else tokens[:1_000_000].max()) >= vocab:
        raise DataError(f"{path}: token ids reach {int(tokens.max())} but the model's vocab_size is {vocab}")
    return PackedWindows(tokens, None, d.seq_len, cfg.train.seed, rank, world, str(path))


def _entry(cfg: RunConfig, vocab: int, model_path: str | None, has_tokenizer: bool, log):
    return token_cache.open_entry(cfg.data, cfg.train.seed, model_path, has_tokenizer, vocab, log)


def _build(cfg: RunConfig, vocab: int, model_path: str | None, has_tokenizer: bool, rank: int, world: int,
           log=print):
    """(train source, cache entry or None)."""
    d = cfg.data
    if d.source == "tokens":
        return _token_file(cfg, vocab, rank, world), None
    if d.source == "synthetic" or not d.path:
        return SyntheticTokens(vocab, d.seq_len, cfg.train.seed, rank, world), None
    entry = _entry(cfg, vocab, model_path, has_tokenizer, log)
    src = PackedWindows(entry.train.ids, entry.train.flags, d.seq_len, cfg.train.seed, rank, world,
                        f"[data] path: {d.path}", cross_doc=d.cross_document_attention)
    return src, entry


def summary(cfg: RunConfig, world: int, src, entry) -> P.DataSummary:
    t, d = cfg.train, cfg.data
    global_batch = t.micro_batch * t.grad_accum * world
    if entry is None:
        kind = "tokens" if d.source == "tokens" else "synthetic"
        samples = src.n if kind == "tokens" else 0
        return P.DataSummary(source=d.path if kind == "tokens" else "synthetic", format=kind,
                             tokenizer="" if kind == "synthetic" else "pre-tokenized", samples=samples,
                             tokens=samples * d.seq_len, records=0,
                             epochs=round(t.steps * global_batch / samples, 3) if samples else 0.0,
                             cross_document_attention=True)
    m = entry.meta
    tr = m["splits"]["train"]
    ev = m["splits"].get("eval")
    ev_samples = -(-(ev["tokens"] - 1) // d.seq_len) if ev and ev["tokens"] > 1 else 0
    note = ""
    if m["tokenizer"] == "bytes":
        note = "no tokenizer in the model: text is read as UTF-8 bytes"
    if m["template"] == "shardconsole-plain":
        note = (note + "; " if note else "") + "the tokenizer has no chat template: chats use the plain " \
            "\"User: ... / Assistant: ...\" template"
    for part in _split_notes(m, d):
        note = (note + "; " if note else "") + part
    # This run's file, not m["source"]: a cache entry is keyed by content, and one built from another
    # path (a copy, another user's) named that path on this run's data line.
    return P.DataSummary(source=str(Path(d.path).expanduser()), format=m["format"], tokenizer=m["tokenizer"],
                         template=m["template"],
                         records=tr["records"], tokens=tr["tokens"], samples=src.n,
                         loss_share=round(tr["loss_tokens"] / max(1, tr["tokens"]), 4),
                         epochs=round(t.steps * global_batch / src.n, 3),
                         eval_records=ev["records"] if ev else 0, eval_samples=ev_samples,
                         cross_document_attention=d.cross_document_attention, note=note)


_TEXT_SPLIT_WORDS = {"blank_line": "split on blank lines", "line": "one record per line",
                     "file": "the whole file one record"}


def _split_notes(m: dict, d) -> list[str]:
    """How the file became records (a .txt) and how the eval split was made, for the data summary."""
    out = []
    if m.get("text_split"):
        other = " or ".join(f'"{k}"' for k in _TEXT_SPLIT_WORDS if k != m["text_split"])
        out.append(f"{Path(m['source']).name}: {_TEXT_SPLIT_WORDS[m['text_split']]} into "
                   f"{m['splits']['train']['records']} record(s) (data.text_split = {other} to change)")
    ev = m["splits"].get("eval")
    if m.get("eval_split") == "windows" and ev:
        out.append(f"eval: too few records to hold out whole ones, so the last {ev['windows']} packed "
                   f"window(s) ({ev['tokens']} tokens) are held out")
    return out


def make_source(r):
    """The rank's training source (r: a backends.common.Rank); rank 0 emits the data summary."""
    src, entry = _build(r.cfg, r.spec.vocab, r.spec.path, r.spec.has_tokenizer, r.rank, r.world, r.log)
    r.data_state.entry, r.data_state.built = entry, True
    if r.rank == 0:
        s = summary(r.cfg, r.world, src, entry)
        r.emit(dataclasses.replace(s, run=r.run_id, rank=r.rank))
        if entry is not None and s.epochs > 1:
            r.event("info", f"data: {s.samples} samples; {r.cfg.train.steps} steps make {s.epochs} epochs")
    return src


def make_eval_source(r) -> EvalWindows | None:
    """The held-out windows of this rank, or None when there is no eval data (needs make_source first)."""
    if not r.data_state.built:
        _, r.data_state.entry = _build(r.cfg, r.spec.vocab, r.spec.path, r.spec.has_tokenizer, r.rank, r.world, r.log)
        r.data_state.built = True
    entry = r.data_state.entry
    if entry is None or entry.eval is None or len(entry.eval.ids) < 2:
        return None
    return EvalWindows(entry.eval.ids, entry.eval.flags, r.cfg.data.seq_len, r.rank, r.world,
                       r.cfg.data.cross_document_attention)


def next_batch(source, micro_batch: int, device: torch.device) -> Batch:
    """The next Batch on the rank's device."""
    return source.batch(micro_batch).to(device)


# ---------------------------------------------------------------------------------------------------
# The data a checkpoint was trained on

def identity(r) -> dict | None:
    """What a checkpoint records of its data: the file's content hash, its record count and the token
    cache key (the tokenizer, seq_len, split and format settings). None: synthetic tokens or a token file."""
    entry = r.data_state.entry
    if entry is None:
        return None
    m = entry.meta
    return {"path": r.cfg.data.path, "sha256": m.get("data_sha256"), "hashed": HASHED, "records": m.get("records"),
            "cache_key": entry.folder.name}


HASHED = data_hash.HASHED


def _same_content(saved: dict, now: dict) -> bool:
    return data_hash.same_content(saved, Path(now["path"]), now["sha256"])


def check_resume(r, saved: dict | None, checkpoint: Path) -> None:
    """Refuse to resume on data other than the checkpoint's: its sample position would index another
    corpus (re-packed, re-shuffled) without a word. data.allow_changed = true goes on, from the start
    of an epoch of the new data (Data.seek rounds the position up to one)."""
    now = identity(r)
    if not saved or now is None or not saved.get("sha256"):
        return      # synthetic tokens, a token file, or a checkpoint from before data identity
    same = _same_content(saved, now)
    # An older checkpoint's cache key hashed the file's name with its content: only its content compares.
    if same and (saved.get("cache_key") == now["cache_key"] or saved.get("hashed") != HASHED):
        if saved.get("path") and Path(saved["path"]).expanduser().resolve() != Path(now["path"]).expanduser().resolve():
            if r.rank == 0:
                r.event("info", f"data: {now['path']}: the same content as {saved['path']}, which "
                                f"{checkpoint.name} trained on")
        return
    if not same:
        was, has = saved.get("records"), now["records"]
        what = (f"{has - was} record(s) added" if has > was else f"cut from {was} to {has} records" if has < was
                else f"as many records ({has}), other content")
        what = f"its content changed since {checkpoint.name}: {what}"
    else:
        what = (f"the same content, tokenized otherwise since {checkpoint.name} (the tokenizer, data.seq_len, "
                f"text_key, text_split or the eval split changed)")
    if not r.cfg.data.allow_changed:
        raise DataError(f"[data] path: {now['path']}: {what}; resume on the data the checkpoint was trained on, "
                        f"or --set data.allow_changed=true to go on from the start of an epoch of the new data")
    r.data_state.changed = True
    if r.rank == 0:
        r.event("warning", f"data: {now['path']}: {what}; data.allow_changed: going on from the start of an "
                           f"epoch of the new data")


def epoch_start(source, samples: int) -> int:
    """The first global sample of the next epoch of source at or after samples (a new corpus has its own
    epochs: a position inside one of the old corpus means nothing in it)."""
    n = getattr(source, "n", 0)
    return -(-samples // n) * n if n else samples
