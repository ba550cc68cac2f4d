"""Damaged and good checkpoints in one folder (issue 64, the sweep after items 2 and 5): the resume loads the
newest good one, says which it skipped and why, and keeps the skipped one. Before: a newest step folder
that had lost its manifest was loaded unverified as "saved before shardconsole wrote them", and the
resumed session, saving that step again, deleted the damaged folder it had skipped. Real 2-rank runs."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.conftest import messages, of_kind, shardconsole


@pytest.fixture(scope="module")
def two_saves(tmp_path_factory) -> Path:
    """A finished 4-step run with checkpoints at steps 2 and 4."""
    run = tmp_path_factory.mktemp("mixes") / "run"
    res = shardconsole("--preset", "tiny-cpu", "--headless", "--run-dir", str(run), "--set", "train.steps=4",
                       "--set", "train.checkpoint_every=2", timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    assert sorted(p.name for p in (run / "checkpoints").glob("step_*")) == ["step_00000002", "step_00000004"]
    return run


def _flip_a_byte(step: Path) -> None:
    shard = max(step.glob("*.distcp"), key=lambda f: f.stat().st_size)
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {str(f.relative_to(folder)): f.read_bytes() for f in sorted(folder.rglob("*")) if f.is_file()}


@pytest.mark.parametrize("damage, why", [
    (_flip_a_byte, "does not match its checksum"),
    (lambda step: (step / "shardconsole.json").unlink(), "shardconsole.json is missing"),
])
def test_a_damaged_newest_checkpoint_is_skipped_said_and_kept(two_saves, tmp_path, damage, why):
    run = tmp_path / "run"
    shutil.copytree(two_saves, run, symlinks=True)
    newest = run / "checkpoints" / "step_00000004"
    damage(newest)
    before = _snapshot(newest)
    res = shardconsole("resume", str(run), "--set", "train.steps=6", timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert f"resumed from {run / 'checkpoints'}/step_00000002 (step 2)" in res.stdout, res.stdout[-3000:]
    warnings = [e.detail for e in of_kind(messages(run), "event") if e.name == "warning"]
    assert any(f"skipping checkpoint {newest}: " in w and why in w for w in warnings), warnings
    assert not any("loaded unverified" in w for w in warnings), warnings
    kept = run / "checkpoints" / "step_00000004.replaced"
    assert _snapshot(kept) == before                       # the skipped one, byte for byte
    assert any("kept as step_00000004.replaced" in w for w in warnings), warnings
    assert max(s.step for s in of_kind(messages(run), "step")) == 6


def test_checkpoints_that_all_lost_their_manifest_are_refused_not_loaded_unverified(two_saves, tmp_path):
    """Every manifest deleted: taken for checkpoints saved before shardconsole wrote manifests, loaded
    unverified. Their rank_state/ came in with the manifest: refused before launch, nothing changed."""
    run = tmp_path / "run"
    shutil.copytree(two_saves, run, symlinks=True)
    for step in (run / "checkpoints").glob("step_*"):
        (step / "shardconsole.json").unlink()
    before = _snapshot(run / "checkpoints")
    res = shardconsole("resume", str(run), "--set", "train.steps=6", timeout=300)
    lines = [x for x in res.stderr.splitlines() if x.strip()]
    assert res.returncode == 2 and len(lines) == 1 and "Traceback" not in res.stderr, res.stderr[-3000:]
    assert "no loadable checkpoint" in lines[0] and "shardconsole.json is missing" in lines[0], lines[0]
    assert _snapshot(run / "checkpoints") == before
