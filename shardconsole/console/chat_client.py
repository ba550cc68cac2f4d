"""The console's side of a chat: `shardconsole chat TARGET --serve` in a child process (the console imports
no torch; the model's memory goes back when the screen closes), spoken to in tryout/chat_wire's lines.

`heard()` blocks (a thread worker reads it); `send` and `close` do not wait on the model.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Iterator

from shardconsole.tryout import chat_wire as W

CLOSE_WAIT_S = 5.0       # a child told to stop and whose stdin closed ends within a token; else it is killed


class ChatProcess:
    def __init__(self, target: Path, step: int | None = None, device: str | None = None,
                 base: Path | None = None) -> None:
        """base: the base model's folder (None: the one the run started from, found by the child)."""
        self.target, self.step, self.device, self.base = Path(target), step, device, base
        self.proc: subprocess.Popen[str] | None = None
        self._stderr = tempfile.TemporaryFile(mode="w+", prefix="shardconsole-chat-")

    def argv(self) -> list[str]:
        return [sys.executable, "-m", "shardconsole", "chat", str(self.target), "--serve",
                *(["--step", str(self.step)] if self.step is not None else []),
                *(["--device", self.device] if self.device else []),
                *(["--base", str(self.base)] if self.base is not None else [])]

    def start(self) -> None:
        # Its stderr (transformers' progress bars, torch's warnings) would draw over the console: kept aside,
        # its last line shown if the child dies.
        self.proc = subprocess.Popen(self.argv(), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._stderr,
                                     text=True, bufsize=1, encoding="utf-8", errors="replace")

    def send(self, msg: W.Wire) -> bool:
        """False when the child is gone (its end is reported by heard())."""
        if self.proc is None or self.proc.stdin is None:
            return False
        try:
            self.proc.stdin.write(W.encode(msg))
            self.proc.stdin.flush()
            return True
        except (BrokenPipeError, OSError, ValueError):
            return False

    def heard(self) -> Iterator[W.Wire]:
        """The child's lines until it ends; a line that is not ours (a stray print) is skipped."""
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:
            try:
                yield W.decode(line)
            except W.WireError:
                continue

    def why_ended(self) -> str:
        """After heard() ended: the exit code and the child's last stderr line."""
        assert self.proc is not None
        code = self.proc.wait()
        try:
            self._stderr.seek(0)
            lines = [ln.strip() for ln in self._stderr.read().splitlines() if ln.strip()]
        except ValueError:        # closed: the screen closed it, nobody reads this
            lines = []
        last = lines[-1][-200:] if lines else "nothing on its stderr"
        return f"the chat process ended (exit {code}): {last}"

    def close(self) -> None:
        """Stop the answer under way, close stdin (the child's loop ends), kill our child if it lingers."""
        if self.proc is None:
            return
        self.send(W.Stop())
        try:
            if self.proc.stdin is not None:
                self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(timeout=CLOSE_WAIT_S)
        except subprocess.TimeoutExpired:      # still loading a large model: ours, so ours to end
            self.proc.kill()
            self.proc.wait()
        self._stderr.close()
