"""`shardconsole presets`: the built-in and the user's presets, with the user folder."""

from __future__ import annotations

import argparse
import sys

from shardconsole.cli.terminal import fit
from shardconsole.settings import preset_store
from shardconsole.user_folders import presets_dir


def cmd_presets(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="shardconsole presets", description="list built-in and user presets")
    ap.parse_args(argv)
    infos = preset_store.list_presets()
    # A name outside the rule (a file put there by hand: a newline, a space) is shown quoted, on its line.
    names = [i.name if preset_store.valid_name(i.name) else ascii(i.name) for i in infos]
    width = max((len(n) for n in names), default=10)
    rows = [f"{name:<{width}}  {i.origin:<8}  {i.description}" for name, i in zip(names, infos)]
    # On a terminal each description wraps under its own column (an 80-column terminal would fold it under
    # the names); piped, a preset stays one line for grep and head.
    if rows:
        print(fit("\n".join(rows), hang=width + 2 + 8 + 2))
    print(f"\nuser presets folder: {presets_dir()}", file=sys.stderr)
    return 0
