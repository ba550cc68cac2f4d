"""benchmarks/gpu_runs.py --markdown: a results file (what --out writes) as the markdown table the GPU
scripts (issue35_gpu.sh, lora_7b_gpu.sh) append to their logs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_markdown_prints_a_row_per_result_and_a_failed_runs_first_line(tmp_path):
    ok = {"name": "3b-ok", "rc": 0, "tokens_per_s": 2564.4, "nvml_used_gib": 7.09, "peak_reserved_gib": 5.09,
          "host_used_gib": 56.5, "eval_loss": 4.80372, "failed": []}
    crashed = {"name": "3b-crash", "rc": 1, "tokens_per_s": None, "nvml_used_gib": 18.5, "peak_reserved_gib": None,
               "host_used_gib": None, "failed": ["crash: NotImplementedError: a | b\nsecond line"]}
    silent = {"name": "3b-silent", "rc": -9, "tokens_per_s": None, "nvml_used_gib": None, "peak_reserved_gib": None,
              "host_used_gib": None, "failed": [], "stderr_tail": "starting\nKilled by the timeout\n\n"}
    results = tmp_path / "runs.json"
    results.write_text(json.dumps({"date": "2026-12-02", "argv": [], "results": [ok, crashed, silent]}))
    res = subprocess.run([sys.executable, str(REPO / "benchmarks" / "gpu_runs.py"), "--markdown", str(results)],
                         capture_output=True, text=True, timeout=120, cwd=REPO)
    assert res.returncode == 0, res.stderr[-2000:]
    lines = res.stdout.splitlines()
    assert lines[0] == ("| run | rc | tokens/s | NVML peak GiB | allocator reserved GiB | host GiB | held-out loss "
                        "| failure |")
    rows = [ln for ln in lines[2:] if ln.startswith("| ")]
    assert rows == ["| 3b-ok | 0 | 2,564 | 7.1 | 5.1 | 56.5 | 4.8037 |  |",
                    "| 3b-crash | 1 | - | 18.5 | - | - | - | crash: NotImplementedError: a / b |",
                    "| 3b-silent | -9 | - | - | - | - | - | Killed by the timeout |"]
    assert all(row.count("|") == 9 for row in rows)          # a failure's own '|' does not add a column
