"""The offloaded FSDP2 step overlapped with the backward (fsdp.offload_overlap).

Without it an offloaded step is the sum of its parts: the GPU's forward and backward, then the host's
optimizer step over every shard while the GPU idles (issue 35: 7B fp32 masters, 2.77 s GPU + 1.81 s host
of a 4.57 s step). Here each FSDP unit's host step starts as soon as that unit's gradients have reached
the host, while the GPU runs the backward of the units before it: FSDP2's post_backward of a unit issues
its reduce-scatter and the copies of the gradients to the host, then hands us the unit; a host thread
waits for those copies (CUDA events, the GIL released), steps the unit's parameters (the run's optimizer
narrowed to them in place, partial_step.py) and refreshes their compute copy. At the end of the backward
only the last units' steps (the first layer and the root: backward runs in reverse) are left to wait for.

The update is the one of the plain step: each parameter is stepped once, by the same optimizer with the
same state, hyper-parameters and (RoundedAdamW) the same rounding seeds; fused AdamW's arithmetic is per
tensor, so stepping a unit's tensors apart from the others' changes no bit. What cannot overlap:
- train.clip_grad_norm > 0: the clip factor is the global norm's, known when the last gradient is;
- fp16 loss scaling: an inf anywhere skips the whole step (the scaler's found_inf), known as late;
- a step whose gradients a test fault rewrites after the backward (faults.py's overflow);
- the micro-batches before the last one (no gradient reaches the host before the last backward).
Those steps run as before, after the backward, and the run says so once (an info event) and in the
offload view's `overlap` field.

One host thread runs the units in the order their gradients arrive (a unit's step is a few large
kernels, each parallel over OpenMP threads); it gets every core, at nice 10 with its OpenMP workers, so
the thread that launches the GPU's backward takes a core from it whenever it wakes. (H200, 3b under the
24 GiB cap, one call: 1.528 s a step on all cores but one at the rank's priority, 1.494 s at nice 10,
1.452 s on all 16 cores at nice 10; fewer threads were slower at every size, and holding the host
thread to some cores was slower too: benchmarks/results/issue35_20261202.) One thread, not several:
the optimizer's state dict and torch.compile'd host update (RoundedAdamW) are then never used by two
threads at once, and the order is fixed.

The next step's parameter copies need no help here: FSDP2's forward prefetch already issues layer i+1's
copy under layer i's compute, and the first units' copies cannot start earlier than the end of their
steps, which are the last of the backward.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from shardconsole.backends.optim import adam_mini, master_update
from shardconsole.backends.rank.common import Rank
from shardconsole.backends.rank.knobs import Knobs
from shardconsole.backends.offload.host_copy import ComputeCopy
from shardconsole.backends.optim.partial_step import PartialStep


def why_not(r: Rank, optim: torch.optim.Optimizer, scaler) -> str:
    """Why the host step cannot overlap the backward in this run ("" when it can)."""
    cfg = r.cfg
    if not (cfg.fsdp.cpu_offload and cfg.fsdp.offload_overlap):
        return "off"
    if type(optim) not in (torch.optim.AdamW, master_update.RoundedAdamW, adam_mini.AdamMini):
        return f"off: optim.name = {cfg.optim.name!r} steps on the device"
    if scaler is not None:
        return "off: fp16 loss scaling skips a step on an inf in any gradient, known only after the backward"
    if cfg.train.clip_grad_norm > 0:
        return (f"off: train.clip_grad_norm = {cfg.train.clip_grad_norm:g} needs the global gradient norm "
                f"before any update (set it to 0 to overlap)")
    return ""


class _Unit:
    """One FSDP2 parameter group: its optimizer parameters and the compute copies they feed."""

    def __init__(self, group, in_optim: set[int], copy) -> None:
        self.group = group
        fps = list(group.fsdp_params)
        self.params = [fp.sharded_param for fp in fps if id(fp.sharded_param) in in_optim]
        copied = set(map(id, copy.params)) if copy is not None else set()
        self.copies = [fp for fp in fps if id(fp) in copied]


class Overlap:
    """Arms each step's last backward; `finish` waits for the units' steps and returns the host seconds
    they took (the part of them that ran under the backward is that less the wait)."""

    def __init__(self, r: Rank, model: torch.nn.Module, optim: torch.optim.Optimizer,
                 compute_copy: ComputeCopy | None = None) -> None:
        from shardconsole.backends.offload.host_copy import fsdp_params
        from torch.distributed.fsdp import FSDPModule
        self.r, self.optim = r, optim
        self.partial = PartialStep(optim)     # the one optimizer narrowed to a unit (partial_step.py)
        in_optim = {id(p) for g in optim.param_groups for p in g["params"]}
        self.units: list[_Unit] = []
        for m in model.modules():
            if isinstance(m, FSDPModule):
                for group in _param_groups(m._get_fsdp_state()):
                    unit = _Unit(group, in_optim, compute_copy)
                    if unit.params:
                        self.units.append(unit)
                        group.post_backward = self._wrap(group.post_backward, unit)
        covered = {id(p) for u in self.units for p in u.params}
        # A parameter outside every unit would be stepped by nobody: the plain step then (never seen).
        self.complete = covered == in_optim and len(fsdp_params(model)) > 0
        self.plan, cores, switch_s, self.nice = _host_threads(r.knobs)
        self.threads = self.step_threads = self.plan[0]
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="host-step",
                                       initializer=_start_host_thread, initargs=(self.threads, cores, self.nice))
        if switch_s:
            sys.setswitchinterval(switch_s)
        self.blocking = not r.knobs.overlap_spin
        # RoundedAdamW's host update is torch.compile'd at its first call: that step runs plain, so Dynamo
        # and Inductor compile on the main thread, and the host thread only calls the compiled code.
        self.cold = isinstance(optim, master_update.RoundedAdamW) and optim.compile
        self.armed = False
        self.in_flight = InFlight(r.cfg.fsdp.offload_grads_in_flight)
        self.said_most = 0
        self.futures: list[Future] = []
        self.stepped: set[int] = set()
        self.work_s = 0.0

    def arm(self, step: int) -> bool:
        """Before the last micro-batch's backward: its units step as their gradients land. Not on a step
        whose gradients a test fault rewrites after the backward."""
        self.armed = self.complete and not self.cold and not self.r.faults.changes_grads(step)
        if len(self.plan) > 1:      # a benchmark's sweep: one thread count a step, said in the rank log
            self.step_threads = self.plan[step % len(self.plan)]
            self.r.log(f"offload overlap: step {step} on {self.step_threads} OpenMP threads")
        self.cold = False
        return self.armed

    def _wrap(self, post_backward, unit: _Unit):
        def hooked(*args, **kwargs):
            out = post_backward(*args, **kwargs)
            if self.armed and id(unit) not in self.stepped:
                params = [p for p in unit.params if p.grad is not None]
                if params:     # None: this call reduced nothing (FSDP2 calls it again at the end)
                    self.stepped.add(id(unit))
                    events = _landed(unit.group, self.blocking)
                    # Held here, the backward's next unit is not launched: its gradients' pinned blocks
                    # wait for the host step to free earlier ones (fsdp.offload_grads_in_flight)
                    self.in_flight.admit(self.futures)
                    self.futures.append(self.pool.submit(self._step, unit, params, events, self.step_threads))
            return out
        return hooked

    def _step(self, unit: _Unit, params: list, events: list, threads: int) -> float:
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
        for e in events:
            e.synchronize()       # the unit's gradients are on the host (releases the GIL)
        t = time.perf_counter()
        with torch.no_grad():
            self.partial.step(params)
            # Stepped: the unit's host gradients are done with (no clip or scaler reads them when the step
            # overlaps), so they go now, not at the step's end. The whole model's gradients are then never
            # on the host at once, only the units between landing and stepping (adam-mini's 6 bytes a
            # parameter would be 8 with bf16 gradients held to the end, 10 with fp32 ones).
            for p in params:
                p.grad = None
            if unit.copies:
                torch._foreach_copy_([fp._compute_copy for fp in unit.copies],
                                     [fp._sharded_param_data for fp in unit.copies])
        return time.perf_counter() - t

    def finish(self) -> float:
        """After the backward: every unit's step done (the last ones waited for); the units whose
        post_backward reduced nothing had no gradient, so the plain step would skip them too. Returns
        the host seconds of this step's updates."""
        try:
            work = sum(f.result() for f in self.futures)
        finally:
            self.futures, self.stepped, self.armed = [], set(), False
        gate = self.in_flight
        if gate.most > self.said_most:      # said when it grows: the rank log shows the bound held
            self.said_most = gate.most
            self.r.log(f"offload overlap: at most {gate.most} units' gradients on the host at once "
                       f"(fsdp.offload_grads_in_flight = {gate.bound or 'no bound'}; the backward waited "
                       f"{gate.waits} times so far)")
        return work

    def close(self) -> None:
        self.pool.shutdown(wait=True)


