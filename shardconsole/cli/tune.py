"""`shardconsole tune`: the planner proposes, short real runs decide, the winner is saved as a preset.

    shardconsole tune --preset P [--set table.key=value ...] [--gpu-memory SIZE] [--host-memory SIZE]
                      [--host-cores N] [--host-gbps X]
                      [--budget DURATION] [--max-probes N] [--probe-steps N] [--vary KEY ...] [-o NAME]
                      [--dry-run]

The settings as given run first (the baseline), then the options the planner ranks fastest that fit,
each a few steps through the normal launch path under the memory cap, re-ranked after each probe with
what it measured, until the budget or the probe count ends. The fastest probe that stayed under the
caps is written as the user preset NAME (default: P-tuned), its figures in the header comment. A key
given with --set is kept as given: the tune searches only the others. The numerics (precision.dtype,
master_dtype, master_rounding, optim.name, optim.step_in_backward, train.clip_grad_norm) change the
update, so they are kept as given too unless named with --vary KEY (repeatable); where changing them
is predicted much faster, one line under the table says so (planned, not probed). The output preset name is checked before the first probe. Exit codes: 0 a preset written,
1 no probe finished under the caps, 2 bad input, 130 stopped with Ctrl-C (a preset is written from what
was measured when one finished).
"""

from __future__ import annotations

import argparse
import sys

from shardconsole.settings import config as C
from shardconsole.settings import resolve as settings
from shardconsole.tune.engine import Tune
from shardconsole.tune.setup import make_tune, output_name, parse_duration
from shardconsole.tune.report import format_table, machine_text, numerics_note, table, tie_note, write_preset

DRY_RUN_SHOWN = 20          # the options --dry-run lists; the count of the rest that fit is said


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="shardconsole tune",
        description="Probe the settings that fit with short real runs and save the fastest as a preset.")
    ap.add_argument("--preset", default=None, help="preset name or .toml file to tune (default: the default preset)")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="TABLE.KEY=VALUE",
                    help="override one setting; a key set here is not searched; repeatable")
    ap.add_argument("--gpu-memory", default=None, metavar="SIZE",
                    help="the GPU memory cap the probes run under, e.g. 24GiB (default: memory.gpu_memory_limit, "
                         "else the card)")
    ap.add_argument("--host-memory", default=None, metavar="SIZE",
                    help="host RAM the run may use, e.g. 64GiB (default: this machine's); on CPU ranks the cap")
    ap.add_argument("--host-cores", default=None, metavar="N",
                    help="rank with the host side (the offloaded optimizer step) of a host of N CPU cores "
                         "(default: this machine's); for --dry-run planning another machine")
    ap.add_argument("--host-gbps", default=None, metavar="X",
                    help="rank with this host memory bandwidth, GB/s (default: $SHARDCONSOLE_HOST_GBPS, else "
                         "the H200 test host's 118 scaled by cores)")
    ap.add_argument("--budget", default="10m", metavar="DURATION", help="wall time for all probes: 90s, 10m, 1h")
    ap.add_argument("--max-probes", type=int, default=6, help="at most this many probes, the baseline included")
    ap.add_argument("--probe-steps", type=int, default=6, help="optimizer steps of each probe (the first is not timed)")
    ap.add_argument("--vary", action="append", default=[], metavar="KEY",
                    help="search a numerics key too (precision.dtype, precision.master_dtype, "
                         "precision.master_rounding, precision.fp8, optim.name, optim.step_in_backward, "
                         "train.clip_grad_norm: 0 lets an FSDP2 offload's host step run under the backward): it "
                         "changes the update, "
                         "so it is kept as given unless named; repeatable")
    ap.add_argument("-o", "--output", default=None, metavar="NAME", help="the preset to write (default: P-tuned)")
    ap.add_argument("--runs-root", default=None, metavar="DIR", help="where the probes' run folders go")
    ap.add_argument("--dry-run", action="store_true", help="list the options that fit, ranked; probe nothing")
    return ap


def _positive(flag: str, n: int) -> int:
    if n < 1:
        raise C.ConfigError(f"{flag}: {n} is below 1")
    return n


def setup(args: argparse.Namespace) -> tuple[Tune, str, str]:
    """The tune of these arguments, ready to run; bad input raises ConfigError. Returns (tune, the
    preset's name, the output preset name)."""
    from shardconsole.settings.resolve import DEFAULT_PRESET

    budget = parse_duration("--budget", args.budget)
    _positive("--max-probes", args.max_probes)
    _positive("--probe-steps", args.probe_steps)
    preset = args.preset or DEFAULT_PRESET
    overrides = settings.from_cli(args.overrides)
    resolved = settings.resolve(preset, overrides)
    name = output_name(args.output, resolved.preset)
    tune = make_tune(resolved, budget_s=budget, max_probes=args.max_probes, probe_steps=args.probe_steps,
                     gpu_memory=args.gpu_memory, host_memory=args.host_memory, runs_root_dir=args.runs_root, name=name,
                     vary=args.vary, dry_run=args.dry_run, host_cores=args.host_cores, host_gbps=args.host_gbps)
    return tune, resolved.preset, name


