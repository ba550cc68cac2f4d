"""The one settings pipeline: (preset, ordered overrides each with its source) -> the resolved settings.

    resolve("tiny-cpu", from_cli(["train.steps=8"]))   -> Resolved(cfg, preset, path, notes, origins)

Order (later wins): the dataclass defaults < the preset file < each override in turn; then, for a
DeepSpeed run made from FSDP settings (`--set parallel.backend=deepspeed`), the ZeRO equivalents of the
fsdp table for every deepspeed key nobody set; then the checks that span several keys. Every front end
(run, the console's launch, plan, export, print-command, Slurm) calls it once and uses what it returns.
Errors name the source the value came from: the preset file, `--set table.key`, or `console: [table] key`.

Checks against this machine (GPUs, model folder, data file, host RAM) are not here: they are
session/preflight.py's, over a Resolved. Settings layer: no front end, no backends, no I/O but the
preset file's read.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

from shardconsole.settings import config as C
from shardconsole.settings import preset_store

DEFAULT_PRESET = "tiny-cpu"


@dataclass(frozen=True)
class Override:
    """One `table.key=value`, as `--set` takes the value, with the source its errors name."""
    table: str
    key: str
    text: str
    source: str

    @property
    def path(self) -> str:
        return f"{self.table}.{self.key}"

    def __str__(self) -> str:
        return f"{self.table}.{self.key}={self.text}"


def from_cli(texts: Iterable[str]) -> list[Override]:
    """`--set` arguments; a malformed one ("steps=3", "trian.steps=3") is a ConfigError naming it."""
    out = []
    for text in texts:
        table, key, value = C.parse_override(text)
        out.append(Override(table, key, value, C.override_source("--set", table, key)))
    return out


def from_console(table: str, key: str, text: str) -> Override:
    """A console field's text; its errors say `console: [table] key`."""
    return Override(table, key, text, C.override_source("console", table, key))


@dataclass
class Resolved:
    cfg: C.RunConfig
    preset: str                     # the preset's name ("tiny-cpu", a file's stem) or "defaults"
    path: Path | None               # its file; None for the defaults
    notes: list[str] = field(default_factory=list)       # deepspeed settings filled from the fsdp table
    origins: dict[str, str] = field(default_factory=dict)  # "table.key" -> the override source that set it
    overrides: list[Override] = field(default_factory=list)  # those applied, in order
    refused: dict[str, C.ConfigError] = field(default_factory=dict)  # lenient only: set aside, by table.key
    invalid: C.ConfigError | None = None     # lenient only: the first impossible combination

    @property
    def source(self) -> str:
        """Where the values nobody overrode came from: the preset file, or "defaults"."""
        return str(self.path) if self.path is not None else "defaults"

    def origin(self, table: str, key: str) -> str:
        """The source of one setting's value, for an error about it."""
        return self.origins.get(f"{table}.{key}", self.source)

    def error(self, table: str, key: str, reason: str) -> C.ConfigError:
        """A ConfigError about one setting, blaming the source of its value."""
        return C.ConfigError(reason, source=self.origin(table, key), table=table, key=key)

    @property
    def problems(self) -> list[C.ConfigError]:
        """Lenient only: the refused overrides, then the impossible combination (not at a refused key)."""
        out = list(self.refused.values())
        if self.invalid is not None and self.invalid.path not in self.refused:
            out.append(self.invalid)
        return out


def resolve(preset: str | None, overrides: Iterable[Override | str] = (), *, gpu_count: int | None = None,
            lenient: bool = False, rendezvous_from_launcher: bool = False) -> Resolved:
    """The settings a run of this preset uses. preset: a name, a .toml path, or None for the defaults.
    overrides: Override objects or `table.key=value` strings (taken as `--set`). gpu_count: GPUs here,
    when the caller knows (None: not checked). lenient (the console): a bad override is set aside in
    `refused` and an impossible combination kept in `invalid` instead of raising; a bad preset file
    still raises. rendezvous_from_launcher (`--slurm`): the launcher names node 0, so several nodes
    need no parallel.rdzv_endpoint."""
    if preset is None:
        return resolve_doc(None, "defaults", None, overrides, gpu_count=gpu_count, lenient=lenient,
                           rendezvous_from_launcher=rendezvous_from_launcher)
    path = preset_store.find(preset)
    return resolve_doc(C.load_toml(path), path.stem, path, overrides, gpu_count=gpu_count, lenient=lenient,
                       rendezvous_from_launcher=rendezvous_from_launcher)


