"""Run folders that `--print-command` and `--slurm` prepare, and what `runs` and `compare` say of a run
folder made with `--run-dir` (issue 36 items 6 and 14). The real CLI; nothing is launched."""

from __future__ import annotations

import json

from shardconsole.settings import config as C
from tests.conftest import shardconsole


def _runs(root) -> dict[str, dict]:
    res = shardconsole("runs", "--runs-root", str(root), "--json")
    assert res.returncode == 0, res.stderr
    return {r["id"]: r for r in map(json.loads, res.stdout.splitlines())}


def test_prepared_folders_are_listed_as_prepared_and_pruned_alone(tmp_path):
    root = tmp_path / "runs"
    for name, how in (("a", "--print-command"), ("b", "--slurm"), ("c", "--print-command")):
        res = shardconsole("--preset", "tiny-cpu", how, "--run-dir", str(root / name))
        assert res.returncode == 0, res.stderr
    (root / "c" / "metrics.jsonl").write_text("")       # c's printed command was run: it started
    ended = root / "d"                                     # a run folder of an older version: no origin.json
    ended.mkdir()
    C.save(C.build({}), ended / "preset.toml")
    listed = _runs(root)
    assert {k: (r["status"], r["preset"]) for k, r in listed.items()} == {
        "a": ("prepared", "tiny-cpu"), "b": ("prepared", "tiny-cpu"), "c": ("unknown", "tiny-cpu"),
        "d": ("unknown", "")}
    assert "--slurm, not started yet" in listed["b"]["detail"]
    table = shardconsole("runs", "--runs-root", str(root)).stdout
    assert "prepared" in next(line for line in table.splitlines() if line.startswith("a "))

    res = shardconsole("runs", "--runs-root", str(root), "--prune")
    assert res.returncode == 0, res.stderr
    assert sorted(res.stdout.splitlines()) == [f"removed {root / 'a'} (prepared, never started)",
                                               f"removed {root / 'b'} (prepared, never started)"]
    assert sorted(p.name for p in root.iterdir()) == ["c", "d"]
    assert sorted((root / "c").iterdir()) == sorted(root / "c" / n for n in ("metrics.jsonl", "origin.json",
                                                                               "preset.toml"))


def test_compare_shows_the_preset_and_leaves_resume_out(tmp_path):
    """A resumed run has train.resume = true in its folder: bookkeeping, not a setting it differs in."""
    root = tmp_path / "runs"
    for name, steps in (("first", 6), ("second", 8)):
        res = shardconsole("--preset", "tiny-cpu", "--print-command", "--run-dir", str(root / name),
                           "--set", f"train.steps={steps}")
        assert res.returncode == 0, res.stderr
    cfg = C.load(root / "second" / "preset.toml")
    cfg.train.resume, cfg.train.schedule_steps = True, 8      # as `resume --set train.steps=8` leaves it
    C.save(cfg, root / "second" / "preset.toml")
    res = shardconsole("compare", "first", "second", "--runs-root", str(root), "--width", "60")
    assert res.returncode == 0, res.stderr
    diff = res.stdout.split("Figures:")[0]
    assert [line.split()[0] for line in diff.splitlines()[3:] if line.strip()] == ["train.steps"], diff
    preset_row = next(line for line in res.stdout.splitlines() if line.strip().startswith("preset"))
    assert preset_row.split()[1:] == ["tiny-cpu", "tiny-cpu"]
