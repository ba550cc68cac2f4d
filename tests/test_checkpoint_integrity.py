"""Nothing trained is silently corrupted or mixed up (issue 46 items 1-2), with real 2-rank CPU runs:
a block overwritten inside a checkpoint file (same size) is caught by its checksum at resume and export,
which fall back to the previous checkpoint naming the file; checkpoints and exports are their owner's
alone; a checkpoint folder belongs to one run."""

from __future__ import annotations

import json
import shutil
import stat
import subprocess
from pathlib import Path

import pytest

from shardconsole.runlog.checkpoint_files import MANIFEST, OWNER, file_checksum, manifest_checksum
from shardconsole.runlog.runfolder import RunFolder
from tests.conftest import messages, of_kind, shardconsole

COMMON = ["precision.dtype=fp32", "train.log_every=1", "train.checkpoint_every=2"]


def run(run_dir: Path, *sets: str) -> subprocess.CompletedProcess:
    return shardconsole("--preset", "tiny-cpu", "--headless", "--run-dir", str(run_dir),
                        *[a for s in sets for a in ("--set", s)], timeout=600)


def explain(res: subprocess.CompletedProcess, run_dir: Path | None = None) -> str:
    logs = "" if run_dir is None else "".join(
        f.read_text(errors="replace")[-2000:] for f in sorted(RunFolder(run_dir).logs.glob("*.log")))
    return res.stdout[-2000:] + res.stderr[-2000:] + logs


def events(run_dir: Path, name: str) -> list[str]:
    return [m.detail for m in of_kind(messages(run_dir), "event") if m.name == name]


def flip_block(ckpt: Path) -> str:
    """4 KiB of 0xFF (fp32 NaN) in the middle of the checkpoint's largest model weight, the file's size
    unchanged: what a bad disk block or a stray write does, and what the manifest's sizes cannot see.
    Returns the file's name."""
    from torch.distributed.checkpoint import FileSystemReader
    where = FileSystemReader(str(ckpt)).read_metadata().storage_data
    info = max((v for k, v in where.items() if k.fqn.startswith("model.")), key=lambda v: v.length)
    assert info.length > 3 * 4096
    path = ckpt / info.relative_path
    data = bytearray(path.read_bytes())
    mid = info.offset + info.length // 2
    data[mid:mid + 4096] = b"\xff" * 4096
    path.write_bytes(bytes(data))
    return path.name


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """FSDP2, 6 steps, checkpoints at 2, 4 and 6, all kept."""
    run_dir = tmp_path_factory.mktemp("integrity") / "run"
    res = run(run_dir, *COMMON, "train.steps=6")
    assert res.returncode == 0, explain(res, run_dir)
    return run_dir


@pytest.fixture
def corrupted(trained, tmp_path) -> tuple[Path, Path, str]:
    """A copy of the trained run with step 6's largest shard overwritten in place: (run, step 6, file)."""
    run_dir = tmp_path / "run"
    shutil.copytree(trained, run_dir, symlinks=True)
    newest = RunFolder(run_dir).checkpoints() / "step_00000006"
    return run_dir, newest, flip_block(newest)


@pytest.mark.slow
def test_checkpoint_files_carry_checksums_and_are_their_owners_alone(trained):
    ckpt = RunFolder(trained).checkpoints() / "step_00000006"
    manifest = json.loads((ckpt / MANIFEST).read_text())
    assert set(manifest["checksums"]) == set(manifest["files"]) and manifest["files"]
    for name, want in manifest["checksums"].items():       # the streamed hashes are the files' hashes
        assert file_checksum(ckpt / name) == want, name
    assert stat.S_IMODE(ckpt.stat().st_mode) == 0o700
    assert {stat.S_IMODE(f.stat().st_mode) for f in ckpt.rglob("*") if f.is_file()} == {0o600}


