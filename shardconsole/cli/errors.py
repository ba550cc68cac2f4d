"""What every subcommand may raise for bad input: main prints it as one line and exits 2."""

from __future__ import annotations

from pathlib import Path


class UsageError(Exception):
    """Bad arguments: one line on stderr, exit code 2 (a ConfigError is the same for settings)."""


def run_folder(ref: str) -> Path:
    """A run folder from a path or a run id under the runs root (history/index.find_run)."""
    from shardconsole.history.index import find_run
    try:
        return find_run(ref)
    except ValueError as e:
        raise UsageError(str(e)) from None
