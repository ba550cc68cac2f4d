"""`shardconsole stop RUN`: stop a run of this machine from any shell."""

from __future__ import annotations

import argparse
import sys

from shardconsole.cli.errors import UsageError, run_folder


def cmd_stop(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="shardconsole stop",
                                 description="stop a run of this machine from any shell: every rank ended, "
                                             "GPUs released (exit 0); a second Ctrl-C skips a checkpoint save")
    ap.add_argument("run_dir", metavar="RUN", help="a run folder, or a run id under the runs root")
    args = ap.parse_args(argv)
    from shardconsole.session.stop import StopRefused, stop_folder
    try:
        return stop_folder(run_folder(args.run_dir), sys.stderr)
    except StopRefused as e:
        raise UsageError(str(e)) from None
