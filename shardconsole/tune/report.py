"""What a tune shows and writes: the table rows (the same cells for the CLI and the console screen) and
the tuned preset, whose header comment holds the measured figures, the date and the machine."""

from __future__ import annotations

import platform
import time
from pathlib import Path

from shardconsole.settings import config as C
from shardconsole.settings import preset_store
from shardconsole.plan import search
from shardconsole.plan.speed.book import machine_key
from shardconsole.tune.engine import Row, Tune
from shardconsole.user_folders import presets_dir

HEADER_MARK = "# shardconsole tune"
COLUMNS = ("#", "settings", "plan GPU", "plan host", "GPU (NVML)", "host (ranks)", "tok/s", "vs baseline", "status")


def _gib(n: int | None) -> str:
    return f"{n / 2**30:.1f}G" if n else "-"


def _rate(x: float) -> str:
    return f"{x / 1000:.2f}k" if x >= 1000 else f"{x:.0f}"


def _plan_host(e) -> int:
    # Like for like with the "host (ranks)" column, which sums the ranks' RSS while they train: the
    # planner's figure for the ranks in the training phase, not the node's peak (that adds the launcher,
    # the front end, torch.compile's workers and a save, none of which a probe's RSS holds).
    return e.host_phases.get("training") or e.host_peak_bytes


def cells(tune: Tune, n: int, row: Row) -> tuple[str, ...]:
    e, res = row.option.estimate, row.result
    base = tune.baseline()
    base_tps = base.result.tokens_per_s if base and base.result and base.result.ok else 0.0
    if res is None:
        status = row.state
        return (str(n), row.label, _gib(e.gpu_peak_bytes), _gib(_plan_host(e)), "-", "-", "-", "-", status)
    vs = f"{100 * (res.tokens_per_s / base_tps - 1):+.0f}%" if res.ok and base_tps and not row.option.baseline else "-"
    status = "running" if row.state == "running" else (res.status if res.ok else f"{res.status}: {res.message}"[:60])
    # under a cap, the NVML peak as the capped card would show it (Tune.card_peak_bytes)
    return (str(n), row.label, _gib(e.gpu_peak_bytes), _gib(_plan_host(e)), _gib(tune.card_peak_bytes(res)),
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
                     _gib(_plan_host(o.estimate)), "-", "-", guess, "-", f"next ({p.source})"))
    return rows


MUCH_FASTER = 1.2      # a numerics change predicted this much faster than the best kept is worth a line

# The numerics the note looks at, a bundle at a time (searching all at once multiplies the options past
# the search's limit). The speed book has no optimizer and no step-in-backward, so a low-bit optimizer
# is faster only where its fewer bytes let a faster strategy fit (no offload); the rounding's cost is the
# host step's, not the planner's, so it is left as given.
NOTE_BUNDLES = (
    ("precision.dtype", "precision.master_dtype"),
    ("train.clip_grad_norm",),                        # the FSDP2 offload's host step under the backward
    ("optim.name", "precision.master_dtype"),         # fewer state bytes: no offload where it then fits
    ("optim.name", "precision.master_dtype", "optim.step_in_backward", "train.clip_grad_norm"),
)


def _boldness(cfg, base) -> tuple[int, int]:
    """How far the numerics move, for ties (the book has no optimizer): the keys changed, then each
    value's place in search.NUMERICS (8-bit states before 4-bit)."""
    changed = search.numerics_changed(cfg, base)
    places = 0
    for path in changed:
        table, key = path.split(".")
        value, values = getattr(getattr(cfg, table), key), search.NUMERICS[path]
        places += values.index(value) if value in values else 0
    return len(changed), places


