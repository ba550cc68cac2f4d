"""`shardconsole runs` and `shardconsole compare`: every run kept, listed and compared.

    shardconsole runs [RUN ...] [--runs-root DIR] [--limit N] [--json] [--tensorboard] [--wandb] [--mlflow] [--prune]
    shardconsole compare RUN RUN ... [--runs-root DIR] [--width N]

RUN is a run folder or a run id (a part of one that names a single run) under the runs root.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

from shardconsole.settings.config import ConfigError
from shardconsole.history import compare as CMP
from shardconsole.history.index import PREPARED, RunSummary, find_run, list_runs, never_started, roots, summarize
from shardconsole.runlog.runfolder import RunFolder

# training: method/objective ("lora/dpo"), so an SFT loss is never read against a DPO one unlabelled
LIST_COLUMNS = ("id", "preset", "backend", "training", "model", "status", "steps", "tokens/s", "MFU", "peak GPU",
                "peak host", "last loss", "eval loss")


MAX_WIDTH = 1000       # characters of a compare plot

def _root_arg(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--runs-root", default=None, metavar="DIR",
                    help="where runs are (default: $SHARDCONSOLE_RUNS_ROOT, else the per-user folder)")


def _pick(refs: list[str], root: str | None) -> list[RunSummary]:
    out = []
    for ref in refs:
        try:
            out.append(summarize(find_run(ref, root)))
        except ValueError as e:
            raise ConfigError(str(e)) from None
    return out


def cmd_runs(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="shardconsole runs",
                                 description="list runs newest first: status (running, finished, stopped, failed "
                                             "with its cause), steps, speed, peaks, losses")
    ap.add_argument("runs", nargs="*", metavar="RUN", help="only these runs (folders or ids)")
    _root_arg(ap)
    ap.add_argument("--limit", type=int, default=None, metavar="N", help="the newest N runs only")
    ap.add_argument("--json", action="store_true", help="one JSON object per run, for scripts")
    ap.add_argument("--tensorboard", action="store_true",
                    help="(re)write the runs' TensorBoard event files from their metrics.jsonl")
    ap.add_argument("--wandb", action="store_true",
                    help="export the named runs to Weights & Biases (offline unless WANDB_MODE says otherwise; "
                         "needs `pip install shardconsole[wandb]`)")
    ap.add_argument("--mlflow", action="store_true",
                    help="export the named runs to MLflow (a file store in the run folder's mlruns/ unless "
                         "MLFLOW_TRACKING_URI names another; needs `pip install shardconsole[mlflow]`)")
    ap.add_argument("--prune", action="store_true",
                    help="remove the folders --print-command and --slurm prepared that no run ever started "
                         "(nothing in them but preset.toml and origin.json); nothing else")
    args = ap.parse_args(argv)
    if args.limit is not None and args.limit < 1:
        raise ConfigError(f"--limit: {args.limit} is not a positive number of runs")
    for flag in ("wandb", "mlflow"):
        if getattr(args, flag) and not args.runs:
            raise ConfigError(f"--{flag} exports the runs you name: give at least one RUN")
    runs = _pick(args.runs, args.runs_root) if args.runs else list_runs(args.runs_root, args.limit)
    where = " and ".join(str(r) for r in roots(args.runs_root))
    if args.tensorboard:
        return _tensorboard(runs, where)
    if args.prune:
        return _prune(runs, where)
    if args.wandb:
        from shardconsole.history.wandb_export import export
        for r in runs:
            print(export(r.path))
        return 0
    if args.mlflow:
        from shardconsole.history.mlflow_export import export as to_mlflow
        for r in runs:
            print(to_mlflow(r.path))
        return 0
    if args.json:
        for r in runs:
            print(json.dumps(_as_json(r)))
        return 0
    if not runs:
        print(f"no runs in {where} yet", file=sys.stderr)
        return 0
    rows = []
    for r in runs:
        f = CMP.figures(r)
        rows.append([r.run_id, *(f[c] for c in LIST_COLUMNS[1:])])
    for line in CMP.table(list(LIST_COLUMNS), rows, max_cell=32):
        print(line)
    for r in runs:
        if r.status in ("failed", "unknown") and r.detail:
            print(f"  {CMP.shown(r.run_id)}: {r.detail}")
    print(f"\nruns root: {where}  (`tensorboard --logdir {roots(args.runs_root)[0]}` shows their curves)",
          file=sys.stderr)
    return 0


def _prune(runs: list[RunSummary], where: str) -> int:
    """Remove prepared folders that never started. Each is moved aside first (one atomic rename: a run
    started from its printed command from then on finds no folder, rather than half of one), checked
    again there (nothing in it but preset.toml and origin.json) and put back if anything else is."""
    import os
    removed = 0
    for r in runs:
        if r.status != PREPARED or not never_started(RunFolder(r.path)):
            continue
        aside = r.path.with_name(f".{r.path.name}.pruning-{os.getpid()}")
        try:
            os.rename(r.path, aside)
        except OSError as e:
            print(f"{r.run_id}: kept ({e.strerror})", file=sys.stderr)
            continue
        folder = RunFolder(aside)
        if not never_started(folder):
            os.rename(aside, r.path)
            print(f"{r.run_id}: kept (it started while being pruned)", file=sys.stderr)
            continue
        folder.preset.unlink()
        folder.origin.unlink()
        aside.rmdir()
        removed += 1
        print(f"removed {r.path} (prepared, never started)")
    print(f"{removed} prepared folder(s) removed from {where}", file=sys.stderr)
    return 0


def _tensorboard(runs: list[RunSummary], where: str) -> int:
    from shardconsole.runlog.tbevents import rebuild
    if not runs:
        print(f"no runs in {where} yet", file=sys.stderr)
        return 0
    failed = 0
    for r in runs:
        rec = rebuild(r.path)
        if rec.path is not None:
            print(f"{r.run_id}: {rec.path}")
        else:
            failed += 1
            print(f"{r.run_id}: not written: {rec.why_not}", file=sys.stderr)
    print(f"view them with `tensorboard --logdir {runs[0].path.parent}`", file=sys.stderr)
    return 1 if failed else 0


def _as_json(r: RunSummary) -> dict:
    return {"id": r.run_id, "path": str(r.path), "status": r.status, "cause": r.cause, "detail": r.detail,
            "started": r.started, "preset": r.preset, "backend": r.backend, "training": r.training, "model": r.model, "step": r.step,
            "steps": r.steps, "tokens_per_s": r.tokens_per_s, "mfu": r.mfu, "peak_gpu_bytes": r.peak_gpu_bytes,
            "peak_host_bytes": r.peak_host_bytes, "last_loss": r.last_loss, "eval_loss": r.eval_loss}


def cmd_compare(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="shardconsole compare",
                                 description="runs side by side: the settings that differ, their figures, and "
                                             "their loss and tokens/s curves overlaid")
    ap.add_argument("runs", nargs="+", metavar="RUN", help="two or more run folders or ids")
    _root_arg(ap)
    ap.add_argument("--width", type=int, default=None, help="plot width in characters (default: the terminal's)")
    args = ap.parse_args(argv)
    if len(args.runs) < 2:
        raise ConfigError("compare needs at least two runs (folders or ids; `shardconsole runs` lists them)")
    width = args.width or min(120, shutil.get_terminal_size((100, 24)).columns)
    # a plot is width x rows of characters: --width 999999999 grew the front end until the kernel killed it
    if not 30 <= width <= MAX_WIDTH:
        raise ConfigError(f"--width: {width} is {'too narrow' if width < 30 else 'too wide'} for a plot "
                          f"(30 to {MAX_WIDTH})")
    paths = []
    for ref in args.runs:
        try:
            p = find_run(ref, args.runs_root).resolve()
        except ValueError as e:
            raise ConfigError(str(e)) from None
        if p in paths:
            raise ConfigError(f"{ref!r} is named twice ({p})")
        paths.append(p)
    for line in CMP.compare_text([summarize(Path(p)) for p in paths], width=width):
        print(line)
    return 0
