"""GRPO's prompts (train.objective grpo): prompt-only records (settings/data/prompt_records.py), each prompt
rendered (a message list through the chat template with the generation prompt, a string as it is),
tokenized once, cut from the left to data.seq_len - grpo.max_new_tokens tokens, and served micro_batch
prompts at a time, padded on the left (the sampler appends to the right). The records stay in memory: their
other columns are the reward functions' keyword arguments (backends/objective/rewards.py)."""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from shardconsole.backends.data import corpus
from shardconsole.backends.data.batches import IGNORE, Batch, GlobalCursor, shuffled
from shardconsole.backends.rank.errors import DataError
from shardconsole.runlog import protocol as P
from shardconsole.settings.data import data_hash, prompt_records
from shardconsole.settings.data.data_scan import ScanError


@dataclass
class PromptSet:
    records: list[dict[str, Any]]          # as read, every column
    prompts: list[Any]                     # each record's prompt: text or turns (what the reward functions get)
    ids: list[np.ndarray]                  # each prompt's tokens, cut from the left
    where: Callable[[int], str]            # record index -> "file:line"
    encoder: corpus.Encoder
    cut: int = 0
    # what a checkpoint records of its data (batches.identity): the file's content and how it was cut
    meta: dict[str, Any] = dataclasses.field(default_factory=dict)
    folder: Path = Path("prompts")


def load(r) -> PromptSet:
    """The run's prompts, read once per rank (kept on r.data_state for the objective)."""
    if isinstance(r.data_state.entry, PromptSet):
        return r.data_state.entry
    cfg = r.cfg
    scratch = r.run_dir / "datasets-cache"
    ds, _, where = corpus.load_records(cfg.data.path, "path", cfg.data.text_key, scratch)
    enc = corpus.load_encoder(r.spec.path, r.spec.has_tokenizer, r.spec.vocab)
    chat = corpus.Renderer("chat", "text", enc.tokenizer)
    keep = cfg.data.seq_len - cfg.grpo.max_new_tokens
    records, prompts, texts = [], [], []
    for i, rec in enumerate(ds):
        try:
            prompt = prompt_records.prompt_of(rec, where(i))
        except ScanError as e:
            raise DataError(str(e)) from None
        records.append(dict(rec))
        prompts.append(prompt)
        texts.append(prompt if isinstance(prompt, str) else chat._render(prompt, True))
    ids, cut = [], 0
    for t in enc.encode(texts):
        cut += len(t) > keep
        ids.append(np.asarray(t[-keep:], dtype=np.int64))
    if len(records) < r.world:
        raise DataError(f"[data] path: {cfg.data.path}: {len(records)} prompt(s), fewer than the {r.world} ranks")
    key = hashlib.sha256(f"{enc.name}|{keep}".encode()).hexdigest()[:16]
    meta = {"data_sha256": data_hash.content_hash(Path(cfg.data.path).expanduser()), "records": len(records)}
    out = PromptSet(records, prompts, ids, where, enc, cut, meta, Path(f"prompts-{key}"))
    r.data_state.entry, r.data_state.built = out, True
    return out


def to_batch(ps: PromptSet, index: list[int], pad: int) -> Batch:
    """Prompts padded on the left to the longest, `mask` 1 on their tokens."""
    longest = max(len(ps.ids[i]) for i in index)
    ids = np.full((len(index), longest), pad, dtype=np.int64)
    mask = np.zeros((len(index), longest), dtype=np.int64)
    for row, i in enumerate(index):
        n = len(ps.ids[i])
        ids[row, longest - n:] = ps.ids[i]
        mask[row, longest - n:] = 1
    inputs = torch.from_numpy(ids)
    return Batch(inputs, torch.full_like(inputs, IGNORE), None, pairs=torch.tensor(index, dtype=torch.int64),
                 mask=torch.from_numpy(mask))


class PromptSource(GlobalCursor):
    """micro_batch prompts at a time in a per-epoch shuffled order (batches.PackedWindows' rule)."""

    def __init__(self, ps: PromptSet, seed: int, rank: int, world: int) -> None:
        super().__init__(rank, world)
        self.ps, self.seed, self.n = ps, seed, len(ps.ids)

    def batch(self, micro_batch: int) -> Batch:
        index = []
        for g in self.take(micro_batch):
            epoch, i = divmod(g, self.n)
            index.append(shuffled(i, self.n, self.seed * 1_000_003 + epoch))
        return to_batch(self.ps, index, self.ps.encoder.eos)


def make_source(r) -> PromptSource:
    """The rank's prompts; rank 0 emits the data summary."""
    ps = load(r)
    if r.rank == 0:
        cfg, t = r.cfg, r.cfg.train
        tokens = int(sum(len(x) for x in ps.ids))
        per_step = t.micro_batch * t.grad_accum * r.world
        notes = [f"{len(ps.ids)} prompts, each completed {cfg.grpo.generations} times, up to "
                 f"{cfg.grpo.max_new_tokens} new tokens"]
        if ps.cut:
            notes.append(f"{ps.cut} prompt(s) longer than data.seq_len - grpo.max_new_tokens: cut from the left")
        r.emit(P.DataSummary(run=r.run_id, rank=0, source=str(cfg.data.path), format="prompts",
                             tokenizer=ps.encoder.name, template="", records=len(ps.ids), tokens=tokens,
                             samples=len(ps.ids), loss_share=0.0,
                             epochs=round(t.steps * per_step / max(1, len(ps.ids)), 3), eval_records=0,
                             eval_samples=0, cross_document_attention=True, note="; ".join(notes)))
    return PromptSource(ps, r.cfg.train.seed, r.rank, r.world)


def make_eval_source(r) -> None:
    return None


__all__ = ["PromptSet", "PromptSource", "load", "make_source", "make_eval_source"]
