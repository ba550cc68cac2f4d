"""Several runs side by side: the settings in which they differ, their figures, their curves. Text
only, shared by `shardconsole compare` and the console's compare view."""

from __future__ import annotations

import time
from typing import Any

from shardconsole.settings import config as C
from shardconsole.history.index import RunSummary
from shardconsole.history.textplot import overlay


def fmt_bytes(n: int | None) -> str:
    return "-" if n is None else C.format_size(n)


def fmt_num(x: float | None, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def fmt_rate(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x / 1000:.1f}k" if x >= 1000 else f"{x:.0f}"


def fmt_time(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(t)) if t else "-"


def figures(s: RunSummary) -> dict[str, str]:
    """The figures of one run as `runs` and `compare` print them."""
    return {
        "status": s.status_text,
        "started": fmt_time(s.started),
        "preset": s.preset or "-",
        "backend": s.backend or "-",
        "training": s.training or "-",      # an SFT loss and a DPO loss are not the same figure
        "model": s.model or "-",
        "steps": f"{s.step}/{s.steps}" if s.steps else "-",
        "tokens/s": fmt_rate(s.tokens_per_s),
        "MFU": "-" if s.mfu is None else f"{100 * s.mfu:.1f}%",
        "peak GPU": fmt_bytes(s.peak_gpu_bytes),
        "peak host": fmt_bytes(s.peak_host_bytes),
        "last loss": fmt_num(s.last_loss, ".4f"),
        "eval loss": fmt_num(s.eval_loss, ".4f"),
    }


# Bookkeeping, not a setting the runs were trained with: `resume` turns train.resume on in the folder.
NOT_SETTINGS = {"description", "train.resume"}


def _flat(cfg: C.RunConfig | None) -> dict[str, Any]:
    if cfg is None:
        return {}
    out: dict[str, Any] = {}
    for table, values in cfg.to_dict().items():
        if isinstance(values, dict):
            out.update({f"{table}.{k}": v for k, v in values.items()})
        else:
            out[table] = values
    # A schedule as long as the run is the default whether written as 0 or as train.steps (a resume
    # writes it): only one that ends before the run's last step differs in how it trains.
    if cfg.train.schedule_steps in (0, cfg.train.steps):
        out.pop("train.schedule_steps", None)
    return out


def settings_diff(runs: list[RunSummary]) -> list[tuple[str, list[str]]]:
    """(table.key, each run's value) for every setting whose value is not the same in all runs; a run
    whose preset.toml could not be read shows '?'."""
    flats = [_flat(r.settings) for r in runs]
    keys = sorted({k for f in flats for k in f} - NOT_SETTINGS)
    out = []
    for key in keys:
        values = ["?" if r.settings is None else _show(f.get(key)) for r, f in zip(runs, flats)]
        if len(set(values)) > 1:
            out.append((key, values))
    return out


def _show(v: Any) -> str:
    if v is None:
        return "(unset)"
    if isinstance(v, bool):
        return "true" if v else "false"
    return str(v)


def shown(text: str) -> str:
    """text with its unprintable characters escaped as Python writes them: a run folder named with a
    newline broke its row in two, and the columns after it."""
    return "".join(ch if ch.isprintable() else repr(ch)[1:-1] for ch in text)


def table(header: list[str], rows: list[list[str]], max_cell: int = 40) -> list[str]:
    rows = [[shown(c)[:max_cell - 1] + "…" if len(shown(c)) > max_cell else shown(c) for c in row] for row in rows]
    header = [h if len(h) <= max_cell else h[:max_cell - 1] + "…" for h in header]
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    line = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()   # noqa: E731
    return [line(header), line(["-" * w for w in widths]), *[line(r) for r in rows]]


def compare_text(runs: list[RunSummary], width: int = 100) -> list[str]:
    """The whole comparison: settings that differ, the figures side by side, the loss and tokens/s
    curves overlaid."""
    ids = [r.run_id for r in runs]
    out = ["Settings that differ:"]
    diff = settings_diff(runs)
    out += ["  " + line for line in table(["setting", *ids], [[k, *v] for k, v in diff])] if diff \
        else ["  none: the same settings"]
    out += ["", "Figures:"]
    figs = [figures(r) for r in runs]
    rows = [[name, *(f[name] for f in figs)] for name in figs[0]]
    if any(r.eval_pref_accuracy is not None for r in runs):     # preference runs (issue 47)
        rows.append(["eval pref accuracy", *("-" if r.eval_pref_accuracy is None else f"{100 * r.eval_pref_accuracy:.1f}%"
                                             for r in runs)])
    out += ["  " + line for line in table(["", *ids], rows)]
    for r in runs:
        if r.status != "finished" and r.detail:
            out.append(f"  {r.run_id}: {r.detail}")
    names = [f"{r.run_id}" for r in runs]
    out.append("")
    out += overlay("loss (train)", list(zip(names, [r.loss for r in runs])), width=width)
    if any(r.eval for r in runs):
        out.append("")
        out += overlay("loss (eval)", list(zip(names, [r.eval for r in runs])), width=width)
    out.append("")
    out += overlay("tokens/s", list(zip(names, [r.throughput for r in runs])), width=width, fmt=".4g")
    return out
