"""`shardconsole settings [TABLE | TABLE.KEY] [--json] [--preset NAME]`: every setting with its type, default, allowed
values and help, read from config.py's dataclasses (the tables the console's forms are built from, and
the ones `--set` and preset files are checked against), so the list cannot drift from what is accepted.

A name another tool uses (`learning_rate`, `gradient_accumulation_steps`) is answered with the setting
that means the same, as an unknown `--set` key is.
"""

from __future__ import annotations

import argparse
import json
import sys
import textwrap
import types
import typing
from dataclasses import MISSING, fields
from typing import Any, Literal, get_args, get_origin

from shardconsole.settings import config as C


def _plain(tp: Any) -> tuple[Any, bool]:
    """(the type without None, whether None, "not set", is allowed)."""
    if get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in get_args(tp) if a is not type(None)]
        return (args[0] if len(args) == 1 else typing.Union[tuple(args)]), len(args) < len(get_args(tp))
    return tp, False


def describe(table: str, key: str) -> dict[str, Any]:
    """One setting as data: type, default (None: not set), allowed values or range, help."""
    f = next(f for f in fields(C.TABLES[table]) if f.name == key)
    tp, optional = _plain(C.field_type(table, key))
    # no default means a default_factory here: typeshed's Field cannot say that one of the two is set
    default = f.default if f.default is not MISSING else f.default_factory()   # type: ignore[misc,operator]
    meta = f.metadata
    out: dict[str, Any] = {"key": f"{table}.{key}", "default": default, "optional": optional}
    if get_origin(tp) is Literal:
        out["type"] = "choice"
        out["allowed"] = list(get_args(tp))
    elif tp is bool:
        out["type"], out["allowed"] = "bool", [True, False]
    elif meta.get("size"):
        out["type"] = "size"
        out["allowed"] = "a byte size such as 24GiB, 512MiB or a number of bytes (empty: none)"
    else:
        out["type"] = {int: "int", float: "float", str: "string"}.get(tp, str(tp))
    if meta.get("min") is not None:
        out["min"] = meta["min"]
    if meta.get("max") is not None:
        out["max"] = meta["max"]
    out["help"] = str(meta.get("help", ""))
    return out


def _toml(value: Any) -> str:
    if value is None:
        return "(not set)"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, int) and abs(value) >= 100_000:
        return f"{value:_}"
    return repr(value)


def _allowed(d: dict[str, Any]) -> str:
    if d["type"] in ("choice", "bool"):
        text = " | ".join(_toml(a) for a in d["allowed"])
    elif d["type"] == "size":
        text = "a size (24GiB, 512MiB, bytes)"
    else:
        text = {"int": "integer", "float": "number", "string": "text"}[d["type"]]
        lo, hi = d.get("min"), d.get("max")
        if lo is not None and hi is not None:
            text += f" {_toml(lo)}..{_toml(hi)}"
        elif lo is not None:
            text += f" >= {_toml(lo)}"
    return text + (" (or unset)" if d["optional"] else "")


