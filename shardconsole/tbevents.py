"""The stream as TensorBoard event files: `tensorboard --logdir RUNS_ROOT` shows every run, live.

Written by the front end that watches a run, from the lines it reads anyway (the ranks pay nothing),
and rebuilt from metrics.jsonl for a run that had no front end (`shardconsole attach`,
`shardconsole runs --tensorboard`). Standard library only, like stream.py: the event file format is
a TFRecord of `Event` protobufs, of which a scalar needs four fields, so it is written here by hand
rather than through the `tensorboard` package (protobuf, grpc, numpy: a viewer's dependencies, not a
front end's) or torch.utils.tensorboard (torch is not allowed in front ends). The tests read the files
back with TensorBoard's own EventAccumulator.

One writer per run: the recorder takes an advisory lock on the run's metrics.jsonl (flock; the ranks
do not lock, so they never wait on it). The writer that gets it rewrites the run's event file from the
whole stream with a reader of its own, then follows it; another front end on the same run writes
nothing until the lock is free. A dead writer's lock is released by the kernel, and the next front end
writes a complete file in its place.
"""

from __future__ import annotations

import fcntl
import math
import os
import socket
import struct
import time
from collections.abc import Iterable
from pathlib import Path

from shardconsole import protocol as P
from shardconsole.runfolder import RunFolder

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
    elif isinstance(msg, P.Eval):
        out.append(("loss/eval", msg.loss))
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


def _gib(n: int | None) -> float | None:
    return None if n is None else n / GiB


def _gb(n: float | None) -> float | None:
    return None if n is None else n / 1e9


# ---------------------------------------------------------------------------------------------------
# The file format: TFRecord framing (length, masked CRC-32C of it, data, masked CRC-32C of the data)
# around Event protobufs (wall_time=1 double, step=2 int64, file_version=3 string, summary=5,
# session_log=7); Summary.value=1 {tag=1 string, simple_value=2 float}.

def _crc32c_table() -> list[int]:
    table = []
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
        table.append(c)
    return table


_CRC_TABLE = _crc32c_table()


def _slice_tables() -> list[list[int]]:
    tables = [_CRC_TABLE]
    for _ in range(7):
        prev = tables[-1]
        tables.append([(v >> 8) ^ _CRC_TABLE[v & 0xFF] for v in prev])
    return tables


_T0, _T1, _T2, _T3, _T4, _T5, _T6, _T7 = _slice_tables()


def crc32c(data: bytes) -> int:
    """CRC-32C, eight bytes a step (slicing-by-8): the front end checksums every record it writes."""
    c = 0xFFFFFFFF
    whole = len(data) - len(data) % 8
    for lo, hi in struct.iter_unpack("<II", data[:whole]):
        c ^= lo
        c = (_T7[c & 0xFF] ^ _T6[(c >> 8) & 0xFF] ^ _T5[(c >> 16) & 0xFF] ^ _T4[c >> 24]
             ^ _T3[hi & 0xFF] ^ _T2[(hi >> 8) & 0xFF] ^ _T1[(hi >> 16) & 0xFF] ^ _T0[hi >> 24])
    for b in data[whole:]:
        c = _T0[(c ^ b) & 0xFF] ^ (c >> 8)
    return c ^ 0xFFFFFFFF


def _masked(data: bytes) -> bytes:
    c = crc32c(data)
    return struct.pack("<I", (((c >> 15) | (c << 17)) + 0xA282EAD8) & 0xFFFFFFFF)


def record(data: bytes) -> bytes:
    head = struct.pack("<Q", len(data))
    return head + _masked(head) + data + _masked(data)


def _varint(n: int) -> bytes:
    if 0 <= n < 0x80:
        return _SMALL[n]
    n &= (1 << 64) - 1        # int64 two's complement, as protobuf encodes a negative step
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


_SMALL = [bytes((i,)) for i in range(0x80)]


