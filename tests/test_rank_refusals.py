"""The ranks' own refusals (issue 64 item 4): what only a launched rank reads (a token cache entry, the
checkpoints it loads) refused while it builds, before step 1. The refusal reaches the user as one line
(exit 2, no traceback, no failure paragraph) and the folder's status says what it was, never a crash.
Real 2-rank CPU runs."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from tests.conftest import messages, of_kind, shardconsole


def _verdict(res) -> str:
    """The front end's last line, which must be the whole verdict (no try:/log: lines, no traceback)."""
    assert "Traceback" not in res.stderr + res.stdout, res.stderr[-3000:]
    last = res.stderr.strip().splitlines()[-1]
    assert last.startswith("run refused on rank ") and " before its first step: " in last, res.stderr[-3000:]
    return last


def _status(run: Path, env: dict | None = None) -> dict:
    res = shardconsole("runs", "--json", str(run), env=env)
    assert res.returncode == 0, res.stderr[-2000:]
    return json.loads(res.stdout.splitlines()[0])


def _no_step(run: Path) -> None:
    msgs = messages(run)
    assert not of_kind(msgs, "step") and of_kind(msgs, "failed")


def test_a_token_cache_entry_damaged_since_is_refused_by_the_ranks_in_one_line(tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"text": f"record {i}: the quick brown fox."}) + "\n" for i in range(40)))
    cache = tmp_path / "cache"
    env = {"SHARDCONSOLE_CACHE_DIR": str(cache), "DS_ACCELERATOR": "cpu"}
    sets = ["--set", "train.steps=2", "--set", "data.seq_len=32", "--set", f"data.path={data}"]
    first = shardconsole("--preset", "tiny-cpu", "--headless", "--run-dir", str(tmp_path / "a"), *sets, env=env)
    assert first.returncode == 0, first.stderr[-2000:]
    [meta] = list((cache / "tokens").glob("*/meta.json"))
    damaged = json.loads(meta.read_text())
    damaged["splits"].pop("train")
    meta.write_text(json.dumps(damaged))

    run = tmp_path / "b"
    res = shardconsole("--preset", "tiny-cpu", "--headless", "--run-dir", str(run), *sets, env=env)
    assert res.returncode == 2, res.stderr[-3000:]
    line = _verdict(res)
    assert "DataError: " in line and str(meta.parent) in line, line
    _no_step(run)
    said = _status(run, env)
    assert said["status"] == "failed" and said["cause"] == "config_error", said
    assert said["detail"] == line, said


def test_a_checkpoint_folder_copied_from_another_run_is_refused_by_the_ranks_in_one_line(tmp_path):
    """A new run with train.resume = true on checkpoints another run wrote (copied, without the folder's
    owner file): the ranks refuse to load them and keep them."""
    first = tmp_path / "first"
    res = shardconsole("--preset", "tiny-cpu", "--headless", "--run-dir", str(first), "--set", "train.steps=2",
                       timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    ckpt = tmp_path / "copied"
    shutil.copytree(first / "checkpoints", ckpt, ignore=shutil.ignore_patterns(".shardconsole-run.json"))
    before = sorted(p.name for p in ckpt.glob("step_*"))

    run = tmp_path / "second"
    res = shardconsole("--preset", "tiny-cpu", "--headless", "--run-dir", str(run), "--set", "train.steps=4",
                       "--set", "train.resume=true", "--set", f"train.checkpoint_dir={ckpt}", timeout=300)
    assert res.returncode == 2, res.stderr[-3000:]
    line = _verdict(res)
    assert "NoLoadableCheckpoint: " in line and f"another run wrote it ({first.resolve()})" in line, line
    assert sorted(p.name for p in ckpt.glob("step_*")) == before      # kept (the front end claims the folder)
    _no_step(run)
    said = _status(run)
    assert said["status"] == "failed" and said["cause"] == "config_error" and "crash" not in said["detail"], said
