"""A resume on changed data is refused before the launch, in one line, and the run it would have
continued keeps its outcome (issue 65 item 4): the ranks refused it too, but only after the launch, and
the folder then read `failed (config_error)` over a run that had finished."""

from __future__ import annotations

import json

import pytest

from conftest import messages, of_kind, shardconsole


def records(n: int, start: int = 0) -> str:
    return "".join(json.dumps({"text": f"record number {i}: the quick brown fox."}) + "\n"
                   for i in range(start, start + n))


def status(run, env) -> dict:
    res = shardconsole("runs", "--runs-root", str(run.parent), "--json", str(run), env=env)
    assert res.returncode == 0, res.stderr[-2000:]
    return json.loads(res.stdout.splitlines()[0])


@pytest.mark.slow
def test_a_resume_on_changed_data_is_refused_before_the_launch(tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text(records(40))
    run = tmp_path / "runs" / "run"
    env = {"SHARDCONSOLE_CACHE_DIR": str(tmp_path / "cache")}
    res = shardconsole("--preset", "tiny-cpu", "--headless", "--run-dir", str(run), "--set", "train.steps=2",
                       "--set", "data.seq_len=32", "--set", f"data.path={data}", env=env)
    assert res.returncode == 0, res.stderr[-2000:]
    assert status(run, env)["status"] == "finished"
    preset, stream = (run / "preset.toml").read_text(), (run / "metrics.jsonl").read_text()

    with data.open("a") as fh:
        fh.write(records(400, 40))
    res = shardconsole("resume", str(run), "--set", "train.steps=4", env=env)
    assert res.returncode == 2
    assert res.stderr.strip().splitlines() == [
        f"shardconsole: error: {run}/preset.toml: [data] path: {data}: its content changed since step_00000002: "
        f"400 record(s) added; resume on the data the checkpoint was trained on, or --set "
        f"data.allow_changed=true to go on from the start of an epoch of the new data"]
    # Nothing launched, nothing rewritten: the run still reads finished.
    assert (run / "metrics.jsonl").read_text() == stream and (run / "preset.toml").read_text() == preset
    assert not (run / "preset.toml.prev").exists()
    assert status(run, env)["status"] == "finished"

    # The same records cut into other samples are other data to the checkpoint's position too.
    data.write_text(records(40))
    res = shardconsole("resume", str(run), "--set", "train.steps=4", "--set", "data.seq_len=64", env=env)
    assert res.returncode == 2
    [line] = res.stderr.strip().splitlines()
    assert "--set data.seq_len: " in line and "data.seq_len = 32" in line and "data.allow_changed=true" in line
    assert (run / "metrics.jsonl").read_text() == stream and status(run, env)["status"] == "finished"

    # The data the checkpoint was trained on: the resume goes on.
    res = shardconsole("resume", str(run), "--set", "train.steps=3", env=env)
    assert res.returncode == 0, res.stderr[-2000:]
    assert max(m.step for m in of_kind(messages(run), "step")) == 3
