"""A failure inside a rank, classified (gpu_oom, nan_loss, ...) with a hint, and sent as a `failed`
line before the rank exits."""

from __future__ import annotations

import dataclasses
import sys
import traceback
from pathlib import Path

import torch

from shardconsole.settings import config as C
from shardconsole.runlog import protocol as P
from shardconsole.backends.rank.common import Rank
from shardconsole.backends.rank.errors import RankFailure, Stopped
from shardconsole.backends.rank.knobs import KnobError, Knobs
from shardconsole.settings.models import ModelError
from shardconsole.runlog.runfolder import metrics_file_of_node
from shardconsole.runlog.stream import MetricsWriter


# Failure reports and the exit

def classify(exc: BaseException, knobs: Knobs) -> tuple[str, str]:
    """(cause, hint) for a failure inside a rank."""
    text = f"{type(exc).__name__}: {exc}"
    if isinstance(exc, Stopped) and knobs.slurm_job:   # Slurm's script resumes when submitted again
        return "stopped", "continue it with `sbatch` of the same script, or `shardconsole resume RUN_DIR --slurm`"
    if isinstance(exc, RankFailure):
        return exc.cause, exc.hint
    if isinstance(exc, torch.OutOfMemoryError) or "CUDA out of memory" in text:
        return "gpu_oom", ("lower train.micro_batch, turn on memory.activation_checkpointing, "
                           "or offload (fsdp.cpu_offload / deepspeed.offload_optimizer)")
    if isinstance(exc, (C.ConfigError, ModelError, KnobError)):
        return "config_error", ""
    if "Watchdog" in text or "timed out" in text.lower() or "Timeout" in type(exc).__name__:
        if not _on_nccl():      # gloo (CPU ranks): no NCCL setting helps
            return "nccl_timeout", ("a rank stopped answering: is a node gone? on several nodes, set "
                                    "GLOO_SOCKET_IFNAME to the interface the nodes share")
        return "nccl_timeout", ("a rank stopped answering; on consumer GPUs without P2P try "
                                "NCCL_P2P_DISABLE=1")
    if isinstance(exc, FileNotFoundError):
        return "config_error", ""
    return "crash", ""


def _knobs_or_defaults() -> Knobs:
    """The rank's environment when the failure came before its Rank (a bad knob among them: then rank 0's)."""
    try:
        return Knobs.from_env()
    except KnobError:
        return Knobs()


def _on_nccl() -> bool:
    import torch.distributed as dist
    try:
        return dist.is_initialized() and "nccl" in str(dist.get_backend())
    except Exception:      # a process group torn down mid-failure: say nothing of NCCL
        return False


def _oom_context(r: Rank | None) -> str:
    """Where a GPU OOM happened and what the allocator held then: loading and stepping need different fixes."""
    if r is None:
        return ""
    where = "while loading the model" if r.current_phase in ("starting", "loading model", "building ops") \
        else f"during step {r.step}" if r.current_phase == "training" else f"while {r.current_phase}"
    mem = ""
    if r.is_cuda:
        total = torch.cuda.get_device_properties(r.device).total_memory
        mem = (f"; allocator held {C.format_size(torch.cuda.memory_reserved(r.device))} reserved, "
               f"peak {C.format_size(torch.cuda.max_memory_reserved(r.device))} of {C.format_size(total)}"
               + (f" (capped at {r.cfg.memory.gpu_memory_limit})" if r.cfg.memory.gpu_memory_limit else ""))
    return where + mem


def report_failure(r: Rank | None, exc: BaseException, run_dir: Path, run_id: str) -> None:
    """Once per failure: an engine's loop.ending reports it before its teardown, __main__ then again."""
    if getattr(exc, "_shardconsole_reported", False):
        return
    try:
        exc._shardconsole_reported = True       # type: ignore[attr-defined]
    except AttributeError:                      # an exception without a __dict__: reported twice at worst
        pass
    knobs = r.knobs if r else _knobs_or_defaults()
    cause, hint = classify(exc, knobs)
    # A stop is not a crash: no traceback in the report.
    tb = "" if cause == "stopped" else "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    print(tb, file=sys.stderr, flush=True)
    rank = knobs.rank
    writer = r.writer if r else MetricsWriter(run_dir / metrics_file_of_node(knobs.node), run_id, rank)
    message = str(exc).splitlines()[0][:600] if str(exc) else type(exc).__name__
    if cause == "gpu_oom":
        try:
            message = f"GPU out of memory {_oom_context(r)}"
        except Exception:   # the report must go out even if CUDA is in a bad state
            pass
    failed = P.Failed(run=run_id, rank=rank, cause=cause, message=message, exc_type=type(exc).__name__,
                      traceback_tail=tb[-1500:], step=r.step if r else None, hint=hint)
    writer.emit(failed)
    # also in the rank's log (its traceback is printed above): a metrics.jsonl deleted later still leaves
    # the cause (session/faults/stream_gone.py)
    print(P.encode(dataclasses.replace(failed, traceback_tail="")), file=sys.stderr, flush=True)
