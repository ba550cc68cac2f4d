"""Predicted (plan/speed/model.py) against measured tokens/s for every run recorded in benchmarks/data and
benchmarks/results (gpu_runs.py's rows, the shardconsole runs, not the bare peers), on the H200 they ran on.

    python3 benchmarks/speed_calibrate.py            # one line a run, then the share within 15% / 25%
    python3 benchmarks/speed_calibrate.py --json F   # the rows as JSON

Rows written before issue 45's meter fix (all but benchmarks/results/issue45) printed tokens/s x grad_accum: they are divided back here (the
old meter's tokens/s x step_s is the step's tokens whatever grad_accum was, which also recovers the
micro-batch of a run whose preset has changed since).
"""

from __future__ import annotations

import argparse
import glob
import json
import statistics
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from shardconsole.plan.estimator import replace_cfg  # noqa: E402
from shardconsole.plan.machine import Hardware  # noqa: E402
from shardconsole.plan.speed.model import predict  # noqa: E402
from shardconsole.settings.models import resolve as resolve_model  # noqa: E402
from shardconsole.settings.resolve import resolve  # noqa: E402

# Results written by the fixed meter (issue 45): their tokens/s are per optimizer step already.
NEW_METER = ("benchmarks/results/issue45",)
H200 = Hardware(gpus=1, gpu_memory_bytes=141 * 10**9, host_memory_bytes=125 * 2**30, gpu_name="NVIDIA H200",
                cpus=16)


def recorded_rows(root: Path = REPO) -> list[dict[str, Any]]:
    files = sorted(glob.glob(str(root / "benchmarks/data/h200_*.json")) +
                   glob.glob(str(root / "benchmarks/results/**/*.json"), recursive=True))
    out = []
    for f in files:
        try:
            d = json.loads(Path(f).read_text())
        except (OSError, ValueError):
            continue
        res = d.get("results") if isinstance(d, dict) else d
        if isinstance(d, dict) and isinstance(d.get("calls"), list):
            res = [r for c in d["calls"] for r in (c.get("results") or [])]
        for r in res if isinstance(res, list) else []:
            if isinstance(r, dict) and r.get("tokens_per_s") and r.get("rc") in (0, None) \
                    and r.get("preset") and not str(r["preset"]).startswith("bare"):
                out.append({**r, "file": str(Path(f).relative_to(root))})
    return out


def compare(r: dict[str, Any], meter_fixed: bool = False) -> dict[str, Any] | None:
    sets = [s for s in (r.get("set") or []) if "=" in s and not s.startswith(("data.path", "data.eval"))]
    try:
        cfg = resolve(r["preset"], sets, lenient=True).cfg
    except Exception:       # a preset renamed since: that row is left out
        return None
    k = cfg.train.grad_accum
    measured = r["tokens_per_s"] if meter_fixed else r["tokens_per_s"] / k
    if r.get("step_s") and not meter_fixed:
        tokens = r["tokens_per_s"] * r["step_s"]
        mb = round(tokens / (cfg.data.seq_len * k * cfg.parallel.nproc_per_node))
        if mb >= 1 and mb != cfg.train.micro_batch:
            cfg = replace_cfg(cfg, ("train", "micro_batch", mb))
    try:
        spec = resolve_model(cfg.model.name)
    except Exception:       # a model folder of the GPU machine's (/tmp/sc-llama3-8b): not here, left out
        return None
    p = predict(cfg, spec, H200)
    if p is None:
        return None
    return {"name": r["name"], "file": r["file"], "measured": measured, "predicted": p.tokens_per_s,
            "ratio": p.tokens_per_s / measured, "bound": p.bound, "parts": p.parts,
            "offload": {k2: (r.get("offload") or {}).get(k2) for k2 in ("gpu_s", "host_step_s", "h2d_s", "d2h_s", "step_s")}}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    rows = [c for c in (compare(r, r["file"].startswith(NEW_METER)) for r in recorded_rows()) if c]
    for c in rows:
        o = c["offload"]
        seen = (f"  measured gpu {o['gpu_s']:.2f} host {o['host_step_s']:.2f} h2d {o['h2d_s']:.2f}"
                if o.get("gpu_s") else "")
        pp = c["parts"]
        print(f"{c['ratio']:5.2f}  {c['measured']:8.0f} {c['predicted']:8.0f}  {c['bound']:<9} {c['name'][:34]:<34} "
              f"gpu {pp['gpu']:.2f} host {pp['host step']:.2f} h2d {pp['h2d']:.2f}{seen}  ({c['file'].split('/')[-1]})")
    ratios = [c["ratio"] for c in rows]
    within = lambda x: sum(abs(r - 1) <= x for r in ratios)  # noqa: E731
    print(f"{len(rows)} runs: {within(0.15)} within 15%, {within(0.25)} within 25%, median ratio "
          f"{statistics.median(ratios):.2f}")
    # Older files ran older code, and their presets are resolved as shipped today (a preset that has since
    # turned compile on is predicted compiled): the rows measured since the meter fix are the model's test.
    new = [c["ratio"] for c in rows if c["file"].startswith(NEW_METER)]
    print(f"since the meter fix ({', '.join(NEW_METER)}): {sum(abs(r - 1) <= 0.15 for r in new)} of {len(new)} "
          f"within 15%")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
