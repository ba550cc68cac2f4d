"""Step folders are read by one function (runlog/checkpoint_files.step_folders): the ranks, resume, the run
list and the save's size estimate all take step_<N> by its number and skip every other name, so none of
them loads, lists or measures a folder another would skip."""

from __future__ import annotations

import json
from pathlib import Path

from shardconsole.runlog.checkpoint_files import MANIFEST, step_folders, step_of
from shardconsole.session.resume import checkpoints_in


def test_step_of_reads_the_number_of_step_folders_and_nothing_else():
    assert step_of("step_00000010") == 10
    assert step_of("step_9") == 9
    for name in ("step_3.replaced", "step_3.replaced2", "step_4.partial", "step_x", "step_", "step_-1",
                 ".step_5.tmp", "step_5.tmp", "step_٣", "steps_5", "checkpoint_5"):
        assert step_of(name) is None, name


def test_step_folders_are_newest_first_by_number_and_skip_the_rest(tmp_path):
    for name in ("step_9", "step_10", "step_00000002", "step_3.replaced", "step_4.partial", "step_x",
                 ".step_11.tmp"):
        (tmp_path / name).mkdir()
    (tmp_path / "step_12").write_text("a file, not a folder")
    assert [(n, p.name) for n, p in step_folders(tmp_path)] == [(10, "step_10"), (9, "step_9"),
                                                                (2, "step_00000002")]
    assert step_folders(tmp_path / "missing") == []


def test_resume_lists_the_same_folders(tmp_path):
    for name in ("step_9", "step_10", "step_3.replaced", "step_4.partial", "step_x"):
        (tmp_path / name).mkdir()
        (tmp_path / name / ".metadata").write_bytes(b"x")
    assert [n for n, _ in checkpoints_in(tmp_path)] == [10, 9]


def test_the_save_estimate_measures_the_newest_save_not_one_set_aside(tmp_path):
    from shardconsole.backends.checkpoint.save_stream import _last_save_bytes
    for name, size in (("step_00000004", 10), ("step_00000004.replaced", 1000), ("step_00000002", 100)):
        (tmp_path / name).mkdir()
        (tmp_path / name / MANIFEST).write_text(json.dumps({"what": "checkpoint"}))
        (tmp_path / name / "weights").write_bytes(b"w" * size)
    manifest = len((tmp_path / "step_00000004" / MANIFEST).read_bytes())
    assert _last_save_bytes(tmp_path / "step_00000006.partial", "checkpoint") == 10 + manifest
    assert _last_save_bytes(tmp_path / "step_00000006.partial", "model") == 0


def test_an_older_step_with_checksums_is_found_by_number(tmp_path: Path):
    """why_incomplete names the older step that had a manifest (step_9 is older than step_10, whatever
    their names sort as)."""
    from shardconsole.runlog.checkpoint_files import why_incomplete
    (tmp_path / "step_9").mkdir()
    (tmp_path / "step_9" / MANIFEST).write_text(json.dumps({"checksums": {"a": "x"}}))
    (tmp_path / "step_10").mkdir()
    (tmp_path / "step_10" / ".metadata").write_bytes(b"x")
    (tmp_path / "step_8").mkdir()
    (tmp_path / "step_8" / ".metadata").write_bytes(b"x")
    assert "the older step_9 has one" in (why_incomplete(tmp_path / "step_10", "fsdp") or "")
    assert why_incomplete(tmp_path / "step_8", "fsdp") is None
