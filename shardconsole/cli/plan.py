"""`shardconsole plan`: will a run fit, before it is launched.

    shardconsole plan --preset NAME [--set table.key=value ...] [--json] [--card NAME]
                      [--gpus N] [--gpu-memory 24GiB] [--host-memory 64GiB] [--host-cores N] [--host-gbps X]
    shardconsole plan --fit [--gpus N] [--gpu-memory 24GiB] [--host-memory 128GiB]
                      [--model NAME|DIR] [--preset NAME] [--seq-len 2048] [--json]

Hardware is what NVML and psutil find on this machine, unless given; --card NAME plans that card (its
memory and speed, plan/speed/cards.py) with this host, or the host --host-cores / --host-gbps describe. The speed (tokens/s, the step and its bound part, the time to
train.steps) is plan/speed/model.py's prediction. Exit codes: 0 the plan was made
(it fits, or cannot tell), 3 its verdict is "does not fit" (the plan is printed all the same), 2 bad
input: one line on stderr (ConfigError, handled by cli.main). No torch import: answers in well under a second.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from typing import Any

from shardconsole.settings import config as C
from shardconsole import plan as PL
from shardconsole.settings import resolve as settings
from shardconsole.settings.models import ModelSpec, human_count
from shardconsole.settings.values import FP8_GPUS
from shardconsole.plan.speed import model as speed_model
from shardconsole.plan.speed.cards import CARDS, Card, card_named
from shardconsole.plan.machine import Hardware, hardware_from_args
from shardconsole.session import preflight
from shardconsole.cli.terminal import fit

EXIT_DOES_NOT_FIT = 3


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="shardconsole plan",
        description="Predict the peak GPU memory (largest rank) and host RAM of a run, part by part, "
                    "and whether it fits; or (--fit) which models and settings fit a machine.")
    ap.add_argument("--preset", default=None, help=f"preset name or .toml file (default: {settings.DEFAULT_PRESET}, "
                    "the preset `shardconsole` opens; --fit: the built-in defaults at seq_len 2048)")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="TABLE.KEY=VALUE",
                    help="override one setting; repeatable")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    ap.add_argument("--gpus", type=int, default=None, help="GPUs per node (default: found by NVML)")
    ap.add_argument("--gpu-memory", default=None, metavar="SIZE", help="memory of one GPU, e.g. 24GiB")
    ap.add_argument("--host-memory", default=None, metavar="SIZE", help="host RAM of one node, e.g. 64GiB")
    ap.add_argument("--host-cores", default=None, metavar="N",
                    help="plan the host side (the offloaded optimizer step, host copies) for a host of N CPU "
                         "cores (default: this machine's)")
    ap.add_argument("--host-gbps", default=None, metavar="X",
                    help="the host's memory bandwidth a step reaches, GB/s (default: $SHARDCONSOLE_HOST_GBPS, "
                         "else the H200 test host's 118 scaled by cores)")
    ap.add_argument("--card", default=None, metavar="NAME",
                    help=f"plan this card with this host: its memory and its speed ({', '.join(CARDS)})")
    ap.add_argument("--fit", action="store_true",
                    help="for each strategy the largest catalog model that trains; with --model, the settings "
                         "that fit that model, fastest first")
    ap.add_argument("--model", default=None, help="--fit: a catalog size or a model folder with config.json")
    ap.add_argument("--seq-len", type=int, default=None, help="--fit: tokens per sample (default 2048, or the preset's)")
    return ap


def load(preset: str | None, overrides: list[settings.Override]) -> settings.Resolved:
    """The run's settings, resolved as a launch resolves them, but not checked against this machine's
    GPUs: a plan is often made for another machine."""
    return settings.resolve(preset, overrides)


def _hw_text(hw: PL.Hardware) -> str:
    gpu = (f"{hw.gpus} x {hw.gpu_name + ' ' if hw.gpu_name else ''}{C.format_size(hw.gpu_memory_bytes)}"
           if hw.gpus and hw.gpu_memory_bytes else "no GPU known")
    host = C.format_size(hw.host_memory_bytes) if hw.host_memory_bytes else "unknown"
    cores = f", {hw.cpus} CPU cores" if hw.cpus else ""
    return f"{gpu}, host {host}{cores} ({hw.source}{', ' + hw.host_given if hw.host_given else ''})"


def _hw_dict(hw: PL.Hardware) -> dict[str, Any]:
    return {"gpus": hw.gpus, "gpu_memory_bytes": hw.gpu_memory_bytes, "host_memory_bytes": hw.host_memory_bytes,
            "gpu_name": hw.gpu_name, "source": hw.source, "host_cores": hw.cpus or None,
            "host_gbps": hw.host_gbps or None, "host_given": hw.host_given}


def describe(cfg: C.RunConfig) -> str:
    p = cfg.parallel
    if p.backend == "fsdp":
        eng = f"FSDP2 {cfg.fsdp.sharding}" + (" + CPU offload" if cfg.fsdp.cpu_offload else "")
    else:
        d = cfg.deepspeed
        off = [k for k, v in (("optimizer", d.offload_optimizer), ("params", d.offload_param)) if v != "none"]
        eng = f"DeepSpeed ZeRO-{d.stage}" + (f" + offload {'+'.join(off)}" if off else "")
    ranks = p.nproc_per_node * p.nnodes
    return (f"{eng}, {ranks} rank(s), {cfg.precision.dtype}, micro_batch {cfg.train.micro_batch} x seq "
            f"{cfg.data.seq_len}, {cfg.model.attn_implementation}, "
            + ("checkpointing" if cfg.memory.activation_checkpointing else "no checkpointing")
            + (f", cap {cfg.memory.gpu_memory_limit} (a card of that size)" if cfg.memory.gpu_memory_limit else ""))


def _parts_lines(parts: dict[str, int], width: int = 40) -> list[str]:
    return [f"  {k:<{width}} {C.format_size(v):>10}" for k, v in parts.items()]


def format_estimate(est: PL.Estimate, cfg: C.RunConfig, name: str, hw: PL.Hardware) -> str:
    lines = [f"plan: {name}: model {est.model} ({human_count(est.n_params)} parameters), {describe(cfg)}",
             *([f"train.method {cfg.train.method}: {est.trainable_line}"] if cfg.adapters else []),
             f"hardware: {_hw_text(hw)}", ""]
    if est.gpu_parts:
        lines.append(f"GPU, largest rank: {PL.gpu_peak_text(est)}, set at the {est.gpu_peak_phase} (allocator "
                     f"{C.format_size(est.gpu_allocator_peak_bytes)} + context + driver reserve)")
        lines += _parts_lines(est.gpu_parts)
        others = [f"{k} {C.format_size(v)}" for k, v in est.gpu_phases.items() if k != est.gpu_peak_phase]
        if others:
            lines.append("  other moments (allocated): " + ", ".join(others))
        for k, v in est.alternatives.items():
            lines.append(f"  {k}: {C.format_size(v)} saved for backward")
        if est.gpu_budget_bytes:
            # "allocatable": what torch's allocator must be let hold for the run to go on (under less it
            # fails); above it the allocator only caches. The budget is the device less context and driver.
            lines.append(f"  allocator: needs {C.format_size(est.gpu_required_bytes)} of the "
                         f"{C.format_size(est.gpu_budget_bytes)} it may hold (the device less context and "
                         f"driver; below the need the run fails, above it the allocator caches)")
        lines.append("")
    ld, per_node = est.loading, est.ranks_per_node
    if est.host_peak_phase == "loading" and ld is not None and ld.who == "rank 0" and per_node > 1:
        ranks = (f"rank 0 {C.format_size(ld.rank_bytes(0))} + {per_node - 1} rank(s) x "
                 f"{C.format_size(ld.rank_bytes(1))}")
    else:
        ranks = f"{per_node} rank(s) x {C.format_size(est.host_rank_bytes)}"
    lines.append(f"host RAM, node: {C.format_size(est.host_peak_bytes)} ({ranks} + launcher + front end)")
    lines += _parts_lines(est.host_parts)
    lines.append(PL.host_peak_line(est))
    if ld is not None:
        lines.append(f"  loading the model folder ({ld.how}): the node's ranks "
                     f"{C.format_size(est.host_phases['loading'])}, training's "
                     f"{C.format_size(est.host_phases.get('training', 0))}")
    if est.saves is not None:
        lines += ["", *PL.saves_text_lines(est.saves, cfg.train.checkpoint_dir)]
    for n in est.notes:
        lines.append(f"note: {n}")
    lines += ["", f"verdict: {est.verdict}"]
    return "\n".join(lines)


def fmt_duration(seconds: float) -> str:
    """3h05m, 12m30s, 45s."""
    s = int(round(seconds))
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


def speed_lines(p: speed_model.SpeedPrediction | None, cfg: C.RunConfig, host_given: str = "") -> list[str]:
    """The prediction in words: tokens/s, the step and its bound part, the time to train.steps."""
    if p is None:
        lines = ["speed: no prediction (CPU ranks, or a GPU the speed model does not know: --card NAME names one)"]
        if cfg.precision.fp8 != "none":     # (with a known card the speed model's notes say whether it has FP8)
            lines.append(f"  note: precision.fp8 runs only on a CUDA GPU with FP8 tensor cores ({FP8_GPUS}); "
                         "a launch without one refuses it in one line")
        return lines
    parts = ", ".join(f"{k} {v:.3g} s" for k, v in p.parts.items() if v > 0)
    card = CARDS[p.card].title if p.card in CARDS else p.card
    host = f"the host of {host_given}" if host_given else "this host"
    lines = [f"speed (predicted, {card}, {host}): {p.tokens_per_s:,.0f} tokens/s; a step {p.step_s:.3g} s, "
             f"{p.bound} bound ({parts})",
             f"  {cfg.train.steps} steps: {fmt_duration(p.seconds)} (start, model build"
             + (", compile" if cfg.train.compile else "") + f" ~{fmt_duration(p.start_s)}, then "
             f"{fmt_duration(p.seconds - p.start_s)} of steps)"]
    lines += [f"  note: {n}" for n in p.notes]
    return lines


def would_fit(cfg: C.RunConfig, spec: ModelSpec, hw: Hardware) -> PL.Candidate | None:
    """For a run that does not fit hw: the smallest change that does, the largest lower micro-batch, else
    the fastest settings of `plan --fit --model`
    (strategy, checkpointing, micro-batch); None where none does or no GPU is known to plan them on."""
    if cfg.parallel.device == "cpu":
        return None
    if (not hw.gpus or not hw.gpu_memory_bytes) and cfg.gpu_memory_limit_bytes:
        # No GPU here: the settings' cap is the card they are planned on (a card of that size, one a rank),
        # as the verdict above was; a user planning the 24 GiB box from a laptop gets the change too
        hw = replace(hw, gpus=cfg.parallel.nproc_per_node, gpu_memory_bytes=cfg.gpu_memory_limit_bytes)
    if not hw.gpus or not hw.gpu_memory_bytes:
        return None
    from shardconsole.plan.fit import at_the_edge
    from shardconsole.plan.speed.book import SpeedBook
    book = SpeedBook.load()
    # (grad_accum as given: accumulating more keeps unsynced gradients, which an offloaded run holds on the GPU)
    for mb in range(cfg.train.micro_batch - 1, 0, -1):
        c2 = PL.replace_cfg(cfg, ("train", "micro_batch", mb))
        est = PL.estimate(c2, spec, hw)
        if est.fits and not at_the_edge(est):      # one at the edge is no fix (fit.at_the_edge): look further
            p = book.predict(c2, hw, spec)
            return PL.Candidate(f"train.micro_batch {mb}", [f"train.micro_batch={mb}"], est, p.value, p.unit, p.source)
    cands = PL.settings_that_fit(cfg, hw, spec, book=book)
    return cands[0] if cands else None


def no_fit_lines(instead: PL.Candidate | None, hw: Hardware) -> list[str]:
    """What plan says in place of a speed for a run that does not fit: no tokens/s, no time to finish
    (the run would stop, not finish), and what would fit."""
    lines = ["speed: none predicted: the run does not fit (the verdict above), so it would not finish"]
    if instead is None:
        lines.append("  would fit: no strategy, checkpointing or micro-batch here; lower what the verdict names"
                     + (", or plan another machine (--gpus, --gpu-memory, --host-memory)" if hw.gpus else ""))
        return lines
    speed = (f", {instead.speed:,.0f} tokens/s ({instead.speed_source})" if instead.speed_unit == "tokens/s" else "")
    lines.append(f"  would fit: {instead.name}{speed}: " + " ".join(f"--set {o}" for o in instead.overrides))
    lines.append("  (`shardconsole plan --fit --model NAME` lists every setting that fits, fastest first)")
    return lines


def _with_card(hw: Hardware, card: Card | None, gpu_memory_given: bool) -> Hardware:
    """hw with card's GPU (its memory unless --gpu-memory was given; one GPU where none was found)."""
    if card is None:
        return hw
    return Hardware(gpus=hw.gpus or 1, gpu_memory_bytes=hw.gpu_memory_bytes if gpu_memory_given else card.memory_bytes,
                    host_memory_bytes=hw.host_memory_bytes, gpu_name=card.title, source=f"{hw.source}, --card {card.name}",
                    cpus=hw.cpus, host_gbps=hw.host_gbps, host_given=hw.host_given)


