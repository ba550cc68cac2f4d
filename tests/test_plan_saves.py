"""What a run writes, before it is launched (issue 30): the planner's checkpoint sizes against real tiny-cpu
checkpoints on disk (FSDP2's DCP and DeepSpeed's engine.save_checkpoint), the disk total with
keep_checkpoints, the host peak with the save, and the launch refused on a tmpfs smaller than one
checkpoint."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from shardconsole import plan as PL
from shardconsole.settings import config as C
from shardconsole.settings import preset_store
from shardconsole.settings.models import resolve
from shardconsole.plan.shapes import Shapes
from tests.conftest import shardconsole

GiB = 2**30


def _tiny(*sets: str) -> C.RunConfig:
    return C.build(C.load_toml(preset_store.find("tiny-cpu")), "tiny-cpu", list(sets))


def _du(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


def _planned_vs_disk(finished) -> tuple[int, int]:
    """The planned size of one checkpoint and its newest checkpoint's on disk, of a finished run
    (conftest's shared runs: the size does not depend on the step count)."""
    res, run_dir = finished.res, finished.run
    assert res.returncode == 0, res.stderr[-3000:]
    step = sorted((run_dir / "checkpoints").glob("step_*"))[-1]
    sv = PL.saves(C.load(run_dir / "preset.toml"), Shapes.of(resolve("tiny")))
    return sv.full_bytes, _du(step)


@pytest.mark.slow
def test_the_planned_dcp_checkpoint_is_the_size_fsdp2_writes(fsdp_tiny_run):
    planned, on_disk = _planned_vs_disk(fsdp_tiny_run)
    assert abs(planned / on_disk - 1) < 0.03, (planned, on_disk)


@pytest.mark.slow
def test_the_planned_deepspeed_checkpoint_is_the_size_zero3_writes(zero3_tiny_run):
    planned, on_disk = _planned_vs_disk(zero3_tiny_run)
    assert abs(planned / on_disk - 1) < 0.03, (planned, on_disk)


def test_the_disk_total_counts_the_checkpoints_kept_at_once():
    s = Shapes.of(resolve("tiny"))
    every = PL.saves(_tiny("train.checkpoint_every=10"), s)          # steps 10, 20, 30, none pruned
    assert every.schedule == [(10, "full"), (20, "full"), (30, "full")]
    assert every.kept_at_once == 3 and every.disk_peak_bytes == 3 * every.full_bytes
    kept = PL.saves(_tiny("train.checkpoint_every=10", "train.keep_checkpoints=1"), s)
    # the new one is written beside the kept one and the old one pruned only once it is complete
    assert kept.kept_at_once == 2 and kept.disk_peak_bytes == 2 * kept.full_bytes
    model = PL.saves(_tiny("train.checkpoint_every=10", "train.keep_checkpoints=1", "train.save_final=false"), s)
    assert model.schedule == [(10, "full"), (20, "full"), (30, "full")]     # 30 is a checkpoint_every step
    none = PL.saves(_tiny("train.save_final=false"), s)
    assert none.schedule == [] and none.disk_peak_bytes == 0
    # a resume from step 20 with two checkpoints there: only the final save is new
    resumed = PL.saves(_tiny("train.checkpoint_every=10", "train.keep_checkpoints=2"), s, start_step=20,
                       existing=[every.full_bytes] * 2)
    assert resumed.schedule == [(30, "full")] and resumed.disk_peak_bytes - resumed.existing_bytes == every.full_bytes


def test_sizes_follow_the_master_dtype_and_the_export_dtype():
    s = Shapes.of(resolve("3b"))
    base = ["parallel.device=cuda", "parallel.nproc_per_node=1", "model.name=3b", "precision.dtype=bf16"]
    fp32 = PL.saves(_tiny(*base), s)
    bf16 = PL.saves(_tiny(*base, "precision.master_dtype=bf16"), s)
    P = s.n_params
    assert fp32.full_bytes == pytest.approx(12 * P, rel=0.01) and bf16.full_bytes == pytest.approx(6 * P, rel=0.01)
    assert fp32.model_bytes == pytest.approx(4 * P, rel=0.01)
    assert fp32.export_dtype == "fp32" and fp32.export_bytes == pytest.approx(4 * P, rel=0.01)
    assert bf16.export_dtype == "bf16" and bf16.export_bytes == pytest.approx(2 * P, rel=0.01)
    ds = PL.saves(_tiny(*base, "parallel.backend=deepspeed", "deepspeed.stage=2"), s)
    assert ds.full_bytes == pytest.approx(2 * P + 12 * P, rel=0.01)     # bf16 module + fp32 master and Adam


def test_the_host_peak_says_which_phase_sets_it_and_what_the_save_adds(capsys):
    hw = PL.Hardware(gpus=1, gpu_memory_bytes=24 * GiB, host_memory_bytes=128 * GiB)
    sets = ["parallel.device=cuda", "parallel.nproc_per_node=1", "model.name=3b", "precision.dtype=bf16",
            "fsdp.cpu_offload=true", "memory.gpu_memory_limit=24GiB"]
    saving = PL.estimate(_tiny(*sets), resolve("3b"), hw)
    quiet = PL.estimate(_tiny(*sets, "train.save_final=false"), resolve("3b"), hw)
    assert quiet.host_peak_phase == "training" and quiet.host_save_adds_bytes == 0
    # the streaming save copies one tensor at a time: the largest one (the embedding, fp32 masters) and
    # the writer's buffers; within the bound the save path is held to
    shape = resolve("3b").config
    largest = 4 * shape["vocab_size"] * shape["hidden_size"]
    add = saving.host_save_adds_bytes
    assert saving.host_peak_phase == "saving" and largest < add <= max(GiB, largest) + PL.SAVE_FIXED_BYTES
    assert saving.host_peak_bytes == quiet.host_peak_bytes + add
    assert PL.host_peak_line(saving) == (f"host peak {C.format_size(saving.host_peak_bytes)} (saving); the save "
                                         f"adds {C.format_size(add)}")
    compiled = PL.estimate(_tiny(*sets, "train.compile=true"), resolve("3b"), PL.Hardware(1, 24 * GiB, 128 * GiB, cpus=16))
    assert compiled.host_peak_bytes - saving.host_peak_bytes == PL.COMPILE_SIDECAR_BYTES + 16 * PL.COMPILE_WORKER_BYTES
    assert shardconsole_plan(capsys, *sum((["--set", x] for x in sets), [])).count(f"the save adds {C.format_size(add)}") == 1


def shardconsole_plan(capsys, *args: str) -> str:
    from shardconsole.cli.plan import cmd_plan
    assert cmd_plan(["--preset", "tiny-cpu", "--gpu-memory", "24GiB", "--host-memory", "128GiB", *args]) == 0
    text = capsys.readouterr().out
    assert "disk: one full checkpoint" in text
    assert cmd_plan(["--preset", "tiny-cpu", "--json", *args, "--gpu-memory", "24GiB", "--host-memory", "128GiB"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["saves"]["full_checkpoint_bytes"] > 0 and doc["host_peak_phase"] == "saving"
    return text


@pytest.fixture
def small_tmpfs(tmp_path):
    mnt = tmp_path / "small"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], check=True)
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "--lazy", str(mnt)], check=True)


