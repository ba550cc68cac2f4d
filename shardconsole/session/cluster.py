"""A run of several nodes or of a Slurm job, seen from its shared run folder (issue 32).

- `start_session(run_dir, job_id)`: the Slurm script's first line of work, on the job's first node
  before srun. A folder whose stream already has lines is a resubmitted or requeued job: it turns
  train.resume on (the ranks load the newest complete checkpoint, or start from step 0 when there is
  none) and names a session of its own (`<run id>-resume-<time>-job<id>`, the prefix that attach and
  the watcher follow as a resume), so the earlier session's end is history, not this one's.
- `request_stop(run_dir, session, who)`: a stop through the folder (runfolder.write_stop_request):
  what Slurm's USR1 (the batch script's trap) and `shardconsole stop` of a multi-node run write.
  Every node's ranks look for it at step boundaries and agree on one boundary to save and stop.
- `stop_through_folder(run_dir, err)`: `shardconsole stop` of such a run, from any node: asks, then
  waits for every rank's end line and reports each node.

`python -m shardconsole.session.cluster start RUN_DIR JOB_ID` prints the session id;
`python -m shardconsole.session.cluster stop RUN_DIR SESSION WHO` asks for the stop.
"""

from __future__ import annotations

import shutil
import sys
import time
from pathlib import Path
from typing import TextIO

from shardconsole.launch.job import node_agents
from shardconsole.runlog import protocol as P
from shardconsole.runlog.runfolder import RunFolder, write_stop_request
from shardconsole.runlog.stream import MetricsReader, MetricsWriter
from shardconsole.session import network
from shardconsole.session.faults import lost
from shardconsole.session.outcome import stop_save_timeout
from shardconsole.settings import config as C

PREV_SUFFIX = ".prev"
STOP_REQUESTED = "stop_requested"    # session.outcome's event name: the front ends say "stopped by"
ANSWER_MARGIN_S = 120.0              # past the save budget: a step to reach the boundary, the exit


def _has_history(folder: RunFolder) -> bool:
    try:
        return folder.metrics.stat().st_size > 0
    except OSError:
        return False


def start_session(run_dir: Path, job_id: str, head_node: str = "") -> str:
    """The session id of this job's ranks; a folder with history resumes (see the module's text). A
    stop request left by an earlier job is removed first: it was for a session that has ended. A
    node whose gloo would bind to loopback is refused here, before srun (session/network.py)."""
    folder = RunFolder(Path(run_dir).absolute())
    cfg = C.load(folder.preset)
    network.check_multi_node(cfg, head_node, f"the Slurm job {job_id} (node 0: {head_node})")
    folder.stop_request.unlink(missing_ok=True)
    if not _has_history(folder):
        return folder.run_id
    if not cfg.train.resume:
        shutil.copy2(folder.preset, folder.preset.with_name(folder.preset.name + PREV_SUFFIX))
        cfg.train.resume = True
        C.save(cfg, folder.preset)
    return f"{folder.run_id}-resume-{time.strftime('%Y%m%d-%H%M%S')}-job{job_id}"


def announce(folder: RunFolder, session: str, who: str) -> None:
    """Who stops the run, in the stream before the request (the front ends then say "stopped by")."""
    try:
        w = MetricsWriter(folder.metrics, session, -1)
    except OSError:
        return
    w.emit(P.Event(run=session, rank=-1, name=STOP_REQUESTED, detail=who))
    w.close()


def request_stop(run_dir: Path, session: str, who: str) -> None:
    folder = RunFolder(Path(run_dir))
    announce(folder, session, who)
    write_stop_request(folder.path, session, who)


class _Session:
    """The newest session of a run folder, folded from its stream: each rank's host and its end line."""

    def __init__(self) -> None:
        self._reset()

    def _reset(self) -> None:
        self.run = ""
        self.hosts: dict[int, str] = {}
        self.hellos: dict[int, P.Hello] = {}
        self.world = 0
        self.ends: dict[int, P.Failed | P.Finished] = {}
        self.last_step = 0

    def apply(self, msg: P.Message) -> None:
        if isinstance(msg, P.Hello):
            if msg.run != self.run:
                self._reset()
                self.run = msg.run
            self.hosts[msg.rank], self.world = msg.host, msg.world
            self.hellos[msg.rank] = msg
        elif msg.run != self.run:
            return
        elif isinstance(msg, P.Step):
            self.last_step = max(self.last_step, msg.step)
        elif isinstance(msg, P.Finished):
            self.ends.update({r: msg for r in self.hosts})     # rank 0 says it for the run
        elif isinstance(msg, P.Failed) and msg.rank >= 0:
            self.ends[msg.rank] = msg

    @property
    def ended(self) -> bool:
        return bool(self.world) and len(self.ends) >= self.world

    def by_node(self) -> dict[str, list[int]]:
        out: dict[str, list[int]] = {}
        for rank, host in sorted(self.hosts.items()):
            out.setdefault(host or "?", []).append(rank)
        return out


