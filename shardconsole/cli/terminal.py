"""Long report lines fitted to the terminal they are printed on.

The plan and doctor reports are lines of prose (a verdict, a note) and aligned rows. Printed to a terminal
narrower than a line, the terminal folds it at the last column, mid-word and back at column 0, under the
rows' names. Here such a line wraps between words, its continuation indented two past the line's own
indent. Piped or redirected, the text is left as it is: one line a fact, for grep and head.
"""

from __future__ import annotations

import shutil
import sys
import textwrap
from typing import TextIO


def fit(text: str, stream: TextIO | None = None, hang: int | None = None) -> str:
    """`text` with each line wider than the terminal wrapped under its own indent (unchanged unless
    `stream`, stdout by default, is a terminal). `hang`: the continuation lines start at this column
    instead (a table's last column: `shardconsole presets`' descriptions)."""
    out = sys.stdout if stream is None else stream
    if not out.isatty():
        return text
    width = shutil.get_terminal_size((100, 24)).columns - 1
    lines = []
    for line in text.split("\n"):      # not splitlines: a trailing blank line stays
        indent = " " * (len(line) - len(line.lstrip(" ")))
        cont = indent + "  " if hang is None else " " * hang
        if len(line) <= width or width - (len(indent) if hang is None else hang) < 30:
            lines.append(line)
            continue
        lines.extend(textwrap.wrap(line, width=width, initial_indent=indent, subsequent_indent=cont,
                                   break_on_hyphens=False, break_long_words=False) or [line])
    return "\n".join(lines)
