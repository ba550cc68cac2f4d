"""Shared fixtures. Runs that launch real ranks are marked `slow`; they use the tiny model on CPU."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def _user_presets(tmp_path_factory, monkeypatch):
    """Never read or write the real user's presets folder."""
    d = tmp_path_factory.mktemp("user-presets")
    monkeypatch.setenv("SHARDCONSOLE_PRESETS_DIR", str(d))
    return d


def shardconsole(*args: str, timeout: float = 180, env: dict | None = None, cwd: Path | None = None
                 ) -> subprocess.CompletedProcess:
    """Run the real CLI in a subprocess, as a user would."""
    full_env = {**os.environ, **(env or {})}
    return subprocess.run([sys.executable, "-m", "shardconsole", *args], capture_output=True, text=True,
                          timeout=timeout, env=full_env, cwd=cwd)