def _node_lines(s: _Session) -> list[str]:
    lines = []
    for host, ranks in s.by_node().items():
        answered = [r for r in ranks if r in s.ends]
        missing = [r for r in ranks if r not in s.ends]
        words = [f"rank(s) {', '.join(map(str, answered))} ended ({_how(s.ends[answered[0]])})"] if answered else []
        if missing:
            words.append(f"rank(s) {', '.join(map(str, missing))} did not answer (last step seen {s.last_step}): "
                         f"is the node gone? end them there (scancel for a Slurm job)")
        lines.append(f"  node {host}: " + "; ".join(words))
    return lines


def _all_gone(s: _Session, folder: RunFolder, quiet_s: float, err: TextIO, lead: str) -> bool:
    """Every rank without an end line gone (session/faults/lost.py): said, as the run's end, in one paragraph."""
    if not s.hellos or not lost.gone(s.hellos, set(s.ends), folder.path, quiet_s):
        return False
    gone = {r: h for r, h in s.hellos.items() if r not in s.ends}
    print(f"{lead}: {lost.message(gone, s.last_step, folder.path)[1]}", file=err, flush=True)
    return True


def _how(end: P.Failed | P.Finished) -> str:
    if isinstance(end, P.Finished):
        return f"finished, {end.steps} steps"
    return end.message.splitlines()[0] if end.message else end.cause


def stop_through_folder(run_dir: Path, err: TextIO, *, who: str = "", answer_s: float | None = None) -> int:
    """Ask every node's ranks through the run folder, wait for each rank's end line (the save budget and
    a margin), and say how each node ended. 0 once every rank has ended."""
    folder = RunFolder(Path(run_dir))
    s = _Session()
    reader = MetricsReader(folder.metrics)
    try:
        while batch := reader.poll():      # the whole history, 8 MiB at a time
            for msg in batch:
                s.apply(msg)
        agents = node_agents(folder.path)
        if not s.run:
            # Nothing names the session to ask, and nothing of ours runs it here (a usage error: exit 2).
            waiting = f" (node agents: {agents}; still in the rendezvous?)" if agents else ""
            print(f"shardconsole: {folder.path}: a run started elsewhere (--print-command, --slurm or another "
                  f"node) whose ranks have not started (no hello line){waiting}: nothing to stop here; end each "
                  f"node's agent there (Ctrl-C in its front end); for a Slurm job still pending, scancel it",
                  file=err)
            return 2
        if s.ended:
            print(f"nothing to stop: the run has already ended (session {s.run})", file=err)
            return 0
        if _all_gone(s, folder, lost.silent_for(folder.path), err, "nothing to stop"):
            return 0
        budget_s = stop_save_timeout(folder.path)
        wait_s = answer_s if answer_s is not None else budget_s + ANSWER_MARGIN_S
        nodes = s.by_node()
        print(f"stopping {folder.path}: asked every node through {folder.stop_request.name} "
              f"({len(nodes)} node(s): {', '.join(nodes)}{'; agents ' + agents if agents else ''}); waiting up to {wait_s:.0f}s for the ranks to save "
              f"and end", file=err, flush=True)
        request_stop(folder.path, s.run, who or "`shardconsole stop`")
        deadline = heard = time.monotonic()
        deadline += wait_s
        while not s.ended and time.monotonic() < deadline:
            for msg in reader.poll():
                s.apply(msg)
                heard = time.monotonic()
            if _all_gone(s, folder, time.monotonic() - heard, err, "stop ended"):
                return 0        # no rank left to save: waiting out the save budget would wait for nobody
            time.sleep(0.2)       # the ranks look once a second; nothing to wake us sooner
        print(("stopped:" if s.ended else f"stop incomplete after {wait_s:.0f}s:"), file=err)
        print("\n".join(_node_lines(s)), file=err, flush=True)
        return 0 if s.ended else 1
    finally:
        reader.close()


def stops_through_folder(run_dir: Path) -> bool:
    """Whether `shardconsole stop` goes through the folder: a run of several nodes (its signals reach
    only one host) or one started elsewhere (--print-command, --slurm: no job.json of ours)."""
    folder = RunFolder(Path(run_dir))
    if not folder.job.is_file():
        return True
    try:
        return C.load(folder.preset).parallel.nnodes > 1
    except (OSError, C.ConfigError):
        return False


