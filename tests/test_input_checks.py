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
    (("tune", "--dry-run", "--preset", "tiny-cpu", "--gpu-memory", "1e400GiB"),
     "--gpu-memory: '1e400GiB' is not a size"),
    (("--preset", "tiny-cpu", "--print-command", "--set", "memory.gpu_memory_limit=1e400GiB"),
     "--set memory.gpu_memory_limit: '1e400GiB' is not a size"),
    (("plan", "--fit", "--seq-len", "-5", "--gpu-memory", "24GiB", "--host-memory", "64GiB"),
     "--seq-len: [data] seq_len: -5 is below the minimum 8"),
    (("plan", "--preset", "tiny-cpu", "--gpus", "99999999999999999999999"),
     "--gpus: 99999999999999999999999 is not a GPU count of one node; it takes 0 to 1024"),
    (("compare", "a", "b", "--width", "999999999"), "--width: 999999999 is too wide for a plot (30 to 1000)"),
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


def test_a_preset_saved_with_a_byte_order_mark_loads(tmp_path):
    preset = tmp_path / "bom.toml"
    preset.write_bytes(b"\xef\xbb\xbf[train]\nsteps = 3\n")      # Windows Notepad's UTF-8
    res = shardconsole("--preset", str(preset), "--print-command", "--run-dir", str(tmp_path / "run"))
    assert res.returncode == 0, res.stderr
    assert "steps = 3" in (tmp_path / "run" / "preset.toml").read_text()


@pytest.mark.parametrize("text, says", [
    ("steps = 5\n[train]\nlr = 1e-3\n", "'steps' is a key outside any table; [train] has it: put it under that header"),
    ("path = \"d.jsonl\"\n", "'path' is a key outside any table; [data] has it"),
    ("learning_rate = 1e-3\n", "'learning_rate' is a key outside any table (did you mean train.lr?)"),
])
def test_a_key_above_every_table_is_said_as_that_with_the_table_that_has_it(tmp_path, text, says):
    preset = tmp_path / "top.toml"
    preset.write_text(text)
    line = _one_line(shardconsole("--preset", str(preset), "--print-command", "--run-dir", str(tmp_path / "run")))
    assert line.startswith(f"shardconsole: error: {preset}: {says}") and "unknown table" not in line, line


def test_a_run_folder_named_with_a_newline_keeps_its_row_in_the_runs_table(tmp_path):
    root = tmp_path / "root"
    for name in ("a\nb", "plain"):
        assert shardconsole("--preset", "tiny-cpu", "--print-command", "--run-dir", str(root / name)).returncode == 0
    res = shardconsole("runs", "--runs-root", str(root))
    rows = res.stdout.splitlines()
    assert res.returncode == 0 and len(rows) == 4, res.stdout
    assert sorted(r.split()[0] for r in rows[2:]) == ["a\\nb", "plain"], res.stdout


@pytest.fixture
def few_inodes(tmp_path):
    """A file system of 12 inodes and 50 MiB (a tmpfs: needs root's mount), so bytes are plenty."""
    import subprocess
    where = tmp_path / "fs"
    where.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=50m,nr_inodes=12", "tmpfs", str(where)],
                      capture_output=True).returncode != 0:
        pytest.skip("mounting a tmpfs needs root")
    yield where
    subprocess.run(["umount", str(where)], capture_output=True)


def test_a_file_system_out_of_inodes_is_said_as_that_before_launch(few_inodes):
    # it trained, then its first save failed "disk full ...: needs 1.5 MiB, 48.1 MiB free"
    line = _one_line(shardconsole("--preset", "tiny-cpu", "--headless", "--run-dir", str(few_inodes / "run"),
                                  "--set", "train.steps=2"))
    assert f"--run-dir {few_inodes / 'run'}: its file system ({few_inodes}) has 11 inodes free" in line, line
    for i in range(11):
        (few_inodes / f"f{i}").touch()
    line = _one_line(shardconsole("--preset", "tiny-cpu", "--headless", "--run-dir", str(few_inodes / "run"),
                                  "--set", "train.steps=2"))
    assert f"its file system ({few_inodes}) is out of inodes" in line, line


def test_a_save_that_ran_out_of_inodes_says_so(few_inodes):
    """During a run (after the launch's check: another process took the last inodes), a failed save names what
    filled the file system: out of inodes, not "needs 1.5 MiB, 48.1 MiB free" (bytes it had plenty of)."""
    from shardconsole.backends.checkpoint import save_stream
    bytes_left = save_stream.full_words(few_inodes, 1 << 20)
    assert "needs 1.0 MiB" in bytes_left and "free on" in bytes_left
    made = 0
    try:
        while made < 100:
            (few_inodes / f"f{made}").touch()
            made += 1
    except OSError:
        pass
    assert 0 < made < 100
    words = save_stream.full_words(few_inodes, 1 << 20)
    assert words.startswith(f"out of inodes on {few_inodes}") and "needs" not in words, words


def test_a_full_disk_under_the_token_cache_is_said_as_that(tmp_path):
    """The records are fine, the cache's disk is full: the run ends disk_full (exit 9) naming the cache and
    SHARDCONSOLE_CACHE_DIR, where it said "cannot read its records" of the user's file."""
    import json
    import os
    import subprocess
    cache = tmp_path / "cache"
    cache.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=300k", "tmpfs", str(cache)], capture_output=True).returncode:
        pytest.skip("mounting a tmpfs needs root")
    try:
        data = tmp_path / "text.jsonl"
        data.write_text("".join(json.dumps({"text": f"the quick brown fox {i} " * 8}) + "\n" for i in range(4000)))
        res = shardconsole("--preset", "tiny-cpu", "--headless", "--run-dir", str(tmp_path / "run"),
                           "--set", f"data.path={data}", "--set", "data.tokenizer=bytes", "--set", "train.steps=2",
                           env={**os.environ, "SHARDCONSOLE_CACHE_DIR": str(cache)})
        assert res.returncode == 9, res.stdout[-1500:] + res.stderr[-1500:]
        said = res.stdout + res.stderr
        assert "is full" in said and "SHARDCONSOLE_CACHE_DIR" in said and "cannot read its records" not in said
    finally:
        subprocess.run(["umount", str(cache)], capture_output=True)
