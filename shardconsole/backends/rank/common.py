"""A rank's life, the same in every backend: start-up (logs, stream, device, memory cap), the process
group, the learning-rate schedule, and the exit. The model, metrics, checkpoints and failure reports
live in model.py, metrics.py, checkpoints.py and failures.py beside this.

Runs inside the ranks only (never imported by a front end). Talks to the front end only through the
metrics stream (shardconsole.runlog.stream), never through textual or rich.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import socket
import sys
from dataclasses import dataclass, field
from typing import Any
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from shardconsole.settings import config as C
from shardconsole.runlog import protocol as P
from shardconsole.machine.hardware import allocator_limit_bytes
from shardconsole.runlog.runfolder import LOGS_DIR, PRESET_FILE, metrics_file_of_node
from shardconsole.settings.models import ModelSpec, resolve
from shardconsole.settings.schedule import lr_factor      # noqa: F401  (the loops call common.lr_factor; torch-free for resume's line)
from shardconsole.runlog.stream import MetricsWriter
from shardconsole.backends.rank.faults import Injector
from shardconsole.backends.rank.knobs import Knobs



@dataclass
class Progress:
    """What changes in a rank as it runs: the step, the phase, and each save kind's last duration (a stop
    with little time left decides from it)."""
    step: int = 0
    phase: str = "starting"
    save_seconds: dict[str, float] = field(default_factory=dict)
    # The real tokens trained on so far, where padding makes them fewer than step * tokens_per_step
    # (preference pairs; observe/metrics.StepMeter sets it); None: all of those are real.
    tokens: int | None = None


@dataclass
class DataState:
    """The token cache's entry of the run's data (None for synthetic data; `built` tells it from "not yet"),
    and whether a resume runs on other data than the checkpoint's (data.allow_changed)."""
    entry: Any = None
    built: bool = False
    changed: bool = False


@dataclass(frozen=True)
class Rank:
    """One rank's view of the run, fixed at start: who it is, where it computes, where it reports, what the
    environment asked of it. What changes as it runs is in `progress` and `data_state`; what an engine builds
    (model, optimizer, host arena) is the engine's (engine/contract.py), never the rank's."""
    cfg: C.RunConfig
    run_dir: Path
    run_id: str
    rank: int
    local_rank: int
    world: int
    device: torch.device
    writer: MetricsWriter
    spec: ModelSpec
    knobs: Knobs = field(default_factory=Knobs)
    faults: Injector = field(default=None)  # type: ignore[assignment]
    progress: Progress = field(default_factory=Progress)
    data_state: DataState = field(default_factory=DataState)

    def __post_init__(self) -> None:
        if self.faults is None:
            object.__setattr__(self, "faults", Injector(self.rank, self.knobs.faults))

    @property
    def step(self) -> int:
        return self.progress.step

    @property
    def current_phase(self) -> str:
        return self.progress.phase

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"

    def emit(self, msg: P.Message) -> None:
        if self.writer.path is None and isinstance(msg, (P.Step, P.Finished)):
            print(P.encode(msg), flush=True)   # stream off (benchmarks): step lines go to the rank's log
        self.writer.emit(msg)

    def event(self, name: str, detail: str = "", *, all_ranks: bool = False) -> None:
        if all_ranks or self.rank == 0:
            self.emit(P.Event(run=self.run_id, rank=self.rank, name=name, detail=detail, step=self.step))

    def phase(self, name: str) -> None:
        assert name in P.PHASES, name
        self.progress.phase = name
        self.event("phase", name)

    def log(self, text: str) -> None:
        print(f"[rank {self.rank}] {text}", flush=True)

    def checkpoint_dir(self) -> Path:
        d = self.cfg.train.checkpoint_dir
        return Path(d).expanduser() if d else self.run_dir / "checkpoints"


# ---------------------------------------------------------------------------------------------------
# Start-up

