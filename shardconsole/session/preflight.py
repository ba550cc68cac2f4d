"""The checks before a launch on this machine, over settings already resolved (settings.resolve).

The settings pipeline knows nothing of the machine; these functions do: the GPUs it has, the model
folder, the data files, the host RAM the planner predicts. `--headless` and the console's launch call
the same ones, so the console never starts what `--headless` would refuse. Each failure is one
ConfigError naming the source of the value at fault (the preset file, `--set table.key`, a console
field); warnings come back as lines for the front end to show.
"""

from __future__ import annotations

import codecs
from dataclasses import fields
from pathlib import Path
from types import ModuleType
from typing import Any

from shardconsole.settings import config as C
from shardconsole.settings.models import ModelError, ModelSpec, resolve as resolve_model
from shardconsole.settings.resolve import Resolved


def check_gpus(r: Resolved, gpu_count: int) -> list[str]:
    """The settings against this machine's GPU count (more ranks than GPUs, cuda without one)."""
    cfg = r.cfg
    if cfg.parallel.device == "cpu":
        return []
    C.validate(cfg, r.source, gpu_count=gpu_count, origins=r.origins)
    if cfg.parallel.device == "auto" and gpu_count == 0:
        # CPU ranks over gloo: allowed (tests and laptops), but rarely what a GPU preset meant
        return ["parallel.device is auto and this machine has no GPU: the ranks compute on the CPU "
                "(slow for anything but the tiny model)"]
    return []


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
    return spec


_MARK = "\x00preflight"   # a source no file or override has: its prefix in data_check's lines is ours


def check_data(r: Resolved) -> None:
    """The data files exist and are what the ranks read (data_check.check_data, the ranks' own rules).
    Its lines start "<source>: [table] key: "; run with a marker for the source, the line is rebuilt as a
    ConfigError of that setting that blames the source of its value."""
    try:
        from shardconsole.settings.data_check import check_data as check
    except ImportError:
        _check_data_file(r)
        return
    try:
        check(r.cfg, _MARK)
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


def host_overrun(r: Resolved, spec: ModelSpec | None = None, hardware: Any = None,
                 planner: ModuleType | None = None) -> tuple[int, int] | None:
    """(planned host peak, usable host RAM) when the planner puts the run over this machine's RAM; None
    when it fits or the planner cannot say (a check that cannot run must not block a launch). The
    console passes its own planner and the hardware its probes saw; --headless detects them."""
    try:
        if planner is None:
            from shardconsole import plan as planner
        spec = spec or resolve_model(r.cfg.model.name)
        est = planner.estimate(r.cfg, spec, hardware if hardware is not None else planner.detect_hardware())
    except Exception:
        return None
    budget = getattr(est, "host_budget_bytes", None)
    if not budget or est.host_peak_bytes <= budget:
        return None
    return est.host_peak_bytes, budget


def check_host_memory(r: Resolved, spec: ModelSpec) -> None:
    """Refuse a launch that the planner says cannot fit this machine's RAM: a host out of memory does not
    fail cleanly like a GPU OOM, the kernel's OOM killer may take any process (the planner's host figure
    was within 6% of every calibration run). GPU verdicts are left to the run: a GPU OOM is caught and
    explained with the settings that fit."""
    over = host_overrun(r, spec)
    if over is not None:
        peak, budget = (C.format_size(b) for b in over)
        raise C.ConfigError(f"the planner puts this run at {peak} of host RAM, over the {budget} usable here "
                            f"(`shardconsole plan --preset {r.preset}` lists the parts; --force launches anyway)",
                            source=r.preset)


def check_launch(r: Resolved, *, gpu_count: int | None) -> list[str]:
    """Every check that stops a launch here except the host RAM (the console asks, --headless refuses
    unless --force). gpu_count None: not known yet (not checked). Returns the warnings."""
    warnings = check_gpus(r, gpu_count) if gpu_count is not None else []
    check_model(r)
    check_data(r)
    return warnings
