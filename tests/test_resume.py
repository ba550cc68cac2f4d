"""Exact resume and nothing trained lost, with real 2-rank runs on CPU (issue 15 items 5-6, issue 22
items 7-8).

The reference is an uninterrupted run; the run under test fails on purpose after a checkpoint
(SHARDCONSOLE_FAULT) and is continued with `shardconsole resume RUN_DIR` in the same folder. In fp32
on CPU its step losses must equal the reference's to 1e-5: that needs the data position, the RNG
states and the optimizer state back, not only the weights.
"""

from __future__ import annotations

import json
import os
import pickle
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shardconsole.settings import config as C
from shardconsole.runlog.checkpoint_files import MANIFEST, file_checksum, manifest_checksum
from shardconsole.runlog.runfolder import RunFolder
from tests.conftest import assert_nothing_left, messages, of_kind, shardconsole, wait_for_steps

RUN_TIMEOUT = 600
COMMON = ["precision.dtype=fp32", "train.steps=6", "train.log_every=1", "train.checkpoint_every=2"]


def start(run_dir: Path, *sets: str, env: dict | None = None) -> subprocess.CompletedProcess:
    args = ["--preset", "tiny-cpu", "--headless", "--run-dir", str(run_dir)]
    for s in sets:
        args += ["--set", s]
    return shardconsole(*args, timeout=RUN_TIMEOUT, env=env)


def resume(run_dir: Path, *sets: str) -> subprocess.CompletedProcess:
    return shardconsole("resume", str(run_dir), *[a for s in sets for a in ("--set", s)], timeout=RUN_TIMEOUT)


def losses(run_dir: Path) -> dict[int, float]:
    """Step -> loss; a step that appears twice (replayed after a resume) keeps its last value."""
    return {m.step: m.loss for m in of_kind(messages(run_dir), "step")}


def events(run_dir: Path, name: str) -> list:
    return [m for m in messages(run_dir) if m.kind == "event" and m.name == name]


def _explain(res: subprocess.CompletedProcess, run_dir: Path) -> str:
    logs = "".join(f.read_text(errors="replace")[-2000:] for f in sorted(RunFolder(run_dir).logs.glob("*.log")))
    return res.stdout[-2000:] + res.stderr[-2000:] + logs


def interrupted_then_resumed(tmp: Path, backend_sets: list[str]) -> tuple[dict, Path, Path]:
    """The reference run's losses, a run that failed at step 5 (checkpoints at 2 and 4) and was resumed,
    and the reference run's folder."""
    ref, run = tmp / "reference", tmp / "interrupted"
    res = start(ref, *COMMON, *backend_sets)
    assert res.returncode == 0, _explain(res, ref)
    res = start(run, *COMMON, *backend_sets, env={"SHARDCONSOLE_FAULT": "raise@rank=0,step=5"})
    assert res.returncode != 0
    assert sorted(losses(run)) == [1, 2, 3, 4]
    res = resume(run)
    assert res.returncode == 0, _explain(res, run)
    return losses(ref), run, ref


def assert_exact_continuation(ref: dict, run: Path, _ref_dir: Path) -> None:
    got = losses(run)
    assert sorted(got) == [1, 2, 3, 4, 5, 6]
    assert got == pytest.approx(ref, abs=1e-5), (got, ref)
    msgs = messages(run)
    resumed = [e for e in of_kind(msgs, "event") if e.name == "info" and "resumed from" in e.detail]
    assert len(resumed) == 1 and resumed[0].detail.endswith("step_00000004 (step 4)"), resumed
    # Appended to the same stream, under a run id of its own; the first run's settings kept beside.
    runs = {m.run for m in of_kind(msgs, "step")}
    assert len(runs) == 2
    assert len(of_kind(msgs, "finished")) == 1
    folder = RunFolder(run)
    assert C.load(folder.preset).train.resume is True
    assert C.load(folder.preset.with_name("preset.toml.prev")).train.resume is False
    assert_nothing_left(run, msgs)


@pytest.fixture(scope="module")
def fsdp_resumed(tmp_path_factory):
    return interrupted_then_resumed(tmp_path_factory.mktemp("fsdp-resume"), [])


