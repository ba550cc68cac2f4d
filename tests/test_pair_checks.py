"""Preference pairs before launch (issue 64): pairs whose chosen equals rejected (DPO learns nothing from
them: refused when all are, a warning with the share when some are), a field of the wrong type named
with the type found and what is allowed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import shardconsole

GOOD = [{"prompt": f"Question {i}: yes or no?", "chosen": " yes", "rejected": " no"} for i in range(8)]
SAME = [{"prompt": f"Question {i}: yes or no?", "chosen": " yes", "rejected": " yes"} for i in range(8)]


def _jsonl(path: Path, records: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _print_command(tmp_path: Path, data: Path, objective: str = "dpo"):
    return shardconsole("--preset", "tiny-cpu", "--print-command", "--run-dir", str(tmp_path / "run"),
                        "--set", f"data.path={data}", "--set", f"train.objective={objective}")


def test_dpo_on_pairs_all_the_same_is_refused_before_launch(tmp_path):
    data = _jsonl(tmp_path / "same.jsonl", SAME)
    res = _print_command(tmp_path, data)
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2 and len(lines) == 1, res.stderr
    assert "'chosen' equals 'rejected' in all 8 pairs" in lines[0] and "train nothing" in lines[0]
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("objective, says", [("dpo", "DPO learns nothing from those"),
                                             ("orpo", "only its NLL term")])
def test_some_pairs_the_same_is_a_warning_with_the_share(tmp_path, objective, says):
    data = _jsonl(tmp_path / "some.jsonl", GOOD[:6] + SAME[:2])
    res = _print_command(tmp_path, data, objective)
    assert res.returncode == 0, res.stderr
    assert [ln for ln in res.stderr.splitlines() if "'chosen' equals 'rejected' in 2 of 8 pairs read (25%, the first "
            f"at {data}:7)" in ln and says in ln], res.stderr


@pytest.mark.parametrize("field, value, found", [("chosen", 12345, "got int 12345"),
                                                 ("rejected", 1.5, "got float 1.5"),
                                                 ("chosen", {"role": "assistant"}, "got dict ")])
def test_an_answer_of_the_wrong_type_names_the_type_and_what_is_allowed(tmp_path, field, value, found):
    data = _jsonl(tmp_path / "bad.jsonl", GOOD[:2] + [{**GOOD[2], field: value}])
    res = _print_command(tmp_path, data)
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2 and len(lines) == 1, res.stderr
    assert f"{data}:3: field {field!r}: {found}" in lines[0], lines[0]
    assert lines[0].endswith("expected a string or a list of turns ({role, content})"), lines[0]


def test_resuming_a_dpo_run_as_sft_names_train_objective_before_launch(tmp_path):
    data = _jsonl(tmp_path / "pairs.jsonl", GOOD * 2)
    run = tmp_path / "run"
    done = shardconsole("--preset", "tiny-cpu", "--headless", "--run-dir", str(run), "--set", "train.steps=2",
                        "--set", f"data.path={data}", "--set", "train.objective=dpo")
    assert done.returncode == 0, done.stderr[-2000:]
    before = (run / "preset.toml").read_text()
    res = shardconsole("resume", str(run), "--set", "train.objective=sft", "--set", "train.steps=4")
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2 and len(lines) == 1, res.stderr[-2000:]
    assert lines[0].startswith("shardconsole: error: --set train.objective: 'sft', but the run's checkpoints were "
                               "trained with train.objective = 'dpo'"), lines[0]
    assert (run / "preset.toml").read_text() == before
