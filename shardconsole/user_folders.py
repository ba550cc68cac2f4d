"""Where shardconsole keeps this user's files, one function each: the runs root, the user presets folder,
the cache (run summaries, file hashes, the ranks' token cache, doctor's verdict) and the speeds file.

Each honours its environment variable first (envvars.py checks the value before any command runs), else
the per-user folder platformdirs gives on this system (on Linux: ~/.local/share/shardconsole for data,
~/.cache/shardconsole for the cache, ~/.config/shardconsole for presets). No other module asks platformdirs
or reads these variables (tests/test_user_folders.py holds that), so a folder is moved or documented in
one place.

Standard library and platformdirs only, at the package's top beside envvars.py: the launcher, the settings,
the planner, the machine's readings, the history and the ranks' token cache all import it.
"""

from __future__ import annotations

from pathlib import Path

from shardconsole.envvars import read

APP = "shardconsole"
RUNS_ROOT_ENV = "SHARDCONSOLE_RUNS_ROOT"
PRESETS_ENV = "SHARDCONSOLE_PRESETS_DIR"
CACHE_ENV = "SHARDCONSOLE_CACHE_DIR"
SPEEDS_ENV = "SHARDCONSOLE_SPEEDS_FILE"
OLD_RUNS_ROOT = Path("runs")     # the default before the runs root: relative to where a run started


def runs_root(explicit: str | Path | None = None) -> Path:
    """Where new run folders go, the same from any directory: `--runs-root`, else $SHARDCONSOLE_RUNS_ROOT,
    else the per-user data folder (~/.local/share/shardconsole/runs on Linux). Absolute, so a command
    printed for other nodes or a console started elsewhere names the same folder."""
    if explicit:
        return Path(explicit).expanduser().absolute()
    env = read(RUNS_ROOT_ENV)
    if env:
        return env.absolute()
    import platformdirs
    return Path(platformdirs.user_data_dir(APP)) / "runs"


def presets_dir() -> Path:
    """The user's presets (they shadow built-ins of the same name): $SHARDCONSOLE_PRESETS_DIR, else the
    per-user config folder's presets/."""
    env = read(PRESETS_ENV)
    if env:
        return env
    import platformdirs
    return Path(platformdirs.user_config_dir(APP)) / "presets"


def cache_dir() -> Path:
    """shardconsole's cache: $SHARDCONSOLE_CACHE_DIR, else the per-user cache folder. Everything in it can
    be deleted: it is made again (slower) when needed."""
    env = read(CACHE_ENV)
    if env:
        return env
    import platformdirs
    return Path(platformdirs.user_cache_dir(APP))


def run_summaries_dir() -> Path:
    """`runs`' one summary per run folder (history/cache.py)."""
    return cache_dir() / "runs"


def speeds_file() -> Path:
    """The speeds measured on this machine (plan/speed/book.py): $SHARDCONSOLE_SPEEDS_FILE, else the
    per-user data folder's speeds.jsonl."""
    path = read(SPEEDS_ENV)
    if path:
        return path
    import platformdirs
    return Path(platformdirs.user_data_dir(APP)) / "speeds.jsonl"
