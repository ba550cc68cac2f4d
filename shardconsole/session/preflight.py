"""The checks before a launch on this machine, over settings already resolved (settings.resolve).

The settings pipeline knows nothing of the machine; these functions do: the GPUs it has, the model
folder, the data files, the host RAM the planner predicts. `--headless` and the console's launch call
the same ones, so the console never starts what `--headless` would refuse. Each failure is one
ConfigError naming the source of the value at fault (the preset file, `--set table.key`, a console
field); warnings come back as lines for the front end to show.
"""

from __future__ import annotations

import codecs
import os
import shutil
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

from shardconsole.settings import config as C
from shardconsole.settings.models import ModelError, ModelSpec, resolve as resolve_model
from shardconsole.settings.resolve import Resolved
from shardconsole.session.gpu_checks import check_fp8, check_qlora
from shardconsole.session.planner import Planner



def _the_planner(given: Planner | None) -> Planner:
    """The planner a check was given (the console's, a test's), else shardconsole.plan."""
    if given is not None:
        return given
    from shardconsole import plan
    return plan


def check_gpus(r: Resolved, gpu_count: int) -> list[str]:
    """The settings against this machine's GPU count (more ranks than GPUs, cuda without one)."""
    cfg = r.cfg
    if cfg.parallel.device == "cpu":
        return []
    C.validate(cfg, r.source, gpu_count=gpu_count, origins=r.origins)
    check_qlora(r, gpu_count)
    check_fp8(r, gpu_count)
    if cfg.parallel.device == "auto" and gpu_count == 0:
        # CPU ranks over gloo: allowed (tests and laptops), but rarely what a GPU preset meant
        return ["parallel.device is auto and this machine has no GPU: the ranks compute on the CPU "
                "(slow for anything but the tiny model)"]
    return []


def check_nvme_offload(r: Resolved) -> None:
    """deepspeed offload to "nvme" swaps through DeepSpeed's async I/O op, which links libaio: without the
    library on this machine the op can neither be built nor loaded, and the ranks would refuse it only
    after they started. Found as `shardconsole doctor` finds it, without importing DeepSpeed."""
    d = r.cfg.deepspeed
    if r.cfg.parallel.backend != "deepspeed" or "nvme" not in (d.offload_optimizer, d.offload_param):
        return
    import ctypes.util
    if ctypes.util.find_library("aio") is None:
        key = "offload_optimizer" if d.offload_optimizer == "nvme" else "offload_param"
        raise r.error("deepspeed", key, "\"nvme\" needs DeepSpeed's async I/O op, which needs libaio, and this "
                      "machine has none (apt install libaio-dev): use \"cpu\"")


def check_model(r: Resolved, *, weights: bool = True) -> ModelSpec:
    """The model as the ranks will build it: a catalog size, or a folder transformers can build that
    holds weights (weights=False: the shape is enough, as for a plan)."""
    try:
        spec = resolve_model(r.cfg.model.name)
    except ModelError as e:
        raise r.error("model", "name", str(e)) from None
    if weights and spec.path is not None and not spec.has_weights:
        raise r.error("model", "name", f"{spec.path}: holds a config but no weights (model.safetensors or "
                                       f"pytorch_model.bin); to train this shape from random init, save weights "
                                       f"first or pick a catalog size")
    if r.cfg.adapters:
        from shardconsole.plan.lora import target_problem
        from shardconsole.plan.shapes import Shapes
        problem = target_problem(r.cfg, Shapes.of(spec))
        if problem:
            raise r.error("lora", "target_modules", problem)
    if r.cfg.train.export_gguf:
        from shardconsole.settings.gguf_kinds import problem as gguf_problem
        why = gguf_problem(spec.config, Path(spec.path) if spec.path is not None else None, spec.name)
        if why:
            raise r.error("train", "export_gguf", why)
    return spec


_MARK = "\x00preflight"   # a source no file or override has: its prefix in data_check's lines is ours


