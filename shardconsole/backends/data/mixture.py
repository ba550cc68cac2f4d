"""Several sources mixed by ratio (settings/data_mix.py says how they are set): the ranks' side.

Global sample g of the run is row (g mod block) of block g // block, whose rows are `quota[k]` rows of
source k in an order shuffled by (seed, block). Row g is then sample i of source k, i = the rows of k
in the blocks before plus those before it in its block, and i is read as sample i mod n_k of epoch
i // n_k of that source (a fresh permutation of its windows per epoch, as batches.PackedWindows). All
of it is a function of g: source.seek(consumed) puts every source at the position the uninterrupted
run had there, on any world size, and positions(consumed) says what each source has given.
"""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from shardconsole.backends.data import token_cache
from shardconsole.backends.data.batches import Batch, EvalWindows, GlobalCursor, shuffled, windows_to_batch
from shardconsole.backends.data.corpus import DataError
from shardconsole.settings import data_mix


@dataclass
class MixEntry:
    """The cache entries of a mix's sources, in data.path's order, where the ranks hold one entry.
    `meta` is the first's: the tokenizer and chat template, the same for every source."""
    names: list[str]
    entries: list[token_cache.Entry]
    weights: list[float]

    @property
    def meta(self) -> dict:
        return self.entries[0].meta

    eval = None      # per source: eval_sources()
    source: "MixedWindows | None" = None      # the training rows, once built (its position for a checkpoint)


