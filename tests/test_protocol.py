"""The metrics stream: codec round-trips, size bound, and a reader that survives garbage."""

from __future__ import annotations

import json
import math

import pytest

from shardconsole.runlog import protocol as P
from shardconsole.runlog.stream import MetricsReader, MetricsWriter

SAMPLES = [
    P.Hello(run="r", rank=1, world=2, local_rank=1, host="h", pid=42, device="cuda:1", gpu_name="H200",
            backend="fsdp", n_params=123),
    P.Step(run="r", rank=0, step=5, steps=10, loss=2.5, lr=1e-4, grad_norm=0.7, tokens_per_s=1e5,
           samples_per_s=50.0, step_s=0.3, mfu=0.5, loss_scale=65536.0, skipped_steps=2, tokens=1000),
    P.Step(run="r", rank=0, step=1, loss=None, loss_scale=None, mfu=None),
    P.Step(run="r", rank=0, step=2, loss=0.69, reward_chosen=0.25, reward_rejected=-0.5, reward_margin=0.75,
           pref_accuracy=0.875),
    P.Memory(run="r", rank=0, step=5, allocated_bytes=1, reserved_bytes=2, peak_reserved_bytes=3,
             peak_allocated_bytes=2, host_rss_bytes=4, device_index=0),
    P.Memory(run="r", rank=1, step=5, host_rss_bytes=4),
    P.Event(run="r", rank=0, name="phase", detail="training", step=3),
    P.Finished(run="r", rank=0, steps=10, elapsed_s=3.0, tokens=99),
    P.Failed(run="r", rank=1, cause="gpu_oom", message="CUDA out of memory", exc_type="OutOfMemoryError",
             traceback_tail="...", step=4, hint="lower micro_batch"),
    P.GpuSample(run="r", index=0, name="H200", used_bytes=5, total_bytes=10, util_pct=99.0, pids=(1, 2)),
    P.GpuSample(run="r", index=1, name="RTX 4090", uuid="GPU-8f3a", temp_c=81.0, power_w=431.5, power_limit_w=450.0,
                sm_clock_mhz=2520.0, sm_clock_max_mhz=3105.0, throttle=("sw_power_cap", "sw_thermal"),
                pcie_rx_bps=1.2e10, pcie_tx_bps=None),
    P.OffloadTiming(run="r", rank=1, step=10, steps=5, step_s=1.3, gpu_s=0.4, host_step_s=0.7, h2d_s=0.1,
                    d2h_s=None, h2d_bytes=3, pinned_bytes=7, verdict="host step bound", hint="raise train.grad_accum"),
    P.HostSample(run="r", used_bytes=5, total_bytes=10, ranks_rss_bytes=3, pinned_bytes=None),
    P.Eval(run="r", rank=0, step=10, loss=2.25, tokens=4096, seconds=1.5),
    P.Eval(run="r", rank=0, step=10, loss=0.6, tokens=512, seconds=0.5, pairs=16, reward_chosen=0.1,
           reward_rejected=-0.3, reward_margin=0.4, pref_accuracy=0.75),
    P.SaveProgress(run="r", rank=0, step=60, what="model", written_bytes=12_300_000_000,
                   total_bytes=84_000_000_000, elapsed_s=9.0, path="/runs/x/checkpoints/step_60", done=False),
    P.DataSummary(run="r", rank=0, source="corpus.jsonl", format="chat", tokenizer="my-llama", template="chatml",
                  records=12, tokens=3000, samples=46, loss_share=0.4, epochs=1.5, eval_records=2,
                  eval_samples=3, cross_document_attention=False, note="n"),
]


@pytest.mark.parametrize("msg", SAMPLES, ids=lambda m: m.kind)
def test_round_trip(msg):
    line = P.encode(msg)
    assert "\n" not in line and len(line.encode()) <= P.MAX_LINE
    body = json.loads(line)
    assert body["v"] == P.VERSION and body["kind"] == msg.kind
    assert P.decode(line) == msg


def test_every_kind_has_a_sample():
    assert {m.kind for m in SAMPLES} == set(P.KINDS)


def test_nan_loss_travels():
    back = P.decode(P.encode(P.Step(run="r", step=3, loss=float("nan"))))
    assert math.isnan(back.loss)


def test_oversized_text_is_cut_to_fit():
    msg = P.Failed(run="r", rank=0, message="x" * 10_000, traceback_tail="y" * 10_000)
    line = P.encode(msg)
    assert len(line.encode()) <= P.MAX_LINE
    back = P.decode(line)
    assert back.cause == "crash" and back.message.startswith("xxx") and back.traceback_tail.endswith("yyy")