def _field(number: int, payload: bytes) -> bytes:
    """A length-delimited field (wire type 2)."""
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def event(wall_time: float, step: int, *, values: Iterable[tuple[str, float]] = (), file_version: str = "",
          session_start: bool = False) -> bytes:
    body = _varint(1 << 3 | 1) + struct.pack("<d", wall_time) + _varint(2 << 3) + _varint(step)
    if file_version:
        body += _field(3, file_version.encode())
    summary = b"".join(_value(tag, v) for tag, v in values)
    if summary:
        body += _field(5, summary)
    if session_start:      # SessionLog{status: START}: TensorBoard drops what a resumed run replays
        body += _field(7, _varint(1 << 3) + _varint(1))
    return record(body)


_TAGS: dict[str, tuple[bytes, bytes]] = {}


def _value(tag: str, v: float) -> bytes:
    """Summary.value {tag, simple_value}; the tag's bytes are made once (a run repeats a few dozen tags)."""
    head = _TAGS.get(tag)
    if head is None:
        tag_field = _field(1, tag.encode()) + _varint(2 << 3 | 5)
        head = _TAGS[tag] = (_varint(1 << 3 | 2) + _varint(len(tag_field) + 4), tag_field)
    return head[0] + head[1] + struct.pack("<f", _f32(v))


def _f32(v: float) -> float:
    if math.isfinite(v) and abs(v) > 3.4e38:   # beyond float32: shown as infinite, never an error
        return math.copysign(math.inf, v)
    return v


# ---------------------------------------------------------------------------------------------------
# The writer of one run

class Recorder:
    """Writes a run's event file from its metrics.jsonl, read by a reader of its own, so that it can
    start at any time with the whole history: when the front end that held the run's lock goes, the next
    poll of another front end's recorder takes the lock and writes a complete file. Never raises: a run
    folder it cannot write (someone else's) is left alone and `why_not` says why."""

    RETRY_S = 2.0       # how often a recorder without the lock asks for it again

    def __init__(self, run_dir: Path) -> None:
        self.folder = RunFolder(Path(run_dir))
        self.path: Path | None = None
        self.why_not = ""
        self._fh = None
        self._reader = None
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
        name = f"events.out.{EVENTS_MARK}.{int(time.time()):010d}.{socket.gethostname()}.{os.getpid()}{SUFFIX}"
        try:
            self._fh = open(self.folder.path / name, "xb")
            self._fh.write(event(time.time(), 0, file_version="brain.Event:2"))
        except OSError as e:
            return self._give_up(f"cannot write TensorBoard events in {self.folder.path}: {e.strerror}")
        from shardconsole.stream import MetricsReader
        self._reader = MetricsReader(self.folder.metrics)
        self.path, self.why_not = self.folder.path / name, ""
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

    def poll(self) -> bool:
        """Write what the stream holds that is not written yet; False once nothing more was read."""
        if self._fh is None and not self._start():
            return False
        before = self._reader._pos
        self.write(self._reader.poll())
        return self._reader is not None and self._reader._pos != before

    def write(self, messages: Iterable[P.Message]) -> None:
        out = bytearray()
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
                out += event(group_t, self._step, values=group.items())
                group = {}
            if isinstance(msg, P.Step) and self._new_session:
                # A resumed session restarts from its checkpoint: what the earlier one logged past it is
                # not part of this run's curve any more.
                self._new_session = False
                out += event(msg.t, msg.step, session_start=True)
            self._step = step
            if values:
                group.update(values)
                group_t = msg.t
        if group:
            out += event(group_t, self._step, values=group.items())
        if out and self._fh is not None:
            try:
                self._fh.write(out)
                self._fh.flush()     # a live `tensorboard --logdir` sees each poll's lines
            except (OSError, ValueError) as e:
                self._give_up(f"TensorBoard events stopped: {getattr(e, 'strerror', None) or e}")

    def close(self) -> None:
        if self._fh is not None:
            try:
                self._fh.close()
            except OSError:
                pass
            self._fh = None
        if self._reader is not None:
            self._reader.close()
            self._reader = None
        self._release()

    def _release(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)     # closing the descriptor drops the flock
            self._lock_fd = None


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
    try:
        while rec.poll():
            pass
    finally:
        rec.close()
    return rec