def numerics_note(tune: Tune) -> str:
    """One line: the fastest option the planner and the speed book see if the numerics the tune kept
    (search.NUMERICS, not in --vary) were changed, when it is predicted MUCH_FASTER than the winner (or,
    before any probe, the fastest option kept). Planned, never probed: such a winner would be another
    training ("" when there is none, or it is not much faster)."""
    free = {k for k in search.NUMERICS if k not in tune.fixed and k not in tune.vary}
    alts = []
    for bundle in dict.fromkeys(tuple(k for k in b if k in free) for b in NOTE_BUNDLES):
        if not bundle:
            continue
        alts += [o for o in search.options(tune.base, tune.spec, tune.hw, tune.book, fixed=tune.fixed,
                                           vary=tune.vary | set(bundle))
                 if o.estimate.fits and search.numerics_changed(o.cfg, tune.base)]
    win = tune.winner()
    kept = win.option if win is not None else next((o for o in tune.options if o.estimate.fits), None)
    if not alts or kept is None:
        return ""
    best = max(alts, key=lambda o: (o.prediction.value, tuple(-b for b in _boldness(o.cfg, tune.base)),
                                    -(o.estimate.gpu_peak_bytes or 0)))
    ref = tune.book.predict(kept.cfg, tune.hw)
    if ref.unit != best.prediction.unit or ref.value <= 0 or best.prediction.value < MUCH_FASTER * ref.value:
        return ""
    words = " and ".join(search.numerics_words(best.cfg, tune.base))
    changed = search.numerics_changed(best.cfg, tune.base)
    than = "the winner" if win is not None else "the fastest at the preset's numerics"
    ratio = best.prediction.value / ref.value
    if best.prediction.unit == "tokens/s":
        gain = f"would give ~{_rate(best.prediction.value)} tokens/s, {ratio:.1f}x {than}"
    else:
        gain = f"would be ~{ratio:.1f}x as fast as {than}"
    # The page of docs/ and its section that say what the change costs in quality or why it helps.
    page, section = (("MEASURED.md", "Without offload: low-bit AdamW and the step in backward") if "optim.name" in changed
                     else ("MEASURED.md", "bf16 masters: the trade-off") if "precision.master_dtype" in changed
                     else ("OFFLOAD.md", "The host step under the backward") if "train.clip_grad_norm" in changed
                     else ("TUNE.md", "Tune"))
    return (f"{words} {gain} ({best.name}; {best.prediction.source}, not probed); it changes the update: "
            f"see docs/{page}, \"{section}\"; " + " ".join(f"--vary {k}" for k in changed) + " probes it")


# Two probes of the same settings differ by a few percent even in one call (a step of a few tenths of a
# second moves with the host's other work; the same 3b bf16 settings moved 12% between calls, issue 48):
# closer than this, which of two probes of a few steps is faster is not a finding.
TIE_NOISE = 0.05


def tie_note(tune: Tune) -> str:
    """One line when the winner's measured tokens/s is within TIE_NOISE of the next probe's that stayed
    under the caps: a tie within the run-to-run noise, not a winner ("" otherwise)."""
    done = sorted(((r.option.name, r.result.tokens_per_s) for r in tune.rows
                   if r.result is not None and r.result.ok and r.result.tokens_per_s > 0), key=lambda x: -x[1])
    if len(done) < 2:
        return ""
    best = done[0][1]
    close = [(name, tps) for name, tps in done[1:] if tps >= best * (1 - TIE_NOISE)]
    if not close:
        return ""
    others = ", ".join(f"{name} {tps:,.0f} ({100 * (tps / best - 1):+.1f}%)" for name, tps in close)
    return (f"a tie within the noise: {others} against the winner's {best:,.0f} tokens/s, within the "
            f"{100 * TIE_NOISE:.0f}% that probes of {tune.limits.probe_steps} steps move run to run; the winner was "
            f"written, but it is not shown faster (longer probes, --probe-steps, would tell them apart)")


def format_table(rows: list[tuple[str, ...]]) -> str:
    all_rows = [COLUMNS, *rows]
    widths = [min(max(len(r[i]) for r in all_rows), 70 if i == 1 else 64) for i in range(len(COLUMNS))]
    return "\n".join("  ".join(c[:w].ljust(w) for c, w in zip(r, widths)).rstrip() for r in all_rows)