def saved_stop(run_dir: Path, session: str) -> bool:
    """Whether `session` ended as a stop someone asked for (a stop_requested line) after which every rank
    saved: the batch script then exits 0, so that sacct, job e-mails and `afterok` dependencies see a
    COMPLETED job (torchrun's exit of 1 or 143 made it FAILED)."""
    s, asked = _Session(), False
    reader = MetricsReader(RunFolder(Path(run_dir)).metrics)
    try:
        while msgs := reader.poll():
            for msg in msgs:
                if msg.run != session:
                    continue
                s.apply(msg)
                asked = asked or (isinstance(msg, P.Event) and msg.name == STOP_REQUESTED)
    finally:
        reader.close()
    return asked and s.ended and all(isinstance(e, P.Failed) and e.cause == "stopped" and "saved it" in e.message
                                     for e in s.ends.values())


# What Slurm's SIGTERM was for, as `scontrol show job` says it (JobState, then Reason): the signal itself
# is the same for a scancel, the time limit, a requeue and a failed node, and the stream said 'scancel or
# the time limit' of all of them.
_SLURM_WHY = (("NODE_FAIL", "a failed node"), ("NodeFail", "a failed node"), ("NodeDown", "a failed node"),
              ("TIMEOUT", "its time limit"), ("TimeLimit", "its time limit"), ("PREEMPTED", "preemption"),
              ("REQUEUE", "a requeue"), ("CANCELLED", "scancel"))
SIGTERM_MARK = "SIGTERM to job "


def slurm_why(job_id: str) -> str:
    """Why Slurm ends the job, where `scontrol show job` tells; "" where it does not."""
    import subprocess
    try:
        out = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True,
                             timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return ""
    fields = dict(w.split("=", 1) for w in out.split() if "=" in w)
    said = f"{fields.get('JobState', '')} {fields.get('Reason', '')}"
    return next((words for key, words in _SLURM_WHY if key in said), "")


def sigterm_words(who: str, job_id: str) -> str:
    """The batch shell's 'Slurm (SIGTERM to job N; KillWait Ns)' with what the SIGTERM was for, or that
    Slurm did not say (a scancel, the time limit, a requeue or a failed node all send it)."""
    if SIGTERM_MARK not in who or ";" not in who:
        return who
    why = slurm_why(job_id) or "Slurm did not say why: a scancel, the time limit, a requeue or a failed node"
    head, tail = who.split(";", 1)
    return f"{head}: {why};{tail}"


def saved_line(run_dir: Path, session: str) -> str:
    """Our last line in the job's output after a stop that saved: torchrun's own report above it ends in
    'FAILED' and a traceback (its ranks left with a non-zero code on the stop), which is not how it ended."""
    s = _Session()
    reader = MetricsReader(RunFolder(Path(run_dir)).metrics)
    try:
        while msgs := reader.poll():
            for msg in msgs:
                if msg.run == session:
                    s.apply(msg)
    finally:
        reader.close()
    step = max((e.step or 0 for e in s.ends.values() if isinstance(e, P.Failed)), default=0)
    return (f"shardconsole: run {run_dir} stopped as asked at step {step}, every rank saved; torchrun's "
            f"'FAILED' report above is its ranks leaving on the stop, not a failure: the job ends COMPLETED. "
            f"Continue with `sbatch` of the same script, or `shardconsole resume {run_dir} --slurm`")


def main(argv: list[str]) -> int:
    if len(argv) in (3, 4) and argv[0] == "start":
        try:
            print(start_session(Path(argv[1]), *argv[2:]))
        except C.ConfigError as e:       # one line in the job's output; the script ends before srun
            print(f"shardconsole: {e}", file=sys.stderr)
            return 2
        return 0
    if len(argv) == 4 and argv[0] == "stop":
        from shardconsole.envvars import read
        request_stop(Path(argv[1]), argv[2], sigterm_words(argv[3], read("SLURM_JOB_ID")))
        return 0
    if len(argv) == 3 and argv[0] == "saved":
        if not saved_stop(Path(argv[1]), argv[2]):
            return 1
        print(saved_line(Path(argv[1]), argv[2]), flush=True)
        return 0
    print("usage: python -m shardconsole.session.cluster start RUN_DIR JOB_ID | stop RUN_DIR SESSION WHO | "
          "saved RUN_DIR SESSION", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