@pytest.mark.parametrize("bad", [
    "", "not json", "[1,2]", '{"v": 99, "kind": "step"}', '{"v": 1, "kind": "nope"}',
    '{"v": 1, "kind": "step", "step": "five"}', '{"v": 1, "kind": "memory", "rank": true}',
    '{"v": 1, "kind": "step", "loss": "high"}', "{" * 5000, b"\xff\xfe",
    # issue 22 item 4: each of these once passed decode and crashed a front end further on
    '{"v": 1, "kind": "step", "lr": null}', '{"v": 1, "kind": "hello", "pid": -1}',
    '{"v": 1, "kind": "step", "tokens_per_s": "fast"}', '{"v": 1, "kind": "gpu", "pids": [1, "x"]}',
    '{"v": 1, "kind": "gpu", "util_pct": [1]}', '{"v": 1, "kind": "host", "pinned_bytes": 1.5}',
    '{"v": 1, "kind": "eval", "loss": {}}', '{"v": 1, "kind": "data", "loss_share": "most"}',
    '{"v": 1, "kind": "data", "cross_document_attention": 1}', '{"v": 1, "kind": "finished", "elapsed_s": null}',
    '{"v": 1, "kind": "memory", "host_rss_bytes": -5}', '{"v": 1, "kind": "event", "step": 2.5}',
])
def test_decode_rejects_garbage(bad):
    with pytest.raises(P.DecodeError):
        P.decode(bad)


def test_reader_follows_partial_lines_and_counts_bad_ones(tmp_path):
    path = tmp_path / "metrics.jsonl"
    w = MetricsWriter(path, "r", 0)
    w.emit(SAMPLES[1])
    reader = MetricsReader(path)
    assert reader.poll() == [SAMPLES[1]]
    line = P.encode(SAMPLES[5])
    with open(path, "a") as fh:
        fh.write("garbage\n" + line[:10])        # a writer caught mid-line
    assert reader.poll() == []
    assert reader.bad_lines == 1
    with open(path, "a") as fh:
        fh.write(line[10:] + "\n" + "z" * 9000 + "\n")
    assert reader.poll() == [SAMPLES[5]]
    assert reader.bad_lines == 2
    assert MetricsReader(tmp_path / "absent.jsonl").poll() == []


def test_writer_on_a_full_disk_drops_and_counts_never_raises(tmp_path):
    full = MetricsWriter("/dev/full")       # every write fails with ENOSPC, as on a full disk
    full.emit(SAMPLES[0])
    full.emit(SAMPLES[1])
    assert full.dropped == 2
    w = MetricsWriter(tmp_path / "m.jsonl")
    w.close()
    w.emit(SAMPLES[0])      # closed: nothing written
    assert (tmp_path / "m.jsonl").read_bytes() == b""


def test_every_numeric_field_is_type_checked():
    """Each int/float field of each kind, given a string, makes the line a bad line (not a crash later)."""
    checked = 0
    for kind, types in P._TYPES.items():
        for name, annotation in types.items():
            if annotation.split(" |")[0] in ("int", "float"):
                with pytest.raises(P.DecodeError, match=name):
                    P.decode(json.dumps({"v": 1, "kind": kind, name: "12"}))
                checked += 1
    assert checked > 40


def test_a_20_mib_line_is_one_bad_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    reader = MetricsReader(path)
    with open(path, "wb") as fh:
        fh.write(b"x" * (20 << 20) + b"\n" + P.encode(SAMPLES[1]).encode() + b"\n")
    got = []
    for _ in range(5):
        got += reader.poll()
    assert got == [SAMPLES[1]]
    assert reader.bad_lines == 1


def _deleted_mid_run(path):
    """A stream read once, then deleted while its rank writes on: (the writer, the reader), one line
    waiting in the open file."""
    w = MetricsWriter(path, "r", 0)
    w.emit(SAMPLES[1])
    reader = MetricsReader(path)
    assert reader.poll() == [SAMPLES[1]]
    path.unlink()
    w.emit(SAMPLES[5])
    return w, reader


def test_reader_keeps_reading_a_deleted_stream(tmp_path):
    """Deleting metrics.jsonl mid-run: the ranks write on through their open descriptors, and so the
    reader reads on, saying once that the name is gone (issue 22 item 14)."""
    w, reader = _deleted_mid_run(tmp_path / "metrics.jsonl")
    assert reader.poll() == [SAMPLES[5]]
    assert reader.poll() == [] and "deleted" in reader.lost
    w.close()


def test_a_reader_that_never_catches_up_still_sees_the_name_go(tmp_path, monkeypatch):
    """A slow front end on a loaded machine finds new lines at every poll up to the run's end (CI at
    bedd844: no 'was deleted' said). The name is looked at on a clock as well, and once more at the end."""
    from shardconsole.runlog import stream
    w, reader = _deleted_mid_run(tmp_path / "metrics.jsonl")
    assert reader.poll() == [SAMPLES[5]]
    reader.check_names()                                            # the watcher's last tick
    assert "deleted" in reader.lost
    monkeypatch.setattr(stream, "NAME_EVERY_S", 0.0)
    w2, late = _deleted_mid_run(tmp_path / "other.jsonl")
    assert late.poll() == [SAMPLES[5]] and "deleted" in late.lost
    w.close()
    w2.close()