@pytest.mark.slow
def test_fsdp_resume_equals_the_uninterrupted_run(fsdp_resumed):
    assert_exact_continuation(*fsdp_resumed)


@pytest.mark.slow
def test_fsdp_resume_skips_a_truncated_checkpoint_and_cleans_partials(fsdp_resumed):
    """The newest checkpoint cut short (a full disk) is skipped with a warning naming it; the previous
    complete one is used (step 5's loss, taken before any update of this session, comes out as before);
    a killed save's .partial is removed; and train.keep_checkpoints=2 leaves the two newest complete
    checkpoints (step 6 written again by this session, and its final step 7); the skipped step 6 is kept
    as step_00000006.replaced."""
    ref, run, _ = fsdp_resumed
    ckpts = RunFolder(run).checkpoints()
    newest = ckpts / "step_00000006"
    shard = sorted(newest.glob("*.distcp"))[0]
    shard.write_bytes(shard.read_bytes()[:100])
    killed = ckpts / "step_00000009.partial"
    killed.mkdir()
    (killed / "junk").write_text("half a save")
    res = resume(run, "train.steps=7", "train.keep_checkpoints=2")
    assert res.returncode == 0, _explain(res, run)
    warnings = [e.detail for e in events(run, "warning")]
    assert any(str(newest) in w and "truncated" in w for w in warnings), warnings
    got = losses(run)
    assert got[5] == pytest.approx(ref[5], abs=1e-5)      # train.steps=7 changes the schedule from step 5 on
    assert 7 in got and not killed.exists()
    # the cut-short step 6 it skipped is kept aside (never loaded or pruned), not deleted by the new save
    assert sorted(p.name for p in ckpts.iterdir()) == ["step_00000006", "step_00000006.replaced", "step_00000007"]


@pytest.mark.slow
def test_fsdp_checkpoint_that_would_run_code_is_refused_naming_its_folder(fsdp_resumed, tmp_path):
    """DCP's .metadata is a pickle: one that calls os.system fails the resume with the folder named,
    and the command never runs."""
    _, run, _ = fsdp_resumed
    newest = max(p for p in RunFolder(run).checkpoints().iterdir() if p.is_dir() and "partial" not in p.name)
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    meta = newest / ".metadata"
    payload = pickle.dumps(Evil())
    size = meta.stat().st_size
    meta.write_bytes(payload + b"\0" * (size - len(payload)))    # the manifest's size still matches
    # and its checksum too (whoever can write the file can write the manifest): the loader itself refuses
    manifest = json.loads((newest / MANIFEST).read_text())
    manifest["checksums"][".metadata"] = file_checksum(meta)
    manifest["manifest_checksum"] = manifest_checksum(manifest)
    (newest / MANIFEST).write_text(json.dumps(manifest))
    res = resume(run, "train.steps=9")
    assert res.returncode == 2, _explain(res, run)
    failed = [f for f in of_kind(messages(run), "failed") if f.cause == "config_error"]
    assert failed and str(newest) in failed[-1].message and "posix.system" in failed[-1].message, failed
    assert "weights_only" not in failed[-1].message
    assert not marker.exists()


@pytest.mark.slow
def test_fsdp_resumes_on_another_rank_count(fsdp_resumed):
    """Two ranks saved (the reference run's final checkpoint), one rank resumes: DCP reshards the
    weights and the optimizer state."""
    _, _, run = fsdp_resumed
    first = losses(run)
    res = resume(run, "train.steps=8", "parallel.nproc_per_node=1")
    assert res.returncode == 0, _explain(res, run)
    got = losses(run)
    assert sorted(got) == [1, 2, 3, 4, 5, 6, 7, 8]
    assert got[7] < first[1] - 0.5, got                   # trained weights, not a fresh model
    assert any("resharded" in e.detail for e in events(run, "warning"))
    hellos = of_kind(messages(run), "hello")
    assert {h.world for h in hellos} == {1, 2}


