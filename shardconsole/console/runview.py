"""RunView: what the run screen shows, folded from the stream. No Textual here: tested as plain code.

RunState (shared with the headless front end) keeps the latest of everything; RunView adds the curves
(loss and tokens/s by step, memory by time) and the facts derived for the panels.
"""

from __future__ import annotations

import re

import socket
from dataclasses import dataclass, field
from pathlib import Path

from shardconsole.runlog import protocol as P
from shardconsole.runlog.runstate import RunState, count, eval_unit, kto_records, preference_text, save_line



# Synthetic tokens are a learnable pattern (backends/data/batches.SyntheticTokens: each token's successor is
# fixed), not noise: the loss falls to about 0, which shows the training works; said, so that a user
# who read "random tokens" does not take a loss of 0.0000 for a bug.
SYNTHETIC = "synthetic tokens (no data set): a fixed pattern, learned to a loss near 0"
SYNTHETIC_LONG = ("synthetic tokens (no data set, no tokenizer): each sequence follows one fixed random order of "
                  "the vocabulary, a pattern the model memorises, so the loss falls towards 0; that shows the "
                  "training works, nothing real is learned")


GIB = 2**30
OP_BUILD = "op_build"     # the event a rank sends before it builds (or loads) a DeepSpeed op


class Trace:
    """x/y points of a run's metric. Past max_points, neighbours are averaged in pairs, so a long run
    keeps its whole shape in bounded memory and a plot never walks more than max_points points."""

    def __init__(self, max_points: int = 2048) -> None:
        self.xs: list[float] = []
        self.ys: list[float] = []
        self.max_points = max_points

    def append(self, x: float, y: float) -> None:
        self.xs.append(float(x))
        self.ys.append(float(y))
        if len(self.xs) > self.max_points:
            self.xs = _halve(self.xs)
            self.ys = _halve(self.ys)

    def __len__(self) -> int:
        return len(self.xs)

    @property
    def last(self) -> float | None:
        return self.ys[-1] if self.ys else None


def _halve(values: list[float]) -> list[float]:
    """Pairs averaged; an odd last value (the newest) is kept as it is."""
    out = [(a + b) / 2 for a, b in zip(values[::2], values[1::2])]
    return out + values[-1:] if len(values) % 2 else out


