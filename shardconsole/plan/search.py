"""The settings `shardconsole tune` may try: every combination of the levers that change memory and
speed and keep what is trained the same (the global batch, the model, the data), that the planner
says fits, ranked by the predicted speed (plan/speed/book.py). Pure: no torch, no launches.

The levers: the engine and its sharding or ZeRO stage, offload (none / optimizer / parameters and
optimizer), activation checkpointing and its policy, the micro-batch with gradient accumulation
keeping micro_batch x grad_accum, train.compile (GPU only), and DeepSpeed's reduce bucket (it sets a
GPU buffer; smaller buckets fit under tighter caps). A key the user fixed (`--set table.key=...`) is
never searched.

The numerics (NUMERICS: the compute dtype, the master dtype and its rounding) change the update itself,
so a winner that changed them is another training, not the same one faster (issue 34: bf16 masters
cost +6% final loss at 125m): they are searched only when named (`tune --vary KEY`).
"""

from __future__ import annotations

import itertools
from collections.abc import Set
from dataclasses import dataclass, field
from typing import Any

from shardconsole.settings import config as C
from shardconsole.settings.models import ModelSpec
from shardconsole.plan.estimator import Estimate, estimate, replace_cfg
from shardconsole.plan.fit import EXTRA_STRATEGIES, STRATEGIES, toml_value
from shardconsole.plan.machine import Hardware
from shardconsole.plan.speed.book import Prediction, SpeedBook, signature

ALL_STRATEGIES = {**STRATEGIES, **EXTRA_STRATEGIES}
OFFLOADING = {"full_shard+offload", "ZeRO-3+offload", "ZeRO-3+optimizer offload", "ZeRO-2+optimizer offload"}
MICRO_BATCHES = (1, 2, 4, 8, 16, 32)
# The keys that change what a step computes, each with the values it may take.
NUMERICS: dict[str, tuple[Any, ...]] = {
    "precision.dtype": ("bf16", "fp16", "fp32"),
    "precision.master_dtype": ("fp32", "bf16"),
    "precision.master_rounding": ("nearest", "stochastic", "kahan"),
    # torchao's block-quantized moments (issue 35): fewer bytes, another update
    "optim.name": ("adamw", "adamw8bit", "adamw4bit", "adam-mini"),
    # each parameter stepped in backward (issue 35): no gradient buffer, but no clip (rules refuse one)
    "optim.step_in_backward": (False, True),
    # torchao's float8 linears (issue 48): faster matmuls on FP8 tensor cores, another rounding
    "precision.fp8": ("none", "tensorwise", "rowwise"),
    # no clip by the global norm: the FSDP2 offload's host step can then run under the backward
    # (fsdp.offload_overlap); the values are the base's and 0 (_numerics_levers)
    "train.clip_grad_norm": (0.0,),
}


@dataclass
class Option:
    name: str                                   # "ZeRO-3, full checkpointing, micro_batch 4 x 2"
    changes: list[tuple[str, str, Any]]         # (table, key, value) applied to the base settings
    cfg: C.RunConfig
    estimate: Estimate
    prediction: Prediction
    baseline: bool = False                      # the settings as given, nothing searched
    notes: list[str] = field(default_factory=list)

    @property
    def overrides(self) -> list[str]:
        return [f"{t}.{k}={toml_value(v)}" for t, k, v in self.changes]


def strategy_of(cfg: C.RunConfig) -> str:
    if cfg.parallel.backend == "fsdp":
        return "full_shard+offload" if cfg.fsdp.cpu_offload else cfg.fsdp.sharding
    d = cfg.deepspeed
    z = "ZeRO-3" if d.stage == 3 else "ZeRO-2"
    if d.offload_param != "none":
        return "ZeRO-3+offload"
    if d.offload_optimizer != "none":
        return f"{z}+optimizer offload"
    return z


def describe(cfg: C.RunConfig, base: C.RunConfig | None = None) -> str:
    m = cfg.memory
    ckpt = f"{m.checkpoint_policy} checkpointing" if m.activation_checkpointing else "no checkpointing"
    parts = [strategy_of(cfg), ckpt, f"micro_batch {cfg.train.micro_batch} x {cfg.train.grad_accum}"]
    if cfg.train.compile:
        parts.append("compiled")
    if cfg.optim.step_in_backward:
        parts.append("step in backward")
    if cfg.optim.name != "adamw":
        parts.append(cfg.optim.name)
    if cfg.precision.fp8 != "none":
        parts.append(f"fp8 {cfg.precision.fp8}")
    if base is not None and cfg.precision.dtype != base.precision.dtype:
        parts.append(f"{cfg.precision.dtype} compute")
    if cfg.precision.master_dtype == "bf16":
        rounding = cfg.precision.master_rounding
        parts.append("bf16 masters" + ("" if rounding == "nearest" else f" ({rounding} rounding)"))
    default_bucket = C.RunConfig().deepspeed.reduce_bucket_size
    if cfg.parallel.backend == "deepspeed" and cfg.deepspeed.reduce_bucket_size != default_bucket:
        parts.append(f"bucket {cfg.deepspeed.reduce_bucket_size:.0e}")
    return ", ".join(parts)


