"""RunState: what a front end knows of a run, folded from its metrics stream. No UI, no torch."""

from __future__ import annotations

from dataclasses import dataclass, field

from shardconsole.runlog import protocol as P


def count(n: int, noun: str) -> str:
    """'1 record', '3 records': both front ends' words for a number of things."""
    return f"{n} {noun}{'' if n == 1 else 's'}"


def kto_records(d) -> str:
    """KTO's training records in both front ends' data line (a DataSummary of format kto): '96 records (48
    desirable, 48 undesirable)'; unpaired records, not pairs."""
    return f"{count(d.records, 'record')} ({d.desirable} desirable, {d.records - d.desirable} undesirable)"


def eval_unit(e) -> str:
    """What an eval's count counts: KTO's (it has a kl) are unpaired records, the other objectives' pairs."""
    return "record" if e.kl is not None else "pair"


def fmt_rate(x: float) -> str:
    """Tokens a second as both front ends print them: 61.5k."""
    return f"{x / 1000:.1f}k" if x >= 1000 else f"{x:.0f}"


def preference_text(m: P.Step | P.Eval) -> str:
    """A preference run's figures as both front ends print them: `acc 87.5% margin +0.750 (chosen +0.250,
    rejected -0.500)`, KTO's `margin +0.750 chosen +0.250 rejected -0.500 kl 0.012`; "" for a message without
    them (SFT)."""
    kl = getattr(m, "kl", None)
    if kl is not None:      # KTO: unpaired, so no accuracy; a window of one label has no margin
        sides = " ".join(f"{name} {v:+.3f}" for name, v in (("margin", m.reward_margin), ("chosen", m.reward_chosen),
                                                            ("rejected", m.reward_rejected)) if v is not None)
        return f"{sides} kl {kl:.3f}".strip()
    if m.pref_accuracy is None or m.reward_margin is None:
        return ""
    return (f"acc {100 * m.pref_accuracy:.1f}% margin {m.reward_margin:+.3f} (chosen {m.reward_chosen or 0:+.3f}, "
            f"rejected {m.reward_rejected or 0:+.3f})")


def reward_text(m: P.Step) -> str:
    """A GRPO run's figures as both front ends print them: `reward 0.412 ±0.210 (rewards.py:exact 0.30,
    rewards.py:short 0.11) len 41.3 kl 0.0123 clip 0.0% gen 61%` (gen: the step's time spent sampling
    and scoring); "" for a message without them."""
    if m.reward_mean is None:
        return ""
    parts = [f"reward {m.reward_mean:.3f} ±{m.reward_std or 0:.3f}"]
    if m.rewards and len(m.rewards) > 1:
        parts[0] += " (" + ", ".join(f"{k.rsplit('/', 1)[-1]} {v:.2f}" for k, v in m.rewards.items()) + ")"
    if m.completion_len is not None:
        parts.append(f"len {m.completion_len:.1f}")
    if m.kl is not None:
        parts.append(f"kl {m.kl:.4f}")
    if m.clip_ratio is not None:
        parts.append(f"clip {100 * m.clip_ratio:.1f}%")
    if m.generate_s is not None and m.step_s > 0:
        parts.append(f"gen {100 * min(1.0, m.generate_s / m.step_s):.0f}%")
    return " ".join(parts)


def fmt_eta(seconds: float) -> str:
    """A time left as both front ends print it: 45s, 12m30s, 3h05m."""
    s = max(0, int(round(seconds)))
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


def save_line(sp: P.SaveProgress) -> str:
    """A save as both front ends print it: `saving step 60: 12.3 / 84.0 GB, 9 s`, and once it is done
    `saved step 60: 84.0 GB in 52 s (1.6 GB/s) to DIR`. Rank 0 sends them: the bytes in the save's folder
    so far (every rank's, on the file system they share) of the planned total; decimal units, as disks
    are sold."""
    scale, unit = (1e9, "GB") if max(sp.total_bytes, sp.written_bytes) >= 1e8 else (1e6, "MB")
    what = {"model": "the model of step", "export": "the export of step"}.get(sp.what, "step")
    if sp.done:
        rate = f" ({sp.written_bytes / sp.elapsed_s / 1e9:.2f} GB/s)" if sp.elapsed_s > 0 else ""
        return (f"saved {what} {sp.step}: {sp.written_bytes / scale:.1f} {unit} in {sp.elapsed_s:.0f} s{rate}"
                + (f" to {sp.path}" if sp.path else ""))
    of = f" / {sp.total_bytes / scale:.1f}" if sp.total_bytes else ""
    return f"saving {what} {sp.step}: {sp.written_bytes / scale:.1f}{of} {unit}, {sp.elapsed_s:.0f} s"


