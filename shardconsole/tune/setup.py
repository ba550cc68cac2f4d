"""A tune made from the user's words: the budget as a duration, the output preset's name, and the tune
of resolved settings with its cap, machine, speed book and probe folder (the CLI's and the console's)."""

from __future__ import annotations

import re
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from shardconsole.plan.machine import Hardware, cores_arg, gbps_arg, hardware_from_args, size_arg, with_host
from shardconsole.plan.speed.book import SpeedBook, harvest
from shardconsole.settings import config as C
from shardconsole.settings import resolve as settings
from shardconsole.tune.engine import Limits, Tune

_DURATION = re.compile(r"(\d+(?:\.\d+)?)(h|m|s)")


def parse_duration(flag: str, text: str) -> float:
    """90, 90s, 10m, 1h30m -> seconds; anything else is one line naming the flag."""
    t = text.strip().lower()
    if re.fullmatch(r"\d+(\.\d+)?", t):
        secs = float(t)
    elif t and _DURATION.sub("", t) == "":
        secs = sum(float(n) * {"h": 3600, "m": 60, "s": 1}[u] for n, u in _DURATION.findall(t))
    else:
        raise C.ConfigError(f"{flag}: {text!r} is not a duration; use e.g. 90s, 10m or 1h30m")
    if secs <= 0:
        raise C.ConfigError(f"{flag}: must be more than 0")
    return secs


def output_name(given: str | None, preset: str) -> str:
    """The preset the tune will write, checked now, before any probe: a valid name, and not a preset
    that tune may not replace."""
    from shardconsole.tune.report import check_output
    name = given or f"{Path(preset).stem}-tuned"
    check_output(name)
    return name


def check_vary(keys: list[str], fixed: set[str]) -> set[str]:
    """The numerics keys `--vary` names: each one of search.NUMERICS, none also given with --set."""
    from shardconsole.plan.search import NUMERICS
    out = set()
    for key in keys:
        key = key.strip()
        if key not in NUMERICS:
            raise C.ConfigError(f"--vary: {key!r} is not a numerics key; it takes {', '.join(NUMERICS)} (tune "
                                f"searches the other levers anyway)")
        if key in fixed:
            raise C.ConfigError(f"--vary: {key} is also given with --set; a key set is kept as given")
        out.add(key)
    return out


def planned_gpus(cfg: C.RunConfig, hw: Hardware, preset: str, given: str = "") -> Hardware:
    """The GPUs a dry run plans for on a machine without one: the preset's count (parallel.nproc_per_node)
    of its card size (memory.gpu_memory_limit, which --gpu-memory sets: given), with this host's RAM."""
    size = cfg.gpu_memory_limit_bytes
    if not size:
        raise C.ConfigError(f"--dry-run: no GPU on this machine, and preset {preset!r} names no GPU size "
                            f"(memory.gpu_memory_limit): give the card's with --gpu-memory SIZE, e.g. 24GiB")
    return replace(hw, gpus=cfg.parallel.nproc_per_node, gpu_memory_bytes=size, gpu_name="",
                   source=f"planned: {given or 'the preset' + chr(39) + 's memory.gpu_memory_limit'}; "
                          f"no GPU on this machine")


def make_tune(resolved: settings.Resolved, *, budget_s: float, max_probes: int, probe_steps: int,
              gpu_memory: str | None = None, host_memory: str | None = None, runs_root_dir: str | None = None,
              name: str = "tuned", hardware=None, vary: Sequence[str] = (), dry_run: bool = False,
              host_cores: str | None = None, host_gbps: str | None = None) -> Tune:
    """A tune of resolved settings (the CLI's and the console's): the cap, the machine, the speed book with
    the finished runs under the runs root harvested, the probes' folder. Keys the user set are kept, and
    the numerics (plan/search.NUMERICS) but those named in vary. dry_run: nothing will be measured, so a
    machine without a GPU plans for the preset's (planned_gpus). host_cores, host_gbps: the host the
    ranking plans the host side for (--host-cores, --host-gbps), this machine's when None."""
    from shardconsole.user_folders import runs_root
    from shardconsole.plan.estimator import replace_cfg
    from shardconsole.session import preflight

    cfg = resolved.cfg
    cap = size_arg("--gpu-memory", gpu_memory)
    host_cap = size_arg("--host-memory", host_memory)
    if cap is not None:
        if cfg.parallel.device == "cpu":
            raise C.ConfigError("--gpu-memory: the preset runs on CPU ranks (parallel.device = cpu); "
                                "their cap is --host-memory")
        cfg = replace_cfg(cfg, ("memory", "gpu_memory_limit", str(cap)))
        C.validate(cfg, "--gpu-memory")
    spec = preflight.check_model(resolved, weights=False)
    hw = with_host(hardware or hardware_from_args(None, None, host_memory),
                   cores_arg("--host-cores", host_cores), gbps_arg("--host-gbps", host_gbps))
    if cfg.parallel.device != "cpu" and not hw.gpus:
        if not dry_run:
            raise C.ConfigError(f"no GPU found on this machine and preset {resolved.preset!r} trains on GPUs: tune "
                                f"measures real runs, so it runs where the training will (or use a CPU preset; "
                                f"--dry-run lists the options for the preset's GPU without one)")
        hw = planned_gpus(cfg, hw, resolved.preset, "--gpu-memory" if cap is not None else "")
    fixed = {o.path for o in resolved.overrides}
    varied = check_vary(list(vary), fixed)
    root = runs_root(runs_root_dir) / f"{time.strftime('%Y%m%d-%H%M%S')}-tune-{name}"
    book = SpeedBook.load()
    harvest(book, runs_root(runs_root_dir), hw)
    limits = Limits(budget_s=budget_s, max_probes=max_probes, probe_steps=probe_steps,
                    gpu_cap_bytes=cfg.gpu_memory_limit_bytes or None, host_cap_bytes=host_cap)
    return Tune(cfg, spec, hw, limits, root, book, fixed=fixed, vary=varied)
