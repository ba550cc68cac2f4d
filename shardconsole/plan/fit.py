"""Which settings fit: the article's strategies as settings of this package, the largest catalog
model each trains on a machine (fit_table), and every strategy x checkpointing x micro-batch that
fits, fastest first (settings_that_fit)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from shardconsole.settings import config as C
from shardconsole.settings.models import CATALOG, ModelSpec, resolve
from shardconsole.plan.constants import LONG_CONTEXT, MLP_TILE, SPEED_FACTOR
from shardconsole.plan.estimator import Estimate, estimate, replace_cfg
from shardconsole.plan.machine import Hardware


# ---------------------------------------------------------------------------------------------------
# Strategies, the fit table and the settings that fit

# The article's strategies as settings of this package (parallel.backend and its table).
STRATEGIES: dict[str, list[tuple[str, str, Any]]] = {
    "no_shard": [("parallel", "backend", "fsdp"), ("fsdp", "sharding", "no_shard"), ("fsdp", "cpu_offload", False)],
    "full_shard": [("parallel", "backend", "fsdp"), ("fsdp", "sharding", "full_shard"), ("fsdp", "cpu_offload", False)],
    "shard_grad_op": [("parallel", "backend", "fsdp"), ("fsdp", "sharding", "shard_grad_op"),
                      ("fsdp", "cpu_offload", False)],
    "full_shard+offload": [("parallel", "backend", "fsdp"), ("fsdp", "sharding", "full_shard"),
                           ("fsdp", "cpu_offload", True)],
    "ZeRO-2": [("parallel", "backend", "deepspeed"), ("deepspeed", "stage", 2),
               ("deepspeed", "offload_optimizer", "none"), ("deepspeed", "offload_param", "none")],
    "ZeRO-3": [("parallel", "backend", "deepspeed"), ("deepspeed", "stage", 3),
               ("deepspeed", "offload_optimizer", "none"), ("deepspeed", "offload_param", "none")],
    "ZeRO-3+offload": [("parallel", "backend", "deepspeed"), ("deepspeed", "stage", 3),
                       ("deepspeed", "offload_optimizer", "cpu"), ("deepspeed", "offload_param", "cpu")],
}
# Also searched by settings_that_fit (the article's two-card recipe offloads the optimizer only).
EXTRA_STRATEGIES: dict[str, list[tuple[str, str, Any]]] = {
    "ZeRO-3+optimizer offload": [("parallel", "backend", "deepspeed"), ("deepspeed", "stage", 3),
                                 ("deepspeed", "offload_optimizer", "cpu"), ("deepspeed", "offload_param", "none")],
    "ZeRO-2+optimizer offload": [("parallel", "backend", "deepspeed"), ("deepspeed", "stage", 2),
                                 ("deepspeed", "offload_optimizer", "cpu"), ("deepspeed", "offload_param", "none")],
}


# Rows of the fit table beside the strategies: the consumer box's recipe (issue 60), whose optimizer
# keeps 6 host bytes a parameter instead of 16 (backends/optim/adam_mini.py), with the host step under the
# backward (no clip). Not one of tune's levers: another optimizer is another update (tune --vary optim.name).
FIT_EXTRA_ROWS: dict[str, list[tuple[str, str, Any]]] = {
    "offload + adam-mini": [*STRATEGIES["full_shard+offload"], ("optim", "name", "adam-mini"),
                            ("train", "clip_grad_norm", 0.0)],
}
ADAM_MINI_CHANGES: tuple[tuple[str, str, Any], ...] = (("optim", "name", "adam-mini"), ("train", "clip_grad_norm", 0.0))


def _state_words(cfg: C.RunConfig) -> str:
    """What decides the bytes a parameter beside the strategy, where not the defaults (", bf16 masters,
    adamw8bit states, step in backward"): the table's answer changes with each."""
    p, o = cfg.precision, cfg.optim
    words = [f"{p.master_dtype} masters" + ("" if p.master_rounding == "nearest" else f" ({p.master_rounding})")
             if p.master_dtype != "fp32" else "",
             f"{o.name} states" if o.name != "adamw" else "", "step in backward" if o.step_in_backward else ""]
    return "".join(f", {w}" for w in words if w)


def _strategy_cfg(base: C.RunConfig, name: str, hw: Hardware, *, model: str | None = None,
                  micro_batch: int | None = None, checkpointing: bool | None = None) -> C.RunConfig:
    changes = list({**STRATEGIES, **EXTRA_STRATEGIES, **FIT_EXTRA_ROWS}[name])
    changes.append(("parallel", "nproc_per_node", max(1, hw.gpus or base.parallel.nproc_per_node)))
    changes.append(("parallel", "device", "auto"))
    if base.parallel.backend != dict((t, v) for t, k, v in changes if k == "backend").get("parallel"):
        changes.append(("parallel", "launcher", "torchrun"))
    if model is not None:
        changes.append(("model", "name", model))
    if micro_batch is not None:
        changes.append(("train", "micro_batch", micro_batch))
    if checkpointing is not None:
        changes.append(("memory", "activation_checkpointing", checkpointing))
    return replace_cfg(base, *changes)


def speed_score(cfg: C.RunConfig) -> float:
    """Relative tokens/s (1.0 = FSDP2 on GPU, no checkpointing, 0.95B at micro-batch 8 x 2048),
    from docs/MEASURED.md's measured bare loops (SPEED_FACTOR). Larger micro-batches use the GPU better:
    an assumed factor (tokens / (tokens + 2048)) relative to 16k tokens, not measured."""
    if cfg.parallel.backend == "fsdp":
        key = "fsdp_offload" if cfg.fsdp.cpu_offload else "fsdp"
    else:
        d = cfg.deepspeed
        z = "zero3" if d.stage == 3 else "zero2"
        if d.offload_param != "none":
            key = "zero3_offload_all"
        elif d.offload_optimizer != "none":
            key = f"{z}_offload_opt"
        else:
            key = z
    score = SPEED_FACTOR[key]
    if cfg.memory.activation_checkpointing:
        score *= SPEED_FACTOR["checkpointing"]
    tokens = cfg.train.micro_batch * cfg.rows_per_sample * cfg.data.seq_len
    ref = 16384
    score *= (tokens / (tokens + 2048)) / (ref / (ref + 2048))
    return score


@dataclass
class FitRow:
    strategy: str
    model: str | None               # largest catalog model that trains, None if none does
    n_params: int
    estimate: Estimate | None
    settings: str                   # the settings it was checked with
    refused: str = ""               # why these settings cannot run this strategy at all (settings.rules)

    def to_dict(self) -> dict[str, Any]:
        return {"strategy": self.strategy, "model": self.model, "n_params": self.n_params,
                "settings": self.settings, "refused": self.refused,
                "gpu_peak_bytes": self.estimate.gpu_peak_bytes if self.estimate else None,
                "host_peak_bytes": self.estimate.host_peak_bytes if self.estimate else None}


def _spec_of(name: str) -> ModelSpec:
    return resolve(name)


def fit_table(hardware: Hardware, *, seq_len: int = 2048, micro_batch: int = 1, checkpointing: bool = True,
              base: C.RunConfig | None = None, models: list[str] | None = None) -> list[FitRow]:
    """For each strategy, the largest catalog model that trains on `hardware` (every GPU of the node
    one rank) at the most frugal settings of that strategy: micro-batch 1, checkpointing, bf16."""
    base = base or C.RunConfig()
    base = replace_cfg(base, ("data", "seq_len", seq_len), ("precision", "dtype", base.precision.dtype))
    names = [n for n in (models or list(CATALOG)) if n != "tiny"]
    specs = sorted((_spec_of(n) for n in names), key=lambda sp: sp.n_params)
    rows = []
    for strategy in [*STRATEGIES, *(FIT_EXTRA_ROWS if base.optim.name == "adamw" else {})]:
        best: tuple[ModelSpec, Estimate] | None = None
        refusals, valid = [], False
        for spec in specs:
            cfg = _strategy_cfg(base, strategy, hardware, model=spec.name, micro_batch=micro_batch,
                                checkpointing=checkpointing)
            try:    # a low-bit optimizer with offload, say: no size of model would run
                C.validate(cfg, "fit")
            except C.ConfigError as e:
                refusals.append(str(e).split(": ", 1)[-1])
                continue
            valid = True
            est = estimate(cfg, spec, hardware)
            if est.fits:
                best = (spec, est)
        settings = f"micro_batch {micro_batch}, seq_len {seq_len}, " + \
            ("checkpointing" if checkpointing else "no checkpointing") + f", {base.precision.dtype}" + \
            _state_words(base)
        rows.append(FitRow(strategy, best[0].name if best else None, best[0].n_params if best else 0,
                           best[1] if best else None, settings, "" if valid else refusals[0]))
    return rows


@dataclass
class Candidate:
    name: str                       # e.g. "ZeRO-3, checkpointing, micro_batch 4"
    overrides: list[str]            # --set arguments that turn cfg into this candidate
    estimate: Estimate
    speed: float                    # predicted tokens/s, or relative (speed_unit) on a cold start
    speed_unit: str = "relative"
    speed_source: str = "cold start"    # "measured", "scaled", "model" (plan/speed/book.py) or "cold start"


def settings_that_fit(cfg: C.RunConfig, hardware: Hardware, spec: ModelSpec | None = None,
                      micro_batches: tuple[int, ...] = (1, 2, 4, 8, 16, 32), book: Any = None) -> list[Candidate]:
    """Every strategy x checkpointing x micro-batch for cfg's model, sequence length and dtype that
    fits on `hardware`, fastest first (ties: less GPU memory first). Ranked like `tune` ranks: by the
    speeds measured on this machine (plan/speed/book.py SpeedBook, loaded from the user data folder unless
    given), the fixed factors only where nothing was measured."""
    from shardconsole.plan.speed.book import SpeedBook
    book = book if book is not None else SpeedBook.load()
    spec = spec or resolve(cfg.model.name)
    out = []
    for strategy in {**STRATEGIES, **EXTRA_STRATEGIES}:
        for level in _memory_levels(cfg, strategy):
            for mb in micro_batches:
                c2 = _strategy_cfg(cfg, strategy, hardware, micro_batch=mb, checkpointing=level.checkpointing)
                c2 = replace_cfg(c2, ("train", "grad_accum", max(1, cfg.train.micro_batch * cfg.train.grad_accum // mb)),
                                 *level.changes)
                est = estimate(c2, spec, hardware)
                if not est.fits:
                    continue
                try:        # a level whose changes these settings refuse (adam-mini with kahan rounding)
                    C.validate(c2, "fit")
                except C.ConfigError:
                    continue
                overrides = [f"{t}.{k}={toml_value(v)}" for t, k, v in {**STRATEGIES, **EXTRA_STRATEGIES}[strategy]]
                overrides += [f"parallel.nproc_per_node={c2.parallel.nproc_per_node}",
                              f"memory.activation_checkpointing={toml_value(level.checkpointing)}",
                              *[f"{t}.{k}={toml_value(v)}" for t, k, v in level.changes], f"train.micro_batch={mb}",
                              f"train.grad_accum={c2.train.grad_accum}"]
                name = f"{strategy}, {level.words}, micro_batch {mb}"
                p = book.predict(c2, hardware, spec)
                out.append(Candidate(name, overrides, est, p.value, p.unit, p.source))
    # A candidate that needs more than EDGE of the allocator's budget ranks after those with room: the
    # planner's error there is a run that fails in its first backward (issue 62: LoRA 8B at 32k, planned
    # 21.6-22.2 of 22.3 GiB, ran out of GPU memory on the H100; the same with the frozen base on the host fits)
    out.sort(key=lambda cand: (at_the_edge(cand.estimate), -round(cand.speed, 6), cand.estimate.gpu_peak_bytes))
    return out


EDGE = 0.97


def at_the_edge(est: Estimate) -> bool:
    """The allocator's need within 3% of its budget: planned to fit, with no room for the planner's error."""
    budget = est.gpu_budget_bytes
    return budget is not None and budget > 0 and est.gpu_required_bytes > EDGE * budget


@dataclass(frozen=True)
class _Level:
    """How much of the activations a candidate keeps: checkpointing, and at long context the layer inputs
    on the host (memory.activation_offload) and the MLP in tiles (memory.mlp_tile_tokens, FSDP2 only)."""
    checkpointing: bool
    changes: tuple[tuple[str, str, Any], ...] = ()
    words: str = ""


def _memory_levels(cfg: C.RunConfig, strategy: str) -> list[_Level]:
    levels = [_Level(False, words="no checkpointing"), _Level(True, words="checkpointing")]
    if strategy == "full_shard+offload" and cfg.optim.name == "adamw" and cfg.train.method == "full" and (
            cfg.precision.master_dtype == "fp32" or cfg.precision.master_rounding == "stochastic"):
        # the consumer box's optimizer (6 host bytes a parameter), said in the candidate's name; not for
        # adapters, whose optimizer states are megabytes: it would only drop their clip for nothing
        levels.append(_Level(True, ADAM_MINI_CHANGES, "checkpointing, adam-mini (no clip)"))
    if cfg.data.seq_len >= LONG_CONTEXT:
        fsdp = dict((t, v) for t, k, v in {**STRATEGIES, **EXTRA_STRATEGIES}[strategy] if k == "backend")
        tiles = fsdp.get("parallel") == "fsdp"
        changes = (("memory", "activation_offload", True),) + ((("memory", "mlp_tile_tokens", MLP_TILE),) if tiles else ())
        levels.append(_Level(True, changes, "checkpointing, layer inputs on the host"
                             + (f", MLP in {MLP_TILE:,}-token tiles" if tiles else "")))
    return levels


def toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    return str(v)