def check_data(r: Resolved) -> list[str]:
    """The data files exist and are what the ranks read (data_check.check_data, the ranks' own rules).
    Its lines start "<source>: [table] key: "; run with a marker for the source, the line is rebuilt as a
    ConfigError of that setting that blames the source of its value. Returns the scan's warnings (pairs
    whose answers are the same)."""
    try:
        from shardconsole.settings.data.data_check import check_data as check
    except ImportError:
        _check_data_file(r)
        return []
    try:
        found = check(r.cfg, _MARK)
        return list(found.notes) if found is not None else []
    except C.ConfigError as e:
        text = str(e)
        for table in ("data", "model"):
            for key in (f.name for f in fields(C.TABLES[table])):
                prefix = f"{_MARK}: [{table}] {key}: "
                if text.startswith(prefix):
                    raise r.error(table, key, text[len(prefix):]) from None
        raise C.ConfigError(text.replace(_MARK, r.source)) from None


def _check_data_file(r: Resolved) -> None:
    """A text or token file exists; a text file is UTF-8 (the ranks check it all again as they read)."""
    d = r.cfg.data
    if d.source == "synthetic" or not d.path:
        return
    data = Path(d.path).expanduser()
    if not data.is_file():
        raise r.error("data", "path", f"{data}: no such file")
    if d.source == "tokens":
        return
    with data.open("rb") as fh:
        head = fh.read(1 << 16)
    if b"\x00" in head:
        raise r.error("data", "path", f"{data}: not a text file (it holds NUL bytes); for token ids use "
                                      f"data.source = \"tokens\"")
    try:
        codecs.getincrementaldecoder("utf-8")().decode(head, final=False)
    except UnicodeDecodeError as e:
        raise r.error("data", "path", f"{data}: not UTF-8 text (byte {e.start})") from None


def _host_estimate(r: Resolved, spec: ModelSpec | None, hardware: Any, planner: Planner | None) -> Any:
    """The planner's estimate of the run on this machine; None when it cannot say."""
    try:
        planner = _the_planner(planner)
        spec = spec or resolve_model(r.cfg.model.name)
        return planner.estimate(r.cfg, spec, hardware if hardware is not None else planner.detect_hardware())
    except Exception:
        return None


def _over(est: Any) -> tuple[int, int] | None:
    budget = getattr(est, "host_budget_bytes", None)
    if est is None or not budget or est.host_peak_bytes <= budget:
        return None
    return est.host_peak_bytes, budget


def host_overrun(r: Resolved, spec: ModelSpec | None = None, hardware: Any = None,
                 planner: Planner | None = None) -> tuple[int, int] | None:
    """(planned host peak, usable host RAM) when the planner puts the run over this machine's RAM; None
    when it fits or the planner cannot say (a check that cannot run must not block a launch). The
    console passes its own planner and the hardware its probes saw; --headless detects them."""
    return _over(_host_estimate(r, spec, hardware, planner))


def check_host_memory(r: Resolved, spec: ModelSpec) -> None:
    """Refuse a launch that the planner says cannot fit this machine's RAM: a host out of memory does not
    fail cleanly like a GPU OOM, the kernel's OOM killer may take any process (the planner's host figure
    was within 6% of every calibration run). The GPU's verdict is gpu_checks.gpu_overrun's, checked before
    this one where the plan knows the GPU's memory."""
    est = _host_estimate(r, spec, None, None)
    over = _over(est)
    if over is not None:
        peak, budget = (C.format_size(b) for b in over)
        ld = getattr(est, "loading", None)
        # the load of a model folder, not training, sets the peak: say so, and what the code offers
        what = (f" while loading the model folder ({ld.help})" if ld is not None
                and est.host_peak_phase == "loading" else "")
        cap = r.cfg.host_memory_limit_bytes
        # the cap, not this machine, set the budget (it is the smaller): blame the setting; a cap above this
        # machine's RAM was blamed for the machine's size
        if cap and int(cap * 0.97) <= over[1]:
            raise r.error("memory", "host_memory_limit", f"{r.cfg.memory.host_memory_limit}: the planner puts this run "
                          f"at {peak} of host RAM{what}, over the {budget} usable under it (`shardconsole plan "
                          f"--preset {r.preset}` lists the parts; --force launches anyway)")
        raise C.ConfigError(f"the planner puts this run at {peak} of host RAM{what}, over the {budget} usable here "
                            f"(`shardconsole plan --preset {r.preset}` lists the parts; --force launches anyway)",
                            source=r.preset)