def _select(what: str | None) -> list[tuple[str, list[str]]]:
    """[(table, [keys])] for TABLE, TABLE.KEY or everything; a ConfigError naming what exists otherwise."""
    every = {t: [f.name for f in fields(cls)] for t, cls in C.TABLES.items()}
    if not what:
        return list(every.items())
    table, _, key = what.partition(".")
    if table in every and not key:
        return [(table, every[table])]
    if table in every and key in every[table]:
        return [(table, [key])]
    means = C.familiar_name(key or table, known=every)
    if means:
        hint = f" (did you mean {means}?)"
    else:
        import difflib
        close = difflib.get_close_matches(what, [*every, *(f"{t}.{k}" for t, ks in every.items() for k in ks)], n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
    raise C.ConfigError(f"settings: no table or setting {what!r}{hint}; tables are {', '.join(every)}")


def render(selection: list[tuple[str, list[str]]], width: int | None = None,
           cfg: C.RunConfig | None = None) -> str:
    """The listing; with `cfg` (a resolved preset) each key shows its value there, and the default
    beside it where they differ."""
    import shutil
    width = width or max(40, min(100, shutil.get_terminal_size().columns - 2))
    lines: list[str] = []
    for table, keys in selection:
        lines.append(f"[{table}]")
        for key in keys:
            d = describe(table, key)
            shown = _toml(d["default"])
            if cfg is not None and getattr(getattr(cfg, table), key) != d["default"]:
                shown = f"{_toml(getattr(getattr(cfg, table), key))}  (default {shown})"
            lines.append(f"  {key} = {shown}    {_allowed(d)}")
            lines.extend(textwrap.wrap(d["help"], width=width, initial_indent="      ",
                                       subsequent_indent="      "))
        lines.append("")
    return "\n".join(lines)


def _cell(text: str) -> str:
    """Text inside a Markdown table cell: a pipe would end the cell, a newline the row."""
    return text.replace("|", "\\|").replace("\n", " ")


def render_markdown(selection: list[tuple[str, list[str]]]) -> str:
    """docs/SETTINGS.md: the same listing as a Markdown reference, one table per settings table. The
    committed file is this output (tests/test_docs.py), so the reference cannot drift from what
    `--set` and preset files accept."""
    lines = ["# Settings reference", "",
             "Every key a preset's `[table]` or `--set table.key=value` takes, with its default, what it "
             "allows and what it does.",
             "Written by `shardconsole settings --markdown > docs/SETTINGS.md` from the settings tables "
             "(shardconsole/settings/tables.py); do not edit it by hand. "
             "Precedence: `--set` (or a console field) > the preset file > these defaults.", ""]
    lines.append("Tables: " + ", ".join(f"[{t}](#{t})" for t, _ in selection) + ".")
    lines.append("")
    for table, keys in selection:
        lines += [f"## {table}", ""]
        doc = (C.TABLES[table].__doc__ or "").strip()
        if doc and not doc.startswith(C.TABLES[table].__name__ + "("):     # a dataclass's own signature is no help
            lines += [" ".join(doc.split()), ""]
        lines += ["| key | default | allowed | what it does |", "|---|---|---|---|"]
        for key in keys:
            d = describe(table, key)
            lines.append(f"| `{table}.{key}` | `{_cell(_toml(d['default']))}` | {_cell(_allowed(d))} | "
                         f"{_cell(d['help'])} |")
        lines.append("")
    return "\n".join(lines)


def cmd_settings(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(
        prog="shardconsole settings",
        description="List every setting a preset or `--set table.key=value` takes: its default, allowed values "
                    "and what it does.")
    ap.add_argument("what", nargs="?", default=None, metavar="TABLE[.KEY]",
                    help=f"one table ({', '.join(C.TABLES)}) or one setting (train.lr); default: all")
    ap.add_argument("--json", action="store_true", help="as JSON: {table: {key: {type, default, allowed, ...}}}")
    ap.add_argument("--markdown", action="store_true",
                    help="as the Markdown reference docs/SETTINGS.md holds (shardconsole settings --markdown "
                         "> docs/SETTINGS.md)")
    ap.add_argument("--preset", default=None, help="also show each key's value in this preset (name or .toml file)")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="TABLE.KEY=VALUE",
                    help="with --preset: an override on top, as a run takes it; repeatable")
    args = ap.parse_args(argv)
    selection = _select(args.what)
    cfg = None
    if args.preset or args.overrides:
        from shardconsole.settings import resolve as settings
        cfg = settings.resolve(args.preset or settings.DEFAULT_PRESET, settings.from_cli(args.overrides)).cfg
    if args.markdown:
        if cfg is not None:
            raise C.ConfigError("settings: --markdown writes the defaults' reference; --preset and --set "
                                "show a preset's values (without --markdown)")
        sys.stdout.write(render_markdown(selection))
        return 0
    if args.json:
        doc = {table: {key: {k: v for k, v in describe(table, key).items() if k != "key"} for key in keys}
               for table, keys in selection}
        if cfg is not None:
            for table, keys in doc.items():
                for key, d in keys.items():
                    d["value"] = getattr(getattr(cfg, table), key)
        sys.stdout.write(json.dumps(doc, indent=2) + "\n")
        return 0
    sys.stdout.write(render(selection, cfg=cfg))
    if not args.what:
        print("Set one with `--set table.key=value` or in a preset's [table]; `shardconsole settings TABLE` "
              "lists one table.", file=sys.stderr)
    return 0
