"""The stream as TensorBoard event files: `tensorboard --logdir RUNS_ROOT` shows every run, live.

Written by the front end that watches a run, from the lines it reads anyway (the ranks pay nothing),
and rebuilt from metrics.jsonl for a run that had no front end (`shardconsole attach`,
`shardconsole runs --tensorboard`). The files are written by TensorBoard's own writer
(tensorboard.summary.writer.event_file_writer.EventFileWriter, with its Event/Summary protobufs): the
format's owner keeps its framing, checksums and fields right, and we keep no encoder of our own. It is
imported only when a writer is made, so a front end that records nothing never loads it. No torch
(torch.utils.tensorboard) and no UI here: the session layer's watcher feeds it.

One writer per run: the recorder takes an advisory lock on the run's metrics.jsonl (flock; the ranks
do not lock, so they never wait on it). The writer that gets it rewrites the run's event file from the
whole stream with a reader of its own, then follows it; another front end on the same run writes
nothing until the lock is free. A dead writer's lock is released by the kernel, and the next front end
writes a complete file in its place.
"""

from __future__ import annotations

import fcntl
import os
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from shardconsole.runlog import protocol as P
from shardconsole.runlog.runfolder import RunFolder
from shardconsole.runlog.stream import MetricsReader, read_until

EVENTS_MARK = "tfevents"                    # TensorBoard reads files whose name holds this
SUFFIX = ".shardconsole"                    # ours: only these are replaced on a rebuild
GiB = float(2**30)


# ---------------------------------------------------------------------------------------------------
# What each stream line becomes: (tag, value) pairs, tags named with their units

def scalars(msg: P.Message) -> list[tuple[str, float]]:
    out: list[tuple[str, float | None]] = []
    if isinstance(msg, P.Step):
        out += [("loss/train", msg.loss), ("optim/lr", msg.lr), ("optim/grad_norm", msg.grad_norm),
                ("throughput/tokens_per_s", msg.tokens_per_s), ("throughput/samples_per_s", msg.samples_per_s),
                ("time/step_s", msg.step_s), ("throughput/mfu_pct", None if msg.mfu is None else 100 * msg.mfu)]
        if msg.loss_scale is not None:          # fp16 only: an fp32/bf16 run has no scaler to plot
            out += [("fp16/loss_scale", msg.loss_scale), ("fp16/skipped_steps", msg.skipped_steps)]
        out += _preference("train", msg) + _grpo(msg)
    elif isinstance(msg, P.Eval):
        out.append(("loss/eval", msg.loss))
        out += _preference("eval", msg)
    elif isinstance(msg, P.Memory):
        r = f"memory/rank{msg.rank}"
        out += [(f"{r}_reserved_GiB", _gib(msg.reserved_bytes)), (f"{r}_peak_reserved_GiB", _gib(msg.peak_reserved_bytes)),
                (f"{r}_allocated_GiB", _gib(msg.allocated_bytes)),
                (f"{r}_peak_allocated_GiB", _gib(msg.peak_allocated_bytes)),
                (f"{r}_host_rss_GiB", _gib(msg.host_rss_bytes))]
    elif isinstance(msg, P.GpuSample):
        g = f"gpu/gpu{msg.index}"
        out += [(f"memory/gpu{msg.index}_nvml_used_GiB", _gib(msg.used_bytes)), (f"{g}_util_pct", msg.util_pct),
                (f"{g}_temp_C", getattr(msg, "temp_c", None)), (f"{g}_power_W", getattr(msg, "power_w", None)),
                (f"{g}_sm_clock_MHz", getattr(msg, "sm_clock_mhz", None)),
                (f"pcie/gpu{msg.index}_rx_GBps", _gb(getattr(msg, "pcie_rx_bps", None))),
                (f"pcie/gpu{msg.index}_tx_GBps", _gb(getattr(msg, "pcie_tx_bps", None)))]
    elif msg.kind == "offload":         # where an offloaded step's time goes, per rank
        r = f"offload/rank{msg.rank}"
        out += [(f"{r}_{name}", getattr(msg, name, None)) for name in ("step_s", "gpu_s", "host_step_s", "h2d_s", "d2h_s")]
        out.append((f"{r}_pinned_GiB", _gib(getattr(msg, "pinned_bytes", None))))
    elif isinstance(msg, P.HostSample):
        out += [("host/ram_used_GiB", _gib(msg.used_bytes)), ("host/ranks_rss_GiB", _gib(msg.ranks_rss_bytes)),
                ("host/pinned_GiB", _gib(msg.pinned_bytes))]
    return [(tag, float(v)) for tag, v in out if isinstance(v, (int, float)) and not isinstance(v, bool)]


def _preference(split: str, msg: P.Step | P.Eval) -> list[tuple[str, float | None]]:
    """A DPO / ORPO run's figures (None under SFT: no tag), in TRL's names under our split prefix."""
    return [(f"rewards/{split}_chosen", msg.reward_chosen), (f"rewards/{split}_rejected", msg.reward_rejected),
            (f"rewards/{split}_margin", msg.reward_margin),
            (f"rewards/{split}_accuracy_pct", None if msg.pref_accuracy is None else 100 * msg.pref_accuracy),
            (f"rewards/{split}_kl", getattr(msg, "kl", None))]


