"""What makes a checkpoint folder complete, standard library only: the ranks (backends/checkpoint/checkpoints.py),
export-model (export_model/checkpoint.py) and the console's step chooser judge a step folder by this one
test, so a folder the ranks would skip on resume is never offered to export or chat either.

A save writes step_<N>.partial/ and renames it once rank 0 wrote the manifest (MANIFEST: the step, the
data position, the world size and every file with its size); a folder truncated later is told from a
complete one by the sizes the manifest lists.
"""

from __future__ import annotations

import json
from pathlib import Path

MANIFEST = "shardconsole.json"


def why_incomplete(path: Path, backend: str) -> str | None:
    """None when the folder holds a complete checkpoint, else what is wrong with it."""
    manifest = path / MANIFEST
    if manifest.is_file():
        try:
            meta = json.loads(manifest.read_text())
            files = dict(meta["files"])
        except (OSError, ValueError, KeyError, TypeError):
            return f"its {MANIFEST} is unreadable"
        if meta.get("backend") != backend:
            return f"written by a {meta.get('backend')} run, this run is {backend}"
        for name, size in files.items():
            f = path / name
            if not f.is_file():
                return f"{name} is missing"
            if f.stat().st_size != size:
                return f"{name} is truncated ({f.stat().st_size} of {size} bytes)"
        return None
    # Written before manifests: only the backend's own marker can be checked.
    if backend == "fsdp":
        meta_file = path / ".metadata"
        return None if meta_file.is_file() and meta_file.stat().st_size > 0 else "no DCP .metadata (empty or cut short)"
    if (path / "latest").is_file():
        return None
    return "no DeepSpeed 'latest' file (empty, cut short, or written by an FSDP run)"


def listed_bytes(path: Path) -> int | None:
    """The checkpoint's size as its manifest lists it (no walk of the folder); None without one."""
    try:
        return sum(int(size) for size in json.loads((path / MANIFEST).read_text())["files"].values())
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
