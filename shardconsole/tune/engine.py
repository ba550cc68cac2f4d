"""The tune loop, shared by `shardconsole tune` and the console's tune screen: list the options that
fit (plan/search.py), probe the settings as given first (the baseline every figure is compared with),
then the best predicted, re-ranking after each probe with what it measured, until the budget or the
probe count ends; then pick the fastest probe that stayed under the caps.

Every probe's speed is kept in the speed book (plan/speed/book.py), so the next tune, `plan --fit` and the
hint after a GPU OOM rank with it. Front ends watch through `on_change` (called from this thread)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, cast

from shardconsole.machine.hardware import driver_reserved_bytes
from shardconsole.settings import config as C
from shardconsole.settings.models import ModelSpec
from shardconsole.plan import search
from shardconsole.plan.machine import Hardware
from shardconsole.plan.speed.book import SpeedBook, record_of
from shardconsole.tune.probe import ProbeResult, probe_config, run_probe


@dataclass
class Limits:
    budget_s: float = 600.0             # wall time for all probes
    max_probes: int = 6
    probe_steps: int = 6
    probe_timeout_s: float = 0.0        # 0: what is left of the budget
    gpu_cap_bytes: int | None = None    # the probes run under it (memory.gpu_memory_limit): a card of that
                                        # size, the whole device; a probe whose NVML peak is over it does not win
    host_cap_bytes: int | None = None   # a probe whose ranks' RSS went over it does not win


@dataclass
class Row:
    option: search.Option
    result: ProbeResult | None = None
    state: str = "planned"              # planned, running, done, skipped

    @property
    def label(self) -> str:
        return ("baseline: " if self.option.baseline else "") + self.option.name


@dataclass
class Tune:
    base: C.RunConfig
    spec: ModelSpec
    hw: Hardware
    limits: Limits
    root: Path                                  # probe run folders go under it
    book: SpeedBook
    fixed: set[str] = field(default_factory=set)
    vary: set[str] = field(default_factory=set)   # the numerics keys the user asked to search (search.NUMERICS)
    on_change: Callable[["Tune"], None] = lambda t: None
    rows: list[Row] = field(default_factory=list)
    options: list[search.Option] = field(default_factory=list)
    stop: bool = False
    interrupted: bool = False                   # ended by Ctrl-C (the probe in flight was stopped first)
    started: float = 0.0
    note: str = ""

    def plan(self) -> None:
        self.options = search.options(self.base, self.spec, self.hw, self.book, fixed=self.fixed, vary=self.vary)
        self.on_change(self)

    def _next(self) -> search.Option | None:
        probed = {id(r.option) for r in self.rows}
        left = [o for o in self.options if id(o) not in probed]
        base = [o for o in left if o.baseline]
        if base and not self.rows:
            return base[0]
        fitting = [o for o in left if o.estimate.fits and not self._doomed(o)]
        return fitting[0] if fitting else None

    def _doomed(self, option: search.Option) -> bool:
        """A probe ran out of GPU memory: an option of the same strategy that the planner says needs as
        much or more would too (the planner was under for that strategy here), so it is not probed."""
        for row in self.rows:
            res = row.result
            if (res is not None and res.status == "gpu_oom"
                    and search.strategy_of(row.option.cfg) == search.strategy_of(option.cfg)
                    and option.estimate.gpu_required_bytes >= row.option.estimate.gpu_required_bytes):
                return True
        return False

    def run(self) -> Row | None:
        """Probe until done; returns the winning row (None when no probe finished under the caps)."""
        if not self.options:
            self.plan()
        self.started = time.monotonic()
        while not self.stop and len(self.rows) < self.limits.max_probes:
            left = self.limits.budget_s - (time.monotonic() - self.started)
            if left <= 0:
                self.note = "budget spent"
                break
            option = self._next()
            if option is None:
                self.note = "every option that fits was probed"
                break
            row = Row(option, state="running")
            self.rows.append(row)
            self.on_change(self)
            row.result = self._probe(option, len(self.rows), left)
            row.state = "done"
            if row.result.interrupted:
                self.stop, self.interrupted = True, True
            self._judge(row)
            if row.result.ok and row.result.tokens_per_s > 0:
                self.book.add(record_of(option.cfg, self.hw, row.result.tokens_per_s, "tune probe",
                                        run=row.result.run_dir,
                                        peaks={"gpu": row.result.gpu_peak_bytes, "host": row.result.host_peak_bytes}))
                search.rank(self.options, self.book, self.hw, self.spec)
            self.on_change(self)
        if self.stop and not self.note:
            self.note = "stopped"
        return self.winner()

    def _probe(self, option: search.Option, n: int, left_s: float) -> ProbeResult:
        timeout = min(left_s, self.limits.probe_timeout_s) if self.limits.probe_timeout_s else left_s
        run_dir = self.root / f"probe-{n:02d}"
        try:
            cfg = probe_config(option.cfg, self.limits.probe_steps)
        except C.ConfigError as e:
            return ProbeResult(status="cannot start", message=str(e), run_dir=str(run_dir))

        def live(res: ProbeResult) -> None:
            self.on_change(self)
        return run_probe(cfg, run_dir, timeout_s=max(timeout, 1.0), should_stop=lambda: self.stop, on_step=live)

    def card_peak_bytes(self, res: ProbeResult) -> int:
        """The probe's NVML peak as the capped card would show it: this device's peak less what its
        driver keeps (the idle reading, at most the table's: machine/hardware.CARD_MEMORY), plus what the
        driver keeps of a card of the cap's size. On a card of that size itself, the peak as read."""
        if not res.gpu_peak_bytes:
            return 0
        here = driver_reserved_bytes(self.hw.gpu_name, self.hw.gpu_memory_bytes or None)
        idle = min(res.gpu_idle_bytes, here) if res.gpu_idle_bytes else here
        cap = self.limits.gpu_cap_bytes
        return max(res.gpu_peak_bytes - idle, 0) + driver_reserved_bytes(None, cap) if cap else res.gpu_peak_bytes

    def _judge(self, row: Row) -> None:
        res = row.result
        assert res is not None
        cap = self.limits.gpu_cap_bytes
        if res.ok and cap and res.gpu_peak_bytes and self.card_peak_bytes(res) > cap:
            # The cap limits more than torch's allocator: the context and NCCL are on the card too (a
            # probe at 24.3 GiB NVML under a 24.0 GiB cap would run out of memory on the card; issue 34).
            res.status = "over cap"
            res.message = (f"NVML peak {C.format_size(self.card_peak_bytes(res))} on a "
                           f"{C.format_size(cap)} card, over it")
        if res.ok and self.limits.host_cap_bytes and res.host_peak_bytes > self.limits.host_cap_bytes:
            res.status = "over cap"
            res.message = (f"ranks' RSS {C.format_size(res.host_peak_bytes)} over the host cap "
                           f"{C.format_size(self.limits.host_cap_bytes)}")
        if res.ok and res.tokens_per_s <= 0:
            res.status, res.message = "no speed", "finished without a step line to measure"

    def winner(self) -> Row | None:
        done = [r for r in self.rows if r.result is not None and r.result.ok]
        return max(done, key=lambda r: cast(ProbeResult, r.result).tokens_per_s) if done else None

    def baseline(self) -> Row | None:
        return next((r for r in self.rows if r.option.baseline), None)
