"""One run as a front end holds it: started here, attached to, or resumed; with the folder's settings,
its one watcher, the hang policy and the stop. headless.py and the console's run screen render its
ticks; neither reads the run folder's preset.toml, starts a launcher or stops one itself.

The folder's settings are read once, when the session begins (a started or resumed run: the settings
just written for its ranks), and carried as data: a preset.toml edited or damaged while the run goes on
changes nothing a front end shows or how the session judges a hang or waits on a stop.

Each front end runs its own pre-launch checks first (session/preflight: the model folder, the data, the
GPUs, host RAM, disk), since they answer differently: --headless refuses (unless --force), the console
asks. The checks that only refuse (a fixed port in use, an unwritable folder) are start's.
No UI, no torch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from shardconsole.launch.job import Job, RunJob, StopReport, open_run
from shardconsole.launch.owner import owning
from shardconsole.runlog.runfolder import RunFolder
from shardconsole.runlog.runstate import RunState
from shardconsole.session import checkpoint_owner, rundir
from shardconsole.session.faults.hang import SAVE_STALL_S, hang_message, where_ranks_are
from shardconsole.session.outcome import DEFAULT_STOP_SAVE_TIMEOUT_S, classify
from shardconsole.session.stop import Hurry, stop_run
from shardconsole.session.watcher import Probes, Tick, Watcher
from shardconsole.settings import config as C
from shardconsole.settings.resolve import Resolved

StopWith = Callable[..., StopReport]     # stop_run's signature: (job, rank_pids, *, who, grace_s, hurry, save_timeout_s)


@dataclass(frozen=True)
class Hang:
    """A run judged hung: where its ranks are, and whether this session may stop it (a run started
    elsewhere, by --print-command or --slurm, is not stopped from here)."""
    message: str
    stalled_s: float
    stoppable: bool


def folder_settings(folder: RunFolder) -> C.RunConfig | None:
    """The run folder's settings; None when preset.toml cannot be read now (the session then goes by the
    defaults: the hang limit automatic, the stop's save wait the default; the ranks say what is wrong)."""
    try:
        return C.load(folder.preset)
    except (C.ConfigError, OSError):
        return None