@pytest.mark.slow
def test_deepspeed_resume_equals_the_uninterrupted_run(tmp_path):
    assert_exact_continuation(*interrupted_then_resumed(tmp_path, ["parallel.backend=deepspeed"]))


def test_resume_without_a_checkpoint_is_one_line_and_exit_2(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    C.save(C.build({}), RunFolder(run).preset)
    res = shardconsole("resume", str(run))
    assert res.returncode == 2
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("shardconsole: error: ") and "no checkpoint" in lines[0], lines
    assert not RunFolder(run).preset.with_name("preset.toml.prev").exists()


# ---------------------------------------------------------------------------------------------------
# A stop saves first

def _launch(run_dir: Path, *sets: str, env: dict | None = None) -> subprocess.Popen:
    args = [sys.executable, "-m", "shardconsole", "--preset", "tiny-cpu", "--headless", "--run-dir", str(run_dir),
            "--set", "train.steps=100000", "--set", "train.log_every=1"]
    for s in sets:
        args += ["--set", s]
    return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, **(env or {})})


def _signal_run(run_dir: Path, sig: int) -> None:
    """What a console stop does: the signal to the launcher and to every rank (torchrun forwards its own)."""
    pids = [json.loads(RunFolder(run_dir).job.read_text())["pid"]]
    pids += [h.pid for h in of_kind(messages(run_dir), "hello")]
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def _wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.1)
    pytest.fail(f"no {what} within {timeout:.0f}s")


@pytest.mark.slow
def test_stop_saves_the_step_reached_then_resume_continues(tmp_path):
    run = tmp_path / "run"
    proc = _launch(run)
    wait_for_steps(run, 3, RUN_TIMEOUT, proc)
    _signal_run(run, signal.SIGTERM)
    proc.communicate(timeout=120)
    saves = events(run, "stop_save")
    assert len(saves) == 1, saves
    step = saves[0].step
    assert saves[0].detail == f"saving step {step} before stopping"
    assert [e.detail for e in events(run, "checkpoint_saved")] == [str(RunFolder(run).checkpoints() /
                                                                       f"step_{step:08d}")]
    failed = of_kind(messages(run), "failed")
    assert failed and {f.cause for f in failed} == {"stopped"}, failed
    assert max(losses(run)) == step       # the saved step is the last one trained
    assert_nothing_left(run, messages(run))
    res = resume(run, f"train.steps={step + 2}")
    assert res.returncode == 0, _explain(res, run)
    assert sorted(losses(run))[-2:] == [step + 1, step + 2]


@pytest.mark.slow
def test_a_second_stop_signal_skips_the_save(tmp_path):
    """The save on stop hangs (slow_save fault); a second SIGTERM, later than the launcher's copy of the
    first, ends every rank without it: no checkpoint, the .partial left for the next save to remove."""
    run = tmp_path / "run"
    proc = _launch(run, env={"SHARDCONSOLE_FAULT": "slow_save@step=1"})
    wait_for_steps(run, 2, RUN_TIMEOUT, proc)
    _signal_run(run, signal.SIGTERM)
    _wait_for(lambda: events(run, "stop_save"), 60, "stop_save event")
    time.sleep(3)     # past the debounce that folds the launcher's forwarded copy into the first signal
    _signal_run(run, signal.SIGTERM)
    proc.communicate(timeout=60)
    failed = of_kind(messages(run), "failed")
    assert failed and all(f.cause == "stopped" and "without saving" in f.message for f in failed), failed
    assert not events(run, "checkpoint_saved")
    assert [p.name.endswith(".partial") for p in RunFolder(run).checkpoints().iterdir()] == [True]
    assert_nothing_left(run, messages(run))


# ---------------------------------------------------------------------------------------------------
# Adding steps (issue 36 item 5)

