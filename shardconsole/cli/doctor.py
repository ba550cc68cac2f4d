"""`shardconsole doctor`: what this machine will do to a run, checked before one fails on it.

    shardconsole doctor [--preset NAME|FILE] [--set table.key=value ...] [--json] [--no-allreduce]

Reports the GPUs with their CUDA and NVML indices and UUIDs (they differ on mixed rigs), each card's
PCIe link (generation and width, current and max: a x16 card trained at x4 is a common consumer-board
surprise), peer-to-peer access between each pair and a small NCCL all-reduce with and without P2P,
the memlock limit (`ulimit -l`) against the pinned host memory the planner expects a rank to lock,
the driver / CUDA / torch / NCCL / DeepSpeed versions and whether DeepSpeed's ops are built. On a
machine without a GPU it says what it can.

Its P2P verdict is saved (doctor_verdict.py: doctor.json in the cache folder, with the host and GPU UUIDs):
a later launch on this machine with broken P2P sets NCCL_P2P_DISABLE=1 itself and says so.
Exit code: 0 when nothing is wrong, 1 when a check found a problem (each is listed), 2 for bad input.
"""

from __future__ import annotations

import argparse
import json

from shardconsole.cli.terminal import fit
from shardconsole.doctor.checks import collect, format_report


def cmd_doctor(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="shardconsole doctor", description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", help="check the memlock limit against this preset (default: every built-in one "
                                     "that pins host memory)")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="TABLE.KEY=VALUE")
    ap.add_argument("--json", action="store_true", help="the report as one JSON object")
    ap.add_argument("--no-allreduce", action="store_true", help="skip the NCCL all-reduce with and without P2P")
    args = ap.parse_args(argv)
    report = collect(args.preset, args.overrides, not args.no_allreduce)
    if args.json:
        print(json.dumps(report))
    else:
        print(fit(format_report(report)))
    return 1 if report["problems"] else 0
