"""Front-end diagnosis of a run that stopped making progress: is it hung, and where is each rank?

Ranks register faulthandler on SIGUSR1 (backends/rank/common.py), so a signal makes each one write every
thread's Python stack into its log without stopping it. A rank whose main thread sits inside
torch.distributed waits for a collective; a rank anywhere else is the one holding the others up.
Standard library only.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
import signal
import time
from dataclasses import dataclass
from pathlib import Path

from shardconsole.machine import flight_recorder
from shardconsole.runlog.runfolder import LOGS_DIR
from shardconsole.runlog.runstate import RunState, save_line

FIRST_STEP_GRACE_S = 900.0   # the first step may include torch.compile and op builds
MIN_HANG_S = 120.0
# A save reports its bytes about once a second (protocol.SaveProgress): it is progress, however long the
# save. Only bytes that stop growing for this long (or train.hang_timeout_s, if longer) are a hang: a rank
# waiting at the save's barrier for a slower one, or one large file on a slow disk, sends no new byte
# for a while.
SAVE_STALL_S = 600.0


@dataclass
class Watch:
    """Tracks when the last step line arrived; says when the gap is far longer than a step. During a save
    (a SaveProgress not done) the save's bytes are the progress instead."""
    timeout_s: float = 0.0          # 0: automatic
    save_stall_s: float = SAVE_STALL_S
    _last_step_at: float | None = None
    _training_since: float | None = None
    _seen_step: int = -1
    _save_seen: tuple[int, str, int] | None = None
    _save_moved_at: float | None = None

    def update(self, state: RunState, now: float) -> None:
        sp = state.saving
        if sp is not None:
            seen = (sp.step, sp.what, sp.written_bytes)
            if seen != self._save_seen:
                self._save_seen, self._save_moved_at = seen, now
            self._training_since = None       # the step clock starts again after the save
            self._last_step_at = None
            return
        self._save_seen = self._save_moved_at = None
        if state.phase != "training":
            self._training_since = None       # loading, saving a checkpoint: not a hang
            self._last_step_at = None
            return
        if self._training_since is None:
            self._training_since = now
        s = state.last_step
        if s is not None and s.step != self._seen_step:
            self._seen_step = s.step
            self._last_step_at = now

    def limit(self, state: RunState) -> float:
        if self.timeout_s:
            return self.timeout_s
        s = state.last_step
        if s is None or self._last_step_at is None:
            return FIRST_STEP_GRACE_S
        interval = max(1, s.step - (state.prev_step.step if state.prev_step is not None else 0))
        return max(MIN_HANG_S, 20.0 * s.step_s * interval)

    def save_limit(self) -> float:
        return max(self.timeout_s, self.save_stall_s)

    def stalled_for(self, now: float) -> float:
        ref = self._save_moved_at or self._last_step_at or self._training_since
        return 0.0 if ref is None else now - ref

    def hung(self, state: RunState, now: float) -> bool:
        self.update(state, now)
        if state.saving is not None:
            return self.stalled_for(now) > self.save_limit()
        return state.phase == "training" and self.stalled_for(now) > self.limit(state)


_HEADER = re.compile(r"^(Current thread|Thread) 0x[0-9a-f]+ .*most recent call first", re.M)
_FRAME = re.compile(r'^\s+File "(?P<file>[^"]+)", line (?P<line>\d+) in (?P<func>\S+)')


def main_thread_stack(log_text: str) -> list[str]:
    """The newest faulthandler dump's main-thread frames (innermost first), as 'file:line in func'."""
    starts = [m.start() for m in _HEADER.finditer(log_text)]
    if not starts:
        return []
    # Dumps of several threads follow one another; take the last dump's thread whose stack reaches the
    # rank's entry point (the main thread).
    blocks = []
    for i, start in enumerate(starts):
        end = starts[i + 1] if i + 1 < len(starts) else len(log_text)
        frames: list[str] = []
        for line in log_text[start:end].splitlines()[1:]:
            m = _FRAME.match(line)
            if not m:
                if frames:
                    break
                continue
            frames.append(f"{m['file']}:{m['line']} in {m['func']}")
        blocks.append(frames)
    for frames in reversed(blocks):
        if any("shardconsole/backends/__main__.py" in f for f in frames):
            return frames
    return blocks[-1]