def _redirect_output(run_dir: Path, rank: int) -> None:
    """Each rank's stdout/stderr go to logs/rank<N>.log (also C-level output: NCCL, gloo, aborts)."""
    logs = run_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    fd = os.open(logs / f"rank{rank}.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o666)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def _serve_flight_recorder(run_dir: Path, rank: int) -> None:
    """With the stacks, the hang diagnosis asks for torch's record of the collectives (flight_recorder.py)."""
    from shardconsole.machine import flight_recorder
    c10d = torch._C._distributed_c10d
    fn = getattr(c10d, "_dump_fr_trace_json", None) or getattr(c10d, "_dump_nccl_trace_json", None)
    if fn is not None:
        flight_recorder.serve(run_dir / LOGS_DIR, rank, lambda: fn(includeCollectives=True, onlyActive=False))


FOLDER_GONE_EXIT = 12      # outcome.EXIT_CODES' run_folder_moved


def start(run_dir: Path, run_id: str) -> Rank:
    knobs = Knobs.from_env()
    rank, local_rank, world = knobs.rank, knobs.local_rank, knobs.world
    if not (run_dir / PRESET_FILE).is_file():
        # The folder was renamed or deleted between the launch and this rank's start: writing its logs and
        # stream would make a half folder at the old path (the front end names what happened, outcome.py)
        os.write(2, f"shardconsole: rank {rank}: the run folder {run_dir} is gone (moved or deleted before the "
                    f"ranks started); nothing written\n".encode())
        os._exit(FOLDER_GONE_EXIT)
    _redirect_output(run_dir, rank)
    # SIGUSR1 dumps every thread's Python stack into the rank's log: the front end uses it to say
    # where each rank is stuck when a run hangs.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    _serve_flight_recorder(run_dir, rank)
    # Each node's ranks append to a file of their own (runfolder.py); no stream at all for the benchmark
    # that measures what the stream costs (benchmarks/overhead.py).
    stream_file = metrics_file_of_node(knobs.node)
    writer = MetricsWriter(run_dir / stream_file if knobs.stream else None, run_id, rank)
    cfg = C.load(run_dir / PRESET_FILE)
    spec = resolve(cfg.model.name)
    use_cuda = cfg.parallel.device == "cuda" or (cfg.parallel.device == "auto" and torch.cuda.is_available())
    if use_cuda:
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    r = Rank(cfg, run_dir, run_id, rank, local_rank, world, device, writer, spec, knobs)
    gpu_name = torch.cuda.get_device_name(device) if use_cuda else None
    uuid = None
    if use_cuda:
        try:
            uuid = str(torch.cuda.get_device_properties(device).uuid)
        except Exception:
            uuid = None
    r.emit(P.Hello(run=run_id, rank=rank, world=world, local_rank=local_rank, host=socket.gethostname(),
                   pid=os.getpid(), device=str(device), gpu_name=gpu_name, gpu_uuid=uuid,
                   backend=cfg.parallel.backend, n_params=spec.n_params))
    r.phase("starting")
    if rank == 0 and knobs.p2p_note:     # the launch turned NCCL's P2P off: say why
        r.event("info", knobs.p2p_note)
    limit = cfg.gpu_memory_limit_bytes
    if use_cuda and limit:
        # The cap is a card of that size, the whole device (issue 34): the allocator gets what such a
        # card gives to processes less this rank's context and NCCL, which NVML counts on top of it.
        total = torch.cuda.get_device_properties(device).total_memory
        allocator = allocator_limit_bytes(limit, cfg.parallel.backend)
        torch.cuda.set_per_process_memory_fraction(min(1.0, allocator / total), device)
        r.log(f"CUDA memory capped at {C.format_size(limit)} of {C.format_size(total)} (the whole device): the "
              f"allocator may hold {C.format_size(min(allocator, total))}, the rest is context, NCCL and the driver's")
    torch.manual_seed(cfg.train.seed)
    return r


def init_process_group(r: Rank) -> None:
    backend = "nccl" if r.is_cuda else "gloo"
    if r.is_cuda and r.cfg.parallel.backend == "fsdp" and r.cfg.fsdp.cpu_offload:
        # Offloaded gradients live on the host: clipping's norm reduces CPU tensors, which NCCL cannot.
        backend = "cuda:nccl,cpu:gloo"
    timeout = timedelta(seconds=r.cfg.parallel.timeout_s)
    if r.is_cuda:
        dist.init_process_group(backend, timeout=timeout, device_id=r.device)
    else:
        dist.init_process_group(backend, timeout=timeout)


def compute_dtype(cfg: C.RunConfig) -> torch.dtype:
    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[cfg.precision.dtype]


# ---------------------------------------------------------------------------------------------------
# The exit

def exit_rank(code: int) -> None:
    """End the process without running interpreter teardown: gloo's run-loop thread can abort at exit
    (docs/MEASURED.md: pytorch/pytorch#190489); os._exit after a flush gave 0 failures in 105 runs."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def shutdown(r: Rank) -> None:
    if dist.is_initialized():
        try:
            dist.barrier()
        finally:
            dist.destroy_process_group()
