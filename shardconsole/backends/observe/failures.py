"""A failure inside a rank, classified (gpu_oom, nan_loss, ...) with a hint, and sent as a `failed`
line before the rank exits."""

from __future__ import annotations

import os
import sys
import traceback
from pathlib import Path

import torch

from shardconsole.settings import config as C
from shardconsole.runlog import protocol as P
from shardconsole.backends.rank.common import Rank
from shardconsole.backends.observe.metrics import LossScaleFloorError, NanLossError
from shardconsole.runlog.runfolder import metrics_file_of_node
from shardconsole.runlog.stream import MetricsWriter


# Failure reports and the exit

def classify(exc: BaseException) -> tuple[str, str]:
    """(cause, hint) for a failure inside a rank."""
    text = f"{type(exc).__name__}: {exc}"
    if type(exc).__name__ == "Stopped":
        if os.environ.get("SLURM_JOB_ID"):      # a Slurm job's script resumes when it is submitted again
            return "stopped", "continue it with `sbatch` of the same script, or `shardconsole resume RUN_DIR --slurm`"
        return "stopped", "continue it with `shardconsole resume RUN_DIR`"
    if type(exc).__name__ == "StreamFailed":        # stream_health: disk_full or run_folder_gone, with its hint
        return str(getattr(exc, "cause", "disk_full")), str(getattr(exc, "hint", ""))
    if type(exc).__name__ == "CheckpointError":
        return "config_error", ("move that folder away to resume from the one before it, or set "
                                "train.resume = false")
    if type(exc).__name__ == "DiskFullError":
        return "disk_full", ("free space there, lower train.keep_checkpoints, set train.save_final = \"model\" "
                             "(weights only), or point train.checkpoint_dir elsewhere; then `shardconsole "
                             "resume RUN` continues from the last complete checkpoint")
    if type(exc).__name__ == "SaveOOMError":
        return "host_oom", "the save needs the host memory of its largest tensor beside training's"
    if isinstance(exc, torch.OutOfMemoryError) or "CUDA out of memory" in text:
        return "gpu_oom", ("lower train.micro_batch, turn on memory.activation_checkpointing, "
                           "or offload (fsdp.cpu_offload / deepspeed.offload_optimizer)")
    if isinstance(exc, NanLossError):
        return "nan_loss", ("lower train.lr, keep train.clip_grad_norm on, or use precision.dtype = \"bf16\"")
    if isinstance(exc, LossScaleFloorError):
        return "loss_scale_floor", "fp16 overflows every step: use bf16, lower train.lr, or raise clipping"
    if isinstance(exc, (C.ConfigError,)) or type(exc).__name__ in ("DataError", "ModelError"):
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
    cause, hint = classify(exc)
    # A stop is not a crash: no traceback in the report.
    tb = "" if cause == "stopped" else "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    print(tb, file=sys.stderr, flush=True)
    rank = r.rank if r else int(os.environ.get("RANK", "0"))
    writer = r.writer if r else MetricsWriter(run_dir / metrics_file_of_node(int(os.environ.get("GROUP_RANK", "0") or 0)),
                                               run_id, rank)
    message = str(exc).splitlines()[0][:600] if str(exc) else type(exc).__name__
    if cause == "gpu_oom":
        try:
            message = f"GPU out of memory {_oom_context(r)}"
        except Exception:   # the report must go out even if CUDA is in a bad state
            pass
    writer.emit(P.Failed(run=run_id, rank=rank, cause=cause, message=message,
                         exc_type=type(exc).__name__, traceback_tail=tb[-1500:],
                         step=r.step if r else None, hint=hint))