def _gpu_full(est: Any) -> bool:
    """The planner puts the allocator at this GPU's whole budget: over it, or at it with its cache
    emptied to go on (the planner's caching peak is held to the budget there). 13b on 3090-7b-offload
    under a 24 GiB cap, eager: mb 8 peaks at 21.8 of 22.3 GiB (measured: 21.2 reserved, 23.3 NVML), mb 9
    at the budget; its compiled layers need less, so mb 9 leaves room (measured: 21.7 reserved, 23.8 NVML)."""
    budget = getattr(est, "gpu_budget_bytes", None)
    return bool(budget) and (est.gpu_required_bytes > budget or est.gpu_allocator_peak_bytes >= budget)


def fit_micro_batch(r: Resolved, gpu_count: int | None, spec: ModelSpec | None = None, hardware: Any = None,
                    planner: Planner | None = None) -> tuple[Resolved, str | None]:
    """(the settings to launch, the line that says what changed). A micro-batch nobody chose (the
    preset's or the default, not `--set` or a console field) that the planner puts at this GPU's whole
    budget is lowered to the largest that leaves the allocator room: a preset is tuned for its model
    (3090-7b-offload's 12 is 7b's), and the same preset at 13b would otherwise build, pin 120 GiB of
    host memory and then stop on a GPU out of memory or crawl through emptied caches.
    A micro-batch the user chose is theirs: one the plan puts over the GPU is refused (gpu_checks.gpu_overrun,
    unless --force), and the run's out-of-memory report says what fits. Unchanged
    when the ranks run on the CPU, when no micro-batch fits, or when the planner cannot say."""
    if not gpu_count or r.cfg.parallel.device == "cpu" or "train.micro_batch" in r.origins:
        return r, None
    if r.path is not None and "model.name" not in r.origins:
        # a preset on its own model: its micro-batch was measured with it (3090-8b-64gb's 12 on llama3-8b),
        # where the planner's caching peak reaches the budget at any micro-batch (the 128k-token head's side
        # pools): lowering it halved the speed for nothing
        return r, None
    try:
        planner = _the_planner(planner)
        # the model and the machine once: every micro-batch tried is planned on the same two
        spec = spec or resolve_model(r.cfg.model.name)
        hw = hardware if hardware is not None else planner.detect_hardware()
        est = planner.estimate(r.cfg, spec, hw)
        if not _gpu_full(est):
            return r, None
        old = r.cfg.train.micro_batch
        for mb in range(old - 1, 0, -1):
            cfg = planner.replace_cfg(r.cfg, ("train", "micro_batch", mb))
            if not _gpu_full(planner.estimate(cfg, spec, hw)):
                break
        else:
            return r, None
    except Exception:
        return r, None
    whose = "the default" if r.path is None else f"{r.preset}'s"
    line = (f"train.micro_batch: {whose} {old} at {r.cfg.model.name} needs all of the "
            f"{C.format_size(est.gpu_budget_bytes)} the GPU leaves its allocator, as the planner counts it "
            f"(`shardconsole plan`); running at {mb}, the largest that leaves it room "
            f"(--set train.micro_batch={old} keeps {old})")
    return replace(r, cfg=cfg, origins={**r.origins, "train.micro_batch": "fitted to this GPU"}), line


@dataclass
class DiskShort:
    """A run that writes more than its file system holds: where, what it needs, what is free there."""
    table_key: tuple[str, str]          # the setting to change ("train", "checkpoint_dir" | "export_dir")
    path: Path
    need_bytes: int
    free_bytes: int
    text: str                           # the one line: both figures and what would fit


def _free_on(path: Path) -> tuple[int, int] | None:
    """(free bytes, device id) of the file system that `path` is or will be on (its nearest existing
    folder); None when it cannot be read."""
    p = path.expanduser().absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    try:
        return shutil.disk_usage(p).free, os.stat(p).st_dev
    except OSError:
        return None


def _existing_checkpoints(folder: Path) -> tuple[int, list[int]]:
    """(newest step, sizes oldest first) of the complete checkpoints already in a checkpoint folder."""
    from shardconsole.session.resume import checkpoints_in
    found = sorted(checkpoints_in(folder))
    sizes = [sum(f.stat().st_size for f in p.rglob("*") if f.is_file()) for _, p in found]
    return (found[-1][0] if found else 0), sizes


