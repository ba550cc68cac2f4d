"""What every backend's rank does the same way: start-up, the model, the loss, metrics, checkpoints'
bookkeeping, failure reports and the exit.

Runs inside the ranks only (never imported by a front end). Talks to the front end only through the
metrics stream (shardconsole.stream), never through textual or rich.
"""

from __future__ import annotations

import faulthandler
import math
import os
import shutil
import signal
import socket
import sys
import time
import traceback
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import psutil
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from shardconsole import config as C
from shardconsole import protocol as P
from shardconsole.hardware import peak_tflops
from shardconsole.launch import METRICS_FILE, PRESET_FILE
from shardconsole.models import ModelSpec, resolve
from shardconsole.stream import MetricsWriter


class NanLossError(RuntimeError):
    pass


class LossScaleFloorError(RuntimeError):
    pass


@dataclass
class Rank:
    """One rank's view of the run: who it is, where it computes, where it reports."""
    cfg: C.RunConfig
    run_dir: Path
    run_id: str
    rank: int
    local_rank: int
    world: int
    device: torch.device
    writer: MetricsWriter
    spec: ModelSpec
    step: int = 0
    current_phase: str = "starting"
    extra: dict = field(default_factory=dict)
    faults: "Injector" = field(default=None)  # type: ignore[assignment]

    def __post_init__(self) -> None:
        from shardconsole.backends.faults import Injector
        if self.faults is None:
            self.faults = Injector(self.rank)

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
        self.current_phase = name
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
    fd = os.open(logs / f"rank{rank}.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def start(run_dir: Path, run_id: str) -> Rank:
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    _redirect_output(run_dir, rank)
    # SIGUSR1 dumps every thread's Python stack into the rank's log: the front end uses it to say
    # where each rank is stuck when a run hangs.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    # SHARDCONSOLE_STREAM=off: the same rank with no metrics written (benchmarks/overhead.py measures
    # what the stream costs against this).
    stream_on = os.environ.get("SHARDCONSOLE_STREAM", "on") != "off"
    writer = MetricsWriter(run_dir / METRICS_FILE if stream_on else None, run_id, rank)
    cfg = C.load(run_dir / PRESET_FILE)
    spec = resolve(cfg.model.name)
    use_cuda = cfg.parallel.device == "cuda" or (cfg.parallel.device == "auto" and torch.cuda.is_available())
    if use_cuda:
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    r = Rank(cfg, run_dir, run_id, rank, local_rank, world, device, writer, spec)
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
    limit = cfg.gpu_memory_limit_bytes
    if use_cuda and limit:
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, limit / total), device)
        r.log(f"CUDA memory capped at {C.format_size(limit)} of {C.format_size(total)}")
    torch.manual_seed(cfg.train.seed)
    return r


def init_process_group(r: Rank) -> None:
    backend = "nccl" if r.is_cuda else "gloo"
    timeout = timedelta(seconds=r.cfg.parallel.timeout_s)
    if r.is_cuda:
        dist.init_process_group(backend, timeout=timeout, device_id=r.device)
    else:
        dist.init_process_group(backend, timeout=timeout)


def compute_dtype(cfg: C.RunConfig) -> torch.dtype:
    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[cfg.precision.dtype]


# ---------------------------------------------------------------------------------------------------
# The model

def hf_config(spec: ModelSpec, cfg: C.RunConfig):
    from transformers import AutoConfig, LlamaConfig
    if spec.path is not None:
        hf = AutoConfig.from_pretrained(spec.path, local_files_only=True)
    else:
        hf = LlamaConfig(**spec.config)
    hf._attn_implementation = cfg.model.attn_implementation
    hf.use_cache = False
    return hf


def build_causal_lm(hf_cfg) -> nn.Module:
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_config(hf_cfg, attn_implementation=hf_cfg._attn_implementation)


def decoder_layers(lm: nn.Module) -> nn.ModuleList:
    """The repeated blocks (the unit of sharding, prefetch and checkpointing)."""
    for path in ("model.layers", "transformer.h", "model.decoder.layers"):
        obj = lm
        try:
            for part in path.split("."):
                obj = getattr(obj, part)
            return obj
        except AttributeError:
            continue
    raise TypeError(f"{type(lm).__name__}: cannot find its decoder layers")