def _card_arg(text: str | None) -> Card | None:
    if text is None:
        return None
    try:
        return card_named(text)
    except ValueError as e:
        raise C.ConfigError(f"--card: {e}") from None


def cmd_plan(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    card = _card_arg(args.card)
    if args.fit:
        return _cmd_fit(args)
    if args.model or args.seq_len:
        raise C.ConfigError("--model and --seq-len go with --fit; to plan a run use --set model.name=... "
                            "and --set data.seq_len=...")
    # The preset `shardconsole` itself opens without --preset: a plan of "the run" is a plan of that one.
    name = args.preset or settings.DEFAULT_PRESET
    resolved = load(name, settings.from_cli(args.overrides))
    cfg = resolved.cfg
    spec = preflight.check_model(resolved, weights=False)
    hw = _with_card(hardware_from_args(args.gpus, args.gpu_memory, args.host_memory, args.host_cores, args.host_gbps),
                    card, args.gpu_memory is not None)
    est = PL.estimate(cfg, spec, hw)
    speed = speed_model.predict(cfg, spec, hw, card=card)
    # A run that does not fit has no speed and no time to finish: what would fit instead (issue 65)
    fits_not = est.verdict.startswith("does not fit")
    instead = would_fit(cfg, spec, hw) if fits_not else None
    if args.json:
        out = est.to_dict()
        out["hardware"] = _hw_dict(hw)
        out["preset"] = name
        out["settings"] = describe(cfg)
        out.update(speed.to_dict() if speed else {"predicted_tokens_per_s": None, "predicted_seconds": None})
        if fits_not:
            out.update({"predicted_tokens_per_s": None, "predicted_seconds": None, "predicted_step_s": None,
                        "would_fit": None if instead is None else {"name": instead.name,
                                                                   "overrides": instead.overrides}})
        print(json.dumps(out))
    else:
        print(fit(format_estimate(est, cfg, name, hw)))
        lines = no_fit_lines(instead, hw) if fits_not else speed_lines(speed, cfg, hw.host_given)
        print(fit("\n".join(["", *lines])))
    # A script can ask "does it fit" of the exit code (docs/EXIT_CODES.md); "cannot tell" is not "no".
    return EXIT_DOES_NOT_FIT if est.verdict.startswith("does not fit") else 0


def presets_that_fit(hw: Hardware) -> list[tuple[str, str, PL.Estimate]]:
    """(name, model, plan) of each built-in GPU preset whose settings fit `hw` as saved (a preset's own
    gpu_memory_limit or host_memory_limit included), largest model first."""
    from shardconsole.settings import preset_store
    from shardconsole.settings.models import resolve
    out = []
    for info in preset_store.list_presets():
        if info.origin != "built-in":
            continue
        try:
            cfg = preset_store.load(str(info.path))
            if cfg.parallel.device == "cpu" or cfg.world_size > max(hw.gpus, 1):
                continue
            spec = resolve(cfg.model.name)
            est = PL.estimate(cfg, spec, hw)
        except (C.ConfigError, OSError, ValueError):
            continue
        if est.fits:
            out.append((info.name, cfg.model.name, est, spec.n_params))
    out.sort(key=lambda row: (-row[3], row[0]))
    return [(name, model, est) for name, model, est, _ in out]


def _cmd_fit(args: argparse.Namespace) -> int:
    from shardconsole.plan.speed.book import SpeedBook
    card = _card_arg(args.card)
    overrides = settings.from_cli(args.overrides)
    if args.model:
        overrides.append(settings.Override("model", "name", args.model, "--model"))
    if args.seq_len is not None:
        # through the settings' own reader, its range included (-5 planned a table of negative rows)
        overrides.append(settings.Override("data", "seq_len", str(args.seq_len), "--seq-len"))
    resolved = load(args.preset, overrides)
    cfg = resolved.cfg
    if args.seq_len is None and args.preset is None:
        cfg = PL.replace_cfg(cfg, ("data", "seq_len", 2048))
    hw = _with_card(hardware_from_args(args.gpus, args.gpu_memory, args.host_memory, args.host_cores, args.host_gbps),
                    card, args.gpu_memory is not None)
    if not hw.gpus or not hw.gpu_memory_bytes:
        raise C.ConfigError("--fit: no GPU found on this machine; give --gpu-memory SIZE (and --gpus N)")
    if not hw.host_memory_bytes:
        raise C.ConfigError("--fit: host memory unknown; give --host-memory SIZE")
    # Checkpointing on (the frugal setting) unless the user turned it off with --set.
    off = any(o.split("=", 1)[0].strip() == "memory.activation_checkpointing" for o in args.overrides) \
        and not cfg.memory.activation_checkpointing
    rows = PL.fit_table(hw, seq_len=cfg.data.seq_len, base=cfg, checkpointing=not off)
    book = SpeedBook.load()
    cands = PL.settings_that_fit(cfg, hw, preflight.check_model(resolved, weights=False), book=book) if args.model else None
    if args.json:
        out: dict[str, Any] = {"hardware": _hw_dict(hw), "fit_table": [r.to_dict() for r in rows],
                               "presets_that_fit": [{"name": n, "model": m, "gpu_peak_bytes": e.gpu_peak_bytes,
                                                     "host_peak_bytes": e.host_peak_bytes}
                                                    for n, m, e in presets_that_fit(hw)]}
        if cands is not None:
            out["model"] = cfg.model.name
            out["settings_that_fit"] = [
                {"name": c.name, "overrides": c.overrides, "speed": round(c.speed, 4), "speed_unit": c.speed_unit,
                 "speed_source": c.speed_source,
                 "gpu_peak_bytes": c.estimate.gpu_peak_bytes, "host_peak_bytes": c.estimate.host_peak_bytes}
                for c in cands]
        print(json.dumps(out))
        return 0
    say = lambda text="": print(fit(text))  # noqa: E731  (the rows and notes fitted to a terminal)
    say(f"largest catalog model that trains on {_hw_text(hw)}")
    say(f"({rows[0].settings if rows else ''}; every GPU one rank)\n")
    say(f"  {'strategy':<20} {'model':<7} {'params':>7} {'GPU peak':>10} {'host peak':>10}")
    for r in rows:
        e = r.estimate
        model = "-" if r.refused else r.model or "none"
        say(f"  {r.strategy:<20} {model:<7} {human_count(r.n_params) if r.n_params else '-':>7} "
            f"{C.format_size(e.gpu_peak_bytes) if e else '-':>10} {C.format_size(e.host_peak_bytes) if e else '-':>10}")
    say("  (GPU peak as NVML would show the device: context and the driver's reserve included; host: the "
        "node's RAM, ranks + launcher)")
    for reason in dict.fromkeys(r.refused for r in rows if r.refused):
        names = ", ".join(r.strategy for r in rows if r.refused == reason)
        say(f"  {names}: refused with these settings ({reason})")
    fitting = presets_that_fit(hw)
    if fitting:
        say("\npresets that fit this machine (each as saved, planned here)")
        for name, model, e in fitting:
            say(f"  {name:<20} {model:<18} GPU peak {C.format_size(e.gpu_peak_bytes):>9}, "
                f"host peak {C.format_size(e.host_peak_bytes):>9}")
    if cands is not None:
        say(f"\nsettings that fit {cfg.model.name} (seq_len {cfg.data.seq_len}, {cfg.precision.dtype}), fastest first")
        unit = cands[0].speed_unit if cands else "relative"
        if book.stale_note():
            say(f"  note: {book.stale_note()}")
        say("  speed: tokens/s measured on this machine (probes of `shardconsole tune`, finished runs), scaled "
            "where only similar settings were measured, else predicted by the speed model; where each came from "
            "in brackets" if unit == "tokens/s" else
            "  speed: relative tokens/s from the fixed factors (1.00 = FSDP2 on an H200, no checkpointing); "
            "`shardconsole tune` measures this machine")
        if not cands:
            say("  none: no strategy fits this model here; more GPUs, more host RAM or a shorter sequence")
        for c in cands[:15]:
            e = c.estimate
            # a plain number and its source in words: a trailing "m" for "model" read as milli (900m)
            speed = f"{c.speed:9,.0f}" if c.speed_unit == "tokens/s" else f"{c.speed:9.2f}"
            speed += f" {'(' + c.speed_source + ')':<12}"
            say(f"  {speed}  {c.name:<52} GPU {C.format_size(e.gpu_peak_bytes):>10}  "
                f"host {C.format_size(e.host_peak_bytes):>10}")
        if len(cands) > 15:
            say(f"  ... {len(cands) - 15} more (--json lists all)")
        if cands:
            say("\nfastest: " + " ".join(f"--set {o}" for o in cands[0].overrides))
    return 0