def checkpoint_dir_of(cfg: C.RunConfig, run_dir: Path) -> Path:
    """Where the ranks write checkpoints (backends/rank/common.py Rank.checkpoint_dir)."""
    d = cfg.train.checkpoint_dir
    return Path(d).expanduser() if d else Path(run_dir) / "checkpoints"


def disk_shortfall(cfg: C.RunConfig, run_dir: Path, spec: ModelSpec | None = None,
                   planner: Planner | None = None) -> DiskShort | None:
    """The run's saves (the planner's sizes, the checkpoints already in the folder of a resumed run)
    against the free space of checkpoint_dir's and export_dir's file systems; None when they fit or
    cannot be told (a check that cannot run must not block a launch)."""
    try:
        planner = _the_planner(planner)
        from shardconsole.plan.shapes import Shapes
        spec = spec or resolve_model(cfg.model.name)
        ckpt = checkpoint_dir_of(cfg, run_dir)
        start, existing = _existing_checkpoints(ckpt) if cfg.train.resume else (0, [])
        sv = planner.saves(cfg, Shapes.of(spec), spec.path, start_step=start, existing=existing)
        free_ckpt = _free_on(ckpt)
        export = Path(sv.export_dir).expanduser() if sv.export_dir else None
        free_export = _free_on(export) if export is not None else None
    except Exception:
        return None
    ckpt_need = sv.disk_peak_bytes - sv.existing_bytes if sv.schedule else 0
    same_fs = free_export is not None and free_ckpt is not None and free_export[1] == free_ckpt[1]
    if same_fs:      # the export is written after the last save, beside the checkpoints kept
        ckpt_need = max(ckpt_need, sv.disk_end_bytes - sv.existing_bytes + sv.export_bytes)
    if free_ckpt is not None and ckpt_need > free_ckpt[0]:
        return _short_checkpoints(cfg, sv, planner, ckpt, ckpt_need, free_ckpt[0],
                                  sv.export_bytes if same_fs else 0, start, existing)
    if export is not None and free_export is not None and not same_fs and sv.export_bytes > free_export[0]:
        fs = C.format_size
        return DiskShort(("train", "export_dir"), export, sv.export_bytes, free_export[0],
                         f"{export}: the export needs {fs(sv.export_bytes)} ({sv.export_dtype}), {fs(free_export[0])} "
                         f"free there; would fit: another train.export_dir with {fs(sv.export_bytes)} free"
                         + ("" if sv.export_dtype != "fp32" else ", or train.export_dtype = \"bf16\"")
                         + " (--force launches anyway)")
    return None


def _short_checkpoints(cfg: C.RunConfig, sv: Any, planner: Planner, ckpt: Path, need: int, free: int,
                       export_bytes: int, start: int, existing: list[int]) -> DiskShort:
    """The line for a checkpoint folder too small: both figures, then the settings that would fit."""
    fs = C.format_size
    sizes = {"full": sv.full_bytes, "model": sv.model_bytes}

    def need_with(keep: int, final: str) -> int:
        """The bytes this run adds to the folder at its fullest, with these two settings."""
        sched = planner.schedule(cfg, start, final)
        peak, _, end = planner.disk_peak([sizes[k] for _, k in sched], keep, existing)
        return (max(peak, end + export_bytes) if export_bytes else peak) - sum(existing)

    fits = []
    keep = cfg.train.keep_checkpoints
    n_saves = len(sv.schedule)
    final = planner.save_final_of(cfg)
    if n_saves > 1:
        for n in range((keep - 1) if keep else n_saves - 1, 0, -1):
            if need_with(n, final) <= free:
                fits.append(f"train.keep_checkpoints = {n} ({fs(need_with(n, final))})")
                break
    if sv.model_bytes >= sv.full_bytes:
        pass                 # a DeepSpeed "model" save is a full checkpoint: nothing to suggest
    elif final == "full" and need_with(keep, "model") <= free:
        fits.append(f"train.save_final = \"model\" ({fs(need_with(keep, 'model'))})")
    elif final == "full" and n_saves > 1 and need_with(1, "model") <= free:
        fits.append(f"train.keep_checkpoints = 1 with train.save_final = \"model\" ({fs(need_with(1, 'model'))})")
    fits.append(f"another train.checkpoint_dir with {fs(need)} free")
    what = (f"{sv.kept_at_once} checkpoint(s) at once of {fs(sv.full_bytes)}" if sv.kept_at_once > 1 else
            f"one checkpoint of {fs(max(sizes[k] for _, k in sv.schedule) if sv.schedule else 0)}")
    if export_bytes:
        what += f", then the export's {fs(export_bytes)}"
    text = (f"{ckpt}: the run's saves need {fs(need)} there ({what}), {fs(free)} free on its file system; "
            f"would fit: {', '.join(fits[:-1]) + ', or ' if len(fits) > 1 else ''}{fits[-1]} (--force launches anyway)")
    return DiskShort(("train", "checkpoint_dir"), ckpt, need, free, text)