def test_more_steps_keep_the_schedule_and_the_resume_sums_up_the_earlier_part(tmp_path):
    """A finished 4-step cosine run resumed to 7 steps: the lr goes on from where the schedule ended (a
    constant tail, said at the resume), never back up; the earlier steps are one line, not replayed."""
    run = tmp_path / "run"
    res = start(run, "train.steps=4", "train.log_every=1", "train.lr=1e-3", "train.min_lr_ratio=0.1")
    assert res.returncode == 0, _explain(res, run)
    res = resume(run, "train.steps=7")
    assert res.returncode == 0, _explain(res, run)
    lr = {m.step: m.lr for m in of_kind(messages(run), "step")}
    assert lr[4] == pytest.approx(1e-4) and [lr[5], lr[6], lr[7]] == pytest.approx([1e-4] * 3), lr
    assert "steps 5-7 keep 1.00e-04, the lr the schedule ended on (a constant tail" in res.stderr, res.stderr
    out = res.stdout.splitlines()
    assert out[:2] == [f"earlier in this folder (1 session): steps 1-4, last loss {losses(run)[4]:.4f}, "
                       "lr 1.00e-04; finished at step 4", "-- starting"], out
    assert out.count("-- finished") == 1 and out[-1] == "-- finished", out
    assert [line.split()[1] for line in out if line.startswith("step ")] == ["5/7", "6/7", "7/7"], out
    # the flight recorder's variable is the one this torch reads: no deprecation warning in the rank logs
    logs = "".join(f.read_text(errors="replace") for f in RunFolder(run).logs.glob("*.log"))
    assert "TRACE_BUFFER_SIZE is deprecated" not in logs


@pytest.mark.slow
def test_fsdp_step_in_backward_equals_the_ordinary_step_and_resumes_exactly(tmp_path):
    """optim.step_in_backward (issue 35): each parameter stepped by FSDP2's post-accumulate-grad hook in
    the backward pass. Plain AdamW in fp32 without a clip is the same update, so the losses equal the
    ordinary step's; the run interrupted at step 5 resumes from step 4 onto the same losses (the
    optimizer's state saved and loaded as the ordinary one's)."""
    sets = [*COMMON, "train.clip_grad_norm=0"]
    ordinary, run = tmp_path / "ordinary", tmp_path / "in-backward"
    res = start(ordinary, *sets)
    assert res.returncode == 0, _explain(res, ordinary)
    res = start(run, *sets, "optim.step_in_backward=true", env={"SHARDCONSOLE_FAULT": "raise@rank=0,step=5"})
    assert res.returncode != 0
    said = [e.detail for e in events(run, "info") if e.detail.startswith("optim.step_in_backward")]
    assert said and "parameters step as their gradients are reduced" in said[0], said
    assert sorted(losses(run)) == [1, 2, 3, 4]
    res = resume(run)
    assert res.returncode == 0, _explain(res, run)
    ref = losses(ordinary)
    assert losses(run) == pytest.approx(ref, abs=1e-5), (losses(run), ref)
    assert len(set(ref.values())) == 6          # the model moved: equal losses are not a frozen model's


def test_a_resume_whose_override_cures_the_saved_settings_is_not_refused_for_them(fsdp_tiny_run, tmp_path):
    """A run trained with precision.fp8 (emulated, or on a GPU with FP8) resumed on this CPU with
    `--set precision.fp8=none`: the saved settings are compared, not launched, so the check that refuses fp8
    on a CPU must not refuse them (it did, advising to set fp8 to none: what the user had just done)."""
    import re
    import shutil
    run = tmp_path / "run"
    shutil.copytree(fsdp_tiny_run.run, run, symlinks=True)
    preset = run / "preset.toml"
    preset.write_text(re.sub(r'(?m)^fp8 = "none"', 'fp8 = "tensorwise"', preset.read_text()))
    assert 'fp8 = "tensorwise"' in preset.read_text()
    res = shardconsole("resume", str(run), "--set", "precision.fp8=none", "--set", "train.steps=14", "--print-command")
    assert res.returncode == 0, res.stderr
    preset.write_text(re.sub(r'(?m)^fp8 = "none"', 'fp8 = "tensorwise"', preset.read_text()))   # (it saved the cure)
    refused = shardconsole("resume", str(run), "--set", "train.steps=14", "--print-command")   # fp8 kept: refused
    assert refused.returncode == 2 and "fp8" in refused.stderr
