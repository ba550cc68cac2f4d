"""Issue 30 on one GPU under the 24 GiB cap: the big offload recipes with their final save and the
export, beside a run without a save, in one call of under 10 minutes.

Each run goes through `python -m shardconsole --preset ... --headless` (gpu_runs.run_headless). The host
peaks come from the ranks' own save_host_peak events (VmHWM: training's before the save, the save's own
after a reset), the save's seconds and bytes from its SaveProgress lines; the run without a save gives
the training peak as the front end samples it (ranks' RSS). Run folders are removed between runs: a 7B
checkpoint and its export fill most of a 64 GiB disk.

    python3 benchmarks/issue30_saves.py --out $OUT/issue30.json
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gpu_runs import run_headless  # noqa: E402

from shardconsole.runlog.protocol import decode  # noqa: E402

FEW = ["train.steps=3", "train.log_every=1", "train.checkpoint_every=0", "--force"]
# NAME, PRESET, --set values. "model" where a full checkpoint cannot fit the 64 GiB disk beside the export
# (7B fp32 masters: 84 GB full; 13B bf16 masters: 104 GB full).
RUNS = [
    ("3b-nosave", "3090-offload", ["model.name=3b", "train.save_final=none", *FEW]),
    ("3b-full+export", "3090-offload", ["model.name=3b", "train.save_final=full", "train.export_dtype=bf16", *FEW]),
    ("7b-fp32-model+export", "3090-7b-offload", ["precision.master_dtype=fp32", "train.save_final=model",
                                                 "train.export_dtype=bf16", *FEW]),
    ("13b-stoch-model+export", "3090-7b-offload", ["model.name=13b", "precision.master_rounding=stochastic",
                                                   "train.save_final=model", "train.export_dtype=bf16", *FEW]),
]


def saves(run_dir: Path) -> list[dict]:
    """One row per save and export: what, seconds, bytes, GB/s, and (saves) the ranks' host peaks."""
    msgs = []
    path = run_dir / "metrics.jsonl"
    for line in (path.read_text().splitlines() if path.exists() else []):
        try:
            msgs.append(decode(line))
        except ValueError:
            pass
    peaks = {}
    for m in msgs:
        if m.kind == "event" and m.name == "save_host_peak":
            kv = dict(re.findall(r"(\w+)=(\S+)", m.detail))
            peaks.setdefault(int(kv["step"]), []).append(kv)
    rows = []
    for m in msgs:
        if m.kind != "save" or not m.done:
            continue
        row = {"what": m.what, "step": m.step, "seconds": m.elapsed_s, "gb": m.written_bytes / 1e9,
               "gb_per_s": m.written_bytes / 1e9 / m.elapsed_s if m.elapsed_s else None}
        if m.what != "export" and m.step in peaks:
            ranks = peaks[m.step]
            row["training_peak_gib"] = sum(int(k["training_peak"]) for k in ranks) / 2**30
            row["save_peak_gib"] = sum(int(k["save_peak"]) for k in ranks) / 2**30
            row["save_start_gib"] = sum(int(k["start"]) for k in ranks) / 2**30
        rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--only", nargs="*", default=None)
    ap.add_argument("--timeout", type=int, default=300, help="seconds a run may take")
    ap.add_argument("--budget", type=int, default=560, help="seconds for all runs (one device call is 600)")
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="sc-issue30-"))
    results = []
    deadline = time.time() + args.budget
    for name, preset, sets in RUNS:
        if args.only and name not in args.only:
            continue
        export = root / f"{name}-hf"
        extra = [] if "nosave" in name else [f"train.export_dir={export}"]
        t0 = time.time()
        left = int(deadline - t0)
        if left < 60:
            print(f"# {name}: skipped, {left}s of the budget left", flush=True)
            continue
        res = run_headless(preset, sets + extra, root, name, min(args.timeout, left))
        res["saves"] = saves(root / name)
        res["export_files"] = sorted(p.name for p in export.iterdir()) if export.is_dir() else []
        res.pop("loss_curve", None)
        results.append(res)
        print(json.dumps(res), flush=True)
        shutil.rmtree(root / name, ignore_errors=True)
        shutil.rmtree(export, ignore_errors=True)
        print(f"# {name}: {time.time() - t0:.0f}s", flush=True)
        if args.out:
            Path(args.out).write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "results": results}, indent=1))
    print(f"\n{'run':<24} {'rc':>4} {'tok/s':>7} {'ranks RSS':>9} {'what':>10} {'train pk':>8} {'save pk':>8} "
          f"{'s':>6} {'GB':>6} {'GB/s':>5}")
    for r in results:
        rows = r["saves"] or [{}]
        for i, s in enumerate(rows):
            head = (f"{r['name']:<24} {str(r['rc']):>4} {_f(r.get('tokens_per_s'), ',.0f'):>7} "
                    f"{_f(r.get('ranks_rss_gib'), '.1f'):>9}") if i == 0 else " " * 47
            print(f"{head} {s.get('what', '-'):>10} {_f(s.get('training_peak_gib'), '.1f'):>8} "
                  f"{_f(s.get('save_peak_gib'), '.1f'):>8} {_f(s.get('seconds'), '.1f'):>6} "
                  f"{_f(s.get('gb'), '.1f'):>6} {_f(s.get('gb_per_s'), '.2f'):>5}")
        if r.get("failed"):
            print(f"{'':<24} failed: {r['failed'][0][:150]}")


def _f(v, spec: str) -> str:
    return format(v, spec) if isinstance(v, (int, float)) else "-"


if __name__ == "__main__":
    main()
