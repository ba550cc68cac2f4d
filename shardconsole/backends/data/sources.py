"""The rank's training data, one source (batches.py) or several mixed by weight (mixture.py): what the
engine and the checkpoints call. A mix is dispatched here so that batches.py, which the mix builds on,
never imports it."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from shardconsole.backends.data import batches, mixture
from shardconsole.backends.data.batches import Batch, EvalWindows, epoch_start, next_batch
from shardconsole.settings import data_mix

__all__ = ["Batch", "epoch_start", "next_batch", "make_source", "make_eval_source", "identity", "check_resume"]


def _mix(r) -> mixture.MixEntry:
    """The mix's cache entries and rows, built once per rank (kept in r.data_state as a single entry is)."""
    if not r.data_state.built:
        mix = mixture.open_mix(r.cfg, r.spec.vocab, r.spec.path, r.spec.has_tokenizer, r.log)
        mix.source = mixture.source_of(r.cfg, mix, r.rank, r.world)
        r.data_state.entry, r.data_state.built = mix, True
    return r.data_state.entry


def make_source(r):
    """The rank's training source (r: a backends.common.Rank); rank 0 emits the data summary."""
    if not data_mix.is_mix(r.cfg.data) or r.cfg.data.source not in ("auto", "text"):
        return batches.make_source(r)
    mix = _mix(r)
    assert mix.source is not None
    if r.rank == 0:
        s = mixture.summary(r.cfg, r.world, mix.source, mix)
        r.emit(dataclasses.replace(s, run=r.run_id, rank=r.rank))
    return mix.source


def make_eval_source(r) -> EvalWindows | mixture.PerSource | None:
    """The held-out windows of this rank (a mix: of each source), or None when there is no eval data."""
    if not data_mix.is_mix(r.cfg.data) or r.cfg.data.source not in ("auto", "text"):
        return batches.make_eval_source(r)
    return mixture.PerSource(mixture.eval_sources(r.cfg, _mix(r), r.rank, r.world)) or None


def identity(r) -> dict | None:
    """What a checkpoint records of its data (mixture.identity for a mix)."""
    entry = r.data_state.entry
    return mixture.identity(r.cfg, entry) if isinstance(entry, mixture.MixEntry) else batches.identity(r)


def check_resume(r, saved: dict | None, checkpoint: Path) -> None:
    """Refuse to resume on data other than the checkpoint's (a mix: its sources, weights and content)."""
    now = identity(r)
    if saved and now is not None and saved.get("sha256") and ("sources" in saved or "sources" in now):
        mixture.check_resume(r, saved, now)
        return
    batches.check_resume(r, saved, checkpoint)
