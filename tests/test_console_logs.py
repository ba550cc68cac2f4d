"""What the run screen's Logs panel and the stop report say: torchrun's lines tidied, its traceback on a
stop folded into one line (a real traceback kept whole), the stream's phases and op builds as lines, the
launcher named in the stop report, and where DeepSpeed's JIT builds go (torch's own rule)."""

from __future__ import annotations

import time

from shardconsole.runlog import protocol as P
from shardconsole.console.runview import RunView, log_line
from shardconsole.session.logtail import LogTail
from shardconsole.session.stop import StopOutcome, describe_stop

GLOG = "W1201 04:47:51.591000 23777 torch/distributed/elastic/agent/server/api.py:753] "
FRAMES = ('  File "/x/torch/distributed/run.py", line 1019, in run\n    elastic_launch(\n'
          '  File "/x/torch/distributed/elastic/multiprocessing/api.py", line 86, in _terminate_process_handler\n'
          '    raise SignalException(f"Process {os.getpid()} got signal: {sigval}", sigval=sigval)\n')
# What torchrun writes to launcher.log when it gets SIGTERM (torch 2.13): the signal traceback, chained.
STOPPED = (f"{GLOG}\n{GLOG}*****************************************\n"
           f"{GLOG}Received 15 death signal, shutting down workers\n"
           "Traceback (most recent call last):\n" + FRAMES +
           "torch.distributed.elastic.multiprocessing.api.SignalException: Process 23777 got signal: 15\n\n"
           "During handling of the above exception, another exception occurred:\n\n"
           "Traceback (most recent call last):\n" + FRAMES +
           "torch.distributed.elastic.multiprocessing.api.SignalException: Process 23777 got signal: 15\n")
CRASH = ("Traceback (most recent call last):\n"
         '  File "/x/shardconsole/backends/fsdp.py", line 10, in train\n    loss.backward()\n'
         "RuntimeError: CUDA error: an illegal memory access was encountered\n")


def test_a_stop_is_one_line_and_a_crash_stays_whole(tmp_path):
    (tmp_path / "logs").mkdir()
    (tmp_path / "launcher.log").write_text(STOPPED)
    (tmp_path / "logs" / "rank0.log").write_text("[W1201 05:18:22.839261287 Utils.hpp:137] Warning: c10 says\n"
                                                 "[rank 0] before\n" + CRASH + "[rank 0] after\n")
    lines = LogTail(tmp_path).poll()
    launch = [line.split("│ ", 1)[1] for line in lines if line.startswith("launch")]
    assert launch == ["W Received 15 death signal, shutting down workers",
                      "torchrun (pid 23777) got SIGTERM and shut its workers down: a stop, not a crash "
                      "(its traceback is in launcher.log)"]
    rank0 = [line.split("│ ", 1)[1] for line in lines if line.startswith("    r0")]
    assert rank0 == ["W Warning: c10 says", "[rank 0] before", *CRASH.splitlines(), "[rank 0] after"]


def test_a_stream_line_a_rank_also_logs_is_not_shown_as_json(tmp_path):
    """Rank 0 writes its finished line to its log too (for a stream deleted later); the panel, which shows the
    end in words from the stream, showed it as raw JSON under "finished: 30 steps"."""
    (tmp_path / "logs").mkdir()
    done = P.encode(P.Finished(run="r", rank=0, t=1.0, steps=30, elapsed_s=16.0, tokens=30720))
    (tmp_path / "logs" / "rank0.log").write_text(f"[rank 0] loss: chunked\n{done}\n[rank 0] after\n")
    rank0 = [line.split("│ ", 1)[1] for line in LogTail(tmp_path).poll() if line.startswith("    r0")]
    assert rank0 == ["[rank 0] loss: chunked", "[rank 0] after"]


def test_a_traceback_written_in_pieces_is_judged_when_it_ends(tmp_path):
    log = tmp_path / "launcher.log"
    first, rest = STOPPED.split("During handling")
    log.write_text(first[:first.index("SignalException") - 50])        # cut inside the frames
    tail = LogTail(tmp_path)
    assert not any("Traceback" in line or "File" in line for line in tail.poll())
    log.write_text(STOPPED)
    assert [line for line in tail.poll() if "torchrun (pid 23777) got SIGTERM" in line]
    assert not any("Traceback" in line or "During" in line for line in tail.poll())


def test_the_stream_says_phases_op_builds_and_warnings_in_the_logs():
    t = time.time()
    said = [log_line(m) for m in (
        P.Event(rank=0, t=t, name="phase", detail="building ops"),
        P.Event(rank=0, t=t, name="op_build", detail="CPUAdam (DeepSpeed JIT, ninja) in /c/cpu_adam: compiling"),
        P.Event(rank=0, t=t, name="warning", detail="fp16 on a CPU"),
        P.Event(rank=-1, t=t, name="stop_requested", detail="the console's s"),
        P.Failed(rank=1, t=t, cause="stopped", message="stopped at step 41; saved it"),
        P.Step(rank=0, t=t, step=1), P.Memory(rank=0, t=t))]
    assert said == ["    r0│ ▸ building ops",
                    "    r0│ ▸ building ops: CPUAdam (DeepSpeed JIT, ninja) in /c/cpu_adam: compiling",
                    "    r0│ warning: fp16 on a CPU", "   run│ stop requested: the console's s",
                    "    r1│ stopped: stopped at step 41; saved it", None, None]
    view = RunView()
    view.apply(P.Event(rank=0, t=t - 83, name="phase", detail="building ops"))
    view.apply(P.Event(rank=0, t=t - 80, name="op_build", detail="CPUAdam"))
    assert view.building == "CPUAdam" and 83 <= view.phase_elapsed_s(time.time()) < 90


def test_the_stop_report_names_the_launcher_and_the_ranks():
    report = StopOutcome(signalled=[100, 201, 202], seconds=1.5, launcher_pid=100, rank_pids=(201, 202))
    assert describe_stop(report).startswith("stopped: the launcher (torchrun, pid 100) and 2 rank(s) "
                                            "(pid 201, 202) ended by SIGTERM in 1.5s; none left")
    report = StopOutcome(signalled=[100, 201, 202, 300], launcher_pid=100, rank_pids=(201, 202))
    assert "and 1 other process(es) of the run" in describe_stop(report)


def test_the_op_build_folder_is_torchs(tmp_path, monkeypatch):
    from torch.utils.cpp_extension import _get_build_directory
    from shardconsole.backends.engine.deepspeed import extension_dir
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    assert str(extension_dir("cpu_adam")) == _get_build_directory("cpu_adam", False)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    assert str(extension_dir("fused_adam")) == _get_build_directory("fused_adam", False)
