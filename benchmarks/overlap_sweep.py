"""Reads overlap_sweep.sh's rows: per row and thread count, the median step seconds and tokens/s of the
steps that ran on that count (the rank log's "offload overlap: step N on T OpenMP threads"), and the
offload view's last parts.

    python3 benchmarks/overlap_sweep.py DIR
"""

from __future__ import annotations

import json
import re
import statistics
import sys
from pathlib import Path


def main(root: Path) -> None:
    print("| row | threads | steps | median step s | tokens/s | offload view (last): gpu / host / h2d / d2h / hidden s |")
    print("|---|---|---|---|---|---|")
    for row in sorted(p for p in root.iterdir() if p.is_dir()):
        log = (row / "rank0.log").read_text() if (row / "rank0.log").exists() else ""
        on = {int(s): int(t) for s, t in re.findall(r"offload overlap: step (\d+) on (\d+) OpenMP", log)}
        one = re.search(r"one host thread, (\d+) OpenMP", log)
        lines = [json.loads(x) for x in (row / "metrics.jsonl").read_text().splitlines() if x.startswith("{")] \
            if (row / "metrics.jsonl").exists() else []
        steps = [m for m in lines if m.get("kind") == "step" and m.get("step", 0) > 2]
        views = [m for m in lines if m.get("kind") == "offload"]
        v = views[-1] if views else {}
        view = " / ".join(f"{v.get(k) or 0:.2f}" for k in ("gpu_s", "host_step_s", "h2d_s", "d2h_s", "host_hidden_s"))
        by: dict[int, list] = {}
        for m in steps:
            by.setdefault(on.get(m["step"], int(one.group(1)) if one else 0), []).append(m)
        if not by:
            print(f"| {row.name} | - | 0 | - | - | {view} | (no steps: see rank0.log)")
        for t, ms in sorted(by.items(), reverse=True):
            print(f"| {row.name} | {t} | {len(ms)} | {statistics.median(m['step_s'] for m in ms):.3f} | "
                  f"{statistics.median(m['tokens_per_s'] for m in ms):,.0f} | {view} |")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
