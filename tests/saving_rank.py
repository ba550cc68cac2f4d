"""A stand-in rank. Two uses:

  saving_rank.py RUN_DIR SAVE_S
      tests/test_stop_path.py: says hello, and on SIGTERM says it starts a checkpoint save (Event
      stop_save, as the real ranks do) and then takes its time (SAVE_S seconds) before it exits.
  saving_rank.py RUN_DIR SAVE_S progress|export|stall
      tests/test_save_progress.py: trains 3 steps, then saves as the real ranks do (phase "saving
      checkpoint", protocol.SaveProgress about every SAVE_S / 20 s with its bytes growing, done=True at
      the end, then finished) over SAVE_S seconds; `export` writes the export (what="export") with no
      phase line of its own (the phase stays "training"); `stall` stops the bytes at half and sends the
      same progress line on (a save stuck in its I/O) until it is killed."""

import os
import signal
import sys
import time

from shardconsole.runlog import protocol as P
from shardconsole.runlog.stream import MetricsWriter

run_dir, save_s = sys.argv[1], float(sys.argv[2])
mode = sys.argv[3] if len(sys.argv) > 3 else ""
w = MetricsWriter(os.path.join(run_dir, "metrics.jsonl"), "run", 0)
w.emit(P.Hello(run="run", rank=0, world=1, pid=os.getpid(), host=os.uname().nodename))

if mode:
    w.emit(P.Event(run="run", rank=0, name="phase", detail="training"))
    for step in (1, 2, 3):
        w.emit(P.Step(run="run", rank=0, step=step, steps=3, loss=5.0 - step, step_s=0.01))
    what = "export" if mode == "export" else "checkpoint"
    if mode != "export":
        w.emit(P.Event(run="run", rank=0, name="phase", detail="saving checkpoint"))
    total, ticks, t0 = 84_000_000_000, 20, time.monotonic()
    path = os.path.join(run_dir, "checkpoints", "step_00000003")
    for i in range(1, 10**6):
        done_part = min(i, ticks // 2) if mode == "stall" else min(i, ticks)
        w.emit(P.SaveProgress(run="run", rank=0, step=3, what=what, written_bytes=total * done_part // ticks,
                              total_bytes=total, elapsed_s=time.monotonic() - t0, path=path))
        if done_part == ticks:
            break
        time.sleep(save_s / ticks)
    w.emit(P.SaveProgress(run="run", rank=0, step=3, what=what, written_bytes=total, total_bytes=total,
                          elapsed_s=time.monotonic() - t0, path=path, done=True))
    w.emit(P.Event(run="run", rank=0, name="phase", detail="finished"))
    w.emit(P.Finished(run="run", rank=0, steps=3))
    sys.exit(0)

stop = []
signal.signal(signal.SIGTERM, lambda *_: stop.append(time.monotonic()))
while not stop:
    time.sleep(0.02)
if save_s >= 0:
    w.emit(P.Event(run="run", rank=0, name="stop_save", detail="saving step 3 before stopping"))
    time.sleep(save_s)
else:
    time.sleep(3600)        # no save announced, and deaf to SIGTERM: only SIGKILL ends it
