"""A run made with --run-dir outside the runs root is linked from it, so `shardconsole runs`, attach and
the console find it from any directory (issue 65 item 9): README's `--run-dir runs/my-chat` made a folder
only a listing started in that same directory saw (the old ./runs, relative to where it runs).

The link is the folder's name in the runs root (name-2, ... when taken), pointing at its absolute path;
history/index lists a link at the folder's own path. A courtesy: a runs root that cannot take it (read
only, another file system without links) leaves the run as it was.
"""

from __future__ import annotations

import os
from pathlib import Path

from shardconsole.user_folders import runs_root


def link_into_runs_root(run_dir: Path) -> Path | None:
    """The link made (or already there) for run_dir, or None when it is under the runs root or none could be made."""
    target = Path(run_dir).absolute()
    root = runs_root()
    try:
        if target.parent.resolve() == root.resolve():
            return None
        root.mkdir(parents=True, exist_ok=True)
        for n in range(1, 100):
            link = root / (target.name if n == 1 else f"{target.name}-{n}")
            if link.is_symlink() and Path(os.readlink(link)) == target:
                return link
            try:
                link.symlink_to(target, target_is_directory=True)
                return link
            except FileExistsError:
                continue
    except OSError:
        pass
    return None