class InFlight:
    """At most `bound` units' gradients on the host at once (0: no bound): the unit landing now and those whose
    host step has not ended. Without a bound the host thread ran 10-14 layers behind the backward on the H100
    box (a third of the layers: 24 GiB of pinned gradient blocks at 24B, benchmarks/results/issue60); held to a
    few, the backward waits instead, and the step's length is unchanged wherever the host step was the longer
    part anyway (the last layers' steps wait at the end of the backward either way)."""

    def __init__(self, bound: int) -> None:
        self.bound = bound
        self.waits = 0      # times the backward waited
        self.most = 0       # the most units' gradients seen on the host at once, the landing one counted

    def admit(self, futures: list[Future]) -> None:
        """Before the landing unit's step is queued behind `futures` (in order: one host thread): waits for
        the oldest unfinished steps until bound - 1 are left."""
        pending = [f for f in futures if not f.done()]
        if self.bound:
            excess = len(pending) - (self.bound - 1)
            if excess > 0:
                self.waits += 1
                for f in pending[:excess]:
                    f.result()      # releases the GIL; a failed step raises here, in the backward
                pending = pending[excess:]
        self.most = max(self.most, len(pending) + 1)


def _param_groups(state) -> list:
    groups = getattr(state, "_fsdp_param_groups", None)     # torch >= 2.12; one group before
    if groups is not None:
        return list(groups)
    group = getattr(state, "_fsdp_param_group", None)
    return [group] if group is not None else []