def _grpo(msg: P.Step) -> list[tuple[str, float | None]]:
    """A GRPO run's figures (None otherwise: no tag), near TRL's names; each reward function by its name."""
    out = [("reward/mean", msg.reward_mean), ("reward/std", msg.reward_std),
           ("completions/mean_length", msg.completion_len), ("grpo/kl", msg.kl),
           ("grpo/clip_ratio_pct", None if msg.clip_ratio is None else 100 * msg.clip_ratio),
           ("time/generate_s", msg.generate_s),
           ("time/train_s", None if msg.generate_s is None else max(0.0, msg.step_s - msg.generate_s))]
    for name, value in (msg.rewards or {}).items():
        out.append((f"reward/{name.rsplit('/', 1)[-1]}", value))
    return out


def _gib(n: int | None) -> float | None:
    return None if n is None else n / GiB


def _gb(n: float | None) -> float | None:
    return None if n is None else n / 1e9


# ---------------------------------------------------------------------------------------------------
# TensorBoard's own writer, imported when the first writer is made: it brings protobuf and numpy
# (tensorboard.summary's package), a cost the console's start-up does not pay for a run it never records.

def _tensorboard():
    from tensorboard.compat.proto import event_pb2, summary_pb2
    from tensorboard.summary.writer import event_file_writer
    _quiet_writer_thread(event_file_writer._AsyncWriterThread)
    return event_pb2, summary_pb2, event_file_writer.EventFileWriter


def _quiet_writer_thread(thread_cls: type) -> None:
    """The writer's thread keeps what its file raised (a full disk) and hands it back on our next
    add_event or flush, where the recorder says it once; the thread's default print of it (a traceback
    on stderr, under the console's screen) is left out. Every other thread's errors print as before.
    Put back whenever a writer is made, in case someone replaced the hook since."""
    if getattr(threading.excepthook, "quiet_for", None) is thread_cls:
        return
    previous = threading.excepthook

    def hook(args: threading.ExceptHookArgs) -> None:
        if not isinstance(args.thread, thread_cls):
            previous(args)
    hook.quiet_for = thread_cls         # type: ignore[attr-defined]  # a mark on the function: whose hook it is
    threading.excepthook = hook


# ---------------------------------------------------------------------------------------------------
# The writer of one run

