"""RunConfig: the settings of one run, one dataclass per TOML table.

Load order (later wins): the dataclass defaults < a preset file < `--set table.key=value` overrides.
Every error names the file, the table and the key, says what is allowed and, for a misspelling, the
closest valid name; the CLI turns a ConfigError into one line and exit code 2.

This module is shared by the front end and the ranks: it imports neither torch nor textual.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import sys
import typing
from dataclasses import fields
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

import tomli_w


from shardconsole.settings.rules import validate  # noqa: F401  (config.validate, as before)
from shardconsole.settings.values import (ConfigError, coerce, parse_override_value,  # noqa: F401
                                        familiar_name, format_size, fp8_emulated, names_key, override_source,
                                        parse_size)
from shardconsole.settings.tables import (TABLES, TOP_LEVEL_KEYS, DataSettings, DeepspeedSettings,  # noqa: F401
                                        FsdpSettings, GrpoSettings, LoraSettings, MemorySettings, ModelSettings, ParallelSettings,
                                        PrecisionSettings, PreferenceSettings, RunConfig,
                                        TrainSettings, setting)


# ---------------------------------------------------------------------------------------------------
# Type checking of one value against a field's annotation.

def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


# ---------------------------------------------------------------------------------------------------
# Building a RunConfig from dicts, with errors that name where the value came from.

def _close(name: str, options: list[str]) -> str:
    m = difflib.get_close_matches(name, options, n=1, cutoff=0.6)
    return f" (did you mean {m[0]!r}?)" if m else ""


def _familiar(key: str, table: str | None = None) -> str:
    """" (did you mean train.lr?)" for a name of another tool or another table's key; "" otherwise."""
    known = {t: [f.name for f in fields(cls)] for t, cls in TABLES.items()}
    means = familiar_name(key, known=known)
    return f" (did you mean {means}?)" if means and means != f"{table}.{key}" else ""


def apply_toml(cfg: RunConfig, data: dict[str, Any], source: str) -> None:
    """Merge a parsed TOML document into cfg in place. `source` names the file for errors."""
    for key, value in data.items():
        if key in TOP_LEVEL_KEYS:
            if not isinstance(value, str):
                raise ConfigError(f"description: expected a string, got {value!r}", source=source)
            cfg.description = value
            continue
        if key not in TABLES:
            if not isinstance(value, dict):
                raise ConfigError(_outside_tables(key), source=source)
            raise ConfigError(f"unknown table [{key}]{_close(key, list(TABLES) + list(TOP_LEVEL_KEYS))}; "
                              f"tables are {', '.join(TABLES)}", source=source)
        if not isinstance(value, dict):
            raise ConfigError(f"[{key}] must be a table, got {value!r}", source=source, table=key)
        for k, v in value.items():
            _set(cfg, key, k, v, source)


def _outside_tables(key: str) -> str:
    """A `key = value` above every [table] header (TOML puts it in no table): said as that, with the table
    that has such a key (it was called an unknown table, which sent the reader looking for a header)."""
    owners = [f"[{t}]" for t, cls in TABLES.items() if key in {f.name for f in fields(cls)}]
    if owners:
        hint = f"; {' and '.join(owners)} {'has' if len(owners) == 1 else 'have'} it: put it under that header"
    else:
        hint = _familiar(key) or _close(key, list(TOP_LEVEL_KEYS))
    return f"{key!r} is a key outside any table{hint}; settings live in the tables {', '.join(TABLES)}"


def _set(cfg: RunConfig, table: str, key: str, value: Any, source: str, *, from_text: bool = False) -> None:
    section = getattr(cfg, table)
    hints = _hints(type(section))
    names = [f.name for f in fields(section)]
    if key not in names:
        raise ConfigError(f"unknown key {key!r}{_familiar(key, table) or _close(key, names)}; keys are "
                          f"{', '.join(names)}",
                          source=source, table=table, key=key)
    tp = hints[key]
    if from_text:
        value = parse_override_value(tp, value)
    meta = next(f.metadata for f in fields(section) if f.name == key)
    if meta.get("list") and isinstance(value, list):      # a TOML list of a comma-separated setting
        value = ",".join(str(v) for v in value)
    aliases = meta.get("aliases", {})
    if isinstance(value, (bool, str)) and str(value).lower() in aliases:
        value = aliases[str(value).lower()]     # an older spelling kept working, with no warning
    try:
        value = coerce(tp, value)
        if value is not None and not isinstance(value, (bool, str)):
            lo, hi = meta.get("min"), meta.get("max")
            if lo is not None and value < lo:
                raise ValueError(f"{value!r} is below the minimum {lo}")
            if hi is not None and value > hi:
                raise ValueError(f"{value!r} is above the maximum {hi}")
    except ValueError as e:
        raise ConfigError(f"{e}; {meta.get('help', '')}".rstrip("; "), source=source, table=table, key=key) from None
    setattr(section, key, value)


