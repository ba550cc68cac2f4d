"""The combination matrix (issue 44 items 3-4): settings combinations drawn from the settings tables' own
choices, each told apart before launch as accepted or refused by the same resolve every front end runs.

    combo = Combo.draw(random.Random(seed))      # one point of the matrix
    combo.sets()                                 # its `--set table.key=value` texts
    predicted_refusal(combo, base)               # the ConfigError line resolve gives it, or None

The allowed values come from `shardconsole settings`' describe() of each key (a choice's values, a bool's
two, an int's range), so a choice added to a table is sampled without an edit here. Standard library and
the settings layer only: tests/conftest.py imports it for the seed in pytest's header.
"""

from __future__ import annotations

import os
import random
import shlex
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SEED_ENV = "SHARDCONSOLE_MATRIX_SEED"
# The data each training objective reads (a preference pair, KTO's labelled completion, GRPO's prompt and
# reward), committed beside this file: the sample is drawn at collection, before any fixture exists. SFT's
# corpus is the matrix fixture's.
OBJECTIVE_DATA = Path(__file__).resolve().parent / "data" / "objectives"
DATA_OF = {"dpo": "pairs.jsonl", "orpo": "pairs.jsonl", "simpo": "pairs.jsonl", "kto": "kto.jsonl",
           "grpo": "prompts.jsonl"}


def _seed() -> int:
    """Different each CI run (the clock), fixed by SHARDCONSOLE_MATRIX_SEED to repeat one."""
    text = os.environ.get(SEED_ENV, "").strip()
    return int(text) if text else int(time.time()) % 1_000_000


SEED = _seed()           # read once per process: the header, the collection and the failures agree


def allowed(key: str) -> list[Any]:
    """Every value the settings table allows for `table.key`: a choice's values, a bool's two, an int's
    range (min..max), as `shardconsole settings` lists them."""
    from shardconsole.cli.settings import describe
    table, name = key.split(".")
    d = describe(table, name)
    if d["type"] in ("choice", "bool"):
        return list(d["allowed"])
    if d["type"] == "int" and d.get("min") is not None and d.get("max") is not None:
        return list(range(d["min"], d["max"] + 1))
    raise ValueError(f"{key} is a {d['type']}: pass its sample values yourself")


def _text(value: Any) -> str:
    return ("true" if value else "false") if isinstance(value, bool) else str(value)


# The dimensions. Each is drawn from allowed() unless the brief fixes a small set (grad_accum 1 or 2,
# checkpoint_every 0 or one that falls mid-run, steps 3 or 4: a CPU run of the tiny model is seconds).
STEPS = (3, 4)
EVERY = 2                # mid-run for 3 and 4 steps; the last step too for 4 (a periodic final save)


