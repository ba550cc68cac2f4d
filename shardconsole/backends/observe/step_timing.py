"""Where an offloaded step goes: GPU compute, the host optimizer step, host->GPU and GPU->host copies.

On by default for every offloaded run (FSDP2 cpu_offload, DeepSpeed offload_optimizer/offload_param);
SHARDCONSOLE_OFFLOAD_VIEW=off turns it off (benchmarks measure its cost against that).

Nothing here synchronises the GPU. CUDA events are recorded on the stream where each phase runs and
read back one step late, with `Event.query()` first: by then they have completed (an offloaded step
waits for its gradients on the host anyway), and an event that has not is read at the next step.
- GPU compute: the compute stream's span from the step's start to the end of the last backward
  (it includes any wait on a copy the compute needed);
- host step: host clock around the optimizer step (the host does it; the GPU idles); with
  fsdp.offload_overlap the host thread's own seconds of the units' updates, and `host_hidden_s` the part
  of them the step did not wait for (they ran under the backward);
- H2D (FSDP2): events on FSDP2's all-gather copy-in stream around each unit's parameter copies (every
  offloaded FSDPParam's `all_gather_inputs` is the copy), forward and backward;
- D2H (FSDP2): from each unit's all-reduce hook (the reduce-scatter has landed, the gradient copies
  are next on that stream) to the last of that unit's gradients handed back as a host DTensor;
- DeepSpeed ZeRO-3 with optimizer offload: events around its optimizer's copies of the gradients to the
  host (`partition_grads` at the accumulation boundary, in backward; `_finalize_offload_gradient_
  accumulation` in the step when accumulation is unmanaged) and of each sub-group's updated weights back
  (`_reassign_or_swap_out_partitioned_parameters`, in the step); the host step is engine.step()'s host
  time less the copies inside it (CPU Adam, its unscale and norm). Stages 1-2: the host step is
  engine.step() whole and the copies are n/a.
CPU ranks (no CUDA) time the same phases by wall clock; there are no copies to time there.
"""

from __future__ import annotations

import contextlib
from typing import Any
import os
import time

import torch

from shardconsole.machine import offload_verdict
from shardconsole.runlog import protocol as P
from shardconsole.backends.rank.common import Rank
from shardconsole.backends.observe import pinned

MAX_PENDING = 4   # steps whose events have not completed yet; older ones are dropped, not waited for


def offloaded(cfg) -> bool:
    if cfg.parallel.backend == "fsdp":
        return bool(cfg.fsdp.cpu_offload)
    return cfg.deepspeed.offload_optimizer != "none" or cfg.deepspeed.offload_param != "none"


def knobs(cfg) -> offload_verdict.Knobs:
    fsdp = cfg.parallel.backend == "fsdp"
    return offload_verdict.Knobs(
        backend=cfg.parallel.backend,
        compute_copy=fsdp and cfg.fsdp.offload_compute_copy and cfg.precision.dtype != "fp32"
        and cfg.precision.master_dtype == "fp32",
        low_precision=cfg.precision.dtype != "fp32",
        pin_memory=cfg.fsdp.pin_memory if fsdp else cfg.deepspeed.pin_memory,
        offload_param=fsdp or cfg.deepspeed.offload_param != "none",
        checkpointing=cfg.memory.activation_checkpointing, compiled=cfg.train.compile,
        clip_blocks_overlap=fsdp and cfg.fsdp.offload_overlap and cfg.train.clip_grad_norm > 0
        and cfg.precision.dtype != "fp16")


class _Step:
    """One step's marks: (start, end) pairs of events (GPU) or of perf_counter floats (CPU)."""

    def __init__(self) -> None:
        self.compute: list = []        # [start, end]
        self.h2d: list[tuple] = []
        self.d2h: list[tuple] = []
        self.host = 0.0                # the main thread's time in the host step (what the step waited)
        # offload_overlap: the host step's own seconds, part of them under the backward
        self.host_work: float | None = None
        self.wall = 0.0
        self.h2d_bytes = 0
        self.d2h_bytes = 0
        self.host_has_copies = False     # DeepSpeed: the copies ran inside the host-timed engine.step()