def in_collective(frames: list[str]) -> bool:
    return any("torch/distributed" in f or "deepspeed/comm" in f for f in frames[:4])


def short(frame: str) -> str:
    path, _, rest = frame.partition(":")
    return f"{Path(path).name}:{rest}"


class Stacks(dict):
    """{rank: main-thread frames}, and `collectives`: the flight recorder's line (flight_recorder.summary)
    naming the collective each rank is in; "" when no rank answered."""
    collectives: str = ""


def where_ranks_are(state: RunState, run_dir: Path, ranks: Iterable[int], wait_s: float = 1.5) -> dict[int, list[str]]:
    """Ask each of `ranks` (this host's, checked alive as this run's ranks by the caller: SIGUSR1 would end
    any other process) for its stack and read it from its log; and for its flight recorder's dump."""
    ranks = set(ranks)
    asked = flight_recorder.request(run_dir / LOGS_DIR)
    sizes = {}
    for rank, hello in state.hellos.items():
        if rank not in ranks:
            continue
        log = run_dir / "logs" / f"rank{rank}.log"
        sizes[rank] = log.stat().st_size if log.exists() else 0
        try:
            os.kill(hello.pid, signal.SIGUSR1)
        except (ProcessLookupError, PermissionError):
            sizes.pop(rank)
    time.sleep(wait_s)
    out = Stacks()
    # The recorder's thread looks twice a second, but a rank's dump needs its GIL and a core: on a loaded
    # box (2 cores, the suite beside it) rank 0's came after 3.5 s and the report named no collective.
    # Every rank that answers ends the wait at once, so the longer bound costs only a rank that never does.
    deadline = time.monotonic() + 6.0
    dumps = {r: flight_recorder.read(run_dir / LOGS_DIR, r, asked) for r in sizes}
    while any(d is None for d in dumps.values()) and time.monotonic() < deadline:
        time.sleep(0.1)
        dumps = {r: flight_recorder.read(run_dir / LOGS_DIR, r, asked) for r in sizes}
    if any(d is not None for d in dumps.values()):
        out.collectives = flight_recorder.summary(dumps)
    for rank, size in sizes.items():
        try:
            with open(run_dir / "logs" / f"rank{rank}.log", errors="replace") as fh:
                fh.seek(size)
                out[rank] = main_thread_stack(fh.read())
        except OSError:
            out[rank] = []
    return out


def hang_message(state: RunState, stacks: dict[int, list[str]], stalled_s: float) -> str:
    s = state.last_step
    sp = state.saving
    if sp is not None:
        lines = [f"no save progress for {stalled_s:.0f} s ({save_line(sp)})"]
    else:
        lines = [f"no step for {stalled_s:.0f} s" + (f" (a step took {s.step_s:.2f} s; last step {s.step})" if s else "")]
    waiting = sorted(r for r, f in stacks.items() if f and in_collective(f))
    stuck = sorted(r for r, f in stacks.items() if f and not in_collective(f))
    for r in stuck:
        lines.append(f"rank {r} is stuck at {short(stacks[r][0])} (the others wait for it)")
    if waiting:
        lines.append(f"rank(s) {', '.join(map(str, waiting))} wait in a collective"
                     + (f" at {short(stacks[waiting[0]][0])}" if stacks[waiting[0]] else ""))
    unknown = sorted(r for r, f in stacks.items() if not f)
    if unknown:
        lines.append(f"rank(s) {', '.join(map(str, unknown))} gave no stack (stuck in native code or gone)")
    gpus = " ".join((h.gpu_name or "") for h in state.hellos.values()).lower()
    collectives = getattr(stacks, "collectives", "")    # the flight recorder's reading, where it answered
    if collectives:
        lines.append(collectives)
    if not stuck and any(k in gpus for k in ("geforce", "rtx", "titan")):
        lines.append("consumer GPUs without P2P often hang in NCCL: `shardconsole doctor` tests P2P "
                     "(a launch then sets NCCL_P2P_DISABLE=1 itself when it is broken)")
    return "; ".join(lines)
