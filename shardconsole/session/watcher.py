"""The one watcher of a run, for both front ends: its stream, the machine samples it appends, the rank
logs' tail, the hang watch and the ranks' pids. No UI: `poll()` returns what it found, the front end
draws it.

When the run has ended is decided here, and the stream comes first: the launcher's exit alone is not
the end, since torchrun may exit while its ranks (each in a session of its own) are still writing their
last lines. The run has ended once the launcher has exited and no rank of this host is alive; the
stream is read once more after that, so the classification sees every line a rank wrote.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from shardconsole.launch import process_identity as PI
from shardconsole.launch.job import RunJob
from shardconsole.settings import config as C
from shardconsole.runlog import protocol as P
from shardconsole.session.faults.hang import SAVE_STALL_S, Watch
from shardconsole.runlog.runfolder import RunFolder, metrics_file_of_host
from shardconsole.runlog.runstate import RunState
from shardconsole.session.logtail import LogTail
from shardconsole.session.network import RendezvousWatch
from shardconsole.session.faults import lost
from shardconsole.session.outcome import DETACHED
from shardconsole.session.rundir import stream_stopped_note
from shardconsole.runlog.stream import MetricsReader, SampleAppender
from shardconsole.runlog.tbevents import Recorder, event_files

HOST = PI.this_host()


class Probes(Protocol):
    def gpu_unavailable(self) -> str:
        """Why there are no GPU samples ("" when there are)."""
    def gpus(self, run: str = "") -> list[P.GpuSample]: ...
    def host(self, rank_pids: Iterable[int] = (), run: str = "") -> P.HostSample: ...


class MachineProbes:
    """NVML and psutil (probes.py). NVML starts on first use, in the caller's thread."""

    def __init__(self) -> None:
        self._gpu: Any = None
        self._lock = threading.Lock()

    def _probe(self) -> Any:
        with self._lock:
            if self._gpu is None:
                from shardconsole.machine.probes import GpuProbe
                self._gpu = GpuProbe()
            return self._gpu

    def gpu_unavailable(self) -> str:
        return self._probe().unavailable

    def gpus(self, run: str = "") -> list[P.GpuSample]:
        return self._probe().sample(run)

    def host(self, rank_pids: Iterable[int] = (), run: str = "") -> P.HostSample:
        from shardconsole.machine.probes import host_sample
        return host_sample(rank_pids, run)


@dataclass
class Tick:
    """What one look at the run found."""
    messages: list[P.Message] = field(default_factory=list)   # stream lines and, read-only, samples
    log_lines: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)            # things to say once (the stream was deleted, ...)
    bad_lines: int = 0
    exit_code: int | None = None       # the launcher's, once it has exited
    ended: bool = False                # the launcher has exited and no rank of this host is alive


def rank_alive(hello: P.Hello, run_dir: Path) -> bool:
    """Whether the process that said hello still runs as this run's rank: its pid on this host, with the
    command line of a rank of this run (a pid reused since by another process is not the rank; a hello
    line forged or replayed names nobody to signal). Never raises."""
    if hello.pid <= 0 or (hello.host and hello.host != HOST):
        return False
    try:
        return PI.is_rank_of(hello.pid, hello.host or None, run_dir, hello.run)
    except Exception:    # a pid psutil refuses
        return False


def _parallel(folder: RunFolder, settings: C.RunConfig | None) -> C.ParallelSettings | None:
    """The run's parallel table: from the settings its session read (settings), else the folder's."""
    if settings is not None:
        return settings.parallel
    try:
        return C.load(folder.preset).parallel
    except (C.ConfigError, OSError):
        return None


def _samples_file(folder: RunFolder, parallel: C.ParallelSettings | None) -> Path:
    """Where this front end appends: metrics.jsonl, or on a run of several nodes a file of this host's
    (a front end on each node samples its machine; no two hosts append to one file)."""
    several = parallel is not None and parallel.nnodes > 1
    return folder.path / metrics_file_of_host(HOST) if several else folder.metrics


