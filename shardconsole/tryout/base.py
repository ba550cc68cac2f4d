"""The model a run started from (its model.name), for answering beside the fine-tune: what did training
change? Read without torch from the run's preset.toml, or, for an exported folder, from the preset
that both exports (export-model's and train.export_dir's) copy into their README.
"""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass
from pathlib import Path

from shardconsole.runlog.runfolder import PRESET_FILE
from shardconsole.settings.models import CATALOG, ModelError, resolve

# Both exports' READMEs end with the run's preset.toml in a toml block under this heading.
_PRESET_BLOCK = re.compile(r"## The run's settings \(its preset\.toml\)\s*```toml\n(.*?)```", re.S)


@dataclass(frozen=True)
class Base:
    folder: Path | None       # the weights to load; None: nothing to compare with (see why)
    why: str = ""             # one line: a random catalog init, a folder gone, no preset to read


def of_preset(text: str, source: str) -> Base:
    try:
        name = tomllib.loads(text).get("model", {}).get("name")
    except tomllib.TOMLDecodeError as e:
        return Base(None, f"{source}: not valid TOML ({e})")
    if not isinstance(name, str) or not name:
        return Base(None, f"{source}: names no model.name")
    if name in CATALOG:
        return Base(None, f"the run started from the catalog's {name!r}, a random init: no base to compare with")
    try:
        spec = resolve(name)
    except ModelError as e:
        return Base(None, f"the run's base: {e}")
    if not spec.has_weights:
        return Base(None, f"the run's base {name} has no weights (it was a random init): no base to compare with")
    return Base(Path(spec.path or name))


def of_run(run_dir: Path) -> Base:
    preset = Path(run_dir) / PRESET_FILE
    try:
        return of_preset(preset.read_text(), str(preset))
    except OSError as e:
        return Base(None, f"{preset}: cannot read: {e.strerror}")


def of_export(folder: Path) -> Base:
    readme = Path(folder) / "README.md"
    try:
        found = _PRESET_BLOCK.search(readme.read_text())
    except OSError:
        found = None
    if found is None:
        return Base(None, f"{folder} does not say which run it came from (no preset in its README.md): "
                          f"give the base folder, --base FOLDER")
    return of_preset(found.group(1), str(readme))


def no_tokenizer(run_dir: Path) -> str:
    """Why a run has no words to chat in ("" when it has): an export carries its model folder's tokenizer,
    so a run of a catalog size or of a folder without tokenizer files exports none. Said before the
    export (minutes at 7B), by `chat RUN` and by the console's runs screen alike."""
    preset = Path(run_dir) / PRESET_FILE
    try:
        name = tomllib.loads(preset.read_text()).get("model", {}).get("name")
        spec = resolve(name) if isinstance(name, str) and name else None
    except (OSError, tomllib.TOMLDecodeError, ModelError):
        spec = None
    if spec is None or (spec.path is not None and spec.has_tokenizer):
        return ""       # export-model names what is wrong with an unreadable folder
    what = (f"the catalog size {name!r} from random init (its data went in as token ids or UTF-8 bytes)"
            if spec.path is None else f"{spec.path}, a folder without tokenizer files")
    return (f"chat: {run_dir} trained {what}: there is no tokenizer to turn a message into tokens; chat with "
            f"a run of a Hugging Face model folder that has its tokenizer (model.name = FOLDER)")


def of_folder(folder: Path) -> Base:
    """An explicit base (--base FOLDER): it must be a model folder with weights."""
    try:
        spec = resolve(str(folder))
    except ModelError as e:
        return Base(None, str(e))
    if not spec.has_weights:
        return Base(None, f"{folder} has no weights")
    return Base(Path(spec.path or folder))
