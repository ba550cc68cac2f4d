"""How fast: tokens/s that probes and finished runs measured on this machine, and the prediction that
ranks settings with them (`tune`, `plan --fit`, the hint after a GPU OOM).

The fixed factors of constants.SPEED_FACTOR came from runs of different sizes on one machine; a user's
PCIe, CPU and RAM move them (offload most of all). So every measurement is kept, one JSON line each, in
the user data folder (platformdirs: ~/.local/share/shardconsole/speeds.jsonl on Linux, or
$SHARDCONSOLE_SPEEDS_FILE), and a prediction for settings on a machine is, in this order:
  measured    the median tokens/s measured with the same settings (signature()) on this machine;
  scaled      the speed model's tokens/s (plan/speed/model.py) times the median ratio measured/predicted
              of this machine's measurements of the same model and sequence length, of the same strategy
              when there are some (how much faster or slower this machine runs it than the model says);
  model       the speed model alone, in tokens/s, where nothing like it was measured;
  cold start  where the model cannot say (CPU ranks, a GPU not in plan/speed/cards.py): the fixed factors
              (relative units, 1.0 = FSDP2 on the H200 at 0.95B x 16k tokens a step), scaled as above by
              the ratios measured/cold-start.
A list is ranked in one unit: tokens/s on a GPU the model knows or one this machine measured, else relative.

Each entry carries the step meter's version (runlog/protocol.METER_VERSION). Entries without the current
one are ignored on load (SpeedBook.stale counts them, stale_note says so once): the meter before issue 45
counted micro-batches, so under train.grad_accum = k it wrote k times the real tokens/s, and an old entry
does not hold its grad_accum (the signature has none), so the right ones cannot be told from the wrong;
a tune or a finished run measures them again. A run folder whose step lines came from the old meter is
harvested only without accumulation (its figures are right then).

Standard library and platformdirs only; torch is never imported here.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from functools import lru_cache
from typing import Any, Iterable

from shardconsole.user_folders import speeds_file
from shardconsole.runlog.protocol import METER_VERSION
from shardconsole.settings import config as C
from shardconsole.plan.constants import SPEED_FACTOR
from shardconsole.plan.machine import Hardware
from shardconsole.settings.models import ModelSpec

def machine_key(hw: Hardware, device: str = "cuda") -> str:
    """What makes two machines alike for speed: the GPU model and count, or the CPU ranks."""
    if device == "cpu" or not hw.gpus:
        return f"cpu x{os.cpu_count() or 0}"
    return f"{hw.gpu_name or 'gpu'} x{hw.gpus}"


def strategy_key(cfg: C.RunConfig) -> str:
    """The engine and where the model states live: the grain at which the factors differ."""
    if cfg.parallel.backend == "fsdp":
        return "fsdp_offload" if cfg.fsdp.cpu_offload else "fsdp"
    d = cfg.deepspeed
    z = "zero3" if d.stage == 3 else ("zero2" if d.stage in (1, 2) else "zero0")
    if d.offload_param != "none" and d.stage == 3:
        return "zero3_offload_all"
    if d.offload_optimizer != "none" and d.stage >= 1:
        return f"{z}_offload_opt"
    return z


def signature(cfg: C.RunConfig) -> dict[str, Any]:
    """The settings that decide the speed of a step (not the model's numbers or the data)."""
    m = cfg.memory
    sig = {"model": cfg.model.name, "seq_len": cfg.data.seq_len, "dtype": cfg.precision.dtype,
           "master_dtype": cfg.precision.master_dtype, "strategy": strategy_key(cfg),
           "ranks": cfg.parallel.nproc_per_node * cfg.parallel.nnodes, "micro_batch": cfg.train.micro_batch,
           "checkpointing": m.checkpoint_policy if m.activation_checkpointing else "none",
           "compile": bool(cfg.train.compile)}
    if cfg.precision.fp8 != "none":      # float8 linears: another speed (added only when on: older entries match)
        sig["fp8"] = cfg.precision.fp8
    if cfg.train.objective != "sft":     # a pair's two rows, and LoRA DPO's reference forward: not SFT's speed
        sig["objective"] = cfg.train.objective
    if cfg.parallel.backend == "fsdp":
        sig["sharding"] = cfg.fsdp.sharding
        sig["pin_memory"] = bool(cfg.fsdp.pin_memory) if cfg.fsdp.cpu_offload else None
        if cfg.fsdp.cpu_offload:      # the host step under the backward or after it (backends/offload/overlap.py)
            sig["overlap"] = bool(cfg.fsdp.offload_overlap and cfg.train.clip_grad_norm <= 0
                                  and cfg.precision.dtype != "fp16")
    else:
        sig["stage"] = cfg.deepspeed.stage
        sig["reduce_bucket_size"] = cfg.deepspeed.reduce_bucket_size
        sig["pin_memory"] = bool(cfg.deepspeed.pin_memory) if strategy_key(cfg).endswith(("_opt", "_all")) else None
    return sig


# Cold start. Besides SPEED_FACTOR (the engine), from docs/MEASURED.md's and benchmarks/data's H200 loops:
COMPILE_FACTOR = 64.4 / 57.0          # ZeRO-3 1b, layers compiled vs eager (h200_issue7b.json)
SELECTIVE_FACTOR = 0.9                # between none (1.0) and full checkpointing (0.80): assumed
BF16_MASTER_OFFLOAD_FACTOR = 1.5      # offload moving half the bytes: 7b 2.9k vs 0.5k tok/s measured at
                                      # fp32 masters thrashing the host, so assumed far lower here
# FSDP2 offload with the host step under the backward (fsdp.offload_overlap, no clip): 3b under 24 GiB,
# 5,863 against 4,838 tokens/s in one H200 call (benchmarks/results/issue35_20261202/overlap_matrix.json)
OVERLAP_FACTOR = 5863 / 4838
# LoRA DPO adds a forward of the base without grad per micro-batch (backends/objective/preference.py): about a
# third of a step's compute, counted in no token. Assumed, not measured yet (benchmarks/dpo_gpu.sh measures it).
LORA_DPO_FACTOR = 0.75


def cold_score(cfg: C.RunConfig) -> float:
    """Relative tokens/s from the fixed factors (1.0 = FSDP2 on GPU, no checkpointing, 16k tokens a step)."""
    key = strategy_key(cfg)
    score = SPEED_FACTOR.get(key, SPEED_FACTOR["zero2"])
    m = cfg.memory
    if m.activation_checkpointing:
        score *= SPEED_FACTOR["checkpointing"] if m.checkpoint_policy != "selective" else SELECTIVE_FACTOR
    if cfg.train.compile:
        score *= COMPILE_FACTOR
    if key.endswith(("offload", "_opt", "_all")) and cfg.precision.master_dtype == "bf16":
        score *= BF16_MASTER_OFFLOAD_FACTOR
    if signature(cfg).get("overlap"):
        score *= OVERLAP_FACTOR
    if cfg.train.objective in ("dpo", "kto") and cfg.adapters:     # KTO's reference is DPO's
        score *= LORA_DPO_FACTOR
    # Larger micro-batches use the GPU better: an assumed factor tokens / (tokens + 2048), relative to 16k.
    tokens = cfg.train.micro_batch * cfg.rows_per_sample * cfg.data.seq_len
    ref = 16384
    return score * (tokens / (tokens + 2048)) / (ref / (ref + 2048))


@dataclass
class Record:
    machine: str
    signature: dict[str, Any]
    tokens_per_s: float
    source: str                     # "tune probe" or "run"
    when: str = ""
    run: str = ""                   # the run folder it came from
    cold: float = 0.0               # cold_score of the same settings, when measured
    peaks: dict[str, int] = field(default_factory=dict)
    meter: int = 0                  # the step meter's version that measured it (0: before issue 45)
    grad_accum: int = 1
    predicted: float = 0.0          # the speed model's tokens/s for the same settings (0: it could not say)


@dataclass
class Prediction:
    value: float                    # tokens/s, or relative when unit == "relative"
    source: str                     # "measured", "scaled", "model", "cold start"
    unit: str                       # "tokens/s" or "relative"


class SpeedBook:
    """The measurements of one machine kind, and the prediction from them."""

    def __init__(self, records: Iterable[Record] = (), path: Path | None = None, stale: int = 0) -> None:
        self.records = list(records)
        self.path = path
        self.stale = stale          # entries of the file ignored: measured by an older step meter

    @classmethod
    def load(cls, path: Path | None = None) -> "SpeedBook":
        """Never raises: an unreadable line is skipped, a missing file is an empty book. Entries of another
        meter version are left out and counted (stale)."""
        path = path or speeds_file()
        out, stale = [], 0
        try:
            text = path.read_text()
        except OSError:
            text = ""
        for line in text.splitlines():
            try:
                d = json.loads(line)
                rec = Record(**{k: d[k] for k in Record.__dataclass_fields__ if k in d})
            except (ValueError, TypeError, KeyError):
                continue
            if rec.meter != METER_VERSION:
                stale += 1
                continue
            out.append(rec)
        return cls(out, path, stale)

    def stale_note(self) -> str:
        """The one line that says old entries were ignored ("" when none were)."""
        if not self.stale:
            return ""
        return (f"{self.stale} speed(s) in {self.path or speeds_file()} were measured before the step meter "
                f"counted optimizer steps (figures x grad_accum) and are ignored; tune and finished runs "
                f"measure them again")

    def add(self, rec: Record) -> None:
        """Kept in memory and appended to the file (one line, O_APPEND: concurrent writers never mix)."""
        rec.when = rec.when or time.strftime("%Y-%m-%d %H:%M:%S")
        self.records.append(rec)
        path = self.path or speeds_file()
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                os.write(fd, (json.dumps(asdict(rec), sort_keys=True) + "\n").encode())
            finally:
                os.close(fd)
        except OSError:
            pass    # a measurement not kept must never stop a run or a tune

    def measured_runs(self) -> set[str]:
        return {r.run for r in self.records if r.run}

    def _mine(self, machine: str, sig: dict[str, Any]) -> list[Record]:
        return [r for r in self.records if r.machine == machine and r.signature.get("model") == sig["model"]
                and r.signature.get("seq_len") == sig["seq_len"] and r.tokens_per_s > 0]

    def predict(self, cfg: C.RunConfig, hw: Hardware, spec: ModelSpec | None = None) -> Prediction:
        machine = machine_key(hw, cfg.parallel.device)
        sig = signature(cfg)
        mine = self._mine(machine, sig)
        exact = [r.tokens_per_s for r in mine if r.signature == sig]
        if exact:
            return Prediction(statistics.median(exact), "measured", "tokens/s")
        model = model_speed(cfg, hw, spec)
        base, of = (model, lambda r: r.predicted) if model > 0 else (cold_score(cfg), lambda r: r.cold)
        # Scaled by this machine's measurements that are most like these settings: the same strategy and
        # numerics, then the same strategy, then the same numerics (bf16 compute or masters run at
        # another speed than fp32, which the factors do not hold), then any.
        numerics = lambda r: all(r.signature.get(k) == sig[k] for k in ("dtype", "master_dtype"))  # noqa: E731
        strategy = lambda r: r.signature.get("strategy") == sig["strategy"]                         # noqa: E731
        ratios: list[float] = []
        for like in (lambda r: strategy(r) and numerics(r), strategy, numerics, lambda r: True):
            ratios = [r.tokens_per_s / of(r) for r in mine if of(r) > 0 and like(r)]
            if ratios:
                break
        if ratios:
            return Prediction(base * statistics.median(ratios), "scaled", "tokens/s")
        if model > 0:
            return Prediction(model, "model", "tokens/s")
        return Prediction(base, "cold start", "relative")


@lru_cache(maxsize=64)
def _spec(name: str) -> ModelSpec:
    from shardconsole.settings.models import resolve
    return resolve(name)


def model_speed(cfg: C.RunConfig, hw: Hardware, spec: ModelSpec | None = None) -> float:
    """The speed model's tokens/s for cfg on hw (plan/speed/model.py); 0.0 where it cannot say (CPU ranks,
    a GPU it does not know, a model folder that cannot be read)."""
    from shardconsole.plan.speed.model import predict
    try:
        p = predict(cfg, spec or _spec(cfg.model.name), hw)
    except (C.ConfigError, ValueError, OSError, KeyError, TypeError):
        return 0.0
    return p.tokens_per_s if p is not None else 0.0


def record_of(cfg: C.RunConfig, hw: Hardware, tokens_per_s: float, source: str, run: str = "",
              peaks: dict[str, int] | None = None) -> Record:
    return Record(machine=machine_key(hw, cfg.parallel.device), signature=signature(cfg),
                  tokens_per_s=float(tokens_per_s), source=source, run=run, cold=cold_score(cfg),
                  peaks=dict(peaks or {}), meter=METER_VERSION, grad_accum=cfg.train.grad_accum,
                  predicted=model_speed(cfg, hw))


def steady_tokens_per_s(steps: list[tuple[int, float]]) -> float:
    """The median tokens/s of a run's step lines after the first (compile, allocator warm-up and the
    first optimizer step make it slow); the only one when there is one."""
    rates = [tps for _, tps in sorted(steps) if tps > 0]
    if len(rates) > 1:
        rates = rates[1:]
    return statistics.median(rates) if rates else 0.0


def harvest(book: SpeedBook, runs_root: Path, hw: Hardware, limit: int = 200) -> int:
    """Add the speed of each finished run under runs_root that the book does not hold yet (its
    preset.toml and its step lines); returns how many were added. Never raises."""
    from shardconsole.runlog.runfolder import RunFolder
    try:
        folders = sorted((p for p in runs_root.iterdir() if p.is_dir()), key=lambda p: p.name)[-limit:]
    except OSError:
        return 0
    known = book.measured_runs()
    added = 0
    for folder in folders:
        rf = RunFolder(folder)
        if str(folder) in known or not rf.metrics.is_file():
            continue
        steps, finished, old_meter = [], False, False
        try:
            for line in rf.metrics.read_text(errors="replace").splitlines():
                if '"kind":"step"' in line.replace(" ", ""):
                    d = json.loads(line)
                    steps.append((int(d.get("step", 0)), float(d.get("tokens_per_s") or 0)))
                    old_meter = old_meter or d.get("meter", 0) != METER_VERSION
                elif '"kind":"finished"' in line.replace(" ", ""):
                    finished = True
            if not finished or not steps:
                continue
            cfg = C.load(rf.preset)
        except (OSError, ValueError, C.ConfigError):
            continue
        if old_meter and cfg.train.grad_accum > 1:
            continue            # the old meter's tokens/s were per micro-batch: grad_accum times too high
        tps = steady_tokens_per_s(steps)
        if tps > 0:
            book.add(record_of(cfg, hw, tps, "run", run=str(folder)))
            added += 1
    return added
