"""Every path a run writes, checked against other runs' folders (issue 64, the sweep after item 1): a new run
folder and a train.export_dir inside another run's folder were accepted (by absolute path, through a
symlink, by a relative path), so that run's resume, pruning and `runs` met this run's files. Refused
before launch in one line naming where the value came from; nothing is written there."""

from __future__ import annotations

import shutil
from pathlib import Path

from shardconsole.session.rundir import create_run_dir
from shardconsole.settings import config as C
from tests.conftest import shardconsole

REPO = Path(__file__).resolve().parent.parent


def _one_line(res) -> str:
    lines = [x for x in res.stderr.splitlines() if x.strip()]
    assert res.returncode == 2 and len(lines) == 1 and "Traceback" not in res.stderr, res.stderr[-2000:]
    return lines[0]


def _first(tmp_path: Path) -> Path:
    first = create_run_dir(C.load(REPO / "presets" / "tiny-cpu.toml"), tmp_path / "first")
    (tmp_path / "link").symlink_to(first)
    return first


def test_a_run_folder_inside_another_run_folder_is_refused(tmp_path):
    first = _first(tmp_path)
    before = sorted(p.name for p in first.iterdir())
    for name in (str(first / "checkpoints" / "new"), str(tmp_path / "link" / "logs" / "new"), "first/new"):
        res = shardconsole("--preset", "tiny-cpu", "--headless", "--run-dir", name, "--set", "train.steps=2",
                           cwd=tmp_path)
        line = _one_line(res)
        assert line.endswith(f"--run-dir {name}: inside run folder {first.resolve()}; pick a folder outside "
                             f"every run folder"), line
        res = shardconsole("--preset", "tiny-cpu", "--print-command", "--run-dir", name, cwd=tmp_path)
        assert f"inside run folder {first.resolve()}" in _one_line(res)
    assert sorted(p.name for p in first.iterdir()) == before


def test_an_export_dir_inside_another_run_folder_is_refused_for_a_new_run_and_a_resume(fsdp_tiny_run, tmp_path):
    first = _first(tmp_path)
    for name in (str(first / "checkpoints" / "export"), str(tmp_path / "link" / "export"), "first/export"):
        res = shardconsole("--preset", "tiny-cpu", "--headless", "--run-dir", str(tmp_path / "new"),
                           "--set", "train.steps=2", "--set", f"train.export_dir={name}", cwd=tmp_path)
        line = _one_line(res)
        assert line.startswith("shardconsole: error: --set train.export_dir: ") and \
            f"inside run folder {first.resolve()}" in line, line
        assert not (tmp_path / "new").exists()
    run_dir = tmp_path / "run"
    shutil.copytree(fsdp_tiny_run.run, run_dir, symlinks=True)
    settings = (run_dir / "preset.toml").read_bytes()
    res = shardconsole("resume", str(run_dir), "--set", "train.steps=14",
                       "--set", f"train.export_dir={tmp_path / 'link' / 'export'}")
    assert "--set train.export_dir: " in _one_line(res)
    assert (run_dir / "preset.toml").read_bytes() == settings
    assert not (first / "export").exists() and not (first / "checkpoints").exists()


def test_export_model_into_another_run_folder_or_a_step_folder_is_refused(fsdp_tiny_run, tmp_path):
    """export-model -o: inside another run's folder (through a symlink), or inside one of the run's own
    step folders (pruned or replaced with the export in it). Both were written."""
    first = _first(tmp_path)
    step = next(p for p in (fsdp_tiny_run.run / "checkpoints").iterdir() if p.name.startswith("step_"))
    for out, said in ((tmp_path / "link" / "checkpoints" / "model", f"inside run folder {first.resolve()}"),
                      (step / "model", f"inside the checkpoint {step}")):
        res = shardconsole("export-model", str(fsdp_tiny_run.run), "-o", str(out))
        assert said in _one_line(res) and not out.exists()
