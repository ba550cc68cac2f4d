"""Numeric inputs and the run folder's path, each refused before anything starts in one line (issue 64)."""

from __future__ import annotations

import pytest

from tests.conftest import shardconsole


def _one_line(res) -> str:
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2 and len(lines) == 1, (res.returncode, res.stderr[-2000:])
    return lines[0]


@pytest.mark.parametrize("argv, says", [
    (("chat", "/nonexistent", "--temperature", "nan"), "--temperature: nan is not a number"),
    (("chat", "/nonexistent", "--top-p", "inf"), "--top-p: inf is not a number"),
    (("plan", "--preset", "tiny-cpu", "--gpu-memory", "1e400GiB"), "--gpu-memory: '1e400GiB' is not a size"),
    (("tune", "--dry-run", "--preset", "tiny-cpu", "--gpu-memory", "1e400GiB"), "--gpu-memory: '1e400GiB' is not a size"),
    (("--preset", "tiny-cpu", "--print-command", "--set", "memory.gpu_memory_limit=1e400GiB"),
     "--set memory.gpu_memory_limit: '1e400GiB' is not a size"),
])
def test_a_number_out_of_range_is_one_line(argv, says):
    assert says in _one_line(shardconsole(*argv))


def _deep(tmp_path, total: int):
    """A run folder path of `total` bytes under tmp_path, in names of 200."""
    room = total - len(str(tmp_path)) - 1
    parts = [("a" * 200)] * (room // 201) + ["b" * (room % 201 or 1)]
    return tmp_path.joinpath(*parts)


def test_a_run_folder_whose_deepest_file_passes_path_max_is_refused_before_launch(tmp_path):
    run = _deep(tmp_path, 4060)     # trained, then its first save failed with ENAMETOOLONG
    line = _one_line(shardconsole("--preset", "tiny-cpu", "--headless", "--run-dir", str(run),
                                  "--set", "train.steps=2"))
    assert line.startswith("shardconsole: error: --run-dir ") and "past the file system's limit of 4095" in line
    assert not run.exists()


def test_a_run_folder_that_cannot_be_made_blames_run_dir_not_the_checkpoint_folder():
    line = _one_line(shardconsole("--preset", "tiny-cpu", "--headless", "--run-dir", "/proc/x",
                                  "--set", "train.steps=2"))
    assert line.startswith("shardconsole: error: --run-dir /proc/x: ") and "checkpoint_dir" not in line