def parse_override(text: str) -> tuple[str, str, str]:
    """'table.key=value' -> (table, key, value text)."""
    if "=" not in text or "." not in text.split("=", 1)[0]:
        name, _, value = text.partition("=")
        means = familiar_name(name, known={t: [f.name for f in fields(cls)] for t, cls in TABLES.items()})
        hint = f" (did you mean {means}={value.strip()}?)" if means else ""
        raise ConfigError(f"expected table.key=value, e.g. train.steps=50{hint}", source=f"--set {text!r}")
    path, value = text.split("=", 1)
    table, key = path.strip().split(".", 1)
    if table not in TABLES:
        raise ConfigError(f"unknown table {table!r}{_close(table, list(TABLES))}; tables are {', '.join(TABLES)}",
                          source=f"--set {text!r}")
    return table, key.strip(), value


def set_from_text(cfg: RunConfig, table: str, key: str, text: str, source: str) -> None:
    """One override, its value as `--set` takes it; errors name `source`."""
    _set(cfg, table, key, text, source, from_text=True)


def apply_overrides(cfg: RunConfig, overrides: list[str]) -> None:
    for text in overrides:
        table, key, value = parse_override(text)
        set_from_text(cfg, table, key, value, override_source("--set", table, key))


def load_toml(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    try:
        with open(path, "rb") as fh:
            raw = fh.read()
        # An editor's UTF-8 byte-order mark (Windows Notepad writes one) is no TOML: tomllib read it as
        # "Invalid statement" at line 1, column 1
        return tomllib.loads(raw.removeprefix(b"\xef\xbb\xbf").decode("utf-8"))
    except FileNotFoundError:
        raise ConfigError("no such file", source=str(path)) from None
    except IsADirectoryError:
        raise ConfigError("is a folder, not a preset file", source=str(path)) from None
    except UnicodeDecodeError:
        raise ConfigError("not a text file (a preset is TOML)", source=str(path)) from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"not valid TOML: {e}", source=str(path)) from None
    except OSError as e:
        raise ConfigError(f"cannot read: {e.strerror}", source=str(path)) from None


def build(preset: dict[str, Any] | None = None, source: str = "preset",
          overrides: list[str] | None = None, *, gpu_count: int | None = None) -> RunConfig:
    """Defaults < preset < overrides, then the checks that span several keys."""
    cfg = RunConfig()
    if preset:
        apply_toml(cfg, preset, source)
    apply_overrides(cfg, overrides or [])
    origins = {f"{t}.{k}": override_source("--set", t, k) for t, k, _ in map(parse_override, overrides or [])}
    validate(cfg, source, gpu_count=gpu_count, origins=origins)
    return cfg


# ---------------------------------------------------------------------------------------------------
# Saving: atomic, so that a crash never leaves half a preset.

def dumps(cfg: RunConfig) -> str:
    return tomli_w.dumps(cfg.to_dict())


def save(cfg: RunConfig, path: str | Path, *, overwrite: bool = True) -> Path:
    path = Path(path)
    if path.exists() and not overwrite:
        raise FileExistsError(path)
    return write_atomic(path, dumps(cfg))


def write_atomic(path: Path, text: str) -> Path:
    """Write text to path so that a reader (or a crash) sees the old file or the new one, never half."""
    path.parent.mkdir(parents=True, exist_ok=True)
    # 0o666 and the umask decide (mkstemp's 0600 hid preset.toml from a follower of another uid)
    tmp = str(path.parent / f".{path.name}.{os.getpid()}.{os.urandom(4).hex()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def load(path: str | Path, overrides: list[str] | None = None, *, gpu_count: int | None = None) -> RunConfig:
    return build(load_toml(path), str(path), overrides, gpu_count=gpu_count)


def field_type(table: str, key: str) -> Any:
    return _hints(TABLES[table])[key]


def copy(cfg: RunConfig) -> RunConfig:
    return dataclasses.replace(cfg, **{t: dataclasses.replace(getattr(cfg, t)) for t in TABLES})
