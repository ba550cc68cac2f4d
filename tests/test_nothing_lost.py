"""Nothing lost, nothing silently wrong (issue 64): a run never writes into another run's folder; a
resume that finds nothing loadable refuses and keeps what it found; a checkpoint's manifest is
checksummed like its files; a LoRA resume onto changed base weights is refused; a stop during a save
waits for it. Real runs and real files."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from shardconsole.runlog.checkpoint_files import MANIFEST
from shardconsole.runlog.runfolder import RunFolder
from shardconsole.session.rundir import create_run_dir
from shardconsole.settings import config as C
from tests.conftest import messages, of_kind, shardconsole

REPO = Path(__file__).resolve().parent.parent
COMMON = ["precision.dtype=fp32", "train.log_every=1", "train.checkpoint_every=2"]


def run(run_dir: Path, *sets: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return shardconsole("--preset", "tiny-cpu", "--headless", "--run-dir", str(run_dir),
                        *[a for s in sets for a in ("--set", s)], timeout=600, cwd=cwd)


def explain(res: subprocess.CompletedProcess, run_dir: Path | None = None) -> str:
    logs = "" if run_dir is None else "".join(
        f.read_text(errors="replace")[-2000:] for f in sorted(RunFolder(run_dir).logs.glob("*.log")))
    return res.stdout[-2000:] + res.stderr[-2000:] + logs


def one_line(res: subprocess.CompletedProcess) -> str:
    lines = [x for x in res.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and "Traceback" not in res.stderr, res.stderr
    return lines[0]


# ---------------------------------------------------------------------------------------------------
# 1. One owner check for every path into another run's folder

def test_a_checkpoint_dir_inside_another_run_folder_is_refused_however_it_is_named(tmp_path):
    """Before the first run saved anything (its checkpoints/ does not exist yet): its own checkpoints/
    by absolute path, through a symlink, by a relative path, and a folder deeper inside it."""
    first = create_run_dir(C.load(REPO / "presets" / "tiny-cpu.toml"), tmp_path / "first")
    (tmp_path / "link").symlink_to(first)
    names = [str(first / "checkpoints"), str(tmp_path / "link" / "checkpoints"), "first/checkpoints",
             str(first / "logs" / "elsewhere")]
    for n, name in enumerate(names):
        second = tmp_path / f"second{n}"
        res = run(second, "train.steps=4", f"train.checkpoint_dir={name}", cwd=tmp_path)
        assert res.returncode == 2, (name, explain(res))
        line = one_line(res)
        assert f"inside run folder {first.resolve()}" in line and "checkpoint_dir" in line, line
        assert not (second / "metrics.jsonl").exists()
    assert not (first / "checkpoints").exists()


# ---------------------------------------------------------------------------------------------------
# 2 and 5. A resume loads a checkpoint as saved, manifest included, or refuses and changes nothing

def _copy(run, tmp_path: Path) -> tuple[Path, Path]:
    """A copy of the finished 12-step run (its one checkpoint, step 12): (run folder, step folder)."""
    assert run.res.returncode == 0, explain(run.res, run.run)
    run_dir = tmp_path / "run"
    shutil.copytree(run.run, run_dir, symlinks=True)
    return run_dir, RunFolder(run_dir).checkpoints() / "step_00000012"


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {str(f.relative_to(folder)): f.read_bytes() for f in sorted(folder.rglob("*")) if f.is_file()}


def _edit_manifest(step: Path, change) -> None:
    meta = json.loads((step / MANIFEST).read_text())
    change(meta)
    (step / MANIFEST).write_text(json.dumps(meta, indent=1))


def test_a_resume_whose_every_checkpoint_fails_its_checksum_refuses_and_keeps_them(fsdp_tiny_run, tmp_path):
    run_dir, step = _copy(fsdp_tiny_run, tmp_path)
    shard = max((f for f in step.iterdir() if f.suffix == ".distcp"), key=lambda f: f.stat().st_size)
    data = bytearray(shard.read_bytes())
    data[len(data) // 2:len(data) // 2 + 4096] = b"\xff" * 4096       # same size: only the checksum sees it
    shard.write_bytes(bytes(data))
    before, settings = _snapshot(RunFolder(run_dir).checkpoints()), RunFolder(run_dir).preset.read_bytes()
    lines = len(messages(run_dir))
    res = shardconsole("resume", str(run_dir), "--set", "train.steps=14", timeout=600)
    # Found before the launch (it was the ranks' refusal, after a launch that rewrote the settings).
    assert res.returncode == 2, explain(res, run_dir)
    line = one_line(res)
    assert "no loadable checkpoint" in line and shard.name in line and "checksum" in line, line
    assert _snapshot(RunFolder(run_dir).checkpoints()) == before
    assert RunFolder(run_dir).preset.read_bytes() == settings and len(messages(run_dir)) == lines


@pytest.mark.parametrize("change, why", [
    (lambda m: m.update(samples_consumed=m["samples_consumed"] + 1), "changed after the save"),
    (lambda m: m.pop("checksums"), "changed after the save"),
    (lambda m: [m.pop("checksums"), m.pop("manifest_checksum")], "lost its file checksums"),
])
def test_a_manifest_changed_after_the_save_is_refused_not_loaded(fsdp_tiny_run, tmp_path, change, why):
    """A one-digit edit of the data position, and a current manifest that lost its checksums: damaged,
    refused before launch in one line, nothing changed."""
    run_dir, step = _copy(fsdp_tiny_run, tmp_path)
    _edit_manifest(step, change)
    before = _snapshot(RunFolder(run_dir).checkpoints())
    res = shardconsole("resume", str(run_dir), "--set", "train.steps=14", timeout=300)
    assert res.returncode == 2, explain(res, run_dir)
    line = one_line(res)
    assert "no loadable checkpoint" in line and step.name in line and why in line, line
    assert _snapshot(RunFolder(run_dir).checkpoints()) == before


# ---------------------------------------------------------------------------------------------------
# 4. A LoRA resume onto a base whose weights changed

def test_a_lora_resume_onto_changed_base_weights_is_refused(tmp_path):
    """The base's model.safetensors replaced by another of the same size (another seed: other weights of
    one shape, as another revision or a merge): refused before launch, naming model.name."""
    from tests.hf_fixtures import make_hf_model
    base = make_hf_model(tmp_path / "base")
    run_dir = tmp_path / "run"
    res = run(run_dir, *COMMON, "train.steps=4", f"model.name={base}", "train.method=lora", "lora.rank=4",
              "data.seq_len=32", "train.save_final=none")
    assert res.returncode == 0, explain(res, run_dir)
    assert json.loads((RunFolder(run_dir).checkpoints() / "step_00000004" / MANIFEST).read_text())["base"]
    other = make_hf_model(tmp_path / "other", seed=1)
    assert (other / "model.safetensors").stat().st_size == (base / "model.safetensors").stat().st_size
    shutil.copyfile(other / "model.safetensors", base / "model.safetensors")
    res = shardconsole("resume", str(run_dir), "--set", "train.steps=6", timeout=300)
    assert res.returncode == 2, explain(res, run_dir)
    line = one_line(res)
    assert "[model] name" in line and str(base) in line and "other bytes" in line, line
    assert "lora.allow_changed_base" in line, line
    # The override trains the adapters on from the new weights, and its checkpoint records them.
    res = shardconsole("resume", str(run_dir), "--set", "train.steps=6", "--set", "lora.allow_changed_base=true",
                       timeout=300)
    assert res.returncode == 0, explain(res, run_dir)
    from shardconsole.runlog.base_weights import fingerprint
    saved = json.loads((RunFolder(run_dir).checkpoints() / "step_00000006" / MANIFEST).read_text())["base"]
    assert saved == fingerprint(base)
