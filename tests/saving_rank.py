"""A stand-in rank for tests/test_stop_path.py: says hello, and on SIGTERM says it starts a checkpoint
save (Event stop_save, as the real ranks do) and then takes its time (SAVE_S seconds) before it exits.
Usage: saving_rank.py RUN_DIR SAVE_S"""

import os
import signal
import sys
import time

from shardconsole.runlog import protocol as P
from shardconsole.runlog.stream import MetricsWriter

run_dir, save_s = sys.argv[1], float(sys.argv[2])
w = MetricsWriter(os.path.join(run_dir, "metrics.jsonl"), "run", 0)
stop = []
signal.signal(signal.SIGTERM, lambda *_: stop.append(time.monotonic()))
w.emit(P.Hello(run="run", rank=0, world=1, pid=os.getpid(), host=os.uname().nodename))
while not stop:
    time.sleep(0.02)
if save_s >= 0:
    w.emit(P.Event(run="run", rank=0, name="stop_save", detail="saving step 3 before stopping"))
    time.sleep(save_s)
else:
    time.sleep(3600)        # no save announced, and deaf to SIGTERM: only SIGKILL ends it
