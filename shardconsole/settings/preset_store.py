"""Where presets live: the built-in ones shipped with the package and the user's own folder.

A preset is named by its file stem ("3090-offload") or given as a path to a .toml file. The user's
folder (platformdirs' config dir, or $SHARDCONSOLE_PRESETS_DIR) shadows built-ins of the same name.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from shardconsole.user_folders import presets_dir
from shardconsole.settings import config as C
from shardconsole.settings.paths import PathError, regular_file, shown


def builtin_dir() -> Path:
    here = Path(__file__).resolve().parents[1]     # the shardconsole package
    shipped = here / "presets"           # inside an installed wheel
    return shipped if shipped.is_dir() else here.parent / "presets"   # a source checkout


@dataclass(frozen=True)
class PresetInfo:
    name: str
    path: Path
    origin: str          # "built-in" or "user"
    description: str


def describe(path: Path) -> str:
    """The first line of a preset file's description (or why it cannot be read)."""
    try:
        data = C.load_toml(path)
    except C.ConfigError as e:
        return f"(unreadable: {e})"
    desc = data.get("description", "")
    return desc.strip().splitlines()[0] if isinstance(desc, str) and desc.strip() else ""


def list_presets() -> list[PresetInfo]:
    found: dict[str, PresetInfo] = {}
    for origin, folder in (("built-in", builtin_dir()), ("user", presets_dir())):
        if not folder.is_dir():
            continue
        for path in sorted(folder.glob("*.toml")):
            found[path.stem] = PresetInfo(path.stem, path, origin, describe(path))
    return list(found.values())


def find(name_or_path: str) -> Path:
    """The file of a preset name or path. ConfigError names what exists when nothing matches."""
    p = Path(name_or_path).expanduser()
    try:
        if p.suffix == ".toml" or os.sep in name_or_path:
            if regular_file(p, "a preset file") == "file":     # a FIFO would block the read for ever
                return p
            raise C.ConfigError(f"{shown(name_or_path)}: no such preset file")
        for folder in (presets_dir(), builtin_dir()):
            candidate = folder / f"{name_or_path}.toml"
            if regular_file(candidate, "a preset file") == "file":
                return candidate
    except PathError as e:
        raise C.ConfigError(f"--preset: {e}") from None
    names = [i.name for i in list_presets()]
    import difflib
    close = difflib.get_close_matches(name_or_path, names, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    raise C.ConfigError(f"preset {name_or_path!r}: not found{hint}; presets are {', '.join(names)} "
                        f"or a path to a .toml file")


def load(name_or_path: str, overrides: list[str] | None = None) -> C.RunConfig:
    """A preset file's settings with `--set` overrides, as written: no DeepSpeed equivalents of FSDP
    settings and no machine checks. What a run uses comes from settings.resolve."""
    path = find(name_or_path)
    return C.build(C.load_toml(path), str(path), overrides)


# Letters, digits, '-' and '_', not first a '-' (it would read as an option) and short enough for any
# file system (255 bytes a name, with ".toml").
_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_-]{0,63}")


def valid_name(name: str) -> bool:
    return bool(_NAME.fullmatch(name))


def check_name(name: str) -> str:
    """A preset name to save under, or ConfigError saying the rule. Built-in names are taken: a user
    preset of the same name would hide the built-in from every front end."""
    if not valid_name(name):
        shown = name if len(name) <= 40 else name[:37] + "..."
        hint = " (leave out .toml)" if name.endswith(".toml") else ""
        raise C.ConfigError(f"{shown!r} is not a preset name{hint}: use up to 64 letters, digits, '-' and '_', "
                            f"not starting with '-'", source="preset name")
    if (builtin_dir() / f"{name}.toml").is_file():
        raise C.ConfigError(f"{name!r} is a built-in preset; pick another name (a user preset of that name "
                            f"would hide the built-in)", source="preset name")
    return name


def dumps_preset(cfg: C.RunConfig) -> str:
    """cfg as a preset file: only the settings that differ from the defaults (issue 36.12). A file
    with every key spelled out names keys that do nothing for these settings (master_rounding under
    fp32 masters) and warned about them on every load; one with only the changes says what the preset
    is. It loads back as the same settings (tests/test_tune.py checks a round trip)."""
    import tomli_w
    defaults = C.RunConfig().to_dict()
    doc: dict[str, object] = {}
    for table, values in cfg.to_dict().items():
        if not isinstance(values, dict):
            doc[table] = values                     # the description
            continue
        changed = {k: v for k, v in values.items() if defaults.get(table, {}).get(k, object()) != v}
        if changed:
            doc[table] = changed
    return tomli_w.dumps(doc)


def save_user_preset(cfg: C.RunConfig, name: str, *, overwrite: bool = False) -> Path:
    """Write cfg as <user dir>/<name>.toml (the settings that differ from the defaults). Raises
    ConfigError for a name check_name refuses, and FileExistsError unless overwrite."""
    path = presets_dir() / f"{check_name(name)}.toml"
    if path.exists() and not overwrite:
        raise FileExistsError(path)
    return C.write_atomic(path, dumps_preset(cfg))
