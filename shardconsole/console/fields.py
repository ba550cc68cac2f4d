"""The settings forms, derived from config.py's dataclasses; no Textual here, so it is tested as plain code.

Each key of each TOML table becomes a FieldSpec whose widget kind follows its annotation and metadata
(Literal -> select, bool -> switch, int/float -> number, a "size" string -> size, str -> text). Edits
are checked by the settings pipeline itself (the same path as `--set table.key=value`, with the field as
the source), so the console shows the reasons the command line gives, word for word; a field's error
comes from the ConfigError's table, key and reason, never from its text.
"""

from __future__ import annotations

import types
import typing
from dataclasses import dataclass, fields
from typing import Any, Literal, get_args, get_origin

from shardconsole.settings import config as C
from shardconsole.settings import resolve as settings
from shardconsole.settings.models import human_count

WidgetKind = Literal["select", "switch", "number", "size", "text"]

# Chosen on the pick tab (model list, backend and method switches), so the forms do not repeat them.
PICKED: frozenset[str] = frozenset({"model.name", "parallel.backend", "train.method"})
# Tables that only one backend reads: the other backend's table is hidden.
BACKEND_TABLE: dict[str, str] = {"fsdp": "fsdp", "deepspeed": "deepspeed"}
# The option of an optional select that leaves the setting unset (None: config.py's default applies).
DEFAULT_CHOICE = "default"


@dataclass(frozen=True)
class FieldSpec:
    table: str
    key: str
    kind: WidgetKind
    help: str
    choices: tuple[str, ...] = ()     # select only; DEFAULT_CHOICE first when optional
    optional: bool = False            # None is allowed (shown as an empty input or DEFAULT_CHOICE)

    @property
    def path(self) -> str:
        return f"{self.table}.{self.key}"


def spec_for(table: str, key: str) -> FieldSpec:
    tp = C.field_type(table, key)
    meta = next(f.metadata for f in fields(C.TABLES[table]) if f.name == key)
    optional = False
    if get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in get_args(tp) if a is not type(None)]
        optional = len(args) < len(get_args(tp))
        tp = args[0]
    helptext = str(meta.get("help", ""))
    default = (DEFAULT_CHOICE,) if optional else ()
    if get_origin(tp) is Literal:
        return FieldSpec(table, key, "select", helptext, default + tuple(str(a) for a in get_args(tp)), optional)
    if tp is bool:
        if optional:   # a switch has no third state, so "not set" needs a select
            return FieldSpec(table, key, "select", helptext, default + ("true", "false"), True)
        return FieldSpec(table, key, "switch", helptext)
    if tp in (int, float):
        return FieldSpec(table, key, "number", helptext, optional=optional)
    if meta.get("size"):   # byte sizes written as text ("24GiB")
        return FieldSpec(table, key, "size", helptext, optional=optional)
    return FieldSpec(table, key, "text", helptext, optional=optional)


def table_specs(table: str) -> list[FieldSpec]:
    return [spec_for(table, f.name) for f in fields(C.TABLES[table]) if f"{table}.{f.name}" not in PICKED]


def visible_tables(backend: str, method: str = "full", objective: str = "sft") -> list[str]:
    """The tables whose settings the chosen backend and train.method read, in TOML order ([lora] only
    when adapters train, [preference] only under a preference objective, [grpo] only under GRPO)."""
    return [t for t in C.TABLES if BACKEND_TABLE.get(t, backend) == backend and (t != "lora" or method != "full")
            and (t != "preference" or objective not in ("sft", "grpo")) and (t != "grpo" or objective == "grpo")]


def value_of(cfg: C.RunConfig, spec: FieldSpec) -> Any:
    return getattr(getattr(cfg, spec.table), spec.key)


def to_text(spec: FieldSpec, value: Any) -> str:
    """What the widget shows for a value; override_for() reads it back to the same value."""
    if value is None:
        return DEFAULT_CHOICE if spec.kind == "select" else ""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int) and abs(value) >= 100_000:
        return f"{value:_}"          # 500_000_000 reads better than 500000000; TOML accepts it
    return str(value)


def override_for(spec: FieldSpec, text: str) -> str:
    """The `table.key=value` override that a widget's text stands for."""
    stripped = text.strip()
    if spec.optional and stripped in ("", DEFAULT_CHOICE):
        return f"{spec.path}=none"
    return f"{spec.path}={stripped}"


def override(spec: FieldSpec, text: str) -> settings.Override:
    """The override a widget's text stands for, with the field as its source (`console: [table] key`)."""
    value = override_for(spec, text).split("=", 1)[1]
    return settings.from_console(spec.table, spec.key, value)


def hint(spec: FieldSpec, value: Any) -> str:
    """A reading aid shown after the widget: the size in bytes units, a big count in words."""
    if spec.kind == "switch":
        return "true" if value else "false"   # a switch's state in words, as the TOML will say it
    if spec.kind == "size" and isinstance(value, str) and value:
        try:
            return "= " + C.format_size(C.parse_size(value))
        except ValueError:
            return ""
    if spec.kind == "number" and isinstance(value, int) and not isinstance(value, bool) and value >= 10_000:
        return "= " + human_count(value)
    return ""


def diff_entries(diff: list[tuple[str, Any, Any]]) -> list[str]:
    """'train.steps 30 → 8' for each (table.key, preset's value, value now) of RunConfig.diff."""
    return [f"{path} {_short(old)} → {_short(new)}" for path, old, new in diff]


def _short(value: Any) -> str:
    if value is None:
        return DEFAULT_CHOICE
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return repr(value) if value == "" or " " in value else value
    return str(value)