@pytest.mark.slow
def test_export_skips_a_checkpoint_changed_in_place_naming_the_file(corrupted, tmp_path):
    run_dir, newest, shard = corrupted
    out = tmp_path / "model"
    res = shardconsole("export-model", str(run_dir), "-o", str(out), timeout=300)
    assert res.returncode == 0, explain(res)
    skipped = [line for line in res.stderr.splitlines() if "skipping" in line]
    assert len(skipped) == 1 and str(newest) in skipped[0] and shard in skipped[0] and "checksum" in skipped[0], res.stderr
    assert "from step 4" in res.stdout, res.stdout
    from safetensors.torch import load_file
    import torch
    weights = load_file(str(out / "model.safetensors"))
    assert weights and all(bool(torch.isfinite(t).all()) for t in weights.values())
    assert stat.S_IMODE(out.stat().st_mode) == 0o700
    assert {stat.S_IMODE(f.stat().st_mode) for f in out.rglob("*") if f.is_file()} == {0o600}


@pytest.mark.slow
def test_export_of_the_corrupt_step_is_refused_in_one_line(corrupted, tmp_path):
    run_dir, newest, shard = corrupted
    out = tmp_path / "model"
    res = shardconsole("export-model", str(run_dir), "--step", "6", "-o", str(out), timeout=300)
    assert res.returncode == 2, explain(res)
    assert shard in res.stderr and "checksum" in res.stderr and "Traceback" not in res.stderr, res.stderr
    assert not out.exists()


@pytest.mark.slow
def test_export_refuses_nan_weights_whose_checksums_match(corrupted, tmp_path):
    """A checkpoint whose weights were NaN when saved (its checksums rewritten to match): no folder of
    NaN weights is written, and no refusal points at weights_only=False."""
    run_dir, newest, shard = corrupted
    manifest = json.loads((newest / MANIFEST).read_text())
    manifest["checksums"][shard] = file_checksum(newest / shard)
    manifest["manifest_checksum"] = manifest_checksum(manifest)
    (newest / MANIFEST).write_text(json.dumps(manifest))
    out = tmp_path / "model"
    res = shardconsole("export-model", str(run_dir), "-o", str(out), timeout=300)
    assert res.returncode == 2, explain(res)
    assert "NaN" in res.stderr and "weights_only" not in res.stderr and "Traceback" not in res.stderr, res.stderr
    assert not out.exists()


@pytest.mark.slow
def test_resume_falls_back_from_a_checkpoint_changed_in_place(corrupted):
    run_dir, newest, shard = corrupted
    res = shardconsole("resume", str(run_dir), "--set", "train.steps=8", timeout=600)
    assert res.returncode == 0, explain(res, run_dir)
    warnings = [w for w in events(run_dir, "warning") if w.startswith(f"skipping checkpoint {newest}")]
    assert len(warnings) == 1 and shard in warnings[0] and "checksum" in warnings[0], warnings
    assert any(d.endswith("step_00000004 (step 4)") for d in events(run_dir, "info") if "resumed from" in d)
    assert not of_kind(messages(run_dir), "failed")


@pytest.mark.slow
def test_a_checkpoint_without_checksums_loads_said_unverified(trained, tmp_path):
    """A manifest as shardconsole wrote them before checksums (no checksums, no run_dir, no checksum of its
    own); one of today's that lost them is damaged (tests/test_nothing_lost.py)."""
    run_dir = tmp_path / "run"
    shutil.copytree(trained, run_dir, symlinks=True)
    newest = RunFolder(run_dir).checkpoints() / "step_00000006"
    manifest = json.loads((newest / MANIFEST).read_text())
    for key in ("checksums", "run_dir", "manifest_checksum"):
        del manifest[key]
    (newest / MANIFEST).write_text(json.dumps(manifest))
    res = shardconsole("export-model", str(run_dir), "-o", str(tmp_path / "model"), timeout=300)
    assert res.returncode == 0, explain(res)
    assert "unverified" in res.stderr and "from step 6" in res.stdout, res.stderr + res.stdout


# ---------------------------------------------------------------------------------------------------
# One run per checkpoint folder