def _costed(method):
    """Adds the host time spent in `method` to the view's own cost (reported as view_s a step)."""
    def inner(self, *args, **kwargs):
        t = time.perf_counter()
        try:
            return method(self, *args, **kwargs)
        finally:
            self.view_cost += time.perf_counter() - t
    inner.__name__ = method.__name__
    return inner


class StepTiming:
    def __init__(self, r: Rank, arena: Any = None) -> None:
        """`arena`: FSDP2's host arena (offload/pinned_arena.ShardArena) when the engine built one."""
        self.r = r
        self.arena = arena
        self.on = offloaded(r.cfg) and r.knobs.offload_view
        self.cuda = r.is_cuda
        self.knobs = knobs(r.cfg)
        self.cur: _Step | None = None
        self.pending: list[_Step] = []
        self._reset_sums()
        self._t0 = 0.0
        self.dropped = 0
        self.view_cost = 0.0
        self.overlap = ""        # the offload line's `overlap`: set by the loop (offload_overlap.make)

    def _reset_sums(self) -> None:
        self.n = 0
        self.sums = {"gpu": 0.0, "host": 0.0, "h2d": 0.0, "d2h": 0.0, "wall": 0.0, "hidden": 0.0}
        self.overlapped_steps = 0
        self.bytes = {"h2d": 0, "d2h": 0}
        self.seen = {"h2d": False, "d2h": False}

    def _mark(self):
        if not self.cuda:
            return time.perf_counter()
        try:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        except Exception as e:   # the view must never take training down: it turns itself off
            self.disable(f"{type(e).__name__}: {e}")
            return None

    def disable(self, why: str) -> None:
        if self.on:
            self.on, self.cur, self.pending = False, None, []
            self.r.event("warning", f"offload view turned off: {why}"[:300], all_ranks=True)

    # --- the loop's calls ----------------------------------------------------------------------
    @_costed
    def start(self) -> None:
        if not self.on:
            return
        self.cur = _Step()
        self._t0 = time.perf_counter()
        mark = self._mark()
        if self.cur is not None:
            self.cur.compute = [mark, None]

    @_costed
    def compute_done(self) -> None:
        """After a backward; the last call of a step is the end of its compute."""
        if self.on and self.cur is not None:
            mark = self._mark()
            if self.cur is not None:
                self.cur.compute[1] = mark

    @contextlib.contextmanager
    def host_step(self):
        if not (self.on and self.cur is not None):
            yield
            return
        t = time.perf_counter()
        try:
            yield
        finally:
            self.cur.host += time.perf_counter() - t

    def overlapped(self, work_s: float) -> None:
        """Inside host_step: the host step's updates took `work_s` host seconds, most of them before this
        (offload_overlap, under the backward); host_step's own time is what the step still waited."""
        if self.on and self.cur is not None:
            self.cur.host_work = work_s

    @_costed
    def end(self) -> None:
        if not (self.on and self.cur is not None):
            return
        self.cur.wall = time.perf_counter() - self._t0
        self.pending.append(self.cur)
        self.cur = None
        self._harvest()

    @_costed
    def report(self, step: int) -> None:
        """The mean over the steps read since the last report, as one line of this rank (log steps)."""
        if not self.on or not self.n:
            return
        n = self.n
        gpu, host = self.sums["gpu"] / n, self.sums["host"] / n
        h2d = self.sums["h2d"] / n if self.seen["h2d"] else None
        d2h = self.sums["d2h"] / n if self.seen["d2h"] else None
        verdict, hint = offload_verdict.verdict(gpu, host, h2d, d2h, self.knobs, on_gpu=self.cuda)
        self.r.emit(P.OffloadTiming(
            run=self.r.run_id, rank=self.r.rank, step=step, steps=n,
            clock="cuda_events" if self.cuda else "wall_clock", step_s=self.sums["wall"] / n, gpu_s=gpu,
            host_step_s=host, h2d_s=h2d, d2h_s=d2h, h2d_bytes=self.bytes["h2d"] // n,
            d2h_bytes=self.bytes["d2h"] // n, pinned_bytes=pinned.pinned_bytes(self.r, self.arena), verdict=verdict, hint=hint,
            view_s=self.view_cost / n, overlap=self.overlap,
            host_hidden_s=self.sums["hidden"] / n if self.overlapped_steps else None))
        self._reset_sums()
        self.view_cost = 0.0

    # --- copies (FSDP2) --------------------------------------------------------------------------
    @_costed
    def copy_begin(self):
        return self._mark() if self.on and self.cuda and self.cur is not None else None

    @_costed
    def copy_end(self, kind: str, begin, nbytes: int, in_host_step: bool = False) -> None:
        if begin is None or self.cur is None:
            return
        end = self._mark()
        if end is None or self.cur is None:
            return
        self.cur.host_has_copies |= in_host_step
        getattr(self.cur, kind).append((begin, end))
        setattr(self.cur, f"{kind}_bytes", getattr(self.cur, f"{kind}_bytes") + nbytes)

    # --- reading back, one step late -------------------------------------------------------------
    def _harvest(self) -> None:
        try:
            self._read()
        except Exception as e:   # an event that cannot be read: the view goes, training stays
            self.disable(f"{type(e).__name__}: {e}")

    def _read(self) -> None:
        keep = []
        for s in self.pending:
            if self.cuda and not _done(s):
                keep.append(s)
                continue
            self._add(s)
        if len(keep) > MAX_PENDING:
            self.dropped += len(keep) - MAX_PENDING
            keep = keep[-MAX_PENDING:]
        self.pending = keep

    def _add(self, s: _Step) -> None:
        if s.compute[1] is None:
            return
        self.n += 1
        self.sums["gpu"] += _span(s.compute[0], s.compute[1])
        self.sums["wall"] += s.wall
        copies = 0.0
        for kind in ("h2d", "d2h"):
            pairs = getattr(s, kind)
            if pairs:
                self.seen[kind] = True
                t = sum(_span(a, b) for a, b in pairs)
                copies += t
                self.sums[kind] += t
                self.bytes[kind] += getattr(s, f"{kind}_bytes")
        if s.host_work is not None:       # the part of the updates the step did not wait for was hidden
            self.overlapped_steps += 1
            self.sums["host"] += s.host_work
            self.sums["hidden"] += max(0.0, s.host_work - s.host)
        else:
            self.sums["host"] += max(0.0, s.host - copies) if s.host_has_copies else s.host


