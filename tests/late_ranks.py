"""A stand-in launcher for tests/test_headless.py: exits 1 with torchrun's failure dump at once, while its
two "ranks" (sessions of their own, as torchrun starts them) write their `failed nan_loss` lines a moment
later. Usage: late_ranks.py RUN_DIR   (a rank: late_ranks.py RUN_DIR RANK ...)"""

import os
import subprocess
import sys
import time

from shardconsole.runlog import protocol as P
from shardconsole.runlog.stream import MetricsWriter

run_dir = sys.argv[1]
if len(sys.argv) > 2:
    rank = int(sys.argv[2])
    w = MetricsWriter(os.path.join(run_dir, "metrics.jsonl"), "run", rank)
    w.emit(P.Hello(run="run", rank=rank, world=2, pid=os.getpid(), host=os.uname().nodename))
    time.sleep(1.5)
    w.emit(P.Failed(run="run", rank=rank, cause="nan_loss", message="loss is nan at step 2", step=2))
    sys.exit(1)

# The ranks' command lines carry what a real rank's does (`-m` the worker module, --run-id, --run-dir): the
# front end recognises a live rank by it (process_identity.is_rank_of), never by its pid alone.
ranks = [subprocess.Popen([sys.executable, __file__, run_dir, str(r), "-m", "shardconsole.backends", "--run-id", "run",
                           "--run-dir", run_dir], start_new_session=True) for r in (0, 1)]
metrics = os.path.join(run_dir, "metrics.jsonl")
deadline = time.monotonic() + 60
while time.monotonic() < deadline:      # both hellos written: the front end knows the ranks' pids
    if os.path.exists(metrics) and open(metrics).read().count('"kind":"hello"') >= 2:
        break
    time.sleep(0.02)
with open(os.path.join(run_dir, "launcher.log"), "a") as fh:
    fh.write("torch.distributed.elastic.multiprocessing.errors.ChildFailedError:\nRoot Cause (first observed "
             "failure):\n[0]:\n  rank      : 0 (local_rank: 0)\n  exitcode  : 1 (pid: 1)\n")
sys.exit(1)
