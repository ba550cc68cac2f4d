"""SHARDCONSOLE_PROFILE=A-B: where the steps' time went, measured by torch's profiler over steps A to B.

A step line says how fast; this says why. Each rank profiles its steps A..B (the first steps compile and
warm the allocator, so A is best past them) and writes, in the run folder's profile/:
    rank<R>.txt          the kernels (on a GPU) or the operators (on CPU) by self time, torch's own table
    rank<R>.trace.json   the timeline, for Perfetto or chrome://tracing
and logs one line: the profiled wall time, the kernel time within it, and that time by kind (matmul,
attention, communication, copies, optimizer, elementwise, other): "profile steps 20-22 (rank 0, cuda): 1.95 s wall,
kernels 1.82 s (93%): matmul 61% · elementwise 16% · ..." The kinds come from the kernels' names: a name
that no pattern knows is "other", so an unknown kernel is never counted as the wrong kind.
"""

from __future__ import annotations

import time

import torch
from torch.autograd import DeviceType

from shardconsole.backends.rank.common import Rank
from shardconsole.settings.config import write_atomic

# Lower-case substrings of kernel / operator names, tried in this order (attention before matmul: flash
# kernels' names hold "gemm"-like words; communication before copies: NCCL's kernels copy too).
KINDS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("attention", ("flash", "fmha", "attention", "sdpa", "cudnn_mha")),
    ("communication", ("nccl", "gloo", "all_gather", "allgather", "reduce_scatter", "all_reduce", "allreduce",
                       "broadcast", "c10d", "fsdp::")),
    ("matmul", ("gemm", "_scaled_mm", "matmul", "cutlass", "xmma", "nvjet", "cublas", "aten::mm", "aten::addmm",
                "aten::bmm", "aten::linear", "mkldnn", "wgmma")),
    ("copies", ("memcpy", "memset", "aten::copy_", "aten::to", "aten::_to_copy", "cat_", "catarraybatched",
                "copy_kernel")),
    ("optimizer", ("adam", "multi_tensor", "foreach", "sgd")),
    # what inductor fuses (triton_*) and eager's element-wise kernels: norms, SiLU, RoPE, casts, softmax
    ("elementwise", ("triton_", "elementwise", "softmax", "reduce_kernel", "norm", "silu", "aten::mul",
                     "aten::add", "aten::pow", "aten::rsqrt")),
)


def kind_of(name: str) -> str:
    low = name.lower()
    for kind, words in KINDS:
        if any(w in low for w in words):
            return kind
    return "other"


def by_kind(times: dict[str, float]) -> dict[str, float]:
    """Self times of kernels (name -> seconds) summed by kind, largest first."""
    out: dict[str, float] = {}
    for name, s in times.items():
        k = kind_of(name)
        out[k] = out.get(k, 0.0) + s
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def summary_line(first: int, last: int, rank: int, device: str, wall_s: float, kinds: dict[str, float]) -> str:
    busy = sum(kinds.values())
    what = "kernels" if device == "cuda" else "operators' self time (every thread)"
    parts = " · ".join(f"{k} {v / busy:.0%}" for k, v in kinds.items() if v / busy >= 0.005) if busy else "none"
    share = f" ({busy / wall_s:.0%})" if device == "cuda" and wall_s > 0 else ""
    return (f"profile steps {first}-{last} (rank {rank}, {device}): {wall_s:.2f} s wall, {what} "
            f"{busy:.2f} s{share}: {parts}")


class StepProfiler:
    """Started before step A, stopped after step B (or the run's last step, when that comes first)."""

    def __init__(self, r: Rank) -> None:
        self.r = r
        span = r.knobs.profile_steps
        self.first, self.last = span if span else (0, -1)
        self.last = min(self.last, r.cfg.train.steps)
        self.prof: torch.profiler.profile | None = None
        self.done = False
        self.t0, self.started = 0.0, 0

    def _sync(self) -> None:
        if self.r.is_cuda:
            torch.cuda.synchronize(self.r.device)

    def before(self, step: int) -> None:
        # from the first step in A..B this session trains (a resume past A starts where it resumed)
        if self.prof is not None or self.done or not self.first <= step <= self.last:
            return
        acts = [torch.profiler.ProfilerActivity.CPU]
        if self.r.is_cuda:
            acts.append(torch.profiler.ProfilerActivity.CUDA)
        self._sync()
        self.prof = torch.profiler.profile(activities=acts)
        self.prof.__enter__()
        self.t0, self.started = time.perf_counter(), step

    def after(self, step: int) -> None:
        if self.prof is None or step != self.last:
            return
        self._sync()
        wall = time.perf_counter() - self.t0
        prof, self.prof, self.done = self.prof, None, True
        prof.__exit__(None, None, None)
        self._report(prof, wall)

    def _report(self, prof: torch.profiler.profile, wall: float) -> None:
        cuda = self.r.is_cuda
        times: dict[str, float] = {}
        averages = prof.key_averages()      # one aggregation for the kinds and the table
        for ev in averages:
            if getattr(ev, "is_user_annotation", False):
                continue    # a labelled region (Optimizer.step#AdamW.step) whose kernels are counted already
            if cuda and ev.device_type == DeviceType.CUDA:
                times[ev.key] = times.get(ev.key, 0.0) + ev.self_device_time_total / 1e6
            elif not cuda and ev.device_type == DeviceType.CPU:
                times[ev.key] = times.get(ev.key, 0.0) + ev.self_cpu_time_total / 1e6
        out = self.r.run_dir / "profile"
        sort = "self_device_time_total" if cuda else "self_cpu_time_total"
        table = averages.table(sort_by=sort, row_limit=60, max_name_column_width=90)
        write_atomic(out / f"rank{self.r.rank}.txt", table)     # makes profile/
        prof.export_chrome_trace(str(out / f"rank{self.r.rank}.trace.json"))
        line = summary_line(self.started, self.last, self.r.rank, self.r.device.type, wall, by_kind(times))
        self.r.log(f"{line}; the kernels in {out}/rank{self.r.rank}.txt")

