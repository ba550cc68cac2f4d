"""The messages the console's workers post to its screens (toolong's style: small dataclasses, one module).

Workers run in threads and touch the UI only through these. A message that only carries the latest
machine samples may replace a stale one still queued (can_replace), so a slow screen skips samples
instead of falling behind; anything that carries steps, events or log lines is never dropped.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from textual.message import Message

from shardconsole.runlog import protocol as P
from shardconsole.launch.job import StopReport
from shardconsole.session.run import RunSession

from shardconsole.console.services import Machine
from shardconsole.tryout import chat_wire as W


@dataclass
class RunUpdate(Message):
    """New lines of the metrics stream (steps, memory, events, ...) and of the ranks' logs."""
    messages: list[P.Message] = field(default_factory=list)
    log_lines: list[str] = field(default_factory=list)
    bad_lines: int = 0
    notes: list[str] = field(default_factory=list)     # said once: the stream was deleted, ...


@dataclass
class MachineSampled(Message):
    """GPU and host samples read from the stream; the newest supersedes an older one still queued."""
    samples: list[P.GpuSample | P.HostSample] = field(default_factory=list)
    gpu_unavailable: str = ""     # why there are no GPU samples ("" when there are)

    def can_replace(self, message: Message) -> bool:
        return isinstance(message, MachineSampled)


@dataclass
class RunPlanned(Message):
    """The planner's peaks for the run's settings on this machine (worked out in the follower's thread:
    it asks NVML), drawn as the panels' planned lines; None where it cannot say."""
    gpu_bytes: int | None = None
    host_bytes: int | None = None
    method: str = ""          # " · lora: 40.0M of 6.74B trainable, 0.59%" (services.method_line), "" for full


@dataclass
class RunEnded(Message):
    """The run ended (its launcher and every rank of this host), classified by session/outcome.py."""
    exit_code: int | None = None
    cause: str = "ok"
    message: str = ""
    speed: str = ""           # a finished run: the speed model's tokens/s against the measured ("" none)


@dataclass
class RunHung(Message):
    """No step for far longer than a step takes; where each rank is (session/run.RunSession.hang)."""
    message: str = ""
    stoppable: bool = True       # False: started elsewhere, not stopped from here


@dataclass
class RunResumed(Message):
    """`r` on an ended run: the same folder, a new session (session/run.RunSession) from its newest
    checkpoint."""
    session: RunSession


@dataclass
class StopFinished(Message):
    """A stop ran to its end: who was signalled, what is left, and the GPUs afterwards."""
    report: StopReport
    gpus_after: list[P.GpuSample] = field(default_factory=list)
    gpu_unavailable: str = ""


@dataclass
class MachineDetected(Message):
    """The one look at the machine the setup screen takes at start (GPUs, host memory, planner)."""
    machine: Machine


@dataclass
class ChatHeard(Message):
    """A line of the chat process (a model loading, ready or unavailable, a piece of an answer, an answer
    done), or its end (ended: why). Pieces are never dropped: each is part of the answer."""
    event: W.Wire | None = None
    ended: str = ""
