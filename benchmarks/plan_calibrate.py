"""Calibrate the memory planner (shardconsole/plan/) against real runs.

Runs a matrix of short training runs through the product's own headless path
(`python -m shardconsole --preset BASE --headless --set ... --run-dir DIR`), measures each one's peaks
and writes them, with the planner's prediction for the same settings, to one JSON file:

  GPU   max over ranks of the allocator's peak reserved bytes (memory lines: peak_reserved_bytes),
        and NVML's used bytes of the device (sampled here every 0.2 s and by the front end's gpu lines)
        minus what was in use before the run;
  host  peak RSS (VmHWM, read from /proc while the run lives) of every rank, of torchrun's agent and of
        the headless front end; also the ranks' RSS from their memory lines;
  fate  finished, or failed with its cause (gpu_oom ...), from metrics.jsonl.

For each model at least one run is set up to NOT fit under memory.gpu_memory_limit; it must fail
with gpu_oom. Usage on the H200 test machine (one 10-minute call per subset):

    python3 benchmarks/plan_calibrate.py --subset fsdp --out $OUT/plan_fsdp.json        # 16 runs, ~7 min
    python3 benchmarks/plan_calibrate.py --subset deepspeed --out $OUT/plan_ds.json     # 11 runs, ~8.5 min
    python3 benchmarks/plan_calibrate.py --subset edge --out $OUT/plan_edge.json        # 4 runs, ~2.5 min
    python3 benchmarks/plan_calibrate.py --subset issue16 --lanes 3 --out $OUT/plan_issue16.json  # 10 runs, ~4 min
        (issue 16: today's backends, both engines, offload none/optimizer/all, bf16 masters, pinned and
        unpinned, 1b-7b; three runs at a time on the one GPU, peaks per process; the file records the
        code version, plan/calibration.py; committed as benchmarks/data/plan_calibration_issue16.json)
    python3 benchmarks/plan_calibrate.py --merge plan_fsdp.json plan_ds.json plan_edge.json \
        --out benchmarks/data/plan_calibration.json
    python3 benchmarks/plan_calibrate.py --refresh benchmarks/data/plan_calibration.json  # after a planner change
    python3 benchmarks/plan_calibrate.py --docs-table benchmarks/data/plan_calibration.json
    python3 benchmarks/plan_calibrate.py --dry-run            # the matrix with predictions, no GPU needed

The "edge" runs set their cap just above and just below what the planner says the run needs.

A time budget (--time-budget, default 540 s) skips the runs that would not finish in time, so the JSON
is always written (it is also rewritten after every run).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from shardconsole.settings import config as C  # noqa: E402
from shardconsole import plan as PL  # noqa: E402
from shardconsole.settings.models import resolve  # noqa: E402
from shardconsole.plan.calibration import code_version  # noqa: E402
from shardconsole.machine.hardware import device_cap_for_allocator  # noqa: E402

GiB = 2**30

# Settings shared by every run (written as the base preset; each run adds its --set overrides).
BASE_PRESET: dict[str, Any] = {
    "description": "plan calibration base (benchmarks/plan_calibrate.py)",
    "data": {"source": "synthetic"},
    "train": {"steps": 5, "log_every": 1, "warmup_steps": 0, "lr": 1e-4, "save_final": False},
    "parallel": {"nproc_per_node": 1, "device": "cuda", "launcher": "torchrun"},
    "deepspeed": {"torch_adam": False},
}

# The H200 test machine, for --dry-run predictions on a machine without its GPU (docs/MEASURED.md).
H200 = PL.Hardware(gpus=1, gpu_memory_bytes=143771 * 2**20, host_memory_bytes=125 * GiB, gpu_name="NVIDIA H200",
                   source="assumed H200")


@dataclass
class Run:
    name: str
    subset: str                       # "fsdp" or "deepspeed"
    sets: list[str]                   # --set overrides on top of BASE_PRESET
    expect_oom: bool = False          # set up not to fit under its cap
    seconds: float = 30.0             # expected wall time on the H200 (start + build + steps), for the budget
    cap_factor: float = 0.0           # > 0: cap = the planner's required bytes x this (the verdict's edge)
    lane: int = 0                     # --lanes: runs of different lanes run at the same time on one GPU

    @property
    def model(self) -> str:
        return next(s.split("=", 1)[1] for s in self.sets if s.startswith("model.name="))


def _r(name: str, subset: str, model: str, seq: int, mb: int, dtype: str = "bf16", ckpt: bool = False,
       cap: str = "", extra: tuple[str, ...] = (), oom: bool = False, seconds: float = 30.0) -> Run:
    sets = [f"model.name={model}", f"data.seq_len={seq}", f"train.micro_batch={mb}", f"precision.dtype={dtype}",
            f"memory.activation_checkpointing={'true' if ckpt else 'false'}",
            f"parallel.backend={'fsdp' if subset == 'fsdp' else 'deepspeed'}"]
    if cap:
        sets.append(f"memory.gpu_memory_limit={cap}")
    sets += list(extra)
    return Run(name, subset, sets, oom, seconds)


OFF = ("fsdp.cpu_offload=true",)
Z2 = ("deepspeed.stage=2",)
Z3 = ("deepspeed.stage=3",)
Z3_OPT = ("deepspeed.stage=3", "deepspeed.offload_optimizer=cpu")
Z3_ALL = ("deepspeed.stage=3", "deepspeed.offload_optimizer=cpu", "deepspeed.offload_param=cpu")
Z2_OPT = ("deepspeed.stage=2", "deepspeed.offload_optimizer=cpu")

# Times: a 1b step at micro-batch 8 x 2048 is ~0.3 s on the H200 (docs/MEASURED.md); process start, imports
# and the model build (random init drawn on the CPU) take ~15-30 s a run; CPU Adam over 1B parameters
# ~1-2 s a step. DeepSpeed's first CPUAdam JIT build takes 40-60 s (docs/MEASURED.md): counted once.
MATRIX: list[Run] = [
    # --- FSDP2 ---------------------------------------------------------------------------------
    _r("fsdp-125m-bf16-mb8", "fsdp", "125m", 1024, 8, seconds=15),
    _r("fsdp-125m-bf16-mb16-ckpt", "fsdp", "125m", 1024, 16, ckpt=True, seconds=15),
    _r("fsdp-125m-fp16-mb8-offload", "fsdp", "125m", 1024, 8, "fp16", extra=OFF, seconds=18),
    _r("fsdp-125m-eager-mb4", "fsdp", "125m", 1024, 4, extra=("model.attn_implementation=eager",), seconds=15),
    _r("fsdp-125m-oom-6GiB", "fsdp", "125m", 2048, 16, cap="6GiB", oom=True, seconds=15),
    _r("fsdp-1b-bf16-mb4", "fsdp", "1b", 2048, 4, seconds=25),
    _r("fsdp-1b-fp16-mb8", "fsdp", "1b", 2048, 8, "fp16", seconds=28),
    _r("fsdp-1b-bf16-mb8-ckpt", "fsdp", "1b", 2048, 8, ckpt=True, seconds=28),
    _r("fsdp-1b-bf16-mb4-ckpt-cap24", "fsdp", "1b", 2048, 4, ckpt=True, cap="24GiB", seconds=25),
    _r("fsdp-1b-bf16-mb2-accum2-ckpt", "fsdp", "1b", 2048, 2, ckpt=True, extra=("train.grad_accum=2",), seconds=25),
    _r("fsdp-1b-shard_grad_op-mb4-ckpt", "fsdp", "1b", 2048, 4, ckpt=True, extra=("fsdp.sharding=shard_grad_op",),
       seconds=25),
    _r("fsdp-1b-offload-mb4-ckpt-cap24", "fsdp", "1b", 2048, 4, ckpt=True, cap="24GiB", extra=OFF, seconds=40),
    _r("fsdp-1b-fp16-offload-mb2", "fsdp", "1b", 2048, 2, "fp16", extra=OFF, seconds=40),
    _r("fsdp-1b-oom-24GiB", "fsdp", "1b", 2048, 8, cap="24GiB", oom=True, seconds=22),
    _r("fsdp-3b-bf16-mb4-ckpt", "fsdp", "3b", 2048, 4, ckpt=True, seconds=50),
    _r("fsdp-3b-oom-24GiB", "fsdp", "3b", 2048, 1, ckpt=True, cap="24GiB", oom=True, seconds=45),
    # --- DeepSpeed ZeRO ------------------------------------------------------------------------
    _r("ds-125m-z3-bf16-mb8", "deepspeed", "125m", 1024, 8, extra=Z3, seconds=20),
    _r("ds-125m-z2-fp16-mb8-ckpt", "deepspeed", "125m", 1024, 8, "fp16", ckpt=True, extra=Z2, seconds=20),
    _r("ds-125m-z3-optoff-fp16-mb8", "deepspeed", "125m", 1024, 8, "fp16", extra=Z3_OPT, seconds=80),  # + CPUAdam build
    _r("ds-125m-oom-4GiB", "deepspeed", "125m", 2048, 16, cap="4GiB", extra=Z3, oom=True, seconds=20),
    _r("ds-1b-z3-bf16-mb4", "deepspeed", "1b", 2048, 4, extra=Z3, seconds=35),
    _r("ds-1b-z3-bf16-mb8-ckpt", "deepspeed", "1b", 2048, 8, ckpt=True, extra=Z3, seconds=35),
    _r("ds-1b-z2-bf16-mb4-ckpt", "deepspeed", "1b", 2048, 4, ckpt=True, extra=Z2, seconds=35),
    _r("ds-1b-z3-optoff-mb4-ckpt-cap24", "deepspeed", "1b", 2048, 4, ckpt=True, cap="24GiB", extra=Z3_OPT, seconds=45),
    _r("ds-1b-z3-alloff-mb4-ckpt-cap24", "deepspeed", "1b", 2048, 4, ckpt=True, cap="24GiB", extra=Z3_ALL, seconds=50),
    _r("ds-1b-z2-optoff-fp16-mb4-ckpt", "deepspeed", "1b", 2048, 4, "fp16", ckpt=True, extra=Z2_OPT, seconds=45),
    _r("ds-1b-oom-24GiB", "deepspeed", "1b", 2048, 8, cap="24GiB", extra=Z3, oom=True, seconds=30),
]
# Issue 16: the planner on today's backends (ZeRO-3 gathers each decoder layer whole; bf16 masters;
# pinned and unpinned host buffers; 1b-7b). Run in lanes on the one H200 (--lanes 3): the peaks are
# per process (memory lines, VmHWM, NVML's per-process bytes), so lanes do not disturb them; the
# host RAM of the lanes' runs is kept under the machine's 128 GiB (the 7b run overlaps only small ones).
BF16M = ("precision.master_dtype=bf16",)
UNPIN_F, UNPIN_D = ("fsdp.pin_memory=false",), ("deepspeed.pin_memory=false",)
COMPILED = ("train.compile=true",)
for _run, _lane in (
        (_r("i16-ds-1b-z3-alloff-mb4-ckpt-cap24", "deepspeed", "1b", 2048, 4, ckpt=True, cap="24GiB", extra=Z3_ALL,
            seconds=100), 0),
        (_r("i16-ds-3b-z3-alloff-bf16m-mb4-ckpt-cap24", "deepspeed", "3b", 2048, 4, ckpt=True, cap="24GiB",
            extra=Z3_ALL + BF16M, seconds=110), 0),
        (_r("i16-ds-1b-z3-optoff-bf16m-unpinned-mb4-ckpt", "deepspeed", "1b", 2048, 4, ckpt=True, cap="24GiB",
            extra=Z3_OPT + BF16M + UNPIN_D, seconds=50), 0),
        (_r("i16-fsdp-7b-offload-bf16m-mb8-ckpt-cap24", "fsdp", "7b", 2048, 8, ckpt=True, cap="24GiB",
            extra=OFF + BF16M, seconds=70), 1),
        (_r("i16-fsdp-1b-offload-bf16m-unpinned-mb8-ckpt", "fsdp", "1b", 2048, 8, ckpt=True, cap="24GiB",
            extra=OFF + BF16M + UNPIN_F, seconds=35), 1),
        (_r("i16-fsdp-1b-offload-mb8-ckpt-cap24", "fsdp", "1b", 2048, 8, ckpt=True, cap="24GiB", extra=OFF,
            seconds=40), 1),
        (_r("i16-ds-1b-z3-bf16-mb4-ckpt", "deepspeed", "1b", 2048, 4, ckpt=True, extra=Z3, seconds=35), 2),
        (_r("i16-ds-3b-z3-bf16m-mb4-ckpt", "deepspeed", "3b", 2048, 4, ckpt=True, extra=Z3 + BF16M, seconds=50), 2),
        (_r("i16-fsdp-3b-fp16-mb4-ckpt", "fsdp", "3b", 2048, 4, "fp16", ckpt=True, seconds=45), 2),
        (_r("i16-ds-1b-z2-optoff-bf16-mb4-ckpt", "deepspeed", "1b", 2048, 4, ckpt=True, extra=Z2_OPT, seconds=45), 2),
        # issue 34: compiled runs (the host figure holds torch.compile's sidecar and workers)
        (_r("i34-fsdp-1b-mb4-compiled-cap24", "fsdp", "1b", 2048, 4, cap="24GiB", extra=COMPILED, seconds=80), 2)):
    _run.lane, _run.subset = _lane, "issue16"
    MATRIX.append(_run)

# The verdict's edge: the cap set just above and just below what the planner says a run needs
# (gpu_required_bytes: its allocated peak + 5% + 256 MiB), so a wrong margin shows as a wrong verdict.
for _name, _subset, _model, _mb, _extra in (("fsdp-1b-mb8-ckpt", "fsdp", "1b", 8, ()),
                                            ("ds-1b-z3-mb4-ckpt", "deepspeed", "1b", 4, Z3)):
    for _factor, _tag in ((1.08, "above"), (0.92, "below")):
        _run = _r(f"edge-{_name}-{_tag}", _subset, _model, 2048, _mb, ckpt=True, extra=_extra,
                  oom=_factor < 1, seconds=35)
        _run.subset, _run.cap_factor = "edge", _factor
        MATRIX.append(_run)


# ---------------------------------------------------------------------------------------------------
# Prediction

def resolve_cap(run: Run, hw: PL.Hardware) -> Run:
    """An edge run's cap in bytes, from the planner's requirement for the same settings uncapped."""
    if not run.cap_factor or any(x.startswith("memory.gpu_memory_limit=") for x in run.sets):
        return run
    cfg = C.build(BASE_PRESET, "calibration base", run.sets)
    need = PL.estimate(cfg, resolve(cfg.model.name), hw).gpu_required_bytes
    # the cap is the whole device (issue 34): the one whose allocator share is need x factor
    cap = device_cap_for_allocator(int(need * run.cap_factor), cfg.parallel.backend)
    return Run(run.name, run.subset, run.sets + [f"memory.gpu_memory_limit={cap}"],
               run.expect_oom, run.seconds, run.cap_factor, run.lane)


def config_of(run: Run) -> C.RunConfig:
    return C.build(BASE_PRESET, "calibration base", run.sets)


def predict(run: Run, hw: PL.Hardware) -> dict[str, Any]:
    cfg = config_of(run)
    e = PL.estimate(cfg, resolve(cfg.model.name), hw)
    return {"gpu_peak_bytes": e.gpu_peak_bytes, "gpu_allocator_peak_bytes": e.gpu_allocator_peak_bytes,
            "gpu_allocated_peak_bytes": e.gpu_allocated_peak_bytes, "gpu_required_bytes": e.gpu_required_bytes,
            "host_peak_bytes": e.host_peak_bytes, "host_rank_bytes": e.host_rank_bytes, "fits": e.fits,
            "phase": e.gpu_peak_phase, "gpu_parts": e.gpu_parts, "host_parts": e.host_parts,
            "verdict": e.verdict}


def other_estimators(run: Run) -> dict[str, Any]:
    """DeepSpeed's and accelerate's own estimates for the same model, when importable, for the table
    in docs/PLANNER.md. Both count model states only."""
    cfg = config_of(run)
    spec = resolve(cfg.model.name)
    s = PL.Shapes.of(spec)
    out: dict[str, Any] = {}
    out.update(deepspeed_estimates(s.n_params, s.vocab * s.hidden))
    out["accelerate_training_bytes"] = accelerate_estimate(s.n_params, cfg.precision.dtype)
    return out


def deepspeed_estimates(n_params: int, largest_layer: int) -> dict[str, Any]:
    """DeepSpeed's estimate_zero{2,3}_model_states_mem_needs for one GPU, per offload setting
    (GPU bytes, CPU bytes); None when deepspeed cannot be imported."""
    try:
        from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs as z3
        from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs as z2
    except Exception:   # not installed, or its import fails on this machine
        return {"deepspeed_estimates": None}
    est = {}
    for off_opt, off_par, key in ((False, False, "zero3"), (True, False, "zero3_optoff"), (True, True, "zero3_alloff")):
        cpu, gpu, _ = z3(n_params, largest_layer, 1, 1, cpu_offload=off_opt, cpu_offload_params=off_par,
                         zero_init=True)
        est[key] = {"gpu_bytes": int(gpu), "cpu_bytes": int(cpu)}
    for off, key in ((False, "zero2"), (True, "zero2_optoff")):
        cpu, gpu = z2(n_params, 1, 1, cpu_offload=off)
        est[key] = {"gpu_bytes": int(gpu), "cpu_bytes": int(cpu)}
    return {"deepspeed_estimates": est}


def accelerate_estimate(n_params: int, dtype: str) -> int:
    """accelerate estimate-memory's "Training using Adam" figure: the largest of its parts (model,
    gradients, optimizer, step) for the fp32 model size (accelerate/commands/estimate.py
    estimate_training_usage): fp32 -> 4x the fp32 size; fp16/bf16 mixed -> 2x (its optimizer part)."""
    fp32 = 4 * n_params
    return 4 * fp32 if dtype == "fp32" else 2 * fp32


# ---------------------------------------------------------------------------------------------------
# Measurement

def _status_kb(pid: int, key: str) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        return None
    return None


class Nvml:
    """Device-wide used bytes, sampled here (the front end samples too, once a second)."""

    def __init__(self) -> None:
        self.handles = []
        try:
            import pynvml
            pynvml.nvmlInit()
            self.nv = pynvml
            self.handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
        except Exception:
            self.handles = []

    def used(self) -> list[int]:
        out = []
        for h in self.handles:
            try:
                out.append(int(self.nv.nvmlDeviceGetMemoryInfo(h).used))
            except Exception:
                out.append(0)
        return out

    def used_by(self, pids: set[int]) -> int | None:
        """NVML's bytes of these processes (context included), summed over the devices; None when
        NVML cannot list processes. Runs sharing the GPU (--lanes) are told apart by this."""
        if not self.handles:
            return None
        total, seen = 0, False
        for h in self.handles:
            try:
                procs = self.nv.nvmlDeviceGetComputeRunningProcesses(h)
            except Exception:
                return None
            for pr in procs:
                if pr.pid in pids and pr.usedGpuMemory:
                    total += int(pr.usedGpuMemory)
                    seen = True
        return total if seen else None

    def info(self) -> dict[str, Any]:
        if not self.handles:
            return {}
        h = self.handles[0]
        name = self.nv.nvmlDeviceGetName(h)
        return {"name": name.decode() if isinstance(name, bytes) else name,
                "total_bytes": int(self.nv.nvmlDeviceGetMemoryInfo(h).total), "count": len(self.handles)}


def _read_metrics(path: Path) -> list[dict[str, Any]]:
    out = []
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return out
    for line in text.splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


class _Tail:
    """New complete lines of a growing metrics.jsonl, parsed."""

    def __init__(self, path: Path) -> None:
        self.path, self.pos, self.buf = path, 0, b""

    def read(self) -> list[dict[str, Any]]:
        try:
            with open(self.path, "rb") as fh:
                fh.seek(self.pos)
                data = fh.read()
        except OSError:
            return []
        self.pos += len(data)
        self.buf += data
        *lines, self.buf = self.buf.split(b"\n")
        out = []
        for line in lines:
            try:
                out.append(json.loads(line))
            except (json.JSONDecodeError, UnicodeDecodeError):
                continue
        return out


def _children_pss(pids) -> int:
    """The summed PSS of the descendants of `pids` that are Python (torch.compile's sidecar and workers;
    0 when there are none, or psutil cannot read them). DeepSpeed's JIT op builds (ninja, nvcc, c++) are
    left out: a machine's first DeepSpeed run makes them once (2.6-3.6 GiB for a moment on the H200), and
    the plan names them in a note rather than in its steady figure."""
    import psutil
    total = 0
    for pid in pids:
        try:
            kids = psutil.Process(pid).children(recursive=True)
        except psutil.Error:
            continue
        for k in kids:
            try:
                if "python" not in k.name().lower():
                    continue
                total += k.memory_full_info().pss
            except (psutil.Error, AttributeError):
                continue
    return total


def _tail(path: Path, n: int = 2500) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return ""


def measure(run: Run, base_file: Path, runs_root: Path, timeout_s: float, nvml: Nvml,
            shared: bool = False) -> dict[str, Any]:
    run_dir = runs_root / run.name
    argv = [sys.executable, "-m", "shardconsole", "--preset", str(base_file), "--headless"]
    for s in run.sets:
        argv += ["--set", s]
    argv += ["--run-dir", str(run_dir)]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    # DeepSpeed's op builder cannot parse "9.0a" (docs/MEASURED.md): build for 9.0.
    if "a" in env.get("TORCH_CUDA_ARCH_LIST", ""):
        env["TORCH_CUDA_ARCH_LIST"] = env["TORCH_CUDA_ARCH_LIST"].replace("9.0a", "9.0")
    base_used = nvml.used()
    t0 = time.monotonic()
    log = open(runs_root / f"{run.name}.front.log", "wb")
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=str(ROOT))
    hwm: dict[int, int] = {}            # pid -> VmHWM seen
    role: dict[int, str] = {proc.pid: "front end"}
    nvml_max = [0] * len(base_used)
    nvml_proc_max = 0
    rss_by_phase: dict[str, int] = {}   # the ranks' summed VmRSS, largest seen in each phase of rank 0
    workers_max = 0                     # the ranks' child processes (torch.compile's sidecar and workers), PSS
    phase = "starting"
    tail = _Tail(run_dir / "metrics.jsonl")
    timed_out = False
    while True:
        rc = proc.poll()
        job = run_dir / "job.json"
        if job.is_file() and not any(r == "launcher" for r in role.values()):
            try:
                role[int(json.loads(job.read_text())["pid"])] = "launcher"
            except (ValueError, KeyError, OSError):
                pass
        for m in tail.read():
            if m.get("kind") == "hello" and m.get("pid"):
                role.setdefault(int(m["pid"]), f"rank {m.get('rank', 0)}")
            elif m.get("kind") == "event" and m.get("name") == "phase" and m.get("rank") == 0:
                phase = str(m.get("detail"))
        workers = _children_pss(p for p, r in role.items() if r.startswith("rank"))
        if workers:
            workers_max = max(workers_max, workers)
        rss = 0
        for pid in list(role):
            v = _status_kb(pid, "VmHWM")
            if v is not None:
                hwm[pid] = max(hwm.get(pid, 0), v)
            if role[pid].startswith("rank"):
                rss += _status_kb(pid, "VmRSS") or 0
        if rss:
            rss_by_phase[phase] = max(rss_by_phase.get(phase, 0), rss)
        for i, u in enumerate(nvml.used()):
            nvml_max[i] = max(nvml_max[i], u)
        mine = nvml.used_by({p for p, r in role.items() if r.startswith("rank")})
        if mine:
            nvml_proc_max = max(nvml_proc_max, mine)
        if rc is not None:
            break
        if time.monotonic() - t0 > timeout_s:
            timed_out = True
            proc.send_signal(signal.SIGINT)      # the front end stops the ranks (SIGTERM, grace, SIGKILL)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                try:
                    pgid = json.loads((run_dir / "job.json").read_text())["pid"]
                    os.killpg(int(pgid), signal.SIGKILL)
                except (OSError, ValueError, KeyError):
                    pass
            rc = proc.wait()
            break
        time.sleep(0.2)
    log.close()
    wall = time.monotonic() - t0
    msgs = _read_metrics(run_dir / "metrics.jsonl")
    mem = [m for m in msgs if m.get("kind") == "memory" and m.get("rank", -1) >= 0]
    gpu_lines = [m for m in msgs if m.get("kind") == "gpu"]
    host_lines = [m for m in msgs if m.get("kind") == "host"]
    failed = [m for m in msgs if m.get("kind") == "failed" and m.get("rank", -1) >= 0]
    steps = [m for m in msgs if m.get("kind") == "step"]
    finished = any(m.get("kind") == "finished" for m in msgs)
    if timed_out:
        status, cause = "timeout", None
    elif finished and rc == 0:
        status, cause = "finished", None
    else:
        status = "failed"
        cause = failed[0]["cause"] if failed else ("host_oom" if rc == 4 else f"exit {rc}")
    per_rank_reserved: dict[int, int] = {}
    per_rank_alloc: dict[int, int] = {}
    per_rank_rss: dict[int, int] = {}
    for m in mem:
        r = int(m["rank"])
        per_rank_reserved[r] = max(per_rank_reserved.get(r, 0), int(m.get("peak_reserved_bytes") or 0))
        per_rank_alloc[r] = max(per_rank_alloc.get(r, 0), int(m.get("peak_allocated_bytes") or 0))
        per_rank_rss[r] = max(per_rank_rss.get(r, 0), int(m.get("host_rss_bytes") or 0))
    nvml_front = max((int(g.get("used_bytes") or 0) for g in gpu_lines), default=0)
    nvml_here = max((u - b for u, b in zip(nvml_max, base_used)), default=0)
    nvml_front_net = nvml_front - (base_used[0] if base_used else 0) if nvml_front else 0
    ranks_hwm = sum(v for p, v in hwm.items() if role.get(p, "").startswith("rank"))
    launcher_hwm = sum(v for p, v in hwm.items() if role.get(p) == "launcher")
    front_hwm = hwm.get(proc.pid, 0)
    ranks_rss = ranks_hwm or sum(per_rank_rss.values())
    out: dict[str, Any] = {
        "status": status, "cause": cause, "exit_code": rc, "wall_s": round(wall, 1),
        "peak_reserved_bytes": max(per_rank_reserved.values(), default=None),
        "peak_allocated_bytes": max(per_rank_alloc.values(), default=None),
        "peak_reserved_by_rank": per_rank_reserved,
        # With lanes the device is shared: the ranks' own bytes (per-process NVML) are the measure.
        "nvml_used_bytes": (nvml_proc_max if shared else max(nvml_here, nvml_front_net)) or None,
        "nvml_process_bytes": nvml_proc_max or None,
        "nvml_device_net_bytes": max(nvml_here, nvml_front_net) or None,
        "nvml_baseline_bytes": base_used[0] if base_used else None,
        "host_rss_memory_lines_bytes": sum(per_rank_rss.values()) or None,
        "ranks_hwm_bytes": ranks_hwm or None,
        "launcher_hwm_bytes": launcher_hwm or None,
        "frontend_hwm_bytes": front_hwm or None,
        # torch.compile's sidecar and worker pool are the ranks' children: counted by PSS (forked workers
        # share their pages with the sidecar; RSS would count them once a worker)
        "compile_workers_pss_bytes": workers_max or None,
        "host_peak_bytes": (ranks_rss + launcher_hwm + front_hwm + workers_max) or None,
        "host_used_max_bytes": max((int(h.get("used_bytes") or 0) for h in host_lines), default=None),
        "ranks_rss_by_phase_bytes": rss_by_phase,
        "tokens_per_s": steps[-1].get("tokens_per_s") if steps else None,
        "step_s": steps[-1].get("step_s") if steps else None,
        "steps_done": len(steps),
    }
    if status not in ("finished",) and not (status == "failed" and cause == "gpu_oom"):
        out["rank0_log_tail"] = _tail(run_dir / "logs" / "rank0.log")
        out["launcher_log_tail"] = _tail(run_dir / "launcher.log", 1200)
        out["front_log_tail"] = _tail(runs_root / f"{run.name}.front.log", 1200)
    if status == "failed" and cause == "gpu_oom":
        out["oom_message"] = (failed[0].get("message") or "")[:400] if failed else ""
    return out


# ---------------------------------------------------------------------------------------------------
# Comparison and output

def compare(pred: dict[str, Any], meas: dict[str, Any]) -> dict[str, Any]:
    """Relative errors (prediction / measured - 1) and whether the verdict was right."""
    out: dict[str, Any] = {}
    if meas.get("status") == "finished":
        if meas.get("peak_reserved_bytes"):
            out["gpu_allocator_err"] = pred["gpu_allocator_peak_bytes"] / meas["peak_reserved_bytes"] - 1
        if meas.get("nvml_used_bytes"):
            out["gpu_nvml_err"] = pred["gpu_peak_bytes"] / meas["nvml_used_bytes"] - 1
        if meas.get("host_peak_bytes"):
            out["host_err"] = pred["host_peak_bytes"] / meas["host_peak_bytes"] - 1
    if meas.get("status") in ("finished", "failed"):
        oom = meas.get("status") == "failed" and meas.get("cause") in ("gpu_oom", "host_oom")
        ran = meas.get("status") == "finished"
        out["verdict_ok"] = (pred["fits"] and ran) or (not pred["fits"] and oom)
    return out


def machine_info(nvml: Nvml) -> dict[str, Any]:
    import psutil
    info: dict[str, Any] = {"host": platform.node(), "python": platform.python_version(),
                            "cpus": os.cpu_count(), "host_memory_bytes": int(psutil.virtual_memory().total)}
    info["gpu"] = nvml.info()
    for mod in ("torch", "deepspeed", "transformers"):
        info[mod] = _version(mod)
    return info


def _version(mod: str) -> str | None:
    try:
        from importlib.metadata import version
        return version(mod)
    except Exception:
        return None


def _fmt(n: int | float | None) -> str:
    return "-" if n is None else f"{n / GiB:6.2f}"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:+5.1f}%"


def print_table(runs: list[dict[str, Any]]) -> None:
    print(f"\n{'run':<36} {'status':<9} {'pred GPU':>8} {'reserved':>8} {'err':>7} {'pred tot':>8} {'nvml':>7} "
          f"{'err':>7} {'pred host':>9} {'host':>7} {'err':>7} {'verdict':>7}")
    for r in runs:
        p, m, c = r["predicted"], r["measured"], r.get("errors", {})
        st = m.get("status", "?") if m.get("status") != "failed" else str(m.get("cause"))[:9]
        v = c.get("verdict_ok")
        print(f"{r['name']:<36} {st:<9} {_fmt(p['gpu_allocator_peak_bytes']):>8} {_fmt(m.get('peak_reserved_bytes')):>8} "
              f"{_pct(c.get('gpu_allocator_err')):>7} {_fmt(p['gpu_peak_bytes']):>8} {_fmt(m.get('nvml_used_bytes')):>7} "
              f"{_pct(c.get('gpu_nvml_err')):>7} {_fmt(p['host_peak_bytes']):>9} {_fmt(m.get('host_peak_bytes')):>7} "
              f"{_pct(c.get('host_err')):>7} {('ok' if v else 'WRONG') if v is not None else '-':>7}")
    errs = [abs(r["errors"][k]) for r in runs for k in ("gpu_allocator_err",) if k in r.get("errors", {})]
    herrs = [abs(r["errors"]["host_err"]) for r in runs if "host_err" in r.get("errors", {})]
    wrong = [r["name"] for r in runs if r.get("errors", {}).get("verdict_ok") is False]
    print(f"GiB. runs: {len(runs)}; GPU |err| max {_pct(max(errs, default=None))}; host |err| max "
          f"{_pct(max(herrs, default=None))}; wrong verdicts: {', '.join(wrong) or 'none'}")


def write(path: Path, doc: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1, sort_keys=False))
    os.replace(tmp, path)


def merge(files: list[Path], out: Path) -> int:
    runs: dict[str, dict[str, Any]] = {}
    doc: dict[str, Any] = {}
    for f in files:
        d = json.loads(f.read_text())
        doc = {**d, **{k: v for k, v in doc.items() if k == "commands"}}
        doc.setdefault("commands", [])
        doc["commands"] = list(dict.fromkeys(doc.get("commands", []) + d.get("commands", [d.get("command", "")])))
        for r in d["runs"]:
            runs[r["name"]] = r
    order = [r.name for r in MATRIX]
    doc["runs"] = sorted(runs.values(), key=lambda r: order.index(r["name"]) if r["name"] in order else 999)
    doc.pop("command", None)
    write(out, doc)
    print_table(doc["runs"])
    return 0


def hardware_of(doc: dict[str, Any]) -> PL.Hardware:
    h = doc["hardware"]
    return PL.Hardware(gpus=h["gpus"], gpu_memory_bytes=h["gpu_memory_bytes"], host_memory_bytes=h["host_memory_bytes"])


def run_of(entry: dict[str, Any]) -> Run:
    return Run(entry["name"], entry["subset"], list(entry["sets"]), entry.get("expect_oom", False),
               cap_factor=entry.get("cap_factor", 0.0))


def refresh(path: Path, out: Path) -> int:
    """Predictions and errors of stored measurements, recomputed with the planner as it is now (the
    measurements are kept as they were)."""
    doc = json.loads(path.read_text())
    BASE_PRESET.clear()
    BASE_PRESET.update(doc["base_preset"])
    hw = hardware_of(doc)
    for entry in doc["runs"]:
        entry["predicted"] = predict(run_of(entry), hw)
        entry["errors"] = compare(entry["predicted"], entry["measured"])
    doc["predictions_refreshed"] = time.strftime("%Y-%m-%d %H:%M:%S")
    write(out, doc)
    print_table(doc["runs"])
    return 0


def docs_table(path: Path) -> str:
    """Markdown: each measured run against this planner, DeepSpeed's estimator and accelerate's."""
    doc = json.loads(path.read_text())
    lines = ["| run | measured GPU (NVML) | shardconsole plan | DeepSpeed estimator | accelerate | measured host | "
             "plan host | DeepSpeed CPU |", "|---|---|---|---|---|---|---|---|"]
    for r in doc["runs"]:
        m, p = r["measured"], r["predicted"]
        sets = dict(x.split("=", 1) for x in r["sets"])
        z = "zero3" if sets.get("deepspeed.stage", "3") == "3" else "zero2"
        if sets.get("deepspeed.offload_param") == "cpu" or sets.get("fsdp.cpu_offload") == "true":
            key = z + "_alloff" if z == "zero3" else z + "_optoff"
        elif sets.get("deepspeed.offload_optimizer") == "cpu":
            key = z + "_optoff"
        else:
            key = z
        ds = ((r.get("other_estimators") or {}).get("deepspeed_estimates") or {}).get(key)
        if ds is None:
            spec = resolve(sets["model.name"])
            s = PL.Shapes.of(spec)
            ds = (deepspeed_estimates(s.n_params, s.vocab * s.hidden).get("deepspeed_estimates") or {}).get(key)
        acc = (r.get("other_estimators") or {}).get("accelerate_training_bytes")
        if m["status"] == "finished":
            meas = f"{(m.get('nvml_used_bytes') or 0) / GiB:.1f}"
        else:
            meas = f"OOM under {sets.get('memory.gpu_memory_limit', '?')}" if m.get("cause") == "gpu_oom" else m["status"]
        plan = f"{p['gpu_peak_bytes'] / GiB:.1f}" + ("" if p["fits"] else " (won't fit)")
        lines.append(f"| {r['name']} | {meas} | {plan} | {ds['gpu_bytes'] / GiB:.1f} ({key}) | "
                     f"{(acc or 0) / GiB:.1f} | {(m.get('host_peak_bytes') or 0) / GiB:.1f} | "
                     f"{p['host_peak_bytes'] / GiB:.1f} | {ds['cpu_bytes'] / GiB:.1f} |" if ds else
                     f"| {r['name']} | {meas} | {plan} | n/a | {(acc or 0) / GiB:.1f} | "
                     f"{(m.get('host_peak_bytes') or 0) / GiB:.1f} | {p['host_peak_bytes'] / GiB:.1f} | n/a |")
    return "\n".join(lines)


def adopt16(path: Path) -> int:
    """Make a new --subset issue16 result the planner's calibration data (benchmarks/data/
    plan_calibration_issue16.json, which tests/test_plan.py checks): its runs and the code version they
    ran on replace the stored ones; the earlier device-NVML runs and the notes stay."""
    from shardconsole.plan.calibration import CALIBRATION_FILE
    new = json.loads(path.read_text())
    doc = json.loads(CALIBRATION_FILE.read_text())
    unfinished = [r["name"] for r in new["runs"] if r["measured"].get("status") != "finished"]
    if unfinished:
        print(f"not adopted: {', '.join(unfinished)} did not finish", file=sys.stderr)
        return 1
    for key in ("machine", "hardware", "base_preset", "started", "lanes", "code_version"):
        doc[key] = new[key]
    doc["cap_means"] = new.get("cap_means", "allocator")
    doc["host_arena"] = True        # measured on today's backends: FSDP2's host arena on where it applies
    doc["command"] = new.get("command", doc.get("command"))
    doc.pop("code_version_note", None)
    doc["runs"] = [{k: r[k] for k in ("name", "model", "subset", "sets", "expect_oom", "cap_factor", "lane",
                                      "measured") if k in r} for r in new["runs"]]
    write(CALIBRATION_FILE, doc)
    print(f"wrote {CALIBRATION_FILE} (code version {doc['code_version']['hash']}, {len(doc['runs'])} runs)")
    return 0


def select(subset: str | None, only: str | None) -> list[Run]:
    runs = MATRIX
    if subset:
        if "/" in subset:   # k/n: every n-th run starting at k-1
            k, n = (int(x) for x in subset.split("/"))
            runs = [r for i, r in enumerate(runs) if i % n == k - 1]
        else:
            runs = [r for r in runs if r.subset == subset]
    if only:
        names = set(only.split(","))
        runs = [r for r in runs if r.name in names]
    return runs


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=None, help="JSON file to write")
    ap.add_argument("--subset", default=None, help="fsdp, deepspeed, or k/n (every n-th run from the k-th)")
    ap.add_argument("--only", default=None, help="comma-separated run names")
    ap.add_argument("--steps", type=int, default=5, help="optimizer steps per run (the peak is reached by step 2)")
    ap.add_argument("--time-budget", type=float, default=540.0, help="seconds for the whole matrix")
    ap.add_argument("--run-timeout", type=float, default=150.0, help="seconds before one run is stopped")
    ap.add_argument("--runs-root", type=Path, default=None, help="where run folders go (default /tmp/plancal-<time>)")
    ap.add_argument("--dry-run", action="store_true", help="print the matrix and the predictions; run nothing")
    ap.add_argument("--merge", nargs="+", type=Path, default=None, help="merge result files into --out")
    ap.add_argument("--refresh", type=Path, default=None,
                    help="recompute the predictions and errors of a result file with the current planner")
    ap.add_argument("--docs-table", type=Path, default=None,
                    help="print the markdown comparison table of a result file (docs/PLANNER.md)")
    ap.add_argument("--adopt16", type=Path, default=None,
                    help="make this --subset issue16 result the planner's calibration data (checked by the tests)")
    ap.add_argument("--lanes", type=int, default=1,
                    help="run the matrix's lanes at the same time on one GPU (peaks per process)")
    ap.add_argument("--smoke-cpu", action="store_true",
                    help="check the measuring machinery with one tiny 2-rank CPU run (no GPU needed)")
    args = ap.parse_args(argv)
    if args.merge:
        if not args.out:
            ap.error("--merge needs --out")
        return merge(args.merge, args.out)
    if args.adopt16:
        return adopt16(args.adopt16)
    if args.refresh:
        return refresh(args.refresh, args.out or args.refresh)
    if args.docs_table:
        print(docs_table(args.docs_table))
        return 0
    BASE_PRESET["train"]["steps"] = args.steps
    runs = select(args.subset, args.only)
    if args.smoke_cpu:
        runs = [Run("smoke-cpu-tiny", "fsdp", ["model.name=tiny", "data.seq_len=64", "train.micro_batch=2",
                                               "parallel.device=cpu", "parallel.nproc_per_node=2"], seconds=20)]
    nvml = Nvml() if not args.dry_run else None
    if args.dry_run or not nvml or not nvml.handles:
        hw = H200
        if not args.dry_run:
            print("warning: NVML found no GPU; predictions use the H200's figures", file=sys.stderr)
    else:
        hw = PL.detect_hardware()
    runs = [resolve_cap(r, hw) for r in runs]
    if args.dry_run:
        total = sum(r.seconds for r in runs)
        print(f"{len(runs)} runs, about {total:.0f} s on the H200 ({hw.gpu_name}, {_fmt(hw.gpu_memory_bytes)} GiB, "
              f"host {_fmt(hw.host_memory_bytes)} GiB)\n")
        print(f"{'run':<36} {'pred GPU':>8} {'alloc':>7} {'host':>7} {'phase':<18} {'fits':<5} {'expect':<6} {'s':>4}")
        bad = 0
        for r in runs:
            p = predict(r, hw)
            ok = p["fits"] != r.expect_oom
            bad += not ok
            print(f"{r.name:<36} {_fmt(p['gpu_peak_bytes']):>8} {_fmt(p['gpu_allocator_peak_bytes']):>7} "
                  f"{_fmt(p['host_peak_bytes']):>7} {p['phase']:<18} {str(p['fits']):<5} "
                  f"{'oom' if r.expect_oom else 'run':<6} {r.seconds:4.0f}" + ("" if ok else "  <- matrix expects otherwise"))
        return 1 if bad else 0
    if not args.out:
        ap.error("--out is required (or --dry-run)")
    have_ds = importlib.util.find_spec("deepspeed") is not None and \
        importlib.util.find_spec("shardconsole.backends.engine.deepspeed") is not None
    runs_root = args.runs_root or Path(f"/tmp/plancal-{time.strftime('%Y%m%d-%H%M%S')}")
    runs_root.mkdir(parents=True, exist_ok=True)
    base_file = runs_root / "calibration-base.toml"
    C.save(C.build(BASE_PRESET, "calibration base"), base_file)
    doc: dict[str, Any] = {
        "about": "Measured peaks of real runs vs shardconsole.plan's prediction (benchmarks/plan_calibrate.py)",
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "machine": machine_info(nvml), "hardware": {"gpus": hw.gpus, "gpu_memory_bytes": hw.gpu_memory_bytes,
                                                     "host_memory_bytes": hw.host_memory_bytes},
        "base_preset": BASE_PRESET, "started": time.strftime("%Y-%m-%d %H:%M:%S"), "runs": [],
        "code_version": code_version(), "lanes": args.lanes,
        # memory.gpu_memory_limit in "sets" is the whole device (issue 34); files without this key were
        # measured when it limited the allocator alone (tests/test_plan.py reads them so)
        "cap_means": "device"}
    t_start = time.monotonic()
    lock = threading.Lock()
    shared = args.lanes > 1

    def one(run: Run) -> None:
        entry: dict[str, Any] = {"name": run.name, "model": run.model, "subset": run.subset, "sets": run.sets,
                                 "expect_oom": run.expect_oom, "cap_factor": run.cap_factor, "lane": run.lane,
                                 "predicted": predict(run, hw),
                                 "other_estimators": other_estimators(run)}
        elapsed = time.monotonic() - t_start
        if "parallel.backend=deepspeed" in run.sets and not have_ds:
            entry["measured"] = {"status": "skipped", "reason": "deepspeed or shardconsole.backends.engine.deepspeed missing"}
        elif elapsed + run.seconds > args.time_budget:
            entry["measured"] = {"status": "skipped", "reason": f"time budget ({elapsed:.0f} s used)"}
        else:
            print(f"[{elapsed:5.0f}s] {run.name} ...", flush=True)
            entry["measured"] = measure(run, base_file, runs_root, args.run_timeout, nvml, shared)
            m = entry["measured"]
            print(f"         {run.name}: {m['status']} {m.get('cause') or ''} in {m['wall_s']} s, reserved "
                  f"{_fmt(m.get('peak_reserved_bytes'))} GiB, host {_fmt(m.get('host_peak_bytes'))} GiB", flush=True)
        entry["errors"] = compare(entry["predicted"], entry["measured"])
        with lock:
            doc["runs"].append(entry)
            doc["elapsed_s"] = round(time.monotonic() - t_start, 1)
            write(args.out, doc)

    def lane(k: int) -> None:
        for run in runs:
            if run.lane % args.lanes == k:
                one(run)

    threads = [threading.Thread(target=lane, args=(k,)) for k in range(args.lanes)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    print_table(doc["runs"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