@dataclass(frozen=True)
class Combo:
    """One point of the matrix: `sets` as ordered (key, value) pairs, and the two things that are not a
    setting: export (write train.export_dir) and resume (continue the run with two more steps)."""
    sets_: tuple[tuple[str, Any], ...]
    export: bool
    resume: bool
    extra: tuple[str, ...] = field(default=())       # sets every run of the suite shares (model, data)

    @classmethod
    def draw(cls, rng: random.Random, backend: str | None = None) -> "Combo":
        pick = lambda key: rng.choice(allowed(key))  # noqa: E731
        s: dict[str, Any] = {"parallel.backend": backend or pick("parallel.backend")}
        if s["parallel.backend"] == "deepspeed":
            s["deepspeed.stage"] = pick("deepspeed.stage")
            s["deepspeed.offload_optimizer"] = pick("deepspeed.offload_optimizer")
            s["deepspeed.offload_param"] = pick("deepspeed.offload_param")
        else:
            s["fsdp.cpu_offload"] = pick("fsdp.cpu_offload")
        # A third of the points train another objective than SFT on its own data (the settings table's choices)
        if rng.random() < 0.35:
            s["train.objective"] = rng.choice([o for o in allowed("train.objective") if o != "sft"])
            s["data.path"] = str(OBJECTIVE_DATA / DATA_OF[s["train.objective"]])
            if s["train.objective"] == "grpo":       # two completions of four tokens: seconds on CPU
                s.update({"grpo.reward": f"{OBJECTIVE_DATA / 'reward.py'}:score", "grpo.generations": 2,
                          "grpo.max_new_tokens": 4, "grpo.beta": rng.choice((0.0, 0.04)),
                          "grpo.loss": pick("grpo.loss")})
        s["train.method"] = pick("train.method")
        s["train.save_final"] = pick("train.save_final")
        s["precision.master_dtype"] = pick("precision.master_dtype")
        if s["precision.master_dtype"] == "bf16":     # it rounds bf16 masters only (a note, nothing else, on fp32)
            s["precision.master_rounding"] = pick("precision.master_rounding")
        # bf16 masters need bf16 compute (a rule of their own): drawn otherwise, most bf16-master points
        # would test that one refusal instead of the masters.
        s["precision.dtype"] = "bf16" if s["precision.master_dtype"] == "bf16" else pick("precision.dtype")
        s["optim.name"] = pick("optim.name")
        # FP8 linears need a GPU of SM 8.9+: on this CPU box every such point is a refusal (one line, before
        # launch); rare, so that they do not crowd out the other refusals (tests/test_fp8.py runs them emulated)
        if rng.random() < 0.15:
            s["precision.fp8"] = rng.choice([v for v in allowed("precision.fp8") if v != "none"])
        s["memory.activation_checkpointing"] = pick("memory.activation_checkpointing")
        if s["memory.activation_checkpointing"]:
            s["memory.checkpoint_policy"] = pick("memory.checkpoint_policy")
        s["train.grad_accum"] = rng.choice((1, 2))
        s["train.steps"] = rng.choice(STEPS)
        s["train.checkpoint_every"] = rng.choice((0, EVERY))
        export = rng.random() < 0.5
        if export:
            # merged or peft's adapters (train.export_adapter), at a dtype of the table's or the default
            s["train.export_adapter"] = pick("train.export_adapter")
            dtype = rng.choice([*allowed("train.export_dtype"), None])
            if dtype is not None:
                s["train.export_dtype"] = dtype
        return cls(tuple(s.items()), export=export, resume=rng.random() < 0.3)

    def get(self, key: str, default: Any = None) -> Any:
        return dict(self.sets_).get(key, default)

    @property
    def backend(self) -> str:
        return str(self.get("parallel.backend"))

    def sets(self, export_dir: str = "", nvme_dir: str = "") -> list[str]:
        """The `--set` texts of this point; export_dir / nvme_dir: folders for the export and nvme offload."""
        out = [f"{k}={_text(v)}" for k, v in self.sets_]
        if self.export:
            out.append(f"train.export_dir={export_dir or '/tmp/shardconsole-matrix-export'}")
        if "nvme" in (self.get("deepspeed.offload_optimizer"), self.get("deepspeed.offload_param")):
            out.append(f"deepspeed.nvme_path={nvme_dir or '/tmp/shardconsole-matrix-nvme'}")
        return [*self.extra, *out]

    def label(self) -> str:
        """Short and unique enough to find it again: the values that are not the defaults' of the draw."""
        short = {"parallel.backend": "", "deepspeed.stage": "z", "train.method": "", "train.save_final": "save=",
                 "precision.master_dtype": "master=", "precision.master_rounding": "round=",
                 "precision.dtype": "dtype=", "optim.name": "", "train.grad_accum": "accum=",
                 "train.steps": "steps=", "train.checkpoint_every": "every=",
                 "deepspeed.offload_optimizer": "offopt=", "deepspeed.offload_param": "offparam=",
                 "fsdp.cpu_offload": "offload=", "memory.activation_checkpointing": "ac=", "memory.checkpoint_policy": "",
                 "train.export_adapter": "adapter=", "train.export_dtype": "export_dtype=", "precision.fp8": "fp8=",
                 "train.objective": "", "grpo.beta": "beta=", "grpo.loss": "loss="}
        parts = [f"{short.get(k, k + '=')}{_text(v)}" for k, v in self.sets_
                 if k not in ("data.path", "grpo.reward", "grpo.generations", "grpo.max_new_tokens")]
        return "-".join(parts + (["export"] if self.export else []) + (["resume"] if self.resume else []))

    def command(self, base: list[str], run_dir: str = "RUN") -> str:
        """The shell line that repeats this point's first session by hand."""
        argv = ["python", "-m", "shardconsole", "--preset", "tiny-cpu", "--headless", "--run-dir", run_dir]
        for s in [*base, *self.sets(os.path.join(run_dir + "-export"), run_dir + "-nvme")]:
            argv += ["--set", s]
        return shlex.join(argv)


def predicted_refusal(combo: Combo, base: list[str]) -> str | None:
    """The one line the settings' resolve (and the preflight's nvme check) refuses this point with (what the
    CLI says before launch), or None when they accept it. Cheap: no process, no torch."""
    from shardconsole.session import preflight
    from shardconsole.settings import config as C
    from shardconsole.settings import resolve as settings
    try:
        # and the one check of this machine a point can fail without its model and data (nvme: libaio)
        preflight.check_nvme_offload(settings.resolve("tiny-cpu", settings.from_cli([*base, *combo.sets()])))
    except C.ConfigError as e:
        return str(e)
    return None


def sample(seed: int, runs: int, refusals: int, base: list[str], max_draws: int = 20_000
           ) -> tuple[list[Combo], list[tuple[Combo, str]]]:
    """`runs` points resolve accepts (the engines alternating, so both are in every sample) and `refusals`
    points it refuses (with at least one qlora: CUDA-only, refused on CPU), drawn with `seed`."""
    rng = random.Random(seed)
    backends = allowed("parallel.backend")
    accepted: list[Combo] = []
    refused: list[tuple[Combo, str]] = []
    for _ in range(max_draws):
        if len(accepted) >= runs and len(refused) >= refusals:
            break
        combo = Combo.draw(rng, backends[len(accepted) % len(backends)])
        why = predicted_refusal(combo, base)
        if why is None and len(accepted) < runs:
            accepted.append(combo)
        elif why is not None and len(refused) < refusals:
            refused.append((combo, why))
    if refused and not any(c.get("train.method") == "qlora" for c, _ in refused):
        while True:
            combo = Combo.draw(rng)
            if combo.get("train.method") == "qlora":
                why = predicted_refusal(combo, base)
                if why is not None:
                    refused[-1] = (combo, why)
                    break
    return accepted, refused
