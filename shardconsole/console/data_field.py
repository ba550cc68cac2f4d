"""The data files checked at their fields, as they are typed: the launch's own preflight (exists,
readable, a kind the ranks read, UTF-8 text, the model's tokenizer loads), so the field says what the
launch would refuse before ctrl+r is pressed. No Textual here."""

from __future__ import annotations

from pathlib import Path

from shardconsole.settings import config as C
from shardconsole.settings import resolve as settings
from shardconsole.session import preflight


def _mtime(path: str | None) -> float | None:
    try:
        return Path(path).expanduser().stat().st_mtime if path else None
    except (OSError, ValueError):
        return None


class DataCheck:
    """preflight.check_data, cached on the values and the files' mtimes: the setup screen asks on every
    keystroke, and a model folder's tokenizer is not free to load."""

    def __init__(self) -> None:
        self._key: object = None
        self._found: tuple[str, str] | None = None

    def problem(self, resolved: settings.Resolved) -> tuple[str, str] | None:
        """(table.key, what is wrong) for the first data problem; None when the launch would accept it."""
        cfg = resolved.cfg
        d = cfg.data
        key = (d.source, d.path, d.eval_path, cfg.model.name, _mtime(d.path), _mtime(d.eval_path))
        if key != self._key:
            try:
                preflight.check_data(resolved)
                self._found = None
            except C.ConfigError as e:
                self._found = (e.path or "data.path", e.reason)
            self._key = key
        return self._found