@torch.no_grad()
def init_random_(model: nn.Module, std: float, seed: int, rank: int) -> None:
    """Random init of (possibly sharded) parameters in place: normal(0, std) for matrices, ones for
    norm weights, zeros for biases. Works on each rank's local shard, seeded per rank, so a model
    built on the meta device never needs a full copy anywhere."""
    gens: dict[torch.device, torch.Generator] = {}
    for name, p in model.named_parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        if local.numel() == 0:
            continue
        if "norm" in name.lower() and local.dim() == 1:
            local.fill_(1.0)
        elif name.endswith("bias"):
            local.zero_()
        else:
            # Generated where the shard lives: a 7B model's 27 GiB of fp32 draws on one CPU core is minutes.
            gen = gens.get(local.device)
            if gen is None:
                gen = gens[local.device] = torch.Generator(device=local.device).manual_seed(seed * 7919 + rank)
            local.normal_(0.0, std, generator=gen)


@torch.no_grad()
def reset_buffers_(model: nn.Module, hf_cfg, device: torch.device) -> None:
    """Non-persistent buffers (rotary inv_freq) are garbage after to_empty(): rebuild them."""
    for name, module in model.named_modules():
        if name.endswith("rotary_emb"):
            with torch.device("cpu"):
                fresh = type(module)(config=hf_cfg)
            for bname, buf in fresh.named_buffers(recurse=False):
                module._buffers[bname] = buf.to(device)   # on the compute device even with CPU offload