def _numerics_levers(base: C.RunConfig, vary: set[str]) -> dict[str, list[list[tuple[str, str, Any]]]]:
    """The numerics keys named in vary, each a lever over its values (fp16 only on GPUs: the CPU ranks
    have no fp16 kernels for everything; combinations that do not validate are skipped later)."""
    out: dict[str, list[list[tuple[str, str, Any]]]] = {}
    for path in NUMERICS:
        if path not in vary:
            continue
        table, key = path.split(".")
        values = [v for v in NUMERICS[path] if not (v in ("fp16", "tensorwise", "rowwise")
                                                     and base.parallel.device == "cpu")]
        if path == "train.clip_grad_norm":
            values = sorted({base.train.clip_grad_norm, *values}, reverse=True)
        out[path] = [[(table, key, v)] for v in values]
    return out


def numerics_words(cfg: C.RunConfig, base: C.RunConfig) -> list[str]:
    """How cfg's numerics differ from base's, in words ("bf16 masters", "stochastic rounding")."""
    p, b = cfg.precision, base.precision
    out = []
    if p.dtype != b.dtype:
        out.append(f"{p.dtype} compute")
    if p.master_dtype != b.master_dtype or (p.master_dtype == "bf16" and p.dtype != b.dtype):
        out.append(f"{p.master_dtype} masters")
    if p.master_dtype == "bf16" and p.master_rounding != b.master_rounding:
        out.append(f"{p.master_rounding} rounding")
    if cfg.optim.name != base.optim.name:
        out.append(f"{cfg.optim.name} optimizer")
    if p.fp8 != b.fp8:
        out.append("bf16 linears" if p.fp8 == "none" else f"fp8 {p.fp8} linears")
    if cfg.optim.step_in_backward != base.optim.step_in_backward:
        out.append("step in backward" if cfg.optim.step_in_backward else "step after backward")
    if cfg.train.clip_grad_norm != base.train.clip_grad_norm:
        out.append("no gradient clip" if cfg.train.clip_grad_norm <= 0 else f"clip at {cfg.train.clip_grad_norm:g}")
    return out


def numerics_changed(cfg: C.RunConfig, base: C.RunConfig) -> list[str]:
    """The NUMERICS keys whose value differs between cfg and base (a rounding of fp32 masters is none)."""
    out = []
    for path in NUMERICS:
        table, key = path.split(".")
        if key == "master_rounding" and cfg.precision.master_dtype == "fp32" == base.precision.master_dtype:
            continue
        if getattr(getattr(cfg, table), key) != getattr(getattr(base, table), key):
            out.append(path)
    return out


