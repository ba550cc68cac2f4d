"""`shardconsole data` on several sources (data.path names them, settings/data_mix.py): each source's share
of the rows and the epochs this run makes over it, from each source's token cache (the ranks' own, built
here if the run has not built it yet, and then reused by the run), and a preview of each source's records."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from shardconsole.settings import config as C
from shardconsole.settings import data_mix
from shardconsole.settings.models import ModelSpec
from shardconsole.tryout.preview import Preview, preview


@dataclass
class SourceView:
    path: str
    weight: float
    share: float            # of the run's rows
    samples: int            # packed windows of seq_len + 1 tokens in its train split
    rows: int               # the rows this run takes from it
    epochs: float           # passes over it (above 1: it runs out and starts again)
    preview: Preview


def mix_views(cfg: C.RunConfig, spec: ModelSpec, n: int, *, rnd: bool = False, seed: int = 0) -> list[SourceView]:
    from shardconsole.backends.data import corpus, token_cache
    from shardconsole.backends.data.corpus import DataError
    t, p = cfg.train, cfg.parallel
    rows_total = t.steps * t.micro_batch * t.grad_accum * p.nproc_per_node * p.nnodes
    weights = data_mix.weights(cfg.data)
    q, block = data_mix.quota(weights)
    rows = data_mix.counts(q, block, rows_total)
    out = []
    for path, w, share, r in zip(data_mix.paths(cfg.data), weights, (x / block for x in q), rows):
        one = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, path=path, weights=""))
        try:
            entry = token_cache.open_entry(one.data, t.seed, spec.path, spec.has_tokenizer,
                                           int(spec.config.get("vocab_size", 0)), lambda s: None)
        except (DataError, corpus.DataError) as e:
            raise C.ConfigError(str(e)) from None
        windows = max(0, (len(entry.train.ids) - 1) // cfg.data.seq_len)
        out.append(SourceView(path, w, round(share, 4), windows, int(round(r)),
                              round(r / windows, 3) if windows else 0.0, preview(one, spec, n, rnd=rnd, seed=seed)))
    return out


def header(views: list[SourceView]) -> str:
    return "\n".join([f"data: {len(views)} sources mixed by data.weights (a source that runs out starts another "
                      f"epoch of its own)"] + [
        f"  {v.path}: weight {v.weight:g}, {100 * v.share:.1f}% of the rows, {v.rows} of this run's rows "
        f"from {v.samples} packed samples, {v.epochs:.2f} epochs" for v in views])
