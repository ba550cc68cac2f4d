"""A run folder renamed and a metrics.jsonl deleted, while the run goes on or after it (issue 64 item 9),
with real 2-rank CPU runs. Before: the rename made a half folder at the old path (the next save made it
again) and the run was called deleted; a deleted metrics.jsonl stayed deleted and a later attach called
the finished run "killed or crashed"."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys

import pytest

from shardconsole.runlog import protocol as P
from shardconsole.runlog.stream import MetricsReader, MetricsWriter, SampleAppender
from shardconsole.session.outcome import EXIT_CODES
from tests.conftest import messages, of_kind, shardconsole, wait_for_steps

ARGS = ["--preset", "tiny-cpu", "--headless", "--set", "train.log_every=1"]


def _saved(ckpt) -> list[int]:
    return sorted(int(p.name[5:]) for p in ckpt.glob("step_*") if p.name[5:].isdigit())


@pytest.mark.parametrize("where", ["checkpoints", "outside", "named-inside"])
def test_a_run_folder_renamed_mid_run_stops_saved_at_its_new_path(tmp_path, where):
    """With its checkpoints in it, in a train.checkpoint_dir outside (whose owner file then names the new
    path: the stop's save was refused as another run's), or in one named inside it (an absolute path to
    the old folder: the save made it again)."""
    old, new = tmp_path / "run", tmp_path / "renamed"
    ckpt = {"checkpoints": new / "checkpoints", "outside": tmp_path / "ck", "named-inside": new / "ck"}[where]
    named = {"outside": ckpt, "named-inside": old / "ck"}.get(where)
    proc = subprocess.Popen([sys.executable, "-m", "shardconsole", *ARGS, "--run-dir", str(old),
                             "--set", "train.steps=100000", "--set", "train.checkpoint_every=100000",
                             *(["--set", f"train.checkpoint_dir={named}"] if named else [])],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_for_steps(old, 3, 300, proc)
        old.rename(new)
        out, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == EXIT_CODES["run_folder_moved"], out[-3000:]
    assert "Traceback" not in out
    verdict = out[out.index("run stopped (run_folder_moved)"):]
    assert f"was moved to {new}" in verdict and f"shardconsole resume {new}" in verdict, verdict
    assert not old.exists()                       # no half folder at the old path, ever remade
    saved = _saved(ckpt)                          # the steps since the rename kept, in the new folder
    stopped_at = int(re.search(r"run stopped \(run_folder_moved\) at step (\d+)", out).group(1))
    assert saved == [stopped_at] and stopped_at >= 3, (saved, out[-2000:])
    res = shardconsole("resume", str(new), "--set", f"train.steps={stopped_at + 2}", timeout=300)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    assert f"resumed from {ckpt}/step_{stopped_at:08d}" in res.stdout
    assert not old.exists()


def test_a_finished_run_renamed_resumes_from_its_checkpoint_dir_outside(tmp_path):
    """The folder's owner file names the run's first path: its resume was refused as if another run had
    taken the checkpoints over."""
    old, new, ckpt = tmp_path / "run", tmp_path / "renamed", tmp_path / "ck"
    res = shardconsole(*ARGS, "--run-dir", str(old), "--set", "train.steps=2", "--set",
                       f"train.checkpoint_dir={ckpt}", timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    old.rename(new)
    res = shardconsole("resume", str(new), "--set", "train.steps=4", timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    assert f"resumed from {ckpt}/step_00000002" in res.stdout and _saved(ckpt) == [2, 4]
    assert "renamed " in shardconsole("runs").stdout         # linked again from the runs root
    # the session after the rename is named after the new folder: still this run's (attach said step 2's end)
    att = shardconsole("attach", str(new), "--headless")
    assert att.returncode == 0 and "finished: 4 steps" in att.stdout + att.stderr, att.stderr[-2000:]


def test_a_metrics_jsonl_deleted_mid_run_is_started_again(tmp_path):
    run_dir = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "shardconsole", *ARGS, "--run-dir", str(run_dir),
                             "--set", "train.steps=80"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        wait_for_steps(run_dir, 5, 300, proc)
        (run_dir / "metrics.jsonl").unlink()
        err = proc.communicate(timeout=300)[1]
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0 and "finished: 80 steps" in err, err[-2000:]
    assert "was deleted" in err and "a new" in err, err[-2000:]
    msgs = messages(run_dir)                      # started again: every rank's hello, then the rest
    assert {h.rank for h in of_kind(msgs, "hello")} == {0, 1}
    assert [e for e in of_kind(msgs, "event") if e.name == "stream_restarted"]
    assert of_kind(msgs, "finished")[0].steps == 80 and max(s.step for s in of_kind(msgs, "step")) == 80
    res = shardconsole("attach", str(run_dir), "--headless")
    assert res.returncode == 0 and "finished: 80 steps" in res.stdout + res.stderr, res.stderr[-2000:]


def test_a_finished_run_whose_metrics_were_deleted_is_still_called_finished(tmp_path):
    run_dir = tmp_path / "run"
    res = shardconsole(*ARGS, "--run-dir", str(run_dir), "--set", "train.steps=6", timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    (run_dir / "metrics.jsonl").unlink()
    att = shardconsole("attach", str(run_dir), "--headless")
    said = att.stdout + att.stderr
    assert att.returncode == 0 and "finished: 6 steps" in said and "metrics.jsonl was deleted" in said, said
    assert "finished" in shardconsole("runs", str(run_dir)).stdout
    assert not (run_dir / "metrics.jsonl").exists()         # an attach writes nothing into a run that is over
    # A run of an older version (no end line in its log): its final checkpoint says it finished.
    log = run_dir / "logs" / "rank0.log"
    log.write_text("".join(ln for ln in log.read_text().splitlines(True) if '"kind":"finished"' not in ln))
    att = shardconsole("attach", str(run_dir), "--headless")
    assert att.returncode == 0 and "final checkpoint (step 6 of 6)" in att.stdout + att.stderr
    # Nothing tells: said plainly, never "killed or crashed".
    shutil.rmtree(run_dir / "checkpoints")
    att = shardconsole("attach", str(run_dir), "--headless")
    said = att.stdout + att.stderr
    assert "metrics.jsonl was deleted" in said and "how the run ended is not known" in said, said
    assert "killed" not in said and "Traceback" not in said


def test_the_stream_follows_a_restarted_file_and_never_remakes_a_moved_folder(tmp_path):
    """The reader reads the old file to its end and the new one from its start; the front end's samples
    follow a renamed run folder through their open file and make nothing at the old path."""
    run = tmp_path / "run"
    run.mkdir()
    path = run / "metrics.jsonl"
    w = MetricsWriter(path, "r", 0)
    w.emit(P.Event(run="r", rank=0, t=1.0, name="a"))
    reader = MetricsReader(path)
    assert [m.name for m in reader.poll()] == ["a"]
    path.unlink()
    w.emit(P.Event(run="r", rank=0, t=2.0, name="b"))          # into the deleted file
    reader.check_names()
    assert w.reopen_if_renamed() and path.is_file()
    w.emit(P.Event(run="r", rank=0, t=3.0, name="c"))
    assert [m.name for m in reader.poll()] == ["b", "c"] and reader.notes
    samples = SampleAppender(path, "r")
    samples.append([P.Event(run="r", rank=-1, t=4.0, name="d")])
    run.rename(tmp_path / "moved")
    assert w.folder_now() == (tmp_path / "moved").resolve()
    assert not w.reopen_if_renamed() and not run.exists()      # a rank's writer never remakes the old path
    samples._looked_at = float("-inf")                          # the next append looks at the name
    samples.append([P.Event(run="r", rank=-1, t=5.0, name="e")])
    reader.check_names()
    assert "was moved to" in reader.lost and not run.exists()
    w.close()
    samples.close()
    reader.close()


def test_a_run_folder_renamed_before_its_ranks_start_leaves_nothing_at_the_old_path(tmp_path):
    """Renamed between the launch (job.json written) and the ranks' start (they import torch first): the
    ranks wrote their logs and stream at the old path and refused on a missing preset.toml, and
    TensorBoard's writer made the old folder again; now nothing is made there, and the verdict says what
    happened (exit 12, run_folder_moved)."""
    from tests.conftest import wait_until
    run_dir, moved = tmp_path / "run", tmp_path / "moved"
    proc = subprocess.Popen([sys.executable, "-m", "shardconsole", *ARGS, "--run-dir", str(run_dir)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_until(lambda: (run_dir / "job.json").is_file(), 60, "the launch's job.json")
        run_dir.rename(moved)
        out, err = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == EXIT_CODES["run_folder_moved"], out[-2000:] + err[-2000:]
    assert "moved or deleted before its ranks started" in err and "Traceback" not in err
    assert not run_dir.exists()
    assert not (moved / "logs").exists()            # no rank wrote anything, there or here
