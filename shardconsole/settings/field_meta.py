"""`setting`: a settings field with its default and its metadata: "min"/"max" (inclusive), "size" (the value is a
byte size string or int), "help" (one line shown in the console and in errors). The tables (tables.py,
finetune_tables.py, engine_tables.py) declare every field with it; config.py and the front ends read the metadata
back."""

from __future__ import annotations

from dataclasses import field
from typing import Any


def setting(default: Any, help: str, **meta: Any) -> Any:
    """One setting of a table: `key: type = setting(default, help, min=..., allowed=...)`; the
    metadata is what the CLI, the console and docs/SETTINGS.md read (named for what a table line
    declares; `field_` would only echo dataclasses.field)."""
    meta["help"] = help
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata=meta)
    return field(default=default, metadata=meta)
