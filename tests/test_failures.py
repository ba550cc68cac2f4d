"""Each failure class injected for real (SHARDCONSOLE_FAULT, see backends/rank/faults.py) through the real
headless path: classified right, with the documented exit code and a message that says what to do."""

from __future__ import annotations

import pytest

from shardconsole.session.outcome import EXIT_CODES
from tests.conftest import assert_nothing_left, messages, of_kind, shardconsole

pytestmark = pytest.mark.slow


def run_with_fault(tmp_path, fault: str, *sets: str):
    run_dir = tmp_path / "run"
    args = ["--preset", "tiny-cpu", "--headless", "--run-dir", str(run_dir), "--set", "train.log_every=1"]
    for s in ("train.steps=6",) + sets:
        args += ["--set", s]
    res = shardconsole(*args, env={"SHARDCONSOLE_FAULT": fault}, timeout=240)
    msgs = messages(run_dir)
    assert_nothing_left(run_dir, msgs)
    return res, msgs


@pytest.mark.parametrize("backend, fault, cause, words", [
    ("fsdp", "oom@rank=1,step=2", "gpu_oom", ["GPU out of memory during step 2", "rank 1", "micro_batch"]),
    ("fsdp", "oom_load@rank=0", "gpu_oom", ["GPU out of memory while loading the model", "rank 0"]),
    ("fsdp", "raise@rank=1,step=3", "crash", ["ValueError: injected failure at step 3", "rank1.log"]),
    ("fsdp", "nan@step=2", "nan_loss", ["loss is nan", "lr"]),
    # through DeepSpeed's engine (the failure report is common code; the loss comes from the engine)
    ("deepspeed", "nan@step=2", "nan_loss", ["loss is nan"]),
])
def test_failure_in_a_rank_is_classified(tmp_path, backend, fault, cause, words):
    res, msgs = run_with_fault(tmp_path, fault, f"parallel.backend={backend}")
    assert res.returncode == EXIT_CODES[cause], res.stderr
    assert f"({cause})" in res.stderr
    for w in words:
        assert w in res.stderr, res.stderr
    assert "Traceback" not in res.stderr
    assert any(f.cause == cause for f in of_kind(msgs, "failed"))


def test_a_sigkilled_rank_is_host_oom_only_when_the_kernel_recorded_one(tmp_path):
    """Issue 31 item 6: SIGKILL is also `kill -9`; without an OOM kill in the kernel log or the memory
    cgroup it is "killed (SIGKILL)", a crash, not host_oom."""
    from shardconsole.launch.process_identity import oom_kills
    before = oom_kills()
    res, _ = run_with_fault(tmp_path, "kill@rank=1,step=2")
    if before is not None and oom_kills() != before:
        pytest.skip("the kernel's OOM killer struck in this cgroup during the test")
    assert res.returncode == EXIT_CODES["crash"], res.stderr
    assert "rank 1 was killed (SIGKILL)" in res.stderr and "recorded no OOM kill" in res.stderr, res.stderr
    assert "host_oom" not in res.stderr


def test_hang_names_the_stuck_rank(tmp_path):
    res, _ = run_with_fault(tmp_path, "sleep@rank=1,step=3", "train.steps=1000", "train.hang_timeout_s=6")
    assert res.returncode == EXIT_CODES["hang"], res.stderr
    assert "rank 1 is stuck at faults.py" in res.stderr
    assert "rank(s) 0 wait in a collective" in res.stderr
    assert "none left" in res.stderr


def test_fp16_loss_scale_floor(tmp_path):
    res, msgs = run_with_fault(tmp_path, "overflow@step=2", "train.steps=40", "precision.dtype=fp16",
                               "precision.initial_scale_power=3", "precision.min_loss_scale=2")
    assert res.returncode == EXIT_CODES["loss_scale_floor"], res.stderr
    assert "loss scale stuck at its minimum 2" in res.stderr
    steps = of_kind(msgs, "step")
    assert steps[0].loss_scale == 8.0 and steps[-1].loss_scale == 2.0
    assert steps[-1].skipped_steps >= 8
    assert any(e.name == "overflow" for e in of_kind(msgs, "event"))


# torchrun's report after rank 0 failed and rank 1 outlived the SIGTERM it was sent (copied from a real
# launcher.log of this suite, torch 2.13): the SIGKILL is torchrun's own, not the kernel's OOM killer.
_FORCED_LOG = """\
W1201 03:18:37.731000 3327 torch/distributed/elastic/multiprocessing/api.py:1028] Sending process 3333 closing signal SIGTERM
W1201 03:19:07.732000 3327 torch/distributed/elastic/multiprocessing/api.py:1047] Unable to shutdown process 3333 via 15, forcefully exiting via 9
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
shardconsole.backends FAILED
------------------------------------------------------------
Failures:
[1]:
  time      : 2026-12-01_03:19:07
  host      : localhost
  rank      : 1 (local_rank: 1)
  exitcode  : -9 (pid: 3333)  (SIGKILL)
  error_file: <N/A>
  traceback : Signal 9 (SIGKILL) received by PID 3333
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-12-01_03:18:37
  host      : localhost
  rank      : 0 (local_rank: 0)
  exitcode  : 1 (pid: 3332)
  error_file: <N/A>
  traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html
============================================================
"""


def test_a_rank_torchrun_killed_itself_is_not_the_oom_killer(tmp_path):
    from shardconsole.session.outcome import killed_rank
    (tmp_path / "launcher.log").write_text(_FORCED_LOG)
    assert killed_rank(tmp_path) is None
    # the same report without torchrun's own kill: a SIGKILL from outside, the kernel's OOM killer's mark
    (tmp_path / "launcher.log").write_text(_FORCED_LOG.replace("Unable to shutdown process 3333", "(none)"))
    assert killed_rank(tmp_path) == (1, 9)
