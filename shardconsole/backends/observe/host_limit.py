"""memory.host_memory_limit held in the run (issue 60): the host twin of gpu_memory_limit, to rehearse a
64 GB box on a bigger one. The launch refuses a run the planner puts over it (session/preflight.py); this
holds a launched run to it. A host that runs out of memory does not fail cleanly: the kernel's OOM killer
takes a rank mid-step (or the console), and the steps since the last checkpoint are lost. So at every step
boundary the node's first rank sums the resident memory of the node's run (the launcher and its ranks)
and, past HOLD of the limit, asks the run to stop as a stop signal would: every rank agrees at the next
boundary and saves first, and that rank ends with the verdict (cause host_oom, exit 4) naming the limit.
No cgroup: on the machines this runs on (containers, a user without systemd's delegation) one cannot
always be made, and a cgroup's own OOM kill would lose the steps this keeps.
"""

from __future__ import annotations

import contextlib
import os
import time
from typing import Iterator

from shardconsole.backends.rank.common import Rank
from shardconsole.backends.rank.errors import HostLimitReached

HOLD = 0.97           # stop above this share of the limit: the stop's save needs a little room of its own
LOOK_EVERY_S = 1.0    # the /proc reads at most once a second


class _Watch:
    def __init__(self) -> None:
        self.looked_at = float("-inf")
        self.verdict: str | None = None


_watch = _Watch()


def node_rss_bytes() -> int:
    """Resident bytes of the launcher (this rank's parent), its ranks, and every process the ranks started
    (torch.compile's workers) counted by their proportional share (PSS): a worker maps the same torch
    libraries as its rank, and RSS counted those pages once a process. 3090-8b-64gb on the H100: 16
    workers added 5.1 GiB of RSS to 58.5 GiB of ranks, and this watchdog stopped a run the machine held
    in 62.0 GiB, all of it counted (benchmarks/results/issue60)."""
    import psutil
    try:
        launcher = psutil.Process(os.getppid())
        ranks = launcher.children()
        procs = [(launcher, False), *((p, False) for p in ranks),
                 *((c, True) for p in ranks for c in _children(p))]
    except psutil.Error:
        procs = [(psutil.Process(), False)]
    total = 0
    for p, shared in procs:
        try:
            total += _pss(p.pid) if shared else p.memory_info().rss
        except (psutil.Error, OSError):
            continue
    return total


def _children(p) -> list:
    import psutil
    try:
        return p.children(recursive=True)
    except psutil.Error:
        return []


def _pss(pid: int) -> int:
    """A process's proportional set size from /proc/PID/smaps_rollup (its RSS where that file is missing)."""
    try:
        with open(f"/proc/{pid}/smaps_rollup", "rb") as fh:
            for line in fh:
                if line.startswith(b"Pss:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import psutil
    return psutil.Process(pid).memory_info().rss


def check(r: Rank, stop) -> None:
    """The node's first rank at every step boundary, before the stop agreement."""
    if not r.cfg.memory.host_memory_limit or r.local_rank != 0 or _watch.verdict is not None:
        return          # (the text, not its parse: this runs at every step boundary)
    now = time.monotonic()
    if now - _watch.looked_at < LOOK_EVERY_S:
        return
    _watch.looked_at = now
    limit = r.cfg.host_memory_limit_bytes or 0
    used = node_rss_bytes()
    if used <= HOLD * limit:
        return
    gib = 2**30
    _watch.verdict = (f"the run's processes on this node hold {used / gib:.2f} GiB, past {HOLD:.0%} of "
                      f"memory.host_memory_limit ({limit / gib:.2f} GiB)")
    os.write(2, f"shardconsole: host_oom: rank {r.rank}: {_watch.verdict}; stopping at the next step boundary, "
                f"saving first\n".encode())
    stop.local = True       # as a stop signal would: every rank learns it at the next boundary


@contextlib.contextmanager
def verdict(r: Rank) -> Iterator[None]:
    """Around the stop's save: on the rank that found the node over its limit, the stop's end becomes the
    verdict (cause host_oom), after the save; elsewhere unchanged."""
    try:
        yield
    except Exception as e:
        if _watch.verdict is not None and type(e).__name__ != "Stopped":
            # the stop's save failed (a full checkpoint on a disk too small for one): the run still stopped for
            # the host limit, which the failure alone would hide (14B: "disk full" of a run that was never
            # going to save there)
            raise HostLimitReached(f"host memory limit: rank {r.rank}: {_watch.verdict}; the save before stopping "
                                   f"failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}",
                                   HINT + " (the newest earlier one: this stop's save failed)") from e
        if _watch.verdict is None:
            raise
        raise HostLimitReached(f"host memory limit: rank {r.rank}: {_watch.verdict}; {e}", HINT) from None


HINT = ("raise memory.host_memory_limit, or lower what `shardconsole plan` lists under host RAM (micro-batch, "
        "offload, master dtype); `shardconsole resume` continues from the newest complete checkpoint")
