"""The layering of docs/ARCHITECTURE.md, as import-linter contracts in pyproject.toml: no import cycles,
the console and the session layer free of torch and of the ranks' code, the ranks free of front ends,
the stream on the standard library alone, the settings layer free of front ends."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_import_contracts_hold():
    exe = shutil.which("lint-imports") or str(Path(sys.executable).parent / "lint-imports")
    res = subprocess.run([exe], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-2000:]
    assert "0 broken" in res.stdout
