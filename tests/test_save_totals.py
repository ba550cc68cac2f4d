"""The save progress's total is the size the save ends with (issue 65 item 9): the engines plan a save by
its tensors' bytes, and the folder also holds each record's framing, DCP's .metadata, the rank states and
the manifest (a tiny model's checkpoint: 'saving step 1: 0.0 / 1.6 MB', then 'saved step 1: 1.9 MB').
A real 2-rank CPU run saving every step: from the second save on (and the first save of a resumed session),
every progress line's total is the folder's final size; a done line's total is its bytes written."""

from __future__ import annotations

import pytest

from conftest import messages, of_kind, shardconsole
from shardconsole.runlog.runstate import save_line


@pytest.mark.slow
def test_save_progress_totals_are_the_saved_size(tmp_path):
    run = tmp_path / "run"
    res = shardconsole("--preset", "tiny-cpu", "--headless", "--run-dir", str(run), "--set", "train.steps=3",
                       "--set", "train.checkpoint_every=1", "--set", "train.keep_checkpoints=0",
                       "--set", "data.seq_len=32", env={"SHARDCONSOLE_CACHE_DIR": str(tmp_path / "cache")})
    assert res.returncode == 0, res.stderr[-2000:]
    # a resumed session's first save: the checkpoint it resumed from holds the same tensors
    res = shardconsole("resume", str(run), "--set", "train.steps=4", env={"SHARDCONSOLE_CACHE_DIR": str(tmp_path / "cache")})
    assert res.returncode == 0, res.stderr[-2000:]
    saves = [m for m in of_kind(messages(run), "save") if m.rank == 0]
    done = {m.step: m for m in saves if m.done}
    assert sorted(done) == [1, 2, 3, 4], saves
    assert all(d.total_bytes == d.written_bytes > 0 for d in done.values()), done
    for step in (2, 3, 4):
        for line in [m for m in saves if m.step == step and not m.done]:
            real = done[step].written_bytes
            assert abs(line.total_bytes - real) <= real / 1000, (line, real)
            shown = save_line(line).split(" / ")[1].split(" ")[0]
            assert shown == save_line(done[step]).split(": ")[1].split(" ")[0], (save_line(line), save_line(done[step]))
