"""A run made with a relative --run-dir (README's `--run-dir runs/my-chat`) is found from any directory
(issue 65 item 9): it was listed only by a `shardconsole runs` started where it was made."""

from __future__ import annotations

import json

import pytest

from conftest import shardconsole


@pytest.mark.slow
def test_a_run_made_with_a_relative_run_dir_is_listed_from_elsewhere(tmp_path, _runs_root):
    here, elsewhere = tmp_path / "project", tmp_path / "elsewhere"
    here.mkdir()
    elsewhere.mkdir()
    res = shardconsole("--preset", "tiny-cpu", "--headless", "--run-dir", "runs/my-chat", "--set", "train.steps=2",
                       cwd=here)
    assert res.returncode == 0, res.stderr[-2000:]
    made = here / "runs" / "my-chat"
    res = shardconsole("runs", "--json", cwd=elsewhere)
    assert res.returncode == 0, res.stderr[-2000:]
    listed = [json.loads(line) for line in res.stdout.splitlines()]
    assert [(r["path"], r["status"]) for r in listed] == [(str(made), "finished")]
    res = shardconsole("runs", "--json", "my-chat", cwd=elsewhere)        # by its id too
    assert res.returncode == 0 and json.loads(res.stdout.splitlines()[0])["status"] == "finished", res.stderr
    # Listed once where it was made, where the old ./runs is read as well.
    res = shardconsole("runs", "--json", cwd=here)
    assert len(res.stdout.splitlines()) == 1, res.stdout