def _span(a, b) -> float:
    if isinstance(a, float):
        return b - a
    return a.elapsed_time(b) / 1000.0


def _done(s: _Step) -> bool:
    events = [e for pair in (s.compute, *s.h2d, *s.d2h) for e in pair if e is not None]
    return all(e.query() for e in events)


# ---------------------------------------------------------------------------------------------------
# FSDP2: the copies, timed where FSDP2 issues them

def instrument_fsdp(model: torch.nn.Module, timing: StepTiming) -> int:
    """Time every offloaded unit's parameter copies (H2D) and gradient copies (D2H). Call after the
    model is built and after anything else sets all-reduce hooks (DeviceGradNorm): the hook here wraps
    theirs. Returns the units instrumented (0 on CPU ranks or with the view off)."""
    if not (timing.on and timing.cuda):
        return 0
    from torch.distributed.fsdp import FSDPModule
    classes: dict[type, type] = {}
    units = 0
    for m in model.modules():
        if not isinstance(m, FSDPModule):
            continue
        for group in _param_groups(m._get_fsdp_state()):
            params = [fp for fp in group.fsdp_params if fp.offload_to_cpu]
            if not params:
                continue
            units += 1
            unit = {"h2d": None, "d2h": None}
            for fp in params:
                fp._sc_timing, fp._sc_unit = timing, unit
                fp._sc_first, fp._sc_last = fp is params[0], fp is params[-1]
                fp.__class__ = classes.setdefault(type(fp), _timed(type(fp)))
            group._all_reduce_hook = _hook_wrapper(group._all_reduce_hook, timing, unit)
    return units