def resolve_doc(doc: dict[str, Any] | None, name: str, path: Path | str | None,
                overrides: Iterable[Override | str] = (), *, gpu_count: int | None = None,
                lenient: bool = False, rendezvous_from_launcher: bool = False) -> Resolved:
    """resolve() over a preset already read (an import's merged document, a run folder's preset.toml)."""
    given = [o if isinstance(o, Override) else from_cli([o])[0] for o in overrides]
    path = Path(path) if path is not None else None
    out = Resolved(C.RunConfig(), name, path)
    if doc:
        C.apply_toml(out.cfg, doc, out.source)
    for o in given:
        try:
            C.set_from_text(out.cfg, o.table, o.key, o.text, o.source)
        except C.ConfigError as e:
            if not lenient:
                raise
            out.refused[o.path] = e
            continue
        out.origins[o.path] = o.source
        out.overrides.append(o)
    if rendezvous_from_launcher:
        out.cfg.parallel.rendezvous = "slurm"     # preset.toml says so: the ranks validate it again
    out.notes = apply_fsdp_equivalents(out.cfg, _set_keys(doc, out.overrides, "deepspeed"))
    out.notes += drop_fp16_keys(out.cfg, out.origins)
    # Said only of a value that is not the default: a preset that spells out every key (one written by
    # an earlier version) names the default rounding, and a default never warns (issue 36.12).
    prec = out.cfg.precision
    if prec.master_dtype == "fp32" and prec.master_rounding != C.RunConfig().precision.master_rounding and (
            "precision.master_rounding" in out.origins or "master_rounding" in ((doc or {}).get("precision") or {})):
        out.notes.append(f"precision.master_rounding = {out.cfg.precision.master_rounding!r} has no effect: it "
                         "rounds bf16 masters, and master_dtype is 'fp32'")
    if prec.fp8 != "none" and not out.cfg.compiles_layers and out.cfg.parallel.device != "cpu":
        # torchao's float8 casts (amax, scale, cast) are separate kernels unless inductor fuses them
        out.notes.append(f"precision.fp8 = {prec.fp8!r} without compiled layers: torchao's float8 casts run as "
                         "separate kernels, often slower than bf16; set train.compile = true (DeepSpeed ZeRO-3: "
                         "and deepspeed.stage3_layer_gather = true)")
    try:
        C.validate(out.cfg, out.source, gpu_count=gpu_count, origins=out.origins,
                   rendezvous_from_launcher=rendezvous_from_launcher)
    except C.ConfigError as e:
        if not lenient:
            raise
        out.invalid = e
    return out


def drop_fp16_keys(cfg: C.RunConfig, origins: dict[str, str]) -> list[str]:
    """An override of precision.dtype away from fp16 (`--set precision.dtype=bf16` on an fp16 preset)
    makes the preset's fp16 loss-scale keys moot: they are cleared, one note each. Keys an override set
    itself, or a preset whose own dtype is not fp16, are still refused by validate."""
    prec = cfg.precision
    if prec.dtype == "fp16" or "precision.dtype" not in origins:
        return []
    notes = []
    for key in prec.FP16_KEYS:
        if getattr(prec, key) is not None and f"precision.{key}" not in origins:
            notes.append(f"precision.{key} = {getattr(prec, key)!r} ignored: an fp16 loss-scale setting, and "
                         f"{origins['precision.dtype']} made dtype {prec.dtype!r}")
            setattr(prec, key, None)
    return notes


# ---------------------------------------------------------------------------------------------------
# FSDP settings -> the closest DeepSpeed settings (for `--set parallel.backend=deepspeed`)

FSDP_TO_STAGE = {"full_shard": 3, "hybrid_shard": 3, "shard_grad_op": 2, "no_shard": 0}
_DERIVED_KEYS = ("stage", "offload_optimizer", "offload_param", "pin_memory")


def _set_keys(doc: dict[str, Any] | None, overrides: Iterable[Override], table: str) -> set[str]:
    """Keys of `table` that the preset file or an override names (as opposed to defaults)."""
    section = (doc or {}).get(table)
    keys = set(section) if isinstance(section, dict) else set()
    return keys | {o.key for o in overrides if o.table == table}


def user_set_keys(preset: dict[str, Any] | None, overrides: list[str] | None, table: str) -> set[str]:
    """_set_keys for `table.key=value` strings."""
    return _set_keys(preset, from_cli(overrides or []), table)


def apply_fsdp_equivalents(cfg: C.RunConfig, given: set[str]) -> list[str]:
    """For a DeepSpeed run, fill the deepspeed settings that the user did not set (`given`: the deepspeed
    keys a preset or an override names) from the fsdp table:

        fsdp.sharding    full_shard -> stage 3, hybrid_shard -> stage 3, shard_grad_op -> 2, no_shard -> 0
        fsdp.cpu_offload -> offload_param = "cpu" (stage 3) and offload_optimizer = "cpu" (stage >= 1)
        fsdp.pin_memory  -> pin_memory

    The fsdp defaults (full_shard, no offload, pinned) give the deepspeed defaults, so a preset written
    for DeepSpeed is unchanged. Returns one line per setting changed. Mutates cfg; validate after."""
    if cfg.parallel.backend != "deepspeed":
        return []
    f, d = cfg.fsdp, cfg.deepspeed
    notes: list[str] = []

    def put(key: str, value: Any, why: str) -> None:
        if key in given or getattr(d, key) == value:
            return
        setattr(d, key, value)
        notes.append(f"deepspeed.{key} = {value!r} ({why})")

    if cfg.train.method == "qlora" and FSDP_TO_STAGE[f.sharding] == 3:
        # QLoRA's 4-bit base is replicated (no ZeRO-3 partitions of bitsandbytes' packed weights)
        put("stage", 2, f"from fsdp.sharding = {f.sharding!r}; train.method = \"qlora\" runs at stages 0-2")
    else:
        put("stage", FSDP_TO_STAGE[f.sharding], f"from fsdp.sharding = {f.sharding!r}")
    if f.cpu_offload:
        if d.stage == 3:
            put("offload_param", "cpu", "from fsdp.cpu_offload = true")
        if d.stage >= 1:
            put("offload_optimizer", "cpu", "from fsdp.cpu_offload = true")
        else:
            notes.append("fsdp.cpu_offload: nothing offloaded, ZeRO stage 0 cannot offload")
    put("pin_memory", f.pin_memory, "from fsdp.pin_memory")
    if f.sharding == "hybrid_shard":
        notes.append("fsdp.sharding = 'hybrid_shard': ZeRO-3 shards across all ranks (DeepSpeed's hpZ, "
                     "zero_hpz_partition_size, is not a shardconsole setting)")
    return notes
