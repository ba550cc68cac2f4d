"""Several data sources in one run (issue 66 item 2): data.path names them, data.weights their ratio.

    data.path = ["code.jsonl", "chat.jsonl"]    # or --set data.path=code.jsonl,chat.jsonl
    data.weights = [3, 1]                        # or --set data.weights=3,1 (empty: equal shares)

A list is one comma-separated string inside the settings (as lora.target_modules), so a TOML list and a
--set value are the same setting. The ratio holds at the packed-row level: the run's global samples are
cut into blocks of `block` rows, `quota[k]` of them from source k in an order shuffled per block by the
seed (backends/data/mixture.py), so source k's rows before global sample g are a function of g alone and
a resume at g sees the rows the uninterrupted run would have. A source that runs out starts a new epoch
of its own (a fresh shuffle of its rows), so the shares hold to the end of the run.

Standard library only: the front ends read it before a launch and the ranks after.
"""

from __future__ import annotations

import math
from fractions import Fraction

from shardconsole.settings.values import ConfigError

MAX_BLOCK = 4096        # rows per block; an irrational-looking ratio is rounded to a share of this


def paths(d) -> list[str]:
    """The sources of data.path, in order (one for a plain path)."""
    return [p.strip() for p in str(d.path).split(",") if p.strip()]


def is_mix(d) -> bool:
    return len(paths(d)) > 1


def weights(d, source: str = "preset") -> list[float]:
    """data.weights as numbers, one per source of data.path (empty: 1 each); a ConfigError naming the key."""
    names = paths(d)
    text = [w.strip() for w in str(d.weights).split(",") if w.strip()]
    if not text:
        return [1.0] * len(names)
    out = []
    for w in text:
        try:
            v = float(w)
        except ValueError:
            raise ConfigError(f"{w!r} is not a number; one positive number per source of data.path",
                              source=source, table="data", key="weights") from None
        if not math.isfinite(v) or v <= 0:
            raise ConfigError(f"{w} is not above 0; each source's weight must be a positive number (drop a "
                              f"source from data.path instead of weighting it 0)", source=source, table="data",
                              key="weights")
        out.append(v)
    if len(out) != len(names):
        raise ConfigError(f"has {len(out)} weight(s) but data.path names {len(names)} source(s) "
                          f"({', '.join(names) or 'none'}); give one weight per source, in the same order",
                          source=source, table="data", key="weights")
    return out


def quota(ws: list[float]) -> tuple[list[int], int]:
    """(rows per block from each source, rows per block): the exact ratio when it fits MAX_BLOCK rows
    (3:1 -> [3, 1], 4; 0.7:0.3 -> [7, 3], 10), else the shares rounded to MAX_BLOCK by largest remainder."""
    fr = [Fraction(w).limit_denominator(1000) for w in ws]
    den = math.lcm(*(f.denominator for f in fr))
    q = [int(f * den) for f in fr]
    g = math.gcd(*q)
    q = [x // g for x in q]
    if sum(q) <= MAX_BLOCK and all(q):
        return q, sum(q)
    total = sum(ws)
    raw = [w / total * MAX_BLOCK for w in ws]
    q = [max(1, int(r)) for r in raw]
    for k in sorted(range(len(ws)), key=lambda k: int(raw[k]) - raw[k])[:max(0, MAX_BLOCK - sum(q))]:
        q[k] += 1
    return q, sum(q)


def counts(q: list[int], block: int, samples: int) -> list[float]:
    """About how many of `samples` global rows each source gives (exact at a block boundary)."""
    return [samples * x / block for x in q]


def check(d, source: str = "preset", origins: dict[str, str] | None = None, objective: str = "sft") -> None:
    """The rules of a mix before anything is read: weights (count, values) and what a mix cannot be."""
    def where(key: str) -> str:
        return (origins or {}).get(f"data.{key}", source)
    if str(d.weights).strip() and not d.path:
        raise ConfigError("is set but data.path is empty; name the sources in data.path",
                          source=where("weights"), table="data", key="weights")
    weights(d, where("weights"))
    if not is_mix(d):
        return
    names = paths(d)
    dup = next((p for i, p in enumerate(names) if p in names[:i]), None)
    if dup:
        raise ConfigError(f"names {dup} twice; name each source once and give it a larger weight instead",
                          source=where("path"), table="data", key="path")
    if d.source not in ("auto", "text"):
        raise ConfigError(f"names {len(names)} sources, which are mixed from their records: data.source = "
                          f"\"auto\" (not {d.source!r})", source=where("path"), table="data", key="path")
    if objective != "sft":
        raise ConfigError(f"names {len(names)} sources: a mix of sources is for train.objective = \"sft\" "
                          f"(not {objective!r}) for now; name one file", source=where("path"), table="data",
                          key="path")
    if d.eval_path:
        raise ConfigError("holds one eval set, but data.path names several sources: use data.eval_fraction, "
                          "which holds out records of each source (an eval loss per source)",
                          source=where("eval_path"), table="data", key="eval_path")
