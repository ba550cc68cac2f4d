"""`shardconsole presets`: the built-in and the user's presets, with the user folder."""

from __future__ import annotations

import argparse
import shutil
import sys
import textwrap

from shardconsole.settings import preset_store


def cmd_presets(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="shardconsole presets", description="list built-in and user presets")
    ap.parse_args(argv)
    infos = preset_store.list_presets()
    # A name outside the rule (a file put there by hand: a newline, a space) is shown quoted, on its line.
    names = [i.name if preset_store.valid_name(i.name) else ascii(i.name) for i in infos]
    width = max((len(n) for n in names), default=10)
    indent = width + 2 + 8 + 2
    # On a terminal each description wraps under its own column (an 80-column terminal would fold it under
    # the names); piped, a preset stays one line for grep and head.
    room = shutil.get_terminal_size((100, 24)).columns - 1 - indent if sys.stdout.isatty() else 0
    for name, i in zip(names, infos):
        lines = (textwrap.wrap(i.description, width=room, break_on_hyphens=False, break_long_words=False)
                 if room >= 30 else [i.description])
        print(f"{name:<{width}}  {i.origin:<8}  {lines[0] if lines else ''}")
        for more in lines[1:]:
            print(" " * indent + more)
    print(f"\nuser presets folder: {preset_store.user_dir()}", file=sys.stderr)
    return 0
