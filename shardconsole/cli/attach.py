"""`shardconsole attach RUN [--headless]`: follow a run started earlier (the run goes on without you:
Ctrl-C detaches; `s` in the console or `shardconsole stop RUN` stops it)."""

from __future__ import annotations

import argparse
import sys

from shardconsole.cli.errors import UsageError, run_folder
from shardconsole.launch.job import node_agents, open_run
from shardconsole.session.run import RunSession


def cmd_attach(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="shardconsole attach", description="follow a run started earlier")
    ap.add_argument("run_dir", metavar="RUN", help="a run folder, or a run id under the runs root")
    ap.add_argument("--headless", action="store_true")
    args = ap.parse_args(argv)
    run_dir = run_folder(args.run_dir)
    try:
        job = open_run(run_dir)       # a folder that is not a run's: one line, before any UI
    except ValueError as e:
        raise UsageError(str(e)) from None
    agents = node_agents(run_dir)
    if args.headless and (job.external or agents):
        where = f"node agents: {agents}" if agents else "started elsewhere"
        print(f"following {run_dir} ({where})", file=sys.stderr)
    if args.headless:
        from shardconsole import headless
        return headless.follow(RunSession(job, run_dir))
    try:
        from shardconsole.console.app import run_console
    except ImportError as e:
        print(f"shardconsole: the console is not available ({e}); use --headless", file=sys.stderr)
        return 1
    return run_console(attach=run_dir)