@dataclass
class RunState:
    """What the front ends know of a run, folded from the stream."""
    world: int | None = None
    hellos: dict[int, P.Hello] = field(default_factory=dict)
    last_step: P.Step | None = None
    prev_step: P.Step | None = None      # the step line before last_step: the hang watch's interval
    memory: dict[int, P.Memory] = field(default_factory=dict)
    gpus: dict[int, P.GpuSample] = field(default_factory=dict)
    host: P.HostSample | None = None
    phase: str = "starting"
    events: list[P.Event] = field(default_factory=list)
    failed: list[P.Failed] = field(default_factory=list)
    finished: P.Finished | None = None
    data: P.DataSummary | None = None
    evals: list[P.Eval] = field(default_factory=list)
    offload: dict[int, P.OffloadTiming] = field(default_factory=dict)    # the offload view, by rank
    save: P.SaveProgress | None = None   # the latest save's progress (rank 0's)
    # (step, wall time) of this session's step lines: the ETA's clock (eta_s)
    step_marks: list[tuple[int, float]] = field(default_factory=list)

    @property
    def saving(self) -> P.SaveProgress | None:
        """The save under way (its progress not done yet), else None."""
        return self.save if self.save is not None and not self.save.done else None

    def apply(self, msg: P.Message) -> None:
        if isinstance(msg, P.Hello):
            self.hellos[msg.rank] = msg
            self.world = msg.world
        elif isinstance(msg, P.Step):
            self.prev_step, self.last_step = self.last_step, msg
            if not self.step_marks or msg.step > self.step_marks[-1][0]:
                self.step_marks.append((msg.step, msg.t))
        elif isinstance(msg, P.Memory):
            self.memory[msg.rank] = msg
        elif isinstance(msg, P.GpuSample):
            self.gpus[msg.index] = msg
        elif isinstance(msg, P.HostSample):
            self.host = msg
        elif isinstance(msg, P.Event):
            if msg.name == "phase":
                self.phase = msg.detail
            self.events.append(msg)
        elif isinstance(msg, P.Failed):
            self.failed.append(msg)
        elif isinstance(msg, P.Finished):
            self.finished = msg
        elif isinstance(msg, P.DataSummary):
            self.data = msg
        elif isinstance(msg, P.Eval):
            self.evals.append(msg)
        elif isinstance(msg, P.OffloadTiming):
            self.offload[msg.rank] = msg
        elif isinstance(msg, P.SaveProgress) and msg.rank == 0:
            self.save = msg

    def new_session(self) -> None:
        """A resumed run appends a new session to the same stream: its ranks, its end, its events."""
        self.hellos.clear()
        self.failed.clear()
        self.events.clear()
        self.finished = None
        self.save = None
        self.phase = "starting"
        self.step_marks.clear()         # a resumed session's first steps compile and warm up again

    def gpu_of(self, rank: int) -> P.GpuSample | None:
        """The NVML sample of the card this rank computes on, matched by UUID (never by index)."""
        hello = self.hellos.get(rank)
        key = P.gpu_uuid_key(hello.gpu_uuid) if hello is not None else ""
        return next((g for g in self.gpus.values() if key and P.gpu_uuid_key(g.uuid) == key), None)

    def seconds_per_step(self) -> float | None:
        """The wall time of one step, measured between this session's step lines, leaving out what came
        before the first line (start, build, the compile of the first steps) and, from 4 lines on, the first
        interval too (the allocator's and the optimizer's warm-up). Evals and saves between lines count:
        they recur until the end. None before 2 lines."""
        marks = self.step_marks[1:] if len(self.step_marks) >= 4 else self.step_marks
        if len(marks) < 2 or marks[-1][0] <= marks[0][0]:
            return None
        return max(0.0, marks[-1][1] - marks[0][1]) / (marks[-1][0] - marks[0][0])

    def eta_s(self) -> float | None:
        """Seconds to train.steps at the measured rate (seconds_per_step); None until it is measured, and
        once the run has finished."""
        s, rate = self.last_step, self.seconds_per_step()
        if s is None or not s.steps or rate is None or self.finished is not None:
            return None
        return max(0, s.steps - s.step) * rate

    @property
    def rank_pids(self) -> list[int]:
        return [h.pid for h in self.hellos.values() if h.pid > 0]

    def first_failure(self) -> P.Failed | None:
        """The root cause: the earliest failure that is not a consequence of another rank dying."""
        if not self.failed:
            return None
        primary = [f for f in self.failed if f.cause != "crash" or "terminated" not in f.message.lower()]
        # A rank that stopped on request is not a cause when another rank failed for real.
        real = [f for f in primary if f.cause != "stopped"]
        # memory.host_memory_limit's watchdog stops every rank: another rank's failure in that stop's save (a
        # disk too small for it) is its consequence, and the node's first rank alone knows the cause
        held = [f for f in real if f.cause == "host_oom"]
        return min(held or real or primary or self.failed, key=lambda f: f.t)