@dataclass
class RunView:
    run_id: str = ""
    state: RunState = field(default_factory=RunState)
    loss: Trace = field(default_factory=Trace)
    eval_loss: Trace = field(default_factory=Trace)
    tokens_per_s: Trace = field(default_factory=Trace)
    host_used_gib: Trace = field(default_factory=Trace)
    gpu_used_gib: Trace = field(default_factory=Trace)     # the fullest card: the one that runs out first
    t0: float | None = None          # the first and newest line of any writer (front ends' samples too)
    t_last: float | None = None
    run_t0: float | None = None      # the ranks' own first and last lines: how long the run took
    run_t_last: float | None = None
    bad_lines: int = 0
    min_loss: float | None = None
    local_host: str = field(default_factory=socket.gethostname)
    # The planner's prediction for this run (largest rank as NVML shows it; the node's host RAM), shown
    # beside what is measured. None: no planner, or no prediction for these settings.
    planned_gpu_bytes: int | None = None
    planned_host_bytes: int | None = None
    step_now: int | None = None      # the step the ranks last said they had done (step lines, events, saves)
    phase_t: float | None = None     # when the current phase began (the stream's clock)
    building: str = ""               # the op being built, while the phase is "building ops"

    def apply(self, msg: P.Message) -> None:
        self.state.apply(msg)
        if isinstance(msg, P.Step):
            self.step_now = msg.step
        elif msg.rank >= 0 and isinstance(msg, (P.Event, P.SaveProgress)) and msg.step is not None:
            # a rank's events carry the step it has done: a save on stop between two step lines
            self.step_now = msg.step
        elif isinstance(msg, P.Hello):
            self.step_now = None        # a new session (a resume) counts from its own first line
        if isinstance(msg, P.Event) and msg.name == "phase":
            self.phase_t, self.building = msg.t, ""
        elif isinstance(msg, P.Event) and msg.name == OP_BUILD:
            self.building = msg.detail
        if self.t0 is None or msg.t < self.t0:
            self.t0 = msg.t
        if self.t_last is None or msg.t > self.t_last:
            self.t_last = msg.t
        if msg.rank >= 0:      # a rank's line, not a front end's sample or note
            if self.run_t0 is None or msg.t < self.run_t0:
                self.run_t0 = msg.t
            if self.run_t_last is None or msg.t > self.run_t_last:
                self.run_t_last = msg.t
        if isinstance(msg, P.Step):
            if msg.loss is not None and msg.loss == msg.loss:   # NaN is reported, not plotted
                self.loss.append(msg.step, msg.loss)
                self.min_loss = msg.loss if self.min_loss is None else min(self.min_loss, msg.loss)
            self.tokens_per_s.append(msg.step, msg.tokens_per_s)
        elif isinstance(msg, P.Eval):
            if msg.loss is not None and msg.loss == msg.loss:
                self.eval_loss.append(msg.step, msg.loss)
        elif isinstance(msg, P.HostSample):
            # The front end writes a look's GPU samples just before its host sample: one point per look.
            x = msg.t - (self.t0 or msg.t)
            self.host_used_gib.append(x, msg.used_bytes / GIB)
            if self.state.gpus:
                self.gpu_used_gib.append(x, max(g.used_bytes for g in self.state.gpus.values()) / GIB)

    # --- derived -----------------------------------------------------------------------------------
    @property
    def elapsed_s(self) -> float:
        """From the ranks' first line to their last once the run is over, so that a replayed run shows the
        time it took (never up to a sample a later front end appended); while it goes on, to the newest
        line of any writer (the front end's samples, once a second, keep the clock moving)."""
        start = self.run_t0 if self.run_t0 is not None else self.t0
        over = self.state.finished is not None or bool(self.state.failed)
        end = self.run_t_last if over and self.run_t_last is not None else self.t_last
        return max(0.0, end - start) if start is not None and end is not None else 0.0

    def phase_elapsed_s(self, now: float) -> float | None:
        """How long the current phase has lasted, by the wall clock (a build sends nothing while it runs)."""
        return None if self.phase_t is None else max(0.0, now - self.phase_t)

    @property
    def eta_s(self) -> float | None:
        """From the wall clock of the measured steps, the first compile-bound ones left out (RunState.eta_s)."""
        return self.state.eta_s()

    def ranks_by_gpu(self) -> tuple[dict[int, list[int]], list[int]]:
        """({GPU index: ranks on it}, ranks elsewhere: other hosts or CPU). A rank is on a local GPU when
        its hello's UUID is that card's (NVML's index is not CUDA's on a mixed rig), else when NVML lists
        its pid there or, when NVML lists no pids (containers), by its device index."""
        on_gpu: dict[int, list[int]] = {}
        placed: set[int] = set()
        by_uuid = {P.gpu_uuid_key(g.uuid): idx for idx, g in self.state.gpus.items() if g.uuid}
        for rank, h in self.state.hellos.items():
            if h.host in ("", self.local_host) and h.gpu_uuid and P.gpu_uuid_key(h.gpu_uuid) in by_uuid:
                on_gpu.setdefault(by_uuid[P.gpu_uuid_key(h.gpu_uuid)], []).append(rank)
                placed.add(rank)
        pid_to_rank = {h.pid: r for r, h in self.state.hellos.items() if h.host in ("", self.local_host)}
        for idx, g in self.state.gpus.items():
            for pid in g.pids:
                if pid in pid_to_rank and pid_to_rank[pid] not in placed:
                    on_gpu.setdefault(idx, []).append(pid_to_rank[pid])
                    placed.add(pid_to_rank[pid])
        for rank, m in self.state.memory.items():
            hello = self.state.hellos.get(rank)
            # A CUDA device index is NVML's only by luck: used only when the rank sent no UUID.
            local = hello is None or (hello.host in ("", self.local_host) and not hello.gpu_uuid)
            if rank not in placed and local and m.device_index is not None and m.device_index in self.state.gpus:
                on_gpu.setdefault(m.device_index, []).append(rank)
                placed.add(rank)
        ranks = set(self.state.hellos) | set(self.state.memory)
        return {k: sorted(v) for k, v in on_gpu.items()}, sorted(ranks - placed)

    @property
    def ranks_rss_bytes(self) -> int:
        return sum(m.host_rss_bytes for m in self.state.memory.values())


