"""What a tune shows and writes: the table rows (the same cells for the CLI and the console screen) and
the tuned preset, whose header comment holds the measured figures, the date and the machine."""

from __future__ import annotations

import platform
import time
from pathlib import Path

from shardconsole.settings import config as C
from shardconsole.settings import preset_store
from shardconsole.plan.speeds import machine_key
from shardconsole.tune.engine import Row, Tune

HEADER_MARK = "# shardconsole tune"
COLUMNS = ("#", "settings", "plan GPU", "plan host", "GPU (NVML)", "host (ranks)", "tok/s", "vs baseline", "status")


def _gib(n: int | None) -> str:
    return f"{n / 2**30:.1f}G" if n else "-"


def _rate(x: float) -> str:
    return f"{x / 1000:.2f}k" if x >= 1000 else f"{x:.0f}"


def cells(tune: Tune, n: int, row: Row) -> tuple[str, ...]:
    e, res = row.option.estimate, row.result
    base = tune.baseline()
    base_tps = base.result.tokens_per_s if base and base.result and base.result.ok else 0.0
    if res is None:
        status = row.state
        return (str(n), row.label, _gib(e.gpu_peak_bytes), _gib(e.host_peak_bytes), "-", "-", "-", "-", status)
    vs = f"{100 * (res.tokens_per_s / base_tps - 1):+.0f}%" if res.ok and base_tps and not row.option.baseline else "-"
    status = "running" if row.state == "running" else (res.status if res.ok else f"{res.status}: {res.message}"[:60])
    return (str(n), row.label, _gib(e.gpu_peak_bytes), _gib(e.host_peak_bytes), _gib(res.gpu_peak_bytes),
            _gib(res.host_peak_bytes), _rate(res.tokens_per_s) if res.tokens_per_s else "-", vs, status)


def table(tune: Tune, upcoming: int = 3) -> list[tuple[str, ...]]:
    """The probed rows, then the next few options the planner would probe."""
    rows = [cells(tune, i + 1, r) for i, r in enumerate(tune.rows)]
    probed = {id(r.option) for r in tune.rows}
    nxt = [o for o in tune.options if id(o) not in probed and o.estimate.fits and not tune._doomed(o)][:upcoming]
    for o in nxt:
        p = o.prediction
        guess = f"~{_rate(p.value)}" if p.unit == "tokens/s" else f"~{p.value:.2f}x"
        rows.append(("", ("baseline: " if o.baseline else "") + o.name, _gib(o.estimate.gpu_peak_bytes),
                     _gib(o.estimate.host_peak_bytes), "-", "-", guess, "-", f"next ({p.source})"))
    return rows


def format_table(rows: list[tuple[str, ...]]) -> str:
    all_rows = [COLUMNS, *rows]
    widths = [min(max(len(r[i]) for r in all_rows), 70 if i == 1 else 64) for i in range(len(COLUMNS))]
    return "\n".join("  ".join(c[:w].ljust(w) for c, w in zip(r, widths)).rstrip() for r in all_rows)


def machine_text(tune: Tune) -> str:
    hw = tune.hw
    where = machine_key(hw, tune.base.parallel.device)
    return f"{where}, host {C.format_size(hw.host_memory_bytes)} ({platform.node() or 'this machine'})"


def preset_text(tune: Tune, winner: Row, name: str, source: str) -> str:
    """The winner's settings as a preset file, the figures in its header comment."""
    res = winner.result
    assert res is not None
    base = tune.baseline()
    lines = [f"{HEADER_MARK}, {time.strftime('%Y-%m-%d %H:%M')} on {machine_text(tune)}",
             f"# from preset {source}; the fastest of {len(tune.rows)} probe(s) of {tune.limits.probe_steps} steps "
             f"that stayed under the caps"
             + (f" (GPU cap {C.format_size(tune.limits.gpu_cap_bytes)})" if tune.limits.gpu_cap_bytes else "")
             + (f" (host cap {C.format_size(tune.limits.host_cap_bytes)})" if tune.limits.host_cap_bytes else ""),
             f"# winner: {winner.option.name}: {res.tokens_per_s:.0f} tokens/s, GPU peak {_gib(res.gpu_peak_bytes)} "
             f"(NVML), host {_gib(res.host_peak_bytes)} (ranks' RSS)"]
    if base is not None and base.result is not None:
        b = base.result
        figure = f"{b.tokens_per_s:.0f} tokens/s" if b.ok else f"{b.status} ({b.message[:80]})"
        lines.append(f"# baseline ({source} as given): {figure}")
    lines.append("# probes:")
    for i, row in enumerate(tune.rows):
        r = row.result
        if r is None:
            continue
        what = f"{r.tokens_per_s:.0f} tokens/s, GPU {_gib(r.gpu_peak_bytes)}, host {_gib(r.host_peak_bytes)}" \
            if r.ok else f"{r.status}: {r.message[:80]}"
        lines.append(f"#   {i + 1}. {row.label}: {what}")
    if winner.option.overrides:
        sets = " ".join(f"--set {o}" for o in winner.option.overrides)
        lines.append(f"# the same as: --preset {source} {sets}")
    cfg = C.copy(winner.option.cfg)
    cfg.description = (f"tuned from {source} by shardconsole tune: {winner.option.name}, "
                       f"{res.tokens_per_s:.0f} tokens/s measured")
    return "\n".join(lines) + "\n\n" + C.dumps(cfg)


def write_preset(tune: Tune, winner: Row, name: str, source: str) -> Path:
    """The user preset `name`; one written by an earlier tune is replaced, any other is kept (ConfigError)."""
    preset_store.check_name(name)
    path = preset_store.user_dir() / f"{name}.toml"
    if path.exists():
        try:
            first = path.read_text().split("\n", 1)[0]
        except OSError:
            first = ""
        if not first.startswith(HEADER_MARK):
            raise C.ConfigError(f"a preset {name!r} exists and was not written by tune ({path}); pick another name "
                                f"with -o NAME", source="-o")
    text = preset_text(tune, winner, name, source)
    import tomllib
    C.build(tomllib.loads(text), str(path))          # what is written loads back as these settings
    path.parent.mkdir(parents=True, exist_ok=True)
    return C.write_atomic(path, text)
