"""The data files checked at their fields, as they are typed: the launch's own preflight (exists,
readable, a kind the ranks read, UTF-8 text, the records' shapes, the model's tokenizer loads), so the
field says what the launch would refuse before ctrl+r is pressed. No Textual here.

The check reads files, and a file can take any time (a network mount that stalls, a device): it runs on
a thread of its own, never the UI's. The UI waits for it at most WAIT_S per keystroke; a check still
going then shows as "checking", and one past TIMEOUT_S as a problem of its own, so a stalled file
system can neither freeze the console nor let a launch through unchecked.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Callable

from shardconsole.settings import config as C
from shardconsole.settings import resolve as settings
from shardconsole.session import preflight

WAIT_S = 0.2          # a keystroke's wait for the answer: most checks (a local file) end within it
TIMEOUT_S = 10.0      # a check still running after this is said to be stuck


def _mtime(path: str | None) -> float | None:
    try:
        return Path(path).expanduser().stat().st_mtime if path else None
    except (OSError, ValueError):
        return None


class _Check:
    """One preflight.check_data on a daemon thread (a thread blocked in a read must not keep the
    console from exiting, so no executor: its threads are joined at exit)."""

    def __init__(self, resolved: settings.Resolved, on_done: Callable[[], None] | None, timeout_s: float) -> None:
        self.result: tuple[str, str] | None = None
        self.done = threading.Event()
        self.waited_out = False        # the UI stopped waiting: tell it when the answer comes
        self._lock = threading.Lock()
        self._on_done = on_done
        threading.Thread(target=self._run, args=(resolved,), daemon=True, name="shardconsole-data-check").start()
        if on_done is not None:        # a stuck check is drawn as stuck without waiting for a keystroke
            timer = threading.Timer(timeout_s, self._tell)
            timer.daemon = True
            timer.start()

    def _run(self, resolved: settings.Resolved) -> None:
        try:
            preflight.check_data(resolved)
        except C.ConfigError as e:
            self.result = (e.path or "data.path", e.reason)
        except Exception as e:      # a check that breaks says so at the field rather than dying unseen
            self.result = ("data.path", f"the data check failed: {type(e).__name__}: {e}")
        with self._lock:
            self.done.set()
            tell = self.waited_out
        if tell:
            self._tell()

    def stop_waiting(self) -> bool:
        """True when the answer came meanwhile; else the answer's arrival is told to on_done."""
        with self._lock:
            if self.done.is_set():
                return True
            self.waited_out = True
            return False

    def _tell(self) -> None:
        if self._on_done is not None and self.waited_out:
            try:
                self._on_done()
            except Exception:       # the screen or the app went away meanwhile
                pass


class DataCheck:
    """preflight.check_data, cached on the values and the files' mtimes: the setup screen asks on every
    keystroke, and a model folder's tokenizer is not free to load. on_done is called (from the check's
    thread) when a check the UI stopped waiting for ends, so the screen can draw its answer."""

    def __init__(self, on_done: Callable[[], None] | None = None, *, wait_s: float = WAIT_S,
                 timeout_s: float = TIMEOUT_S) -> None:
        self._key: object = None
        self._check: _Check | None = None
        self._started_s = 0.0
        self.on_done, self.wait_s, self.timeout_s = on_done, wait_s, timeout_s

    def problem(self, resolved: settings.Resolved) -> tuple[str, str] | None:
        """(table.key, what is wrong) for the first data problem; None when the launch would accept it."""
        import time
        cfg = resolved.cfg
        d = cfg.data
        key = (d.source, d.path, d.eval_path, d.text_key, d.eval_fraction, d.text_split, d.tokenizer,
               d.seq_len, cfg.model.name, _mtime(d.path), _mtime(d.eval_path))
        if key != self._key or self._check is None:
            self._key = key
            self._check = _Check(resolved, self.on_done, self.timeout_s)
            self._started_s = time.monotonic()
        check = self._check
        if check.done.wait(self.wait_s) or check.stop_waiting():
            return check.result
        if time.monotonic() - self._started_s >= self.timeout_s:
            return ("data.path", f"the data check did not finish in {self.timeout_s:g} s (a stalled network "
                                 f"file system, or a device?); the launch checks it again")
        return ("data.path", "checking the data file...")
