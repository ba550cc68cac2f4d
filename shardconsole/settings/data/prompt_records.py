"""Prompt-only records (train.objective grpo), in TRL's form: `prompt` as a string or a message list (the
conversation so far, ending with the user's turn); every other column is kept and given to the reward
functions as a keyword list. The check before launch (data_check) and the ranks (backends/data/prompts.py)
read a record through `prompt_of`, so both refuse the same record the same way."""

from __future__ import annotations

import json
from typing import Any

from shardconsole.settings.data.data_scan import ROLES, ScanError

KEYS = ("prompt",)


def prompt_of(rec: dict[str, Any], where: str) -> str | list[dict[str, str]]:
    """The record's prompt: its text, or its turns as [{role, content}]; ScanError names the record."""
    value = rec.get("prompt")
    if value is None:
        raise ScanError(f"{where}: field 'prompt': missing; train.objective = \"grpo\" reads prompt-only records: "
                        f"'prompt' as a string or a message list, other fields passed to the reward functions")
    if isinstance(value, str) and value.lstrip().startswith("[{"):
        try:
            value = json.loads(value)       # a CSV cell holds a message list as its JSON text
        except json.JSONDecodeError:
            pass
    if isinstance(value, str):
        if not value.strip():
            raise ScanError(f"{where}: field 'prompt': empty")
        return value
    if not isinstance(value, list) or not value:
        raise ScanError(f"{where}: field 'prompt': expected a string or a non-empty list of turns, got "
                        f"{type(value).__name__}")
    out = []
    for j, m in enumerate(value):
        if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
            raise ScanError(f"{where}: field 'prompt'[{j}]: expected {{role: {'|'.join(ROLES)}, content: string}}")
        out.append({"role": m["role"], "content": m["content"]})
    return out


def check(rec: dict[str, Any], where: str) -> None:
    """data_scan's record rule for prompt records."""
    prompt_of(rec, where)
