"""`shardconsole --run-dir DIR` opening the console: the first launch goes into DIR, as `--headless
--run-dir DIR` would (the console used to ignore the flag and put the run under the runs root without a
word); the next launch of the session gets a folder of its own; a DIR that holds a run is refused in one
line naming --run-dir. A real terminal (a pty) and real runs, the keys a user presses."""

from __future__ import annotations

import fcntl
import os
import pty
import struct
import subprocess
import sys
import termios
import threading
import time
from pathlib import Path

from tests.conftest import messages, of_kind
from tests.test_console import make_app, wait_for


class _Terminal:
    """The real CLI on a pty of 80x24: what it showed, and keys typed into it."""

    def __init__(self, *args: str) -> None:
        self.main, sub = pty.openpty()
        fcntl.ioctl(sub, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 80, 0, 0))
        self.proc = subprocess.Popen([sys.executable, "-m", "shardconsole", *args], stdin=sub, stdout=sub,
                                     stderr=sub, start_new_session=True,       # Textual draws on stderr
                                     env={**os.environ, "COLUMNS": "", "LINES": ""})
        os.close(sub)
        self.shown = bytearray()
        # Drained all along: a console whose terminal stops reading blocks on its next frame.
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        while True:
            try:
                chunk = os.read(self.main, 65536)
            except OSError:          # EIO: the console ended and closed its end
                return
            if not chunk:
                return
            self.shown += chunk

    def wait(self, condition, what: str, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            assert self.proc.poll() is None, f"the console ended ({self.proc.returncode}) before {what}"
            assert time.monotonic() < deadline, f"never: {what}; shown: {bytes(self.shown[-1500:])!r}"
            time.sleep(0.1)

    def press(self, keys: bytes) -> None:
        os.write(self.main, keys)


def _finished(run_dir: Path) -> bool:
    return (run_dir / "metrics.jsonl").is_file() and bool(of_kind(messages(run_dir), "finished"))


def test_the_consoles_first_launch_goes_into_run_dir_and_the_next_into_the_runs_root(tmp_path):
    named, root = tmp_path / "my-run", tmp_path / "root"
    term = _Terminal("--preset", "tiny-cpu", "--set", "train.steps=2", "--runs-root", str(root),
                     "--run-dir", str(named))
    try:
        term.wait(lambda: b"Launch" in term.shown, "the setup screen")
        term.press(b"\x12")                                   # ctrl+r: launch
        term.wait(lambda: _finished(named) or (root.is_dir() and any(root.iterdir())), "the first run's folder")
        assert _finished(named), f"the first run went to {list(root.iterdir())}, not --run-dir"
        term.wait(lambda: b"New run" in term.shown, "the finished run's keys")
        mark = len(term.shown)
        term.press(b"n")                                      # back to the setup: a new run
        term.wait(lambda: b"Launch" in term.shown[mark:], "the setup screen again")
        term.press(b"\x12")
        term.wait(lambda: root.is_dir() and any(_finished(d) for d in root.iterdir()),
                  "the second run finished under the runs root")
        term.press(b"\x11")                                   # ctrl+q
        assert term.proc.wait(timeout=60) == 0
    finally:
        if term.proc.poll() is None:
            os.killpg(term.proc.pid, 9)
        term.proc.wait()
        os.close(term.main)
    assert [d.name for d in root.iterdir()] != [named.name]
    assert len(of_kind(messages(named), "finished")) == 1      # the second run wrote nothing into it


async def test_a_run_dir_holding_a_run_is_refused_in_one_line_and_left_as_it_was(tmp_path):
    from shardconsole.console.services import TorchrunLauncher
    named = tmp_path / "taken"
    named.mkdir()
    (named / "preset.toml").write_text("# an earlier run's\n")
    app = make_app(tmp_path, launcher=TorchrunLauncher(tmp_path / "root", run_dir=named))
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.press("ctrl+r")
        said = await wait_for(pilot, lambda: [str(n.message) for n in app._notifications
                                              if "--run-dir" in str(n.message)], what="the refusal")
        assert len(said) == 1 and f"--run-dir {named}: folder exists" in said[0] and "\n" not in said[0], said
        assert type(app.screen).__name__ != "RunScreen"
    assert [p.name for p in named.iterdir()] == ["preset.toml"]
    assert (named / "preset.toml").read_text() == "# an earlier run's\n"
    assert not (tmp_path / "root").exists() or not any((tmp_path / "root").iterdir())