@pytest.mark.slow
def test_a_second_run_in_another_runs_checkpoint_folder_is_refused_before_launch(tmp_path):
    ckpt = tmp_path / "ckpt"
    first, second = tmp_path / "first", tmp_path / "second"
    res = run(first, *COMMON, "train.steps=4", f"train.checkpoint_dir={ckpt}")
    assert res.returncode == 0, explain(res, first)
    assert json.loads((ckpt / OWNER).read_text())["run_dir"] == str(first.resolve())

    res = run(second, *COMMON, "train.steps=4", f"train.checkpoint_dir={ckpt}")
    assert res.returncode == 2, explain(res)
    line = [x for x in res.stderr.splitlines() if x.strip()]
    assert len(line) == 1 and "checkpoint_dir" in line[0] and str(first.resolve()) in line[0], res.stderr
    assert not (second / "metrics.jsonl").exists()

    # Continuing from them (train.resume) takes the folder over; the first run no longer resumes there.
    res = run(second, *COMMON, "train.steps=6", "train.resume=true", f"train.checkpoint_dir={ckpt}")
    assert res.returncode == 0, explain(res, second)
    assert any("step_00000004 (step 4)" in d for d in events(second, "info") if "resumed from" in d)
    res = shardconsole("resume", str(first), "--set", "train.steps=8", timeout=300)
    assert res.returncode == 2 and str(second.resolve()) in res.stderr, explain(res)


@pytest.mark.slow
def test_resume_never_loads_a_checkpoint_another_run_wrote(tmp_path):
    """A newer step folder of another run dropped into this run's checkpoint folder (a copy, a second run
    started before the marker existed) is skipped, named; the run's own newest is loaded."""
    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    res = run(ours, *COMMON, "train.steps=4", f"train.checkpoint_dir={tmp_path / 'ck-ours'}")
    assert res.returncode == 0, explain(res, ours)
    res = run(theirs, *COMMON, "train.steps=6", f"train.checkpoint_dir={tmp_path / 'ck-theirs'}")
    assert res.returncode == 0, explain(res, theirs)
    foreign = tmp_path / "ck-ours" / "step_00000006"
    shutil.copytree(tmp_path / "ck-theirs" / "step_00000006", foreign)
    res = shardconsole("resume", str(ours), "--set", "train.steps=8", timeout=600)
    assert res.returncode == 0, explain(res, ours)
    skipped = [w for w in events(ours, "warning") if w.startswith(f"skipping checkpoint {foreign}")]
    assert len(skipped) == 1 and "another run" in skipped[0], events(ours, "warning")
    assert any(d.endswith("step_00000004 (step 4)") for d in events(ours, "info") if "resumed from" in d)


def test_a_refused_pickle_never_suggests_weights_only_false(tmp_path):
    """torch's own refusal advises loading the file with weights_only=False (which runs the pickle's
    code); the line shown keeps what was refused and drops the advice."""
    import os
    import torch
    from shardconsole.backends.checkpoint.checkpoints import CheckpointError
    from shardconsole.export_model.checkpoint import _first_cause

    class Evil:
        def __reduce__(self):
            return (os.system, ("true",))

    f = tmp_path / "evil.pt"
    torch.save({"w": Evil()}, f)
    with pytest.raises(Exception) as caught:
        torch.load(f, weights_only=True)
    assert "weights_only` set to `False`" in str(caught.value)          # torch's text, as of torch 2.6+
    for line in (str(CheckpointError(f"{f}: cannot be read: {caught.value}")), _first_cause(caught.value)):
        assert "weights_only" not in line and "posix.system" in line and "\n" not in line, line


@pytest.mark.slow
def test_deepspeed_checkpoints_are_checksummed_and_export_falls_back(tmp_path):
    """DeepSpeed writes its files itself (engine.save_checkpoint): they are hashed after their write, at
    the manifest. A block overwritten in the newest one's optimizer states is caught at export."""
    run_dir = tmp_path / "run"
    res = run(run_dir, *COMMON, "train.steps=4", "parallel.backend=deepspeed", "deepspeed.stage=2")
    assert res.returncode == 0, explain(res, run_dir)
    newest = RunFolder(run_dir).checkpoints() / "step_00000004"
    manifest = json.loads((newest / MANIFEST).read_text())
    assert set(manifest["checksums"]) == set(manifest["files"])
    assert any(name.endswith("optim_states.pt") for name in manifest["checksums"])
    target = max(newest.rglob("*optim_states.pt"), key=lambda f: f.stat().st_size)
    data = bytearray(target.read_bytes())
    data[len(data) // 2:len(data) // 2 + 4096] = b"\xff" * 4096
    target.write_bytes(bytes(data))
    res = shardconsole("export-model", str(run_dir), "-o", str(tmp_path / "model"), timeout=300)
    assert res.returncode == 0, explain(res)
    assert target.name in res.stderr and "checksum" in res.stderr and "from step 2" in res.stdout, res.stderr
