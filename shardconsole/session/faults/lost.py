"""Every rank of a run gone at once, with no end line (issue 65 item 11).

A node that is lost alone leaves its peers to say so (their collectives break: session/outcome's
node_lost). When every node goes at once (the whole allocation lost, every process SIGKILLed) nobody
writes a line, and a front end that only reads the stream (attach, `runs`, `stop` of a Slurm job)
waited for the hang limit, called it a hang or 'unknown', and stop waited out the whole save budget.
What can be known here: this host's ranks, by pid (a rank's pid with its command line); the other
hosts' ranks, by the stream's silence: alive, they would have written their broken collective's
failure within LOST_QUIET_S. So: every rank of this host is gone, and either no rank is elsewhere or
none of them has written for LOST_QUIET_S.

Standard library and the run log only: outcome, the watcher, history and cluster all ask it.
"""

from __future__ import annotations

from pathlib import Path

from shardconsole.launch import process_identity as PI
from shardconsole.runlog import protocol as P
from shardconsole.settings import config as C

LOST_QUIET_S = 20.0
HOST = PI.this_host()


def _alive(hello: P.Hello, run_dir: Path) -> bool:
    """The rank's process runs (its pid with its command line); one this user may not read (another
    user's run, hidepid) is not known gone, so it counts as alive."""
    import psutil
    try:
        if hello.pid <= 0:
            return True         # no pid said: nothing to look at, so not known gone
        if PI.is_rank_of(hello.pid, hello.host or None, run_dir, hello.run):
            return True
        proc = psutil.Process(hello.pid)
        if proc.status() == psutil.STATUS_ZOMBIE:
            return False
        proc.cmdline()          # readable, and not the rank's: the pid was reused
        return False
    except psutil.AccessDenied:
        return True
    except Exception:           # gone (NoSuchProcess), a pid psutil refuses
        return False


def gone(hellos: dict[int, P.Hello], ended: set[int], run_dir: Path, quiet_s: float) -> bool:
    """Whether every rank without an end line is gone: those of this host by pid, those of other hosts by
    quiet_s seconds of silence from every rank (the caller's measure of the stream's last line)."""
    open_ranks = {r: h for r, h in hellos.items() if r not in ended}
    # a hello without a host (an old stream, a test's) is nowhere known: never counted gone by pid
    here = [h for h in open_ranks.values() if h.host == HOST]
    if not open_ranks or not here or any(_alive(h, Path(run_dir)) for h in here):
        return False
    return len(here) == len(open_ranks) or quiet_s >= LOST_QUIET_S


def silent_for(run_dir: Path) -> float:
    """Seconds since any node last wrote to the run's stream (its files' newest modification); a snapshot's
    measure of the silence (`runs`), where a front end following the run measures it itself."""
    import time
    from shardconsole.runlog.runfolder import RunFolder, node_metrics_files
    main = RunFolder(Path(run_dir)).metrics
    times = []
    for f in [main, *node_metrics_files(main)]:
        try:
            times.append(f.stat().st_mtime)
        except OSError:
            pass
    return time.time() - max(times) if times else 0.0


def _settings(run_dir: Path) -> C.RunConfig | None:
    try:
        return C.load(Path(run_dir) / "preset.toml")
    except (OSError, C.ConfigError):
        return None


def continue_hint(run_dir: Path, settings: C.RunConfig | None = None, nodes: int = 1) -> str:
    """How this run continues from its newest complete checkpoint: a Slurm job by its script (`resume`
    alone refuses a run of several nodes), a run of several nodes by each node's command, else here.
    nodes: the hosts its ranks said hello from (the settings unreadable, they still tell several nodes)."""
    settings = settings or _settings(run_dir)
    p = settings.parallel if settings is not None else None
    if p is not None and p.rendezvous == "slurm":
        return f"resubmit its sbatch script, or `shardconsole resume {run_dir} --slurm` writes it again"
    if p is not None and p.nnodes > 1:
        return f"`shardconsole resume {run_dir} --print-command` gives each node's command"
    if p is None and nodes > 1:
        return (f"a resubmit of its sbatch script (`shardconsole resume {run_dir} --slurm` writes it; "
                f"--print-command for nodes started by hand)")
    return f"`shardconsole resume {run_dir}`"


def message(hellos: dict[int, P.Hello], last_step: int, run_dir: Path,
            settings: C.RunConfig | None = None) -> tuple[str, str]:
    """(cause, paragraph) of a run whose ranks all went at once: node_lost on several nodes (the nodes
    lost together), crash on one."""
    settings = settings or _settings(run_dir)
    nodes: dict[str, list[int]] = {}
    for rank, h in sorted(hellos.items()):
        nodes.setdefault(h.host or "?", []).append(rank)
    where = "; ".join(f"rank(s) {', '.join(map(str, ranks))} on {host}" for host, ranks in nodes.items())
    several = len(nodes) > 1 or (settings is not None and settings.parallel.nnodes > 1)
    cause = "node_lost" if several else "crash"
    what = ("the nodes were lost together (killed, rebooted, cut off)" if several else "the node was lost")
    return cause, (f"run failed ({cause}): every rank gone at once with no end line ({where}; last step seen "
                   f"{last_step}): {what}, or every process was killed outright (SIGKILL, scancel "
                   f"--signal=KILL, the OOM killer)\n  try: look at the nodes (dmesg; the Slurm job's state: "
                   f"sacct -j JOB); {continue_hint(run_dir, settings, len(nodes))} continues from the newest complete "
                   f"checkpoint")