def _host_threads(knobs: Knobs) -> tuple[list[int], list[int] | None, float, int]:
    """(the host step's OpenMP threads, one count or a benchmark's sweep of one a step; the cores its
    thread is held to or None; the interpreter's GIL switch interval to set or 0; the nice value of the
    host thread and its OpenMP workers, 0 = the rank's). Every core at HOST_NICE by default;
    SHARDCONSOLE_OVERLAP_THREADS (N or N,M,...), _PIN=1, _SWITCH_S and _NICE=N are the benchmarks'
    knobs for the contention with the thread that launches the backward."""
    allowed = sorted(os.sched_getaffinity(0))
    asked = list(knobs.overlap_threads)
    plan = [max(1, min(n, len(allowed))) for n in asked or [torch.get_num_threads()]]
    threads = max(plan)
    cores = allowed[-threads:] if knobs.overlap_pin and threads < len(allowed) else None
    return plan, cores, knobs.overlap_switch_s, knobs.overlap_nice


def _start_host_thread(threads: int, cores: list[int] | None, nice: int = 0) -> None:
    """The host thread's start: its cores and its nice value (Linux: both are this thread's only, and
    the OpenMP workers it then starts inherit them), so a lower priority lets the thread that launches
    the GPU's work take a core from the host step at once."""
    if cores:
        os.sched_setaffinity(0, cores)
    tid = threading.get_native_id()
    if nice > os.getpriority(os.PRIO_PROCESS, tid):      # only ever lower (a niced rank stays as it is)
        os.setpriority(os.PRIO_PROCESS, tid, nice)
    torch.set_num_threads(threads)


def _landed(group, blocking: bool = True) -> list:
    """Events after this unit's gradient copies to the host, on every stream FSDP2 may have issued them
    on (the reduce-scatter's, or the all-reduce's for hybrid sharding or an all-reduce hook): recorded
    now, right after its post_backward queued them. None on CPU ranks: their copies are synchronous."""
    if group.device.type != "cuda":
        return []
    ctx = group.comm_ctx
    streams = {id(s): s for s in (getattr(ctx, "reduce_scatter_stream", None), getattr(ctx, "all_reduce_stream", None),
                                  getattr(group, "_all_reduce_hook_stream", None)) if s is not None}
    # Blocking events: the host thread sleeps in the driver while it waits, rather than spinning a core
    # and the driver's locks beside the thread that launches the backward.
    return [s.record_event(torch.cuda.Event(blocking=blocking)) for s in streams.values()]


def make(r: Rank, model: torch.nn.Module, optim: torch.optim.Optimizer, scaler,
         compute_copy: ComputeCopy | None = None) -> tuple[Overlap | None, str]:
    """(the overlap or None, why not). Said once: on, or why off, when the run offloads."""
    reason = why_not(r, optim, scaler)
    if not r.cfg.fsdp.cpu_offload:
        return None, ""
    if reason == "off":
        return None, "off (fsdp.offload_overlap = false)"
    if reason:
        r.event("info", f"fsdp.offload_overlap: the host step runs after the backward, {reason[5:]}")
        return None, reason
    overlap = Overlap(r, model, optim, compute_copy)
    if not overlap.complete:
        overlap.close()
        return None, "off: some trained parameters are in no FSDP2 unit"
    r.log(f"offload: each unit's host step starts when its gradients reach the host, under the backward "
          f"(one host thread, {overlap.threads} OpenMP threads, at nice {overlap.nice} or the rank's if higher)")
    return overlap, "on"