def _levers(base: C.RunConfig, fixed: Set[str],
            vary: Set[str] = frozenset()) -> dict[str, list[list[tuple[str, str, Any]]]]:
    """Each lever: the alternatives, each a list of changes. A fixed key keeps the base's value; a
    numerics key is a lever only when vary names it."""
    on_cpu = base.parallel.device == "cpu"
    free = lambda *keys: not any(k in fixed for k in keys)          # noqa: E731
    strategies = [n for n in ALL_STRATEGIES if not (on_cpu and n in OFFLOADING)]
    if not free("parallel.backend", "fsdp.sharding", "fsdp.cpu_offload", "deepspeed.stage",
                "deepspeed.offload_optimizer", "deepspeed.offload_param"):
        strategies = []
    out: dict[str, list[list[tuple[str, str, Any]]]] = {
        "strategy": [list(ALL_STRATEGIES[n]) for n in strategies] or [[]]}
    if free("memory.activation_checkpointing", "memory.checkpoint_policy"):
        out["checkpointing"] = [[("memory", "activation_checkpointing", False)],
                                [("memory", "activation_checkpointing", True), ("memory", "checkpoint_policy", "full")],
                                [("memory", "activation_checkpointing", True),
                                 ("memory", "checkpoint_policy", "selective")]]
    global_batch = base.train.micro_batch * base.train.grad_accum
    if free("train.micro_batch", "train.grad_accum"):
        mbs = sorted({mb for mb in MICRO_BATCHES if global_batch % mb == 0} | {base.train.micro_batch})
        out["micro_batch"] = [[("train", "micro_batch", mb), ("train", "grad_accum", global_batch // mb)] for mb in mbs]
    if free("train.compile") and not on_cpu:
        out["compile"] = [[("train", "compile", False)], [("train", "compile", True)]]
    out.update(_numerics_levers(base, {k for k in vary if free(k)}))
    if free("deepspeed.reduce_bucket_size"):
        b = base.deepspeed.reduce_bucket_size
        out["bucket"] = [[("deepspeed", "reduce_bucket_size", b)],
                         [("deepspeed", "reduce_bucket_size", max(b // 4, 10**6))]]
    return out


def _irrelevant(cfg: C.RunConfig) -> str:
    """The table of the engine these settings do not use: its keys change nothing."""
    return "deepspeed" if cfg.parallel.backend == "fsdp" else "fsdp"


def _key(cfg: C.RunConfig) -> str:
    d = cfg.to_dict()
    d.pop(_irrelevant(cfg), None)
    d.pop("description", None)
    if cfg.precision.master_dtype == "fp32":     # the rounding of bf16 masters: nothing to round
        d["precision"] = {k: v for k, v in d["precision"].items() if k != "master_rounding"}
    return repr(sorted((k, repr(v)) for k, v in d.items()))


def _effective(cfg: C.RunConfig, base: C.RunConfig, changes: list[tuple[str, str, Any]]) -> list[tuple[str, str, Any]]:
    """The changes that matter for these settings (a DeepSpeed bucket under FSDP does not) and differ
    from the base, each once (the last value given wins)."""
    out: dict[tuple[str, str], Any] = {}
    for t, k, v in changes:
        if t != _irrelevant(cfg) and getattr(getattr(base, t), k) != getattr(getattr(cfg, t), k):
            out[(t, k)] = getattr(getattr(cfg, t), k)
    return [(t, k, v) for (t, k), v in out.items()]


def options(base: C.RunConfig, spec: ModelSpec, hw: Hardware, book: SpeedBook, *,
            fixed: Set[str] = frozenset(), vary: Set[str] = frozenset(), limit: int = 20000) -> list[Option]:
    """Every combination of the free levers that validates and fits, fastest predicted first (ties: less
    GPU memory first); the settings as given are in the list as the baseline whether they fit or not.
    The numerics keys stay as given but those named in vary (NUMERICS)."""
    levers = _levers(base, set(fixed), set(vary))
    seen: set[str] = set()
    out: list[Option] = []
    base_key = _key(base)
    for combo in itertools.islice(itertools.product(*levers.values()), limit):
        changes = [c for group in combo for c in group]
        try:
            cfg = _fill_launcher(replace_cfg(base, *changes), base)
            C.validate(cfg, "tune")
        except (C.ConfigError, ValueError, TypeError):
            continue
        key = _key(cfg)
        if key in seen or _clip_for_nothing(cfg, base):
            continue
        seen.add(key)
        est = estimate(cfg, spec, hw)
        if not est.fits and key != base_key:
            continue
        out.append(Option(describe(cfg, base), _effective(cfg, base, changes + [("parallel", "launcher", None)]), cfg, est,
                          book.predict(cfg, hw, spec), baseline=key == base_key))
    if base_key not in seen:
        out.append(Option(describe(base), [], base, estimate(base, spec, hw), book.predict(base, hw, spec), baseline=True))
    rank(out, book, hw, spec)
    return out


def _clip_for_nothing(cfg: C.RunConfig, base: C.RunConfig) -> bool:
    """A clip changed where it buys no speed: only the FSDP2 offload overlaps its host step without one
    (plan/speeds.signature's "overlap"); elsewhere it would be another training at the same speed."""
    return cfg.train.clip_grad_norm != base.train.clip_grad_norm and not signature(cfg).get("overlap")


def _fill_launcher(cfg: C.RunConfig, base: C.RunConfig) -> C.RunConfig:
    """A DeepSpeed run made from FSDP settings keeps torchrun (fit._strategy_cfg does the same)."""
    if cfg.parallel.backend != base.parallel.backend:
        cfg = replace_cfg(cfg, ("parallel", "launcher", "torchrun"))
    return cfg


def rank(opts: list[Option], book: SpeedBook, hw: Hardware, spec: ModelSpec | None = None) -> None:
    """Predict again with what the book holds now (a probe just measured one: its strategy's ratio
    moves the others), and sort fastest first; ties: less memory first. The options share the model,
    sequence and machine, so their predictions share one unit (SpeedBook.predict)."""
    for o in opts:
        o.prediction = book.predict(o.cfg, hw, spec)
    opts.sort(key=lambda o: (-o.prediction.value, o.estimate.gpu_peak_bytes or o.estimate.host_peak_bytes))
