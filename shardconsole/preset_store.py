"""Where presets live: the built-in ones shipped with the package and the user's own folder.

A preset is named by its file stem ("3090-offload") or given as a path to a .toml file. The user's
folder (platformdirs' config dir, or $SHARDCONSOLE_PRESETS_DIR) shadows built-ins of the same name.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import platformdirs

from shardconsole import config as C


def builtin_dir() -> Path:
    here = Path(__file__).resolve().parent
    shipped = here / "presets"           # inside an installed wheel
    return shipped if shipped.is_dir() else here.parent / "presets"   # a source checkout


def user_dir() -> Path:
    env = os.environ.get("SHARDCONSOLE_PRESETS_DIR")
    if env:
        return Path(env).expanduser()
    return Path(platformdirs.user_config_dir("shardconsole")) / "presets"


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
    for origin, folder in (("built-in", builtin_dir()), ("user", user_dir())):
        if not folder.is_dir():
            continue
        for path in sorted(folder.glob("*.toml")):
            found[path.stem] = PresetInfo(path.stem, path, origin, describe(path))
    return list(found.values())


def find(name_or_path: str) -> Path:
    """The file of a preset name or path. ConfigError names what exists when nothing matches."""
    p = Path(name_or_path).expanduser()
    if p.suffix == ".toml" or os.sep in name_or_path:
        if p.is_file():
            return p
        raise C.ConfigError(f"{name_or_path}: no such preset file")
    for folder in (user_dir(), builtin_dir()):
        candidate = folder / f"{name_or_path}.toml"
        if candidate.is_file():
            return candidate
    names = [i.name for i in list_presets()]
    import difflib
    close = difflib.get_close_matches(name_or_path, names, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    raise C.ConfigError(f"preset {name_or_path!r}: not found{hint}; presets are {', '.join(names)} "
                        f"or a path to a .toml file")


def resolve(name_or_path: str | None, overrides: list[str] | None = None, *,
            gpu_count: int | None = None) -> tuple[C.RunConfig, str, list[str]]:
    """The settings a run of this preset uses: defaults < preset < overrides, and, when the result is a
    DeepSpeed run made from FSDP settings (`--set parallel.backend=deepspeed`), their ZeRO equivalents
    for every deepspeed key the user did not set. Returns (settings, source file, notes on the mapping).
    Every front end (run, plan, export, console) resolves through here, so they agree."""
    from shardconsole import ds_json
    if name_or_path is None:
        cfg, notes = ds_json.deepspeed_config_for(None, "defaults", overrides, gpu_count=gpu_count)
        return cfg, "defaults", notes
    path = find(name_or_path)
    cfg, notes = ds_json.deepspeed_config_for(C.load_toml(path), str(path), overrides, gpu_count=gpu_count)
    return cfg, str(path), notes


def load(name_or_path: str, overrides: list[str] | None = None, *, gpu_count: int | None = None) -> C.RunConfig:
    return resolve(name_or_path, overrides, gpu_count=gpu_count)[0]


def save_user_preset(cfg: C.RunConfig, name: str, *, overwrite: bool = False) -> Path:
    """Write cfg as <user dir>/<name>.toml. Raises FileExistsError unless overwrite."""
    if not name or any(c in name for c in "/\\") or name.startswith("."):
        raise C.ConfigError(f"preset name {name!r}: use letters, digits, '-' and '_'")
    return C.save(cfg, user_dir() / f"{name}.toml", overwrite=overwrite)