def test_a_checkpoint_dir_smaller_than_one_checkpoint_is_refused_before_launch(tmp_path, small_tmpfs):
    run_dir = tmp_path / "run"
    full = PL.saves(_tiny(), Shapes.of(resolve("tiny"))).full_bytes
    res = shardconsole("--preset", "tiny-cpu", "--headless", "--run-dir", str(run_dir),
                       "--set", f"train.checkpoint_dir={small_tmpfs / 'ckpt'}")
    assert res.returncode == 2, res.stderr
    line = res.stderr.strip()
    assert len(line.splitlines()) == 1 and "Traceback" not in line
    assert line.startswith(f"shardconsole: error: --set train.checkpoint_dir: {small_tmpfs / 'ckpt'}: the run's saves need "
                           f"{C.format_size(full)} there"), line
    assert "1.0 MiB free on its file system" in line                   # both figures
    assert 'would fit: train.save_final = "model"' in line and "another train.checkpoint_dir" in line
    assert not run_dir.exists() and list(small_tmpfs.iterdir()) == []  # nothing launched, nothing written


def test_a_resume_that_cannot_save_is_refused_before_any_file_is_written(tmp_path, small_tmpfs):
    """resume: the checkpoints already in the folder count (they stay until pruned); refused in one line
    before preset.toml is rewritten; --force goes past the check."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    ckpt = small_tmpfs / "ckpt"
    C.save(_tiny(f"train.checkpoint_dir={ckpt}", "train.steps=30"), run_dir / "preset.toml")
    step = ckpt / "step_00000010"
    step.mkdir(parents=True)
    # what resume looks for: a manifest of before checksums, of this backend (a step folder none loads is
    # refused as such before the disk is looked at)
    (step / "shardconsole.json").write_text(json.dumps({"step": 10, "files": {}, "backend": "fsdp"}))
    before = (run_dir / "preset.toml").read_text()
    res = shardconsole("resume", str(run_dir))
    assert res.returncode == 2, res.stderr
    line = res.stderr.strip()
    assert len(line.splitlines()) == 1 and f"preset.toml: [train] checkpoint_dir: {ckpt}: the run's saves need" in line
    assert "free on its file system" in line and "--force" in line
    assert (run_dir / "preset.toml").read_text() == before and not (run_dir / "preset.toml.prev").exists()
