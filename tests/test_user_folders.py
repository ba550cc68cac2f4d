"""This user's folders come from one module (shardconsole/user_folders.py): the runs root, the presets
folder, the cache and the speeds file, each its environment variable or else the per-user folder the
platform gives (platformdirs: XDG's on Linux). Checked through the modules that use them, in a fresh
interpreter with the variables set as a user would."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "shardconsole"
WHERE = """
import json
from pathlib import Path
from shardconsole.launch.command import new_run_dir
from shardconsole.history import cache
from shardconsole.machine import doctor_verdict
from shardconsole.plan.speed.book import SpeedBook
from shardconsole.settings import preset_store
from shardconsole.settings.data import data_hash
from shardconsole.backends.data import token_cache
print(json.dumps({
    "run": str(new_run_dir("tiny").parent),
    "presets": str(preset_store.save_user_preset(preset_store.load("tiny-cpu"), "mine").parent),
    "summary": str(cache._file(Path("/x/metrics.jsonl")).parent),
    "doctor": str(doctor_verdict.cache_dir()),
    "hashes": str(data_hash.cache_dir()),
    "tokens": str(token_cache.cache_root()),
    "speeds": str(SpeedBook.load().path),
}))
"""


def where(env: dict[str, str]) -> dict[str, str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("SHARDCONSOLE_", "XDG_"))}
    res = subprocess.run([sys.executable, "-c", WHERE], env={**clean, **env}, capture_output=True, text=True,
                         timeout=120, cwd=PACKAGE.parent)
    assert res.returncode == 0, res.stderr[-2000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def test_the_per_user_folders_are_the_platforms(tmp_path):
    data, cache, config = tmp_path / "data", tmp_path / "cache", tmp_path / "config"
    got = where({"XDG_DATA_HOME": str(data), "XDG_CACHE_HOME": str(cache), "XDG_CONFIG_HOME": str(config)})
    assert got == {"run": str(data / "shardconsole" / "runs"), "presets": str(config / "shardconsole" / "presets"),
                   "summary": str(cache / "shardconsole" / "runs"), "doctor": str(cache / "shardconsole"),
                   "hashes": str(cache / "shardconsole"), "tokens": str(cache / "shardconsole" / "tokens"),
                   "speeds": str(data / "shardconsole" / "speeds.jsonl")}


def test_each_variable_moves_its_folder(tmp_path):
    got = where({"XDG_DATA_HOME": str(tmp_path / "unused"), "XDG_CACHE_HOME": str(tmp_path / "unused"),
                 "XDG_CONFIG_HOME": str(tmp_path / "unused"),
                 "SHARDCONSOLE_RUNS_ROOT": str(tmp_path / "r"), "SHARDCONSOLE_PRESETS_DIR": str(tmp_path / "p"),
                 "SHARDCONSOLE_CACHE_DIR": str(tmp_path / "c"), "SHARDCONSOLE_SPEEDS_FILE": str(tmp_path / "s.jsonl")})
    c = tmp_path / "c"
    assert got == {"run": str(tmp_path / "r"), "presets": str(tmp_path / "p"), "summary": str(c / "runs"),
                   "doctor": str(c), "hashes": str(c), "tokens": str(c / "tokens"), "speeds": str(tmp_path / "s.jsonl")}


def test_no_other_module_asks_platformdirs_or_reads_the_folder_variables():
    """envvars.py declares the variables (their check before any command); session/rundir.py probes the
    cache variable's folder for writing before a launch; the rest ask user_folders."""
    allowed = {"user_folders.py", "envvars.py", "session/rundir.py"}
    found = []
    for f in PACKAGE.rglob("*.py"):
        rel = str(f.relative_to(PACKAGE))
        code = "\n".join(line for line in f.read_text().splitlines() if not line.lstrip().startswith("#"))
        if rel not in allowed and (re.search(r"^\s*(import|from) platformdirs", code, re.M) or re.search(
                r"\"SHARDCONSOLE_(RUNS_ROOT|PRESETS_DIR|CACHE_DIR|SPEEDS_FILE)\"", code)):
            found.append(rel)
    assert found == []