def chunked_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                          chunk_tokens: int = 4096) -> torch.Tensor:
    """Mean next-token loss without ever holding the full [tokens, vocab] fp32 logits.

    Each chunk's logits are recomputed in backward (checkpoint), so the peak is one chunk's logits,
    not all of them: for seq 2048 x micro-batch 8 x vocab 32000 that is 2 GiB of fp32 saved."""
    h = hidden.reshape(-1, hidden.shape[-1])
    y = labels.reshape(-1)
    n = y.numel()
    if n <= chunk_tokens:
        return F.cross_entropy((h @ weight.t()).float(), y)

    def part(hc: torch.Tensor, w: torch.Tensor, yc: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy((hc @ w.t()).float(), yc, reduction="sum")

    total = hidden.new_zeros((), dtype=torch.float32)
    for i in range(0, n, chunk_tokens):
        total = total + torch.utils.checkpoint.checkpoint(
            part, h[i:i + chunk_tokens], weight, y[i:i + chunk_tokens], use_reentrant=False)
    return total / n


class CausalLMLoss(nn.Module):
    """The trained module: a causal LM whose forward returns the mean next-token loss.

    Wrapping the LM keeps the loss inside the root module's forward, so FSDP2's root hooks (and
    DeepSpeed's) gather the embedding and output head for it."""

    def __init__(self, lm: nn.Module) -> None:
        super().__init__()
        self.lm = lm

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        hidden = self.lm.model(input_ids=input_ids).last_hidden_state
        return chunked_cross_entropy(hidden, self.lm.lm_head.weight, labels)


def enable_checkpointing(lm: nn.Module) -> None:
    # transformers 5.x renamed it (the old name warns until v6); older releases only have the old one.
    try:
        lm.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    except (AttributeError, TypeError):
        lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def load_pretrained(spec: ModelSpec, hf_cfg) -> nn.Module:
    if not spec.has_weights:
        raise FileNotFoundError(f"{spec.path}: no weights (model.safetensors or pytorch_model.bin); "
                                f"a catalog size trains from random init")
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(spec.path, config=hf_cfg, local_files_only=True,
                                                torch_dtype=torch.float32)


# ---------------------------------------------------------------------------------------------------
# Schedule

def lr_factor(cfg: C.RunConfig, step: int) -> float:
    """Multiplier of train.lr at optimizer step `step` (1-based): linear warm-up, then cosine or flat."""
    t = cfg.train
    if t.warmup_steps and step <= t.warmup_steps:
        return step / t.warmup_steps
    if t.schedule == "constant":
        return 1.0
    span = max(1, t.steps - t.warmup_steps)
    progress = min(1.0, (step - t.warmup_steps) / span)
    return t.min_lr_ratio + (1 - t.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


# ---------------------------------------------------------------------------------------------------
# Metrics

class StepMeter:
    """Accumulates on the device between log steps; reads (one sync) only when a line is due."""

    def __init__(self, r: Rank) -> None:
        self.r = r
        cfg = r.cfg
        self.tokens_per_step = cfg.tokens_per_step
        self.samples_per_step = cfg.train.micro_batch * cfg.train.grad_accum * r.world
        self.flops_per_token = r.spec.flops_per_token(cfg.data.seq_len)
        rate = cfg.train.peak_tflops or (peak_tflops(torch.cuda.get_device_name(r.device)) if r.is_cuda else None)
        self.peak_flops = rate * 1e12 if rate else None
        self.loss_sum = torch.zeros((), device=r.device, dtype=torch.float32)
        self.n = 0
        self.t_last = time.perf_counter()
        self.tokens_total = 0
        self.proc = psutil.Process()

    def add(self, loss: torch.Tensor) -> None:
        self.loss_sum += loss.detach().float()   # stays on the device: no sync
        self.n += 1
        self.tokens_total += self.tokens_per_step

    def due(self, step: int) -> bool:
        return step % self.r.cfg.train.log_every == 0 or step == self.r.cfg.train.steps

    def report(self, step: int, lr: float, grad_norm: torch.Tensor | float | None,
               loss_scale: float | None = None, skipped: int = 0) -> float:
        """Emit the step line (rank 0) and a memory line (every rank). Returns the mean loss."""
        r = self.r
        if r.is_cuda:
            torch.cuda.synchronize(r.device)   # host-device sync: only on log steps
        now = time.perf_counter()
        loss = self.loss_sum.clone()
        dist.all_reduce(loss, op=dist.ReduceOp.SUM)
        mean_loss = loss.item() / max(1, self.n) / r.world
        steps_done = max(1, self.n)
        dt = (now - self.t_last) / steps_done
        tps = self.tokens_per_step / dt if dt > 0 else 0.0
        mfu = (tps / r.world) * self.flops_per_token / self.peak_flops if self.peak_flops else None
        gn = float(grad_norm) if grad_norm is not None else None
        r.emit(memory_message(r, step, self.proc))   # before the step line, which readers print on
        if r.rank == 0:
            r.emit(P.Step(run=r.run_id, rank=0, step=step, steps=r.cfg.train.steps, loss=mean_loss, lr=lr,
                          grad_norm=gn, tokens_per_s=tps,
                          samples_per_s=self.samples_per_step / dt if dt > 0 else 0.0, step_s=dt, mfu=mfu,
                          loss_scale=loss_scale, skipped_steps=skipped, tokens=self.tokens_total))
        self.loss_sum.zero_()
        self.n = 0
        self.t_last = time.perf_counter()
        return mean_loss


def memory_message(r: Rank, step: int, proc: psutil.Process | None = None) -> P.Memory:
    rss = (proc or psutil.Process()).memory_info().rss
    if r.is_cuda:
        return P.Memory(run=r.run_id, rank=r.rank, step=step,
                        allocated_bytes=torch.cuda.memory_allocated(r.device),
                        reserved_bytes=torch.cuda.memory_reserved(r.device),
                        peak_reserved_bytes=torch.cuda.max_memory_reserved(r.device),
                        peak_allocated_bytes=torch.cuda.max_memory_allocated(r.device),
                        host_rss_bytes=rss, device_index=r.device.index)
    return P.Memory(run=r.run_id, rank=r.rank, step=step, host_rss_bytes=rss)


def check_loss(r: Rank, loss: float, step: int) -> None:
    if not math.isfinite(loss):
        raise NanLossError(f"loss is {loss} at step {step}")


class ScaleFloorWatch:
    """fp16: the loss scale sitting at its minimum while every step overflows means training has
    stopped (each step is skipped). Raise after `patience` such steps in a row instead of burning hours."""

    def __init__(self, cfg: C.RunConfig, patience: int = 8) -> None:
        self.min_scale = float(cfg.precision.fp16_value("min_loss_scale"))
        self.patience = patience
        self.streak = 0
        self.last_step = 0
        self.last_skipped = 0

    def check(self, step: int, scale: float | None, skipped: int) -> None:
        if scale is None:
            return
        interval = step - self.last_step
        new_skips = skipped - self.last_skipped
        self.last_step, self.last_skipped = step, skipped
        if scale <= self.min_scale and new_skips >= interval:
            self.streak += new_skips
        else:
            self.streak = 0
        if self.streak >= self.patience:
            raise LossScaleFloorError(f"fp16 loss scale stuck at its minimum {self.min_scale:g}: "
                                      f"the last {self.streak} steps all overflowed and were skipped")


# ---------------------------------------------------------------------------------------------------
# Checkpoints: written to step_<N>.partial, renamed to step_<N> by rank 0 once every rank is done,
# so a kill mid-save never leaves a folder that resume would pick.

def checkpoint_path(r: Rank, step: int) -> Path:
    return r.checkpoint_dir() / f"step_{step:08d}"


def partial_path(r: Rank, step: int) -> Path:
    return r.checkpoint_dir() / f"step_{step:08d}.partial"


def latest_checkpoint(folder: Path) -> tuple[int, Path] | None:
    if not folder.is_dir():
        return None
    done = []
    for p in folder.iterdir():
        if p.is_dir() and p.name.startswith("step_") and p.name[5:].isdigit():
            done.append((int(p.name[5:]), p))
    return max(done) if done else None


def finish_checkpoint(r: Rank, step: int) -> Path:
    """After every rank wrote its part: make the checkpoint visible (rank 0), then tell everyone."""
    dist.barrier()
    final = checkpoint_path(r, step)
    if r.rank == 0:
        tmp = partial_path(r, step)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        r.event("checkpoint_saved", str(final))
    dist.barrier()
    return final


def prepare_checkpoint(r: Rank, step: int) -> Path:
    tmp = partial_path(r, step)
    if r.rank == 0:
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
    dist.barrier()
    r.faults.on_save(step)
    return tmp


# ---------------------------------------------------------------------------------------------------
# Failure reports and the exit

def classify(exc: BaseException) -> tuple[str, str]:
    """(cause, hint) for a failure inside a rank."""
    text = f"{type(exc).__name__}: {exc}"
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
        return "nccl_timeout", ("a rank stopped answering; on consumer GPUs without P2P try "
                                "NCCL_P2P_DISABLE=1")
    if isinstance(exc, FileNotFoundError):
        return "config_error", ""
    return "crash", ""


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
    cause, hint = classify(exc)
    tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    print(tb, file=sys.stderr, flush=True)
    rank = r.rank if r else int(os.environ.get("RANK", "0"))
    writer = r.writer if r else MetricsWriter(run_dir / METRICS_FILE, run_id, rank)
    message = str(exc).splitlines()[0][:600] if str(exc) else type(exc).__name__
    if cause == "gpu_oom":
        try:
            message = f"GPU out of memory {_oom_context(r)}"
        except Exception:   # the report must go out even if CUDA is in a bad state
            pass
    writer.emit(P.Failed(run=run_id, rank=rank, cause=cause, message=message,
                         exc_type=type(exc).__name__, traceback_tail=tb[-1500:],
                         step=r.step if r else None, hint=hint))


def exit_rank(code: int) -> None:
    """End the process without running interpreter teardown: gloo's run-loop thread can abort at exit
    (DESIGN.md: pytorch/pytorch#190489); os._exit after a flush gave 0 failures in 105 runs."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def shutdown(r: Rank) -> None:
    if dist.is_initialized():
        try:
            dist.barrier()
        finally:
            dist.destroy_process_group()
