"""A resume the ranks refuse before its first step leaves the run's end as it was (issue 65 item 4).

Some refusals only the launched ranks can make; here a token cache entry damaged after the run finished
(its train split gone from meta.json: the ranks say to remove the folder). The folder read `failed
(config_error)` over the finished run and the front end said the refusal in a paragraph; now `runs` keeps
`finished` (the refusal in its detail) and the resume ends with one line. Real 2-rank CPU runs."""

from __future__ import annotations

import json
import shutil

import pytest

from conftest import messages, of_kind, shardconsole


def _status(run, env) -> dict:
    res = shardconsole("runs", "--runs-root", str(run.parent), "--json", str(run), env=env)
    assert res.returncode == 0, res.stderr[-2000:]
    return json.loads(res.stdout.splitlines()[0])


@pytest.mark.slow
def test_a_resume_refused_by_the_ranks_keeps_the_finished_run_and_says_one_line(tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"text": f"record number {i}: the quick brown fox."}) + "\n"
                            for i in range(40)))
    run, cache = tmp_path / "runs" / "run", tmp_path / "cache"
    env = {"SHARDCONSOLE_CACHE_DIR": str(cache), "DS_ACCELERATOR": "cpu"}
    res = shardconsole("--preset", "tiny-cpu", "--headless", "--run-dir", str(run), "--set", "train.steps=2",
                       "--set", "data.seq_len=32", "--set", f"data.path={data}", env=env)
    assert res.returncode == 0, res.stderr[-2000:]
    [meta] = list((cache / "tokens").glob("*/meta.json"))
    damaged = json.loads(meta.read_text())
    damaged["splits"].pop("train")
    meta.write_text(json.dumps(damaged))

    preset = (run / "preset.toml").read_text()
    res = shardconsole("resume", str(run), "--set", "train.steps=4", env=env)
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr[-3000:]
    last = res.stderr.strip().splitlines()[-1]
    assert last.startswith("resume refused on rank ") and "before its first step: DataError: " in last, last
    assert "remove the folder to rebuild it" in last, last
    assert last.endswith(f"; {run} keeps its end and its settings: finished at step 2"), last
    assert "  log: " not in res.stderr          # the failure paragraph's lines
    assert (run / "preset.toml").read_text() == preset      # the resume's train.steps=4 put back
    said = _status(run, env)
    assert said["status"] == "finished" and said["cause"] == "", said
    assert said["detail"].startswith("finished: 2 steps; a resume was refused before its first step: DataError"), said

    # The cache rebuilt, the resume goes on, and ends the run at its own end.
    shutil.rmtree(meta.parent)
    res = shardconsole("resume", str(run), "--set", "train.steps=4", env=env)
    assert res.returncode == 0, res.stderr[-2000:]
    assert max(m.step for m in of_kind(messages(run), "step")) == 4
    said = _status(run, env)
    assert said["status"] == "finished" and said["detail"] == "finished: 4 steps", said