def _param_groups(state) -> list:
    """An FSDP2 state's parameter groups: a list from torch 2.12 (`_fsdp_param_groups`), one group or None
    before (`_fsdp_param_group`: torch 2.11, the GPU machine's, where reading only the list left every copy
    untimed)."""
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is not None:
        return list(groups)
    group = getattr(state, "_fsdp_param_group", None)
    return [group] if group is not None else []


def _hook_wrapper(inner, timing: StepTiming, unit: dict):
    def hook(reduce_output: torch.Tensor) -> None:
        if inner is not None:
            inner(reduce_output)
        unit["d2h"] = timing.copy_begin()    # on the post-reduce stream: the gradient copies come next
    return hook


def _timed(cls: Any) -> type:
    """A subclass of (possibly already replaced) FSDPParam class `cls` that marks the copies."""
    from torch.distributed.fsdp._fully_shard._fsdp_param import ShardedState
    base_inputs, base_to_dtensor = cls.all_gather_inputs, cls.to_sharded_dtensor

    class Timed(cls):   # type: ignore[misc, valid-type]
        @property
        def all_gather_inputs(self):
            timing, unit = self._sc_timing, self._sc_unit
            sharded = timing.on and self.sharded_state == ShardedState.SHARDED
            if sharded and self._sc_first:
                unit["h2d"] = timing.copy_begin()
            out = base_inputs.fget(self)
            if sharded:
                try:
                    unit["h2d_bytes"] = unit.get("h2d_bytes", 0) + sum(t.numel() * t.element_size() for t in out)
                    if self._sc_last:
                        timing.copy_end("h2d", unit["h2d"], unit.pop("h2d_bytes", 0))
                        unit["h2d"] = None
                except Exception as e:   # the view goes, the all-gather stays
                    timing.disable(f"{type(e).__name__}: {e}")
            return out

        def to_sharded_dtensor(self, tensor):
            timing, unit = self._sc_timing, self._sc_unit
            if timing.on and unit["d2h"] is not None and tensor.device.type == "cpu":
                try:
                    unit["d2h_bytes"] = unit.get("d2h_bytes", 0) + tensor.numel() * tensor.element_size()
                    if self._sc_last:
                        timing.copy_end("d2h", unit["d2h"], unit.pop("d2h_bytes", 0))
                        unit["d2h"] = None
                except Exception as e:
                    timing.disable(f"{type(e).__name__}: {e}")
            return base_to_dtensor(self, tensor)
    Timed.__name__ = Timed.__qualname__ = f"Timed{cls.__name__}"
    return Timed


# ---------------------------------------------------------------------------------------------------
# DeepSpeed ZeRO-3: its boundary copies, timed around the optimizer's own methods

# (method, copy direction, runs inside engine.step()). The gradients reach the host in partition_grads
# during backward (DeepSpeed's default, "managed" accumulation) or in the step's finalize (unmanaged);
# the updated weights go back per sub-group inside the step.
DS_COPIES = (("partition_grads", "d2h", False), ("_finalize_offload_gradient_accumulation", "d2h", True),
             ("_reassign_or_swap_out_partitioned_parameters", "h2d", True))


def instrument_deepspeed(engine, timing: StepTiming) -> list[str]:
    """Wrap ZeRO-3's offload copy methods on this engine's optimizer (instance attributes: nothing global).
    Returns the methods wrapped ([] on CPU ranks, with the view off, without optimizer offload, or where the
    optimizer has none of them: stages 1-2)."""
    opt = engine.optimizer
    if not (timing.on and timing.cuda and getattr(opt, "offload_optimizer", False)):
        return []
    boundary = getattr(opt, "is_gradient_accumulation_boundary", lambda: True)
    done = []
    for name, kind, in_step in DS_COPIES:
        fn = getattr(opt, name, None)
        if not callable(fn):
            continue

        def wrapped(*args, _fn=fn, _kind=kind, _in_step=in_step, **kwargs):
            # partition_grads copies to the host only at the accumulation boundary (GPU adds otherwise)
            begin = timing.copy_begin() if _in_step or boundary() else None
            try:
                return _fn(*args, **kwargs)
            finally:
                timing.copy_end(_kind, begin, 0, in_host_step=_in_step)
        setattr(opt, name, wrapped)
        done.append(name)
    return done