class MixedWindows(GlobalCursor):
    """Packed windows of several sources' token caches, `quota` rows of each per block of `block`."""

    def __init__(self, parts: list[tuple[np.ndarray, np.ndarray]], quota: list[int], seq_len: int, seed: int,
                 rank: int, world: int, names: list[str], cross_doc: bool) -> None:
        super().__init__(rank, world)
        self.parts, self.quota, self.block = parts, quota, sum(quota)
        self.seq_len, self.seed, self.cross_doc = seq_len, seed, cross_doc
        self.sizes = [(len(ids) - 1) // seq_len if len(ids) else 0 for ids, _ in parts]
        for name, n in zip(names, self.sizes):
            if n < 1:
                raise DataError(f"[data] path: {name}: fewer tokens than one sample of {seq_len + 1}; lower "
                                f"data.seq_len or add data to it")
        self.n = sum(self.sizes)      # rows of one pass over every source (epoch_start's unit)
        self._cached: tuple[int, list[int], list[int]] = (-1, [], [])

    def _rows(self, b: int) -> tuple[list[int], list[int]]:
        """Block b: the source of each row and how many rows of that source come before it in the block."""
        if self._cached[0] != b:
            edges = np.cumsum(self.quota)
            src, nth, seen = [], [], [0] * len(self.quota)
            for j in range(self.block):
                k = int(np.searchsorted(edges, shuffled(j, self.block, self.seed * 7_919 + b), side="right"))
                src.append(k)
                nth.append(seen[k])
                seen[k] += 1
            self._cached = (b, src, nth)
        return self._cached[1], self._cached[2]

    def locate(self, g: int) -> tuple[int, int]:
        """(source, its sample index) of global sample g."""
        b, j = divmod(g, self.block)
        src, nth = self._rows(b)
        k = src[j]
        return k, b * self.quota[k] + nth[j]

    def window(self, k: int, i: int) -> int:
        epoch, pos = divmod(i, self.sizes[k])
        return shuffled(pos, self.sizes[k], self.seed * 1_000_003 + epoch + ((k + 1) << 40))

    def positions(self, samples: int) -> list[int]:
        """Samples each source has given when the run has consumed `samples` global samples."""
        b, j = divmod(samples, self.block)
        out = [b * q for q in self.quota]
        if j:
            src, _ = self._rows(b)
            for k in src[:j]:
                out[k] += 1
        return out

    def windows(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        S = self.seq_len
        rows = []
        for g in self.take(n):
            k, i = self.locate(g)
            w = self.window(k, i)
            ids, flags = self.parts[k]
            rows.append((np.asarray(ids[w * S: w * S + S + 1]), np.asarray(flags[w * S: w * S + S + 1])))
        return np.stack([r[0] for r in rows]), np.stack([r[1] for r in rows])

    def batch(self, micro_batch: int) -> Batch:
        return windows_to_batch(*self.windows(micro_batch), cross_doc=self.cross_doc)


def open_mix(cfg, vocab: int, model_path: str | None, has_tokenizer: bool, log) -> MixEntry:
    """Each source tokenized and cached as a single data.path is (its own cache entry)."""
    names = data_mix.paths(cfg.data)
    entries = [token_cache.open_entry(dataclasses.replace(cfg.data, path=p, weights=""), cfg.train.seed, model_path,
                                      has_tokenizer, vocab, log) for p in names]
    return MixEntry(names, entries, data_mix.weights(cfg.data, "the ranks"))


def source_of(cfg, entry: MixEntry, rank: int, world: int) -> MixedWindows:
    q, _ = data_mix.quota(entry.weights)
    return MixedWindows([(e.train.ids, e.train.flags) for e in entry.entries], q, cfg.data.seq_len,
                        cfg.train.seed, rank, world, entry.names, cfg.data.cross_document_attention)


def eval_sources(cfg, entry: MixEntry, rank: int, world: int) -> list[tuple[str, EvalWindows]]:
    """(source name, its held-out windows) for each source with eval records (data.eval_fraction)."""
    out = []
    for name, e in zip(entry.names, entry.entries):
        if e.eval is not None and len(e.eval.ids) >= 2:
            out.append((Path(name).name, EvalWindows(e.eval.ids, e.eval.flags, cfg.data.seq_len, rank, world,
                                                     cfg.data.cross_document_attention)))
    return out


@dataclass
class PerSource:
    """A mix's held-out windows, source by source (the evaluator reports a loss for each)."""
    parts: list[tuple[str, EvalWindows]]

    def __bool__(self) -> bool:
        return bool(self.parts)

    def samples(self) -> int:
        return sum(w.samples() for _, w in self.parts)


def shares(entry: MixEntry) -> list[float]:
    q, block = data_mix.quota(entry.weights)
    return [x / block for x in q]


def summary(cfg, world: int, src: MixedWindows, entry: MixEntry):
    """The data line of a mix: the totals, and per source its share, epochs and training tokens."""
    from shardconsole.runlog import protocol as P
    t, d = cfg.train, cfg.data
    rows = t.steps * t.micro_batch * t.grad_accum * world
    given = src.positions(rows)       # exact: the rows each source gives over the whole run
    splits = [e.meta["splits"] for e in entry.entries]
    ev = [s.get("eval") for s in splits]
    ev_samples = sum(-(-(e["tokens"] - 1) // d.seq_len) for e in ev if e and e["tokens"] > 1)
    formats = sorted({e.meta["format"] for e in entry.entries})
    tokens = sum(s["train"]["tokens"] for s in splits)
    return P.DataSummary(
        source=", ".join(str(Path(p).expanduser()) for p in entry.names), format="+".join(formats),
        tokenizer=entry.meta["tokenizer"], template=entry.meta["template"],
        records=sum(s["train"]["records"] for s in splits), tokens=tokens, samples=src.n,
        loss_share=round(sum(s["train"]["loss_tokens"] for s in splits) / max(1, tokens), 4),
        epochs=round(rows / src.n, 3), eval_records=sum(e["records"] for e in ev if e), eval_samples=ev_samples,
        cross_document_attention=d.cross_document_attention,
        sources=tuple(entry.names), source_shares=tuple(round(x, 4) for x in shares(entry)),
        source_epochs=tuple(round(c / n, 3) for c, n in zip(given, src.sizes)),
        source_tokens=tuple(c * d.seq_len for c in given))


def identity(cfg, entry: MixEntry) -> dict:
    """What a checkpoint records of a mix: each source's content and cache key, its weight, and the
    samples it had given at the checkpoint (its position; its epoch is samples // windows)."""
    from shardconsole.settings.data import data_hash
    at = entry.source.positions(entry.source.consumed) if entry.source is not None else [0] * len(entry.names)
    sizes = entry.source.sizes if entry.source is not None else [0] * len(entry.names)
    sources = [{"path": p, "sha256": e.meta.get("data_sha256"), "records": e.meta.get("records"),
                "cache_key": e.folder.name, "weight": w, "samples": a, "windows": n,
                "epoch": a // n if n else 0}
               for p, e, w, a, n in zip(entry.names, entry.entries, entry.weights, at, sizes)]
    combined = ",".join(f"{s['sha256']}:{s['weight']}" for s in sources)
    return {"path": cfg.data.path, "sha256": hashlib.sha256(combined.encode()).hexdigest(),
            "hashed": data_hash.HASHED, "records": sum(s["records"] or 0 for s in sources),
            "cache_key": "mix:" + ",".join(e.folder.name for e in entry.entries), "sources": sources}


def weights_of(sources: list[dict]) -> list[float]:
    return [float(s["weight"]) for s in sources]


def why_other(saved: dict, now: dict) -> str | None:
    """How the checkpoint's mix differs from this run's (None: the same sources, content and weights)."""
    old = saved.get("sources") or [{"path": saved.get("path"), "weight": 1.0, "cache_key": saved.get("cache_key")}]
    new = now["sources"]
    if [Path(str(s["path"])).name for s in old] != [Path(str(s["path"])).name for s in new]:
        return (f"the checkpoint was trained on {', '.join(str(s['path']) for s in old)}, data.path now names "
                f"{', '.join(str(s['path']) for s in new)}")
    if [float(s.get("weight", 1.0)) for s in old] != [float(s["weight"]) for s in new]:
        was = ", ".join(f"{float(s.get('weight', 1.0)):g}" for s in old)
        return f"the checkpoint was trained with data.weights {was}, now {', '.join(f'{s:g}' for s in weights_of(new))}"
    changed = [s["path"] for s, o in zip(new, old) if s["cache_key"] != o.get("cache_key")]
    if changed:
        return f"{', '.join(changed)}: content or tokenizing changed since the checkpoint"
    return None


def check_resume(r, saved: dict, now: dict) -> None:
    """A mix resumes on the same sources, weights and content, or (data.allow_changed) from an epoch start."""
    why: str | None
    if not now.get("sources"):
        why = f"the checkpoint was trained on a mix of {len(saved['sources'])} sources, data.path now names one"
    else:
        why = why_other(saved, now)
    if why is None:
        return
    if not r.cfg.data.allow_changed:
        raise DataError(f"[data] path: {why}; resume on the data the checkpoint was trained on, or --set "
                        f"data.allow_changed=true to go on from the start of an epoch of the new data")
    r.data_state.changed = True
    if r.rank == 0:
        r.event("warning", f"data: {why}; data.allow_changed: going on from the start of an epoch of the new data")
