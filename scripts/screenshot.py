"""Write docs/console.svg: the console on a real run, as Textual's own screenshot draws it.

    python3 scripts/screenshot.py [-o docs/console.svg] [--size 120x40]

It opens the console as `shardconsole` does (the real launcher and machine probes), on the embedded
tiny-cpu preset (2 CPU ranks over gloo), launches with ctrl+r as a user does, waits until the run has
finished, and saves the screen with App.save_screenshot. The runs go to a temporary runs root, so nothing
of yours is touched. About a minute on 2 cores.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


async def shoot(out: Path, size: tuple[int, int], runs_root: Path) -> None:
    from shardconsole.console.app import ShardConsoleApp
    from shardconsole.console.screens.run import RunScreen
    from shardconsole.console.services import MachineProbes, TorchrunLauncher

    app = ShardConsoleApp(TorchrunLauncher(runs_root), MachineProbes(), preset="tiny-cpu")
    async with app.run_test(size=size) as pilot:
        await pilot.pause()
        await pilot.press("ctrl+r")
        deadline = time.monotonic() + 600     # a cap for a broken install, not a pace
        while not (isinstance(app.screen, RunScreen) and app.screen.status in ("finished", "failed", "stopped")):
            if time.monotonic() > deadline:
                raise SystemExit("screenshot: the run did not end within 10 minutes")
            await pilot.pause(0.2)
        screen = app.screen
        if screen.status != "finished":
            raise SystemExit(f"screenshot: the run ended {screen.status}, not finished: {screen.session.run_dir}")
        await pilot.pause(1.0)                # the last samples drawn
        path = app.save_screenshot(filename=out.name, path=str(out.parent))
    svg = Path(path).read_text()
    # The temporary runs root is this machine's; show the default one instead, as a user sees it.
    svg = svg.replace(str(runs_root), "~/.local/share/shardconsole/runs")
    svg = re.sub(r"/tmp/shardconsole-shot-[A-Za-z0-9_]+", "~/.local/share/shardconsole", svg)
    Path(path).write_text(svg)
    print(f"wrote {path}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-o", "--out", type=Path, default=REPO / "docs" / "console.svg")
    ap.add_argument("--size", default="120x40", help="terminal columns x rows (default 120x40)")
    args = ap.parse_args()
    cols, rows = (int(v) for v in args.size.split("x"))
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    with tempfile.TemporaryDirectory(prefix="shardconsole-shot-") as tmp:
        asyncio.run(shoot(args.out.resolve(), (cols, rows), Path(tmp) / "runs"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
