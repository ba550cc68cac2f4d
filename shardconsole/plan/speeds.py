"""How fast: tokens/s that probes and finished runs measured on this machine, and the prediction that
ranks settings with them (`tune`, `plan --fit`, the hint after a GPU OOM).

The fixed factors of constants.SPEED_FACTOR came from runs of different sizes on one machine; a user's
PCIe, CPU and RAM move them (offload most of all). So every measurement is kept, one JSON line each, in
the user data folder (platformdirs: ~/.local/share/shardconsole/speeds.jsonl on Linux, or
$SHARDCONSOLE_SPEEDS_FILE), and a prediction for settings on a machine is, in this order:
  measured    the median tokens/s measured with the same settings (signature()) on this machine;
  scaled      the cold-start score times the median ratio measured/cold-start of this machine's
              measurements of the same model and sequence length, of the same strategy when there are
              some (how much faster or slower this machine runs that strategy than the factors say);
  cold start  the factors alone (relative units, 1.0 = FSDP2 on the H200 at 0.95B x 16k tokens a step).
A list is ranked in one unit: tokens/s when this machine has measured the model, else relative.

Standard library and platformdirs only; torch is never imported here.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable

from shardconsole.settings import config as C
from shardconsole.plan.constants import SPEED_FACTOR
from shardconsole.plan.machine import Hardware

SPEEDS_ENV = "SHARDCONSOLE_SPEEDS_FILE"


def speeds_file() -> Path:
    if os.environ.get(SPEEDS_ENV):
        return Path(os.environ[SPEEDS_ENV]).expanduser()
    import platformdirs
    return Path(platformdirs.user_data_dir("shardconsole")) / "speeds.jsonl"


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
    if cfg.train.objective == "dpo" and cfg.adapters:
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


@dataclass
class Prediction:
    value: float                    # tokens/s, or relative when unit == "relative"
    source: str                     # "measured", "scaled", "cold start"
    unit: str                       # "tokens/s" or "relative"


class SpeedBook:
    """The measurements of one machine kind, and the prediction from them."""

    def __init__(self, records: Iterable[Record] = (), path: Path | None = None) -> None:
        self.records = list(records)
        self.path = path

    @classmethod
    def load(cls, path: Path | None = None) -> "SpeedBook":
        """Never raises: an unreadable line is skipped, a missing file is an empty book."""
        path = path or speeds_file()
        out = []
        try:
            text = path.read_text()
        except OSError:
            text = ""
        for line in text.splitlines():
            try:
                d = json.loads(line)
                out.append(Record(**{k: d[k] for k in Record.__dataclass_fields__ if k in d}))
            except (ValueError, TypeError, KeyError):
                continue
        return cls(out, path)

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

    def predict(self, cfg: C.RunConfig, hw: Hardware) -> Prediction:
        machine = machine_key(hw, cfg.parallel.device)
        sig = signature(cfg)
        mine = self._mine(machine, sig)
        exact = [r.tokens_per_s for r in mine if r.signature == sig]
        if exact:
            return Prediction(statistics.median(exact), "measured", "tokens/s")
        cold = cold_score(cfg)
        # Scaled by this machine's measurements that are most like these settings: the same strategy and
        # numerics, then the same strategy, then the same numerics (bf16 compute or masters run at
        # another speed than fp32, which the factors do not hold), then any.
        numerics = lambda r: all(r.signature.get(k) == sig[k] for k in ("dtype", "master_dtype"))  # noqa: E731
        strategy = lambda r: r.signature.get("strategy") == sig["strategy"]                         # noqa: E731
        ratios: list[float] = []
        for like in (lambda r: strategy(r) and numerics(r), strategy, numerics, lambda r: True):
            ratios = [r.tokens_per_s / r.cold for r in mine if r.cold > 0 and like(r)]
            if ratios:
                break
        if ratios:
            return Prediction(cold * statistics.median(ratios), "scaled", "tokens/s")
        return Prediction(cold, "cold start", "relative")


def record_of(cfg: C.RunConfig, hw: Hardware, tokens_per_s: float, source: str, run: str = "",
              peaks: dict[str, int] | None = None) -> Record:
    return Record(machine=machine_key(hw, cfg.parallel.device), signature=signature(cfg),
                  tokens_per_s=float(tokens_per_s), source=source, run=run, cold=cold_score(cfg),
                  peaks=dict(peaks or {}))


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
        steps, finished = [], False
        try:
            for line in rf.metrics.read_text(errors="replace").splitlines():
                if '"kind":"step"' in line.replace(" ", ""):
                    d = json.loads(line)
                    steps.append((int(d.get("step", 0)), float(d.get("tokens_per_s") or 0)))
                elif '"kind":"finished"' in line.replace(" ", ""):
                    finished = True
            if not finished or not steps:
                continue
            cfg = C.load(rf.preset)
        except (OSError, ValueError, C.ConfigError):
            continue
        tps = steady_tokens_per_s(steps)
        if tps > 0:
            book.add(record_of(cfg, hw, tps, "run", run=str(folder)))
            added += 1
    return added