def machine_text(tune: Tune) -> str:
    hw = tune.hw
    where = machine_key(hw, tune.base.parallel.device)
    # a host given (--host-cores, --host-gbps) is not this machine's: the ranking's host side is that one's
    host = (f"{C.format_size(hw.host_memory_bytes)} ({platform.node() or 'this machine'})" if not hw.host_given else
            f"{C.format_size(hw.host_memory_bytes)}, {hw.cpus} CPU cores ({hw.host_given})")
    if hw.source.startswith("planned"):     # a dry run without a GPU: the preset's cards, not this machine's
        return (f"{hw.gpus} GPU(s) of {C.format_size(hw.gpu_memory_bytes)} ({hw.source.removeprefix('planned: ')}), "
                f"host {host}")
    return f"{where}, host {host}"


def preset_text(tune: Tune, winner: Row, name: str, source: str) -> str:
    """The winner's settings as a preset file, the figures in its header comment."""
    res = winner.result
    assert res is not None
    base = tune.baseline()
    lines = [f"{HEADER_MARK}, {time.strftime('%Y-%m-%d %H:%M')} on {machine_text(tune)}",
             f"# from preset {source}; the fastest of {len(tune.rows)} probe(s) of {tune.limits.probe_steps} steps "
             f"that stayed under the caps"
             + (f" (GPU cap {C.format_size(tune.limits.gpu_cap_bytes)}, the whole device)"
                if tune.limits.gpu_cap_bytes else "")
             + (f" (host cap {C.format_size(tune.limits.host_cap_bytes)})" if tune.limits.host_cap_bytes else ""),
             f"# winner: {winner.option.name}: {res.tokens_per_s:.0f} tokens/s, GPU peak {_gib(tune.card_peak_bytes(res))} "
             f"(NVML{', as on the capped card' if tune.limits.gpu_cap_bytes else ''}), host {_gib(res.host_peak_bytes)} "
             f"(ranks' RSS)"]
    if base is not None and base.result is not None:
        b = base.result
        figure = f"{b.tokens_per_s:.0f} tokens/s" if b.ok else f"{b.status} ({b.message[:80]})"
        lines.append(f"# baseline ({source} as given): {figure}")
    lines.append("# probes:")
    for i, row in enumerate(tune.rows):
        r = row.result
        if r is None:
            continue
        what = f"{r.tokens_per_s:.0f} tokens/s, GPU {_gib(tune.card_peak_bytes(r))}, host {_gib(r.host_peak_bytes)}" \
            if r.ok else f"{r.status}: {r.message[:80]}"
        lines.append(f"#   {i + 1}. {row.label}: {what}")
    if winner.option.overrides:
        sets = " ".join(f"--set {o}" for o in winner.option.overrides)
        lines.append(f"# the same as: --preset {source} {sets}")
    cfg = C.copy(winner.option.cfg)
    cfg.description = (f"tuned from {source} by shardconsole tune: {winner.option.name}, "
                       f"{res.tokens_per_s:.0f} tokens/s measured")
    return "\n".join(lines) + "\n\n" + preset_store.dumps_preset(cfg)


def check_output(name: str) -> Path:
    """The file the user preset `name` goes to, if tune may write it: one written by an earlier tune is
    replaced, any other is kept (ConfigError). Checked before the first probe (issue 36.13: a tune that
    spent its budget and then refused the name saved nothing) and again when writing."""
    preset_store.check_name(name)
    path = presets_dir() / f"{name}.toml"
    if path.exists():
        try:
            first = path.read_text().split("\n", 1)[0]
        except OSError:
            first = ""
        if not first.startswith(HEADER_MARK):
            raise C.ConfigError(f"a preset {name!r} exists and was not written by tune ({path}); pick another name "
                                f"with -o NAME", source="-o")
    return path


def write_preset(tune: Tune, winner: Row, name: str, source: str) -> Path:
    """The user preset `name` (check_output says when it may not be written: ConfigError)."""
    path = check_output(name)
    text = preset_text(tune, winner, name, source)
    import tomllib
    C.build(tomllib.loads(text), str(path))          # what is written loads back as these settings
    path.parent.mkdir(parents=True, exist_ok=True)
    return C.write_atomic(path, text)