class Watcher:
    def __init__(self, job: RunJob, run_dir: Path, run_id: str, probes: Probes | None = None, *,
                 sample_every_s: float = 1.0, look_every_s: float = 1.0, logs: bool = True,
                 hang_timeout_s: float = 0.0, record: bool | None = None, save_stall_s: float = SAVE_STALL_S,
                 settings: C.RunConfig | None = None) -> None:
        """record: write the run's TensorBoard events as the stream grows (tbevents.py); by default the
        front end that samples the machine for the run (`probes`) records it too. settings: the run
        folder's, as the session read them (None: read here)."""
        self.job = job
        self.folder = RunFolder(Path(run_dir))
        self.run_id = run_id
        self.probes = probes
        self.sample_every_s, self.look_every_s = sample_every_s, look_every_s
        self.state = RunState()
        self.reader = MetricsReader(self.folder.metrics)
        parallel = _parallel(self.folder, settings)
        self.samples = SampleAppender(_samples_file(self.folder, parallel), run_id)
        self.logs = LogTail(self.folder.path) if logs else None
        self.watch = Watch(timeout_s=hang_timeout_s, save_stall_s=save_stall_s)
        self.exit_code: int | None = None
        self.ended = False
        self.foreign_lines = 0
        self.session = run_id          # the run id whose finished/failed lines end the run
        # resumed sessions' run ids: the folder's name now, and (renamed or copied since) its first session's
        self._resumed_prefix: tuple[str, ...] = (f"{self.folder.run_id}-resume-",)
        self._first_id = self.folder.run_id       # the first session's run id (another after a copy or rename)
        self._sessions: set[str] = set()
        self._own = job.rc_known and not job.external      # our child: poll() is one waitpid
        # A node we launched of a run of several nodes: a rendezvous nobody hosts is named while it waits.
        self._rdzv = RendezvousWatch(parallel.rdzv_endpoint, parallel.nnodes, time.monotonic(),
                                     parallel.rdzv_connect_timeout_s) if (
            self._own and parallel is not None and parallel.nnodes > 1 and parallel.rdzv_endpoint) else None
        self._last_look = float("-inf")
        self._last_sample = float("-inf")
        self._said_lost = False
        self._said_orphans = False
        self._notes: list[str] = []
        self._stream_stopped = ""
        self.recorder = Recorder(self.folder.path) if (probes is not None if record is None else record) else None
        self._unrecorded: list[P.Message] = []    # what the reader read since the recorder last followed it
        job.heard([])         # the job's hello lines come from this watcher's reader: it reads no stream itself
        self._said_recorder = False

    @property
    def external(self) -> bool:
        return self.job.external

    @property
    def rank_pids(self) -> list[int]:
        """The pids of this host's ranks, from their hello lines."""
        # a copy first: a stop asks from its own thread while the follower's poll adds hellos
        return [h.pid for h in list(self.state.hellos.values()) if h.pid > 0 and (not h.host or h.host == HOST)]

    def live_ranks(self) -> list[int]:
        return sorted(r for r, h in self.state.hellos.items() if rank_alive(h, self.folder.path))

    def poll(self) -> Tick:
        tick = Tick()
        now = time.monotonic()
        # The launcher is asked before the stream is read, so every line written before it ended is read
        # below. An attached launcher is found by scanning processes: once a second is enough.
        if self.exit_code is None and not self.external and (self._own or now - self._last_look >= self.look_every_s):
            self._last_look = now
            try:
                self.exit_code = self.job.poll()
            except Exception:   # psutil refusing a pid from a hand-edited job.json: treat as gone
                self.exit_code = 0
        tick.messages = self._read()
        if not self.ended:
            self._check_end(tick)
            if self.ended:
                self.reader.check_names()
        if self.probes is not None and self._sampling() and now - self._last_sample >= self.sample_every_s:
            self._last_sample = now
            tick.messages += self._take_samples()
        if self.logs is not None:
            tick.log_lines = self.logs.poll()
        tick.notes += self._notes
        self._notes.clear()
        if self._rdzv is not None and self.exit_code is None:
            if any(h.run == self.run_id for h in self.state.hellos.values()):
                self._rdzv = None          # the ranks have met
            elif line := self._rdzv.look(now):
                tick.notes.append(line)
        if self.reader.lost and not self._said_lost:
            self._said_lost = True
            tick.notes.append(self.reader.lost)
        tick.notes += self.reader.notes
        self.reader.notes.clear()
        if self.recorder is not None:
            self._record(self.recorder, tick)
        tick.ended, tick.exit_code, tick.bad_lines = self.ended, self.exit_code, self.reader.bad_lines
        return tick

    def _record(self, recorder: Recorder, tick: Tick) -> None:
        if not recorder.writing and self.over() and event_files(self.folder.path):
            # Over before this front end began writing (an attach to a finished run): its event file
            # stays as the run left it; `runs --tensorboard` rebuilds one on request.
            recorder.close()
            self.recorder = None
            return
        recorder.follow(self.reader, self._unrecorded)
        self._unrecorded = []
        why = recorder.why_not
        if why and not self._said_recorder and recorder.gave_up:
            self._said_recorder = True
            tick.notes.append(f"no TensorBoard events for this run: {why}")

    def _check_stopped_launcher(self, tick: Tick) -> None:
        """The ranks said how the run ended and are gone, but the launcher does not exit: it is stopped
        (SIGSTOP, a debugger). The run is over; waiting for the launcher hung the front end until SIGCONT."""
        if self.state.finished is None and not self.state.failed:
            return
        try:
            import psutil
            stopped = psutil.Process(int(self.job.pid)).status() in (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP)
        except (psutil.Error, AttributeError, TypeError, ValueError):
            return
        if not stopped or self.live_ranks():
            return
        self.ended = True
        self.exit_code = 0 if self.state.finished is not None and not self.state.failed else 1
        tick.notes.append(f"the launcher (pid {self.job.pid}) is stopped (SIGSTOP): the run ended without it; "
                          f"`kill -CONT {self.job.pid}` lets it exit")

    def _check_end(self, tick: Tick) -> None:
        if self.external:
            # Started elsewhere: its stream says it ended, or every rank is gone without a word (this
            # host's by pid, the others' by silence: session/faults/lost.py) where it waited for the hang limit.
            if self.state.finished is not None or self.state.failed:
                self.ended = True
                self.exit_code = 0 if self.state.finished is not None and not self.state.failed else 1
            elif self.state.hellos and lost.gone(self.state.hellos, set(), self.folder.path, self.stalled_for()):
                self.ended, self.exit_code = True, 1
            return
        if self.exit_code is None:
            self._check_stopped_launcher(tick)
            return
        live = self.live_ranks()
        if not live:
            tick.messages += self._read()    # the last lines of ranks that ended after their launcher
            self.ended = True
        elif not self._said_orphans and self.exit_code < 0:
            self._said_orphans = True
            tick.notes.append(f"the launcher ended (signal {-self.exit_code}) but rank(s) {live} still run: "
                              f"watching them by pid; a stop reaches them")

    def _read(self) -> list[P.Message]:
        """The stream's new lines, folded into the state (the front end's one reader: the recorder is
        given the same lines, unfiltered)."""
        out = []
        read = self.reader.poll()
        if self.recorder is not None:
            self._unrecorded += read
        self.job.heard([m for m in read if isinstance(m, P.Hello)])
        for msg in read:
            if isinstance(msg, P.Hello) and not self._sessions and self.run_id == self.folder.run_id and not (
                    msg.run == self.session or msg.run.startswith(self._resumed_prefix)):
                # The folder's first session ran under another name: the folder was copied or renamed
                # since (a copied finished run was reported "killed or crashed"). Its lines are this run's.
                self.session = self._first_id = msg.run.split("-resume-")[0]
                # a resume after the rename names its sessions after the folder's new name: both are this run's
                self._resumed_prefix = (f"{self.session}-resume-", f"{self.folder.run_id}-resume-")
            if isinstance(msg, P.Hello) and msg.run not in self._sessions and (
                    msg.run == self.session or msg.run.startswith(self._resumed_prefix)):
                # A session's first hello: what came before (an earlier session's end, a stop asked of
                # it) is history. `shardconsole resume` appends sessions under run ids of their own.
                self._sessions.add(msg.run)
                if msg.run != self._first_id:           # not the first session: forget the earlier ones' end
                    self.state.new_session()
                self.session = msg.run
            if isinstance(msg, (P.Finished, P.Failed)) and msg.run and msg.run != self.session:
                self.foreign_lines += 1     # another run's end in this folder is not this run's end
                continue
            if isinstance(msg, P.Finished) and msg.rank != 0:
                self.foreign_lines += 1
                continue
            self.state.apply(msg)
            out.append(msg)
        return out

    def over(self) -> bool:
        """Whether the run is over as far as the stream and the processes say: ended, or its session's
        finished or failed line read. A front end writes nothing more into the stream of a run that is
        over (an attach to a finished run leaves its metrics.jsonl byte for byte as it was)."""
        return self.ended or self.state.finished is not None or bool(self.state.failed)

    def _sampling(self) -> bool:
        """Whether to sample the machine into the stream now: while the run goes on, and, attached,
        once the history has been read (an attach reads 8 MiB a look: the end of a long finished run
        may still be unread)."""
        return not self.over() and self.reader.caught_up

    def _take_samples(self) -> list[P.Message]:
        """Append a sample of each GPU and of the host to the stream; returned only when the run folder is
        not writable (someone else's run), since otherwise the reader brings them back next time."""
        if self.probes is None:
            return []
        try:
            taken = [*self.probes.gpus(self.run_id), self.probes.host(self.rank_pids, self.run_id)]
        except Exception:   # a probe must never take the watcher down
            return []
        kept = self.samples.append(taken)
        for msg in kept:
            self.state.apply(msg)
        return kept

    def hung(self) -> bool:
        """No step line for longer than the hang limit (during a save: no new byte saved for longer than
        the save's: hang.SAVE_STALL_S), and nothing else explains the silence. A stream
        that stopped because its disk filled up (the ranks say so in their logs) is not a hang: the ranks
        may be training on, so they are watched by pid and never killed for it."""
        if not self.watch.hung(self.state, time.monotonic()):
            return False
        if not self._stream_stopped:
            self._stream_stopped = stream_stopped_note(self.folder.path)
            if self._stream_stopped:
                self._notes.append(f"{self._stream_stopped}; no step lines can arrive, so the run is watched "
                                   f"by its ranks' pids and not judged hung")
        return not self._stream_stopped

    def stalled_for(self) -> float:
        return self.watch.stalled_for(time.monotonic())

    def note(self, name: str, detail: str) -> None:
        """An event line of the front end's (rank -1) in the run's stream; nothing when it is read-only,
        nor once the run is over (its stream is the record of the run, not of who looked at it since)."""
        if self.over():
            return
        self.samples.append([P.Event(run=self.run_id, rank=-1, name=name, detail=detail)])

    def detach(self, why: str) -> None:
        self.note(DETACHED, f"the front end (pid {os.getpid()}) detached: {why}; the run goes on")

    def close(self) -> None:
        if self.recorder is not None:
            if self.recorder.writing:     # the last lines, when the run ended between two looks
                more, self._unrecorded = self._unrecorded + self.reader.poll(), []
                while more and self.recorder.writing:
                    self.recorder.follow(self.reader, more)
                    more = self.reader.poll()
            self.recorder.close()
        self.samples.close()
        self.reader.close()