def _offload_keys(cfg: C.RunConfig) -> list[tuple[str, str, object]]:
    """(table, key, the value that turns it off) of each offload the settings switch on."""
    if cfg.parallel.backend == "fsdp":
        return [("fsdp", "cpu_offload", False)] if cfg.fsdp.cpu_offload else []
    d = cfg.deepspeed
    return [("deepspeed", k, "none") for k in ("offload_optimizer", "offload_param") if getattr(d, k) != "none"]


def offload_not_needed(r: Resolved, gpu_count: int | None, spec: ModelSpec | None = None, hardware: Any = None,
                       planner: Planner | None = None) -> str | None:
    """One line when a preset's offload is not needed on this GPU: the planner fits the model without
    it (GPU and host), and the settings that do it. Offload trades speed for GPU memory (the article's
    24 GB recipe on a card where the model fits ran 4.6x slower than without it, tune on the H200 capped
    at 24 GiB). None when the user set an offload key themselves, when it is needed, on CPU ranks, or
    when the planner cannot say. Nothing is changed: the user decides."""
    keys = _offload_keys(r.cfg)
    if not gpu_count or r.cfg.parallel.device == "cpu" or not keys or any(
            f"{t}.{k}" in r.origins for t, k, _ in keys):
        return None
    try:
        planner = _the_planner(planner)
        spec = spec or resolve_model(r.cfg.model.name)
        hw = hardware if hardware is not None else planner.detect_hardware()
        cfg = planner.replace_cfg(r.cfg, *keys)
        est = planner.estimate(cfg, spec, hw)
        if not est.fits or _gpu_full(est):
            return None
    except Exception:
        return None
    sets = " ".join(f"--set {t}.{k}={str(v).lower()}" for t, k, v in keys)
    budget = f" of {C.format_size(est.gpu_budget_bytes)}" if est.gpu_budget_bytes else ""
    cap = r.cfg.gpu_memory_limit_bytes
    where = f"under memory.gpu_memory_limit {C.format_size(cap)}" if cap else "on this GPU"
    return (f"offload is not needed here: the planner fits {r.cfg.model.name} {where} without it "
            f"({C.format_size(est.gpu_required_bytes)}{budget}); `{sets}` runs faster (no host step; "
            f"`shardconsole tune` measures both)")


def check_disk(r: Resolved, run_dir: Path, spec: ModelSpec | None = None) -> None:
    """Refuse a launch whose saves cannot fit on their file systems (a run that fails at its last step
    loses everything it trained), in one line with both figures and what would fit."""
    short = disk_shortfall(r.cfg, run_dir, spec)
    if short is not None:
        raise r.error(*short.table_key, short.text)


def check_disk_of(cfg: C.RunConfig, run_dir: Path, source: str) -> None:
    """check_disk for settings read from a run folder (`resume`): the error names `source`."""
    short = disk_shortfall(cfg, run_dir)
    if short is not None:
        raise C.ConfigError(short.text, source=source, table=short.table_key[0], key=short.table_key[1])


def check_launch(r: Resolved, *, gpu_count: int | None) -> list[str]:
    """Every check that stops a launch here except the host RAM (the console asks, --headless refuses
    unless --force). gpu_count None: not known yet (not checked). Returns the warnings."""
    warnings = check_gpus(r, gpu_count) if gpu_count is not None else []
    check_nvme_offload(r)
    check_model(r)
    return warnings + check_data(r)