def log_line(msg: P.Message) -> str | None:
    """The Logs panel's line for a stream message worth reading there (phases, ops, warnings, saves,
    the data, evals, the end), labelled like the log files' lines; None for the rest (steps, samples,
    memory: the panels show them). A healthy run writes nothing to its log files: this is what it says."""
    label = "run" if msg.rank < 0 else f"r{msg.rank}"
    if isinstance(msg, P.Event):
        if msg.name in P.RECORD_ONLY_EVENTS:
            return None
        if msg.name == "phase":
            text = f"▸ {msg.detail}"
        elif msg.name == OP_BUILD:
            text = f"▸ building ops: {msg.detail}"
        else:
            text = f"{msg.name.replace('_', ' ')}: {msg.detail}" if msg.detail else msg.name.replace("_", " ")
    elif isinstance(msg, P.Hello):
        gpu = f" ({msg.gpu_name})" if msg.gpu_name else ""
        text = f"started: {msg.backend or 'rank'} on {msg.device or '?'}{gpu}, pid {msg.pid}" + \
            (f" on {msg.host}" if msg.host else "")
    elif isinstance(msg, P.DataSummary) and msg.format == "synthetic":
        text = f"data: {SYNTHETIC_LONG}" + (f"; {msg.note}" if msg.note else "")
    elif isinstance(msg, P.DataSummary) and not msg.records:    # a token file
        text = f"data: {msg.format} ({msg.source})" + (f"; {msg.note}" if msg.note else "")
    elif isinstance(msg, P.DataSummary):
        records = kto_records(msg) if msg.format == "kto" else \
            f"{count(msg.records, 'record')}, {count(msg.samples, 'sample')}"
        text = f"data: {msg.format} from {msg.source}, {records}, {100 * msg.loss_share:.0f}% under loss" + \
               "".join(f"; {Path(n).name} {100 * sh:.1f}% of rows, {ep:.2f} epochs"      # several sources
                       for n, sh, ep in zip(msg.sources, msg.source_shares, msg.source_epochs)) + \
               (f"; {msg.note}" if msg.note else "")
    elif isinstance(msg, P.Eval):
        text = f"eval at step {msg.step}: loss {'n/a' if msg.loss is None else f'{msg.loss:.4f}'} " + (
            f"{preference_text(msg)} ({count(msg.pairs, eval_unit(msg))}, {msg.seconds:.1f} s)" if preference_text(msg)
            else f"({msg.tokens} tokens, {msg.seconds:.1f} s)") + \
            "".join(f"; {n} {lo:.4f}" for n, lo in zip(msg.sources, msg.source_losses))
    elif isinstance(msg, P.Failed) and msg.cause == "stopped":    # a stop is not a failure
        text = f"stopped: {msg.message}".splitlines()[0]
    elif isinstance(msg, P.Failed):
        text = f"failed ({msg.cause}): {msg.message}".splitlines()[0]
    elif isinstance(msg, P.Finished):
        text = f"finished: {msg.steps} steps in {msg.elapsed_s:.0f} s"
    elif isinstance(msg, P.SaveProgress) and msg.done and msg.rank == 0:     # under way: the status line
        text = save_line(msg)
    else:
        return None
    return f"{label:>6}│ {text}"


# Known-harmless notices libraries print into every rank's log on import (peft pulls torchao, which
# names the optional kernels a CPU or older-GPU build lacks; torchao registers enums torch now handles
# itself). Nothing for the user to act on; at 80x24 the Logs panel showed nothing else. The rank logs
# keep them: only the panel leaves them out.
_LIBRARY_NOISE = re.compile(
    r"Failed to load \S*torchao\S*/_C_\w*\S*\.so"                     # torchao's optional kernels
    r"|torch/utils/_pytree\.py:\d+\].*deprecated"                       # a _pytree deprecation (glog prefix kept)
    r"|Enum subclasses is deprecated"                                    # the same, prefix cut
    r"|_pytree\._register_pytree_node is deprecated")                    # transformers' older pytree call


def library_noise(line: str) -> bool:
    """A Logs panel line that is a known-harmless library notice (left out of the panel only)."""
    return _LIBRARY_NOISE.search(line) is not None
