"""The headless front end's pure pieces: the step line, the OOM advice, torchrun's failure report."""

from __future__ import annotations

from shardconsole import config as C
from shardconsole import headless, plan, preset_store
from shardconsole import protocol as P
from shardconsole.models import resolve
from shardconsole.runstate import RunState


def test_step_line_has_every_figure():
    st = RunState()
    st.apply(P.Memory(rank=0, reserved_bytes=3 * 2**30, peak_reserved_bytes=4 * 2**30, host_rss_bytes=1))
    st.apply(P.Memory(rank=1, host_rss_bytes=2**30))
    st.apply(P.HostSample(used_bytes=5 * 2**30, total_bytes=64 * 2**30))
    st.apply(P.Step(step=3, steps=10, loss=2.5, lr=1e-4, tokens_per_s=12345, step_s=0.25, mfu=0.5,
                    grad_norm=1.0, loss_scale=1024.0, skipped_steps=2))
    line = headless.step_line(st)
    for part in ("step 3/10", "loss 2.5000", "12.3k tok/s", "0.250 s/step", "mfu 50.0%", "scale 1024 skipped 2",
                 "r0 3.0/4.0G", "r1 rss 1.00G", "host 5.0/64G"):
        assert part in line, line


def test_gpu_oom_advice_comes_from_the_planner(tmp_path, monkeypatch):
    cfg = preset_store.load("3090-fsdp", ["train.micro_batch=32"])
    C.save(cfg, tmp_path / "preset.toml")
    monkeypatch.setattr(plan, "detect_hardware",
                        lambda: plan.Hardware(gpus=1, gpu_memory_bytes=80 * 2**30, host_memory_bytes=128 * 2**30))
    text = headless.fitting_settings(tmp_path)
    assert "24.0 GiB a GPU" in text                 # the run's cap, not the card
    first = text.splitlines()[2]
    sets = [s.split("=", 1) for s in first.split("--set ")[1:]]
    assert sets, text
    fixed = preset_store.load("3090-fsdp", [f"{k}={v.strip()}" for k, v in sets])
    assert plan.estimate(fixed, resolve("1b"),
                         plan.Hardware(gpus=1, gpu_memory_bytes=24 * 2**30, host_memory_bytes=128 * 2**30)).fits


def test_killed_rank_read_from_torchruns_report(tmp_path):
    (tmp_path / "launcher.log").write_text("""Failures:
[1]:
  rank      : 0 (local_rank: 0)
  exitcode  : 1 (pid: 10774)
Root Cause (first observed failure):
[0]:
  rank      : 1 (local_rank: 1)
  exitcode  : -9 (pid: 10775)  (SIGKILL)
""")
    assert headless.killed_rank(tmp_path) == (1, 9)
    (tmp_path / "launcher.log").write_text("rank      : 0 (local_rank: 0)\n  exitcode  : -15 (pid: 1)\n")
    assert headless.killed_rank(tmp_path) is None


def test_follower_of_a_read_only_run_folder_shows_samples_without_writing(tmp_path, monkeypatch):
    """attach --headless on someone else's run (a folder it cannot write) follows the stream; the machine
    samples it would have appended are shown (the host figure in the step lines) instead of written."""
    import io
    from shardconsole.stream import MetricsWriter
    run = tmp_path / "run"
    w = MetricsWriter(run / "metrics.jsonl", "r", 0)
    w.emit(P.Step(run="r", rank=0, step=1, steps=2, loss=3.0, lr=1e-4, tokens_per_s=1.0, step_s=1.0))
    w.close()

    def refuse(*a, **k):
        raise PermissionError(13, "Permission denied")
    from shardconsole import stream
    monkeypatch.setattr(stream, "MetricsWriter", refuse)
    out = io.StringIO()
    f = headless.Follower(run, "r", out)
    f.pump()
    assert not f.samples.writable and "step 1/2" in out.getvalue()
    assert f.state.host is not None      # sampled, kept in memory
    assert len((run / "metrics.jsonl").read_text().splitlines()) == 1     # nothing appended
