"""Start-up to first paint of the console, as a user gets it: `shardconsole` in a terminal.

Runs `python -m shardconsole` (no arguments) under a pseudo-terminal of the given size and times from
the fork to the first frame that shows the setup screen (the word "Preset" written to the terminal),
then quits it with ctrl+q. Reports each run and the median. Target: under 1 s.

    python benchmarks/console_startup.py [--runs 7] [--size 120x40]
"""

from __future__ import annotations

import argparse
import fcntl
import os
import pty
import select
import statistics
import struct
import sys
import tempfile
import termios
import time

MARKER = b"Preset"


def one_run(size: tuple[int, int], timeout_s: float = 30.0) -> float:
    cols, rows = size
    with tempfile.TemporaryDirectory() as home:
        t0 = time.perf_counter()
        pid, fd = pty.fork()
        if pid == 0:   # the child: a terminal of the given size, an empty presets folder and run folder
            os.chdir(home)
            os.environ["SHARDCONSOLE_PRESETS_DIR"] = os.path.join(home, "presets")
            os.environ["TERM"] = "xterm-256color"
            os.execv(sys.executable, [sys.executable, "-m", "shardconsole"])
        fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))
        seen = b""
        first_paint = None
        deadline = t0 + timeout_s
        while time.perf_counter() < deadline:
            ready, _, _ = select.select([fd], [], [], 0.05)
            if not ready:
                continue
            try:
                chunk = os.read(fd, 65536)
            except OSError:
                break
            seen = (seen + chunk)[-65536:]
            if MARKER in seen:
                first_paint = time.perf_counter() - t0
                break
        os.write(fd, b"\x11")             # ctrl+q
        end = time.perf_counter() + 10
        while time.perf_counter() < end:  # drain until the child exits
            ready, _, _ = select.select([fd], [], [], 0.1)
            if ready:
                try:
                    if not os.read(fd, 65536):
                        break
                except OSError:
                    break
            done, _ = os.waitpid(pid, os.WNOHANG)
            if done:
                break
        else:
            os.kill(pid, 9)
        try:
            os.waitpid(pid, 0)
        except ChildProcessError:
            pass
        os.close(fd)
    if first_paint is None:
        raise RuntimeError(f"no first paint within {timeout_s}s (output ended with {seen[-200:]!r})")
    return first_paint


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--size", default="120x40", help="terminal COLSxROWS")
    args = ap.parse_args()
    cols, rows = (int(x) for x in args.size.split("x"))
    one_run((cols, rows))                 # warm the file cache (.pyc, shared libraries) once
    times = [one_run((cols, rows)) for _ in range(args.runs)]
    load = os.getloadavg()[0]
    print(f"start-up to first paint, {args.size}, {args.runs} runs: "
          + " ".join(f"{t:.2f}" for t in times) + " s")
    print(f"median {statistics.median(times):.2f} s, min {min(times):.2f} s, max {max(times):.2f} s "
          f"(load average {load:.1f} on {os.cpu_count()} CPUs)")


if __name__ == "__main__":
    main()