def cmd_tune(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    tune, source, name = setup(args)
    out = sys.stdout
    tune.plan()
    fits = [o for o in tune.options if o.estimate.fits]
    print(f"tune {source}: model {tune.base.model.name}, {machine_text(tune)}", file=out)
    if tune.book.stale_note():
        print(f"note: {tune.book.stale_note()}", file=out)
    if args.dry_run:
        print(f"{len(fits)} option(s) fit, ranked by predicted speed (--dry-run: nothing is probed)", file=out)
        shown = tune.options[:DRY_RUN_SHOWN]
        shown += [o for o in tune.options[DRY_RUN_SHOWN:] if o.baseline]   # the settings as given, wherever they rank
        for o in shown:
            p = o.prediction
            print(f"  {p.value:10.2f} {p.unit:<8} ({p.source})  {'[baseline] ' if o.baseline else ''}{o.name}"
                  f"{'' if o.estimate.fits else '  (' + o.estimate.verdict + ')'}", file=out)
        more = sum(1 for o in fits if not any(o is x for x in shown))
        if more:
            print(f"... and {more} more that fit, predicted slower (not listed)", file=out)
        note = numerics_note(tune)
        if note:
            print(note, file=out)
        return 0
    print(f"{len(fits)} option(s) fit; probing up to {tune.limits.max_probes} for {args.budget}, "
          f"{tune.limits.probe_steps} steps each, the settings as given first", file=out, flush=True)
    reported = [0]                     # how many done rows were printed (a list: on_change sets it)

    def on_change(t: Tune) -> None:
        done = [r for r in t.rows if r.state == "done"]
        for i, row in enumerate(done[reported[0]:], start=reported[0]):
            res = row.result
            assert res is not None          # a done row has its probe's result (Tune.run)
            cap = t.limits.gpu_cap_bytes
            gpu = (f"GPU {t.card_peak_bytes(res) / 2**30:.1f}" + (f" of {cap / 2**30:.1f}" if cap else "")
                   + " GiB (NVML), ") if res.gpu_peak_bytes else ""
            what = (f"{res.tokens_per_s:,.0f} tokens/s, {gpu}host {res.host_peak_bytes / 2**30:.1f} GiB"
                    if res.ok else f"{res.status}: {res.message}")
            print(f"probe {i + 1}: {row.label}: {what} ({res.seconds:.0f} s)", file=out, flush=True)
        if len(done) > reported[0] and len(done) < t.limits.max_probes:
            # the table so far and what comes next, re-ranked with what was just measured
            print("\n" + format_table(table(t)) + "\n", file=out, flush=True)
        reported[0] = len(done)
        running = [r for r in t.rows if r.state == "running"]
        if running and getattr(on_change, "said", None) is not running[-1]:
            on_change.said = running[-1]        # type: ignore[attr-defined]
            print(f"probe {len(t.rows)}: {running[-1].label} ...", file=out, flush=True)

    tune.on_change = on_change
    code = 0
    try:
        winner = tune.run()
    except KeyboardInterrupt:         # between probes (a probe in flight stops itself: probe.py)
        tune.stop = tune.interrupted = True
        winner = tune.winner()
    if tune.interrupted:
        code = 130
    print("\n" + format_table(table(tune)), file=out)
    if tune.note:
        print(f"({tune.note})", file=out)
    note = numerics_note(tune)
    if note:
        print(note, file=out)
    if winner is None:
        print("no probe finished under the caps: nothing written (the rows above say why each stopped)",
              file=sys.stderr)
        return code or 1
    path = write_preset(tune, winner, name, source)
    base = tune.baseline()
    assert winner.result is not None    # the winner is a row with a result (Tune.winner)
    vs = ""
    if base is not None and base.result is not None and base.result.ok and base is not winner:
        vs = f", {100 * (winner.result.tokens_per_s / base.result.tokens_per_s - 1):+.0f}% against {source} as given"
    elif base is winner:
        vs = f"; {source} as given was the fastest"
    print(f"winner: {winner.option.name}: {winner.result.tokens_per_s:,.0f} tokens/s{vs}", file=out)
    tie = tie_note(tune)
    if tie:
        print(tie, file=out)
    print(f"wrote {path}; run it with `shardconsole --preset {name}`", file=out)
    return code