class RunSession:
    """A run and the one watcher that follows it. `job` is a launch.RunJob: a Job (started here, or
    attached to through job.json), an ExternalJob (started elsewhere: only its stream says when it
    ended), or a stand-in with its own stop_with (tests)."""

    def __init__(self, job: RunJob, run_dir: Path, run_id: str = "", *, settings: C.RunConfig | None = None,
                 started_here: bool = False, stop_with: StopWith = stop_run) -> None:
        """run_id: the session's own id (a resume's); the folder's name otherwise. settings: what the
        caller just wrote to preset.toml (not read again); else the folder's, read here, once."""
        self.job = job
        self.folder = RunFolder(Path(run_dir))
        self.run_id = run_id or self.folder.run_id
        self.settings = settings if settings is not None else folder_settings(self.folder)
        self.started_here = started_here
        self.watcher: Watcher | None = None
        self._stop_with = stop_with
        self._hang_said = False

    # -- the ways a session begins ---------------------------------------------------------------

    @classmethod
    def start(cls, resolved: Resolved, run_dir: Path, *, explicit: bool = True) -> "RunSession":
        """A new run: a fixed master_port in use or an unwritable run/checkpoint folder refused (one line
        naming the key's source), the folder made and claimed by rundir.create_run_dir (a default name
        taken meanwhile gets the next suffix; every relative path in preset.toml made absolute), the
        preset's name recorded for `runs`, then the launcher started. explicit: run_dir was named by
        the user (--run-dir): a folder holding a run is refused instead of suffixed."""
        cfg = resolved.cfg
        rundir.check_port_free(cfg, resolved.origin)
        rundir.check_writable(cfg, run_dir, resolved.origin)
        checkpoint_owner.check(cfg, run_dir, resolved.origin("train", "checkpoint_dir"), new_run=True,
                               export_source=resolved.origin("train", "export_dir"))
        checkpoint_owner.check_run_dir(run_dir, f"--run-dir {run_dir}" if explicit else str(run_dir))
        run_dir = rundir.create_run_dir(cfg, run_dir, explicit=explicit)
        checkpoint_owner.claim(cfg, run_dir)       # a train.checkpoint_dir outside it names this run now
        RunFolder(run_dir).write_origin(resolved.preset)      # the preset's name for `runs` and `compare`
        return cls.launch(rundir.anchor_paths(cfg), run_dir, run_dir.resolve().name)

    @classmethod
    def launch(cls, cfg: C.RunConfig, run_dir: Path, run_id: str) -> "RunSession":
        """The launcher started in a folder already made for these settings (create_run_dir, a
        resume's preparation); cfg is what its preset.toml holds."""
        return cls(Job.start(cfg, run_dir, run_id), run_dir, run_id, settings=cfg, started_here=True)

    @classmethod
    def attach(cls, run_dir: Path) -> "RunSession":
        """A run started earlier, by this machine (job.json) or elsewhere (its stream alone). ValueError
        with a one-line reason for a folder that is not a run's."""
        run_dir = Path(run_dir).expanduser()
        return cls(open_run(run_dir), run_dir)

    @classmethod
    def resume(cls, run_dir: Path, overrides: list, *,
               check: Callable[[C.RunConfig, str], None] | None = None,
               before_launch: Callable[[C.RunConfig], None] | None = None, who: str = "`shardconsole resume`"
               ) -> "RunSession":
        """An ended run continued in its own folder (session/resume.py: newest complete checkpoint,
        train.resume on). The folder's owner from the preparation to the launch, which hands the lock
        to the launcher, so a second resume meanwhile is refused in one line. check: a last refusal of
        the settings (the free disk); before_launch: shown the settings to resume with (the schedule)."""
        from shardconsole.session.resume import prepare_resume, resume_run_id
        with owning(Path(run_dir), who):
            cfg = prepare_resume(run_dir, overrides, check=check)
            if before_launch is not None:
                before_launch(cfg)
            return cls.launch(cfg, Path(run_dir), resume_run_id(run_dir))

    # -- what it is ------------------------------------------------------------------------------

    @property
    def run_dir(self) -> Path:
        return self.folder.path

    @property
    def external(self) -> bool:
        """Started on other machines: no process here to stop; its end read from the stream."""
        return self.job.external

    @property
    def rc_known(self) -> bool:
        """Whether the launcher's exit code is known here (not when attached: we are not its parent)."""
        return self.job.rc_known

    @property
    def state(self) -> RunState:
        return self.watcher.state if self.watcher is not None else RunState()

    @property
    def hang_timeout_s(self) -> float:
        return self.settings.train.hang_timeout_s if self.settings is not None else 0.0

    @property
    def stop_save_timeout_s(self) -> float:
        return (float(self.settings.train.stop_save_timeout_s) if self.settings is not None
                else DEFAULT_STOP_SAVE_TIMEOUT_S)

    # -- following it ----------------------------------------------------------------------------

    def watch(self, probes: Probes | None = None, *, logs: bool = True, look_every_s: float = 1.0,
              sample_every_s: float = 1.0, record: bool | None = None, save_stall_s: float = SAVE_STALL_S) -> Watcher:
        """The session's one watcher (session/watcher.py): probes, when given, sample the machine into
        the stream (and the TensorBoard events are recorded: record)."""
        if self.watcher is not None:
            raise RuntimeError(f"run {self.run_id}: the session is watched already")
        self.watcher = Watcher(self.job, self.run_dir, self.run_id, probes, logs=logs, look_every_s=look_every_s,
                               sample_every_s=sample_every_s, record=record, save_stall_s=save_stall_s,
                               hang_timeout_s=self.hang_timeout_s, settings=self.settings)
        return self.watcher

    def tick(self) -> Tick:
        """One look at the run (watch() first)."""
        assert self.watcher is not None, "watch() first"
        return self.watcher.poll()

    def hang(self) -> Hang | None:
        """The hang policy: once the watcher judges the run hung (session/faults/hang.Watch: no step for 20x a
        step, or train.hang_timeout_s; a save's bytes count as progress), each of this host's live
        ranks is asked where it is (SIGUSR1, the flight recorder), once a session. A run started
        elsewhere is diagnosed from its stream alone: its ranks are not ours to signal."""
        if self._hang_said or self.watcher is None or not self.watcher.hung():
            return None
        self._hang_said = True
        w = self.watcher
        stalled = w.stalled_for()
        if self.external:
            return Hang(hang_message(w.state, {}, stalled), stalled, stoppable=False)
        stacks = where_ranks_are(w.state, self.run_dir, w.live_ranks())
        return Hang(hang_message(w.state, stacks, stalled), stalled, stoppable=True)

    def outcome(self) -> tuple[str, str]:
        """(cause, message) of the ended run (session/outcome.classify): "ok" with a summary."""
        rc = self.watcher.exit_code if self.watcher is not None and self.rc_known else None
        return classify(self.state, rc, self.run_dir, settings=self.settings)

    def stop(self, who: str, *, grace_s: float = 10.0, hurry: Hurry | None = None) -> StopReport:
        """The one stop path (session/stop.stop_run): who asked written into the stream, SIGTERM to every
        verified process of the run, the wait for a save on stop, SIGKILL after the grace."""
        pids = self.watcher.rank_pids if self.watcher is not None else []
        return self._stop_with(self.job, pids, who=who, grace_s=grace_s, hurry=hurry or Hurry(),
                               save_timeout_s=self.stop_save_timeout_s)

    def detach(self, why: str) -> None:
        """The front end goes, the run does not: said in the stream."""
        if self.watcher is not None:
            self.watcher.detach(why)

    def close(self) -> None:
        if self.watcher is not None:
            self.watcher.close()