class Recorder:
    """Writes a run's event file from its metrics.jsonl as the front end's one reader of it reads it
    (follow): the watcher's, whose lines also feed the panels. It can start at any time with the whole
    history: when the front end that held the run's lock goes, the next follow of another front end's
    recorder takes the lock, reads the history once up to where that reader is, and writes a complete
    file. Never raises: a run folder it cannot write (someone else's) is left alone and `why_not` says why."""

    RETRY_S = 2.0       # how often a recorder without the lock asks for it again

    def __init__(self, run_dir: Path) -> None:
        self.folder = RunFolder(Path(run_dir))
        self.path: Path | None = None
        self.why_not = ""
        self._writer = None
        self._pb: Any = None
        self._lock_fd: int | None = None
        self._gave_up = False
        self._next_try = 0.0
        self._step = 0
        self._session = ""
        self._new_session = False

    @property
    def gave_up(self) -> bool:
        """The folder cannot take the file (unwritable, a full disk): worth saying once."""
        return self._gave_up

    @property
    def writing(self) -> bool:
        """Whether this recorder holds the run's event file (it took the lock and made its file)."""
        return self._writer is not None

    def _still_here(self) -> bool:
        """The locked metrics file is still the one at the folder's path."""
        if self._lock_fd is None:
            return False
        try:
            held, there = os.fstat(self._lock_fd), os.stat(self.folder.metrics)
        except OSError:
            return False
        return (held.st_dev, held.st_ino) == (there.st_dev, there.st_ino)

    def _start(self) -> bool:
        now = time.monotonic()
        if self._gave_up or now < self._next_try:
            return False
        self._next_try = now + self.RETRY_S
        try:
            self._lock_fd = os.open(self.folder.metrics, os.O_RDONLY)
        except FileNotFoundError:
            self.why_not = f"{self.folder.metrics} does not exist yet"      # asked again later
            return False
        except OSError as e:
            return self._give_up(f"{self.folder.metrics}: {e.strerror}")
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self.why_not = "another front end writes this run's TensorBoard file"
            self._release()
            return False
        except OSError as e:
            return self._give_up(f"{self.folder.metrics}: {e.strerror}")
        stale = event_files(self.folder.path)
        if not os.access(self.folder.path, os.W_OK):     # someone else's run: asked once, not per poll
            return self._give_up(f"cannot write TensorBoard events in {self.folder.path}: not writable")
        try:
            event_pb2, summary_pb2, EventFileWriter = _tensorboard()
        except ImportError as e:
            return self._give_up(f"TensorBoard events not written: the tensorboard package is missing ({e}); "
                                 f"pip install tensorboard")
        self._pb = (event_pb2, summary_pb2)
        if not self._still_here():
            # the run folder was renamed or deleted since the look above: TensorBoard's writer would make the
            # old path again (its makedirs), a half folder the next look calls a run
            self.why_not = f"{self.folder.path} is gone (moved or deleted)"
            self._release()
            return False
        try:
            # Its name: events.out.tfevents.<time>.<host>.<pid>.<n> + our suffix; its first record the
            # file version. flush_secs only bounds the thread's own flushes: write() flushes each poll.
            self._writer = EventFileWriter(str(self.folder.path), max_queue_size=1024, flush_secs=5,
                                           filename_suffix=SUFFIX)
        except Exception as e:       # whatever the file raised, handed back by the writer's thread
            return self._give_up(f"cannot write TensorBoard events in {self.folder.path}: {_why(e)}")
        made = [p for p in event_files(self.folder.path) if p not in stale]
        self.path, self.why_not = (made[0] if len(made) == 1 else None), ""
        # Written by a front end that has gone (its lock is free): this file gets the whole stream again.
        for old in stale:
            try:
                old.unlink()
            except OSError:
                pass
        return True

    def _give_up(self, why: str) -> bool:
        self._gave_up, self.why_not = True, why
        self.close()
        return False

    def follow(self, source: MetricsReader, messages: list[P.Message]) -> None:
        """What `source`, the front end's reader of the stream, read last (messages): written. Until this
        recorder holds the run's file they are not its to write; once it takes the lock, the history up
        to where `source` is (this poll's lines included) is read once and written first."""
        if self._writer is not None:
            self.write(messages)
            return
        if not self._start():
            return
        for batch in read_until(source.positions()):
            self.write(batch)

    def write(self, messages: Iterable[P.Message]) -> None:
        if self._writer is None:
            return
        event_pb2, summary_pb2 = self._pb
        events = []

        def scalars_event(t: float, step: int, values: dict[str, float]) -> None:
            # float32, as TensorBoard keeps a scalar; beyond its range protobuf stores an infinity
            summary = summary_pb2.Summary(value=[summary_pb2.Summary.Value(tag=tag, simple_value=v)
                                                 for tag, v in values.items()])
            events.append(event_pb2.Event(wall_time=t, step=step, summary=summary))

        # Consecutive values of one step go out as one Event (64 ranks' memory lines: one record, not 64).
        group: dict[str, float] = {}
        group_t = 0.0
        for msg in messages:
            if isinstance(msg, P.Hello) and msg.run != self._session:
                self._new_session = bool(self._session)
                self._session = msg.run
            values = scalars(msg)
            step = msg.step if isinstance(msg, (P.Step, P.Eval, P.Memory)) or msg.kind == "offload" else self._step
            if group and (step != self._step or any(tag in group for tag, _ in values)):
                scalars_event(group_t, self._step, group)
                group = {}
            if isinstance(msg, P.Step) and self._new_session:
                # A resumed session restarts from its checkpoint: what the earlier one logged past it is
                # not part of this run's curve any more (TensorBoard drops it at a SessionLog START).
                self._new_session = False
                events.append(event_pb2.Event(wall_time=msg.t, step=msg.step, session_log=event_pb2.SessionLog(
                    status=event_pb2.SessionLog.START)))
            self._step = step
            if values:
                group.update(values)
                group_t = msg.t
        if group:
            scalars_event(group_t, self._step, group)
        if not events:
            return
        try:
            for ev in events:
                self._writer.add_event(ev)
            self._writer.flush()     # a live `tensorboard --logdir` sees each poll's lines
        except Exception as e:       # the writer's thread hands back what the file raised (a full disk)
            self._give_up(f"TensorBoard events stopped: {_why(e)}")

    def close(self) -> None:
        if self._writer is not None:
            writer, self._writer = self._writer, None
            try:
                writer.close()
            except Exception:        # its thread already failed: said by write(); nothing more to keep
                pass
        self._release()

    def _release(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)     # closing the descriptor drops the flock
            self._lock_fd = None


def _why(e: BaseException) -> str:
    return getattr(e, "strerror", None) or str(e) or type(e).__name__


def event_files(run_dir: Path) -> list[Path]:
    """This program's event files in a run folder (a user's own TensorBoard files are not ours)."""
    try:
        return sorted(p for p in Path(run_dir).iterdir() if EVENTS_MARK in p.name and p.name.endswith(SUFFIX))
    except OSError:
        return []


def rebuild(run_dir: Path) -> Recorder:
    """A run's event file written again from its whole metrics.jsonl; the recorder says where (`path`)
    or why not (`why_not`)."""
    rec = Recorder(run_dir)
    reader = MetricsReader(rec.folder.metrics)
    try:
        rec.follow(reader, [])              # the lock and the file; nothing read yet
        while rec.writing:
            before = reader.positions()
            messages = reader.poll()
            if reader.positions() == before:
                break
            rec.follow(reader, messages)
    finally:
        rec.close()
        reader.close()
    return rec
