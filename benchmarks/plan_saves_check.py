"""The planner's save figures (plan/saves.py, the host peak's saving moment) against issue 30's GPU runs
(benchmarks/issue30_saves.py's JSON): the ranks' host peak while training and during each save, and the
bytes each save and export wrote. No GPU needed: run it here on the JSON the GPU call wrote.

    python3 benchmarks/plan_saves_check.py issue30.json [--gpu-memory 143771MiB --host-memory 125GiB]

Prints one row per save: planned vs measured (GiB, %), and the bytes planned vs written (GB, %)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from shardconsole import plan as PL  # noqa: E402
from shardconsole.plan.machine import hardware_from_args  # noqa: E402
from shardconsole.settings import resolve as settings  # noqa: E402
from shardconsole.settings.models import resolve as resolve_model  # noqa: E402

GiB = 2**30


def _pct(plan: float, meas: float | None) -> str:
    return "-" if not meas else f"{100 * (plan / meas - 1):+.1f}%"


def check(doc: dict, hw: PL.Hardware) -> list[str]:
    rows = [f"{'run':<24} {'what':>10} {'train plan':>10} {'meas':>6} {'':>7} {'save plan':>9} {'meas':>6} {'':>7} "
            f"{'GB plan':>7} {'written':>7} {'':>7}"]
    for r in doc["results"]:
        sets = [s for s in r.get("set", []) if "=" in s]
        cfg = settings.resolve(r["preset"], settings.from_cli(sets)).cfg
        e = PL.estimate(cfg, resolve_model(cfg.model.name), hw)
        train = e.host_phases.get("training", 0) / GiB
        save = e.host_phases.get("saving", e.host_phases.get("training", 0)) / GiB
        sv = e.saves
        for s in r.get("saves") or [{}]:
            what = s.get("what", "-")
            planned_b = {"checkpoint": sv.full_bytes, "model": sv.model_bytes, "export": sv.export_bytes}.get(what, 0)
            mt, ms = s.get("training_peak_gib"), s.get("save_peak_gib")
            rows.append(f"{r['name']:<24} {what:>10} {train:>10.1f} {mt or 0:>6.1f} {_pct(train, mt):>7} "
                        f"{save:>9.1f} {ms or 0:>6.1f} {_pct(save, ms):>7} {planned_b / 1e9:>7.1f} "
                        f"{s.get('gb') or 0:>7.1f} {_pct(planned_b / 1e9, s.get('gb')):>7}")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("results", type=Path)
    ap.add_argument("--gpu-memory", default="143771MiB")
    ap.add_argument("--host-memory", default="125GiB")
    args = ap.parse_args()
    doc = json.loads(args.results.read_text())
    hw = hardware_from_args(1, args.gpu_memory, args.host_memory)
    print("\n".join(check(doc, hw)))


if __name__ == "__main__":
    main()
