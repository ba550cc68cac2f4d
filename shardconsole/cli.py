"""Command line: `shardconsole` opens the console; `--headless` runs the same job without a UI.

    shardconsole [--preset NAME|FILE] [--set table.key=value ...] [--headless | --print-command]
    shardconsole presets
    shardconsole attach RUN_DIR [--headless]
    shardconsole stop RUN_DIR
    shardconsole resume RUN_DIR [--set table.key=value ...]
    shardconsole export-model RUN_DIR -o OUT_DIR [--step N] [--dtype bf16|fp32]
    shardconsole settings [TABLE] [--json]      every setting: type, default, allowed values, help
    shardconsole plan | export | import | tune | runs | compare | doctor   (each has --help)
    shardconsole --version

Bad input (a preset, an override, a model folder) is one line on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from shardconsole import config as C
from shardconsole import preset_store, settings
from shardconsole.launch import (PRESET_FILE, build_argv, format_argv, new_run_dir, open_run, run_id_of,
                                 slurm_script)
from shardconsole.launch_command import runs_root
from shardconsole.models import ModelError
from shardconsole.session import preflight
from shardconsole.settings import DEFAULT_PRESET


class UsageError(Exception):
    pass


def _run_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="shardconsole",
        description="A terminal console for PyTorch FSDP2 and DeepSpeed ZeRO training. Subcommands: "
                    "presets, settings, attach, stop, resume, export-model, export, import, plan, tune, runs, "
                    "compare, doctor (see `shardconsole SUBCOMMAND --help`).")
    ap.add_argument("--version", action="store_true", help="print the versions of shardconsole, torch, "
                    "deepspeed, transformers and textual, and exit")
    ap.add_argument("--preset", default=None, help=f"preset name or .toml file (default: {DEFAULT_PRESET})")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="TABLE.KEY=VALUE",
                    help="override one setting; repeatable; wins over the preset")
    ap.add_argument("--headless", action="store_true", help="run without the UI, one line per log step")
    ap.add_argument("--print-command", action="store_true",
                    help="write the run folder, print the command that starts this node's ranks, and exit")
    ap.add_argument("--slurm", action="store_true",
                    help="write the run folder and print an sbatch script for the run (submit with sbatch)")
    ap.add_argument("--run-dir", type=Path, default=None, help="run folder (default: <runs root>/<time>-<preset>)")
    ap.add_argument("--runs-root", default=None, metavar="DIR",
                    help="where new run folders go (default: $SHARDCONSOLE_RUNS_ROOT, else the per-user folder "
                         "`shardconsole runs` prints)")
    ap.add_argument("--force", action="store_true",
                    help="--headless: launch even when the planner says the host's RAM is too small")
    return ap


def load_config(preset: str | None, overrides: list[str], *, here: bool = True,
                slurm: bool = False) -> settings.Resolved:
    """The settings of this command, resolved once (settings.resolve) and checked before a launch
    (session/preflight): the model folder, the data files and, when `here` (the ranks run on this
    machine), its GPU count. slurm: the batch script names node 0 (the job's first node). Notes and
    warnings go to stderr."""
    r = settings.resolve(preset or DEFAULT_PRESET, settings.from_cli(overrides), rendezvous_from_launcher=slurm)
    for note in r.notes:
        print(f"shardconsole: {note}", file=sys.stderr)
    gpus = None
    if here and r.cfg.parallel.device != "cpu":
        from shardconsole.probes import gpu_count
        gpus = gpu_count()
    for warning in preflight.check_launch(r, gpu_count=gpus):
        print(f"shardconsole: {warning}", file=sys.stderr)
    return r


def cmd_run(argv: list[str]) -> int:
    args = _run_parser().parse_args(argv)
    if not args.headless and not args.print_command and not args.slurm:
        # Bad input stops here (exit 2); the console checks the machine (NVML) in a worker after its
        # first paint and runs the same preflight before it launches.
        return _open_console(settings.resolve(args.preset or DEFAULT_PRESET, settings.from_cli(args.overrides)),
                             runs_root(args.runs_root))
    if args.headless and (args.print_command or args.slurm):
        raise UsageError("--headless runs the job here; --print-command and --slurm only write it out: pick one")
    # A command or a batch script is for the machines that will run it, not for this one's GPUs.
    resolved = load_config(args.preset, args.overrides, here=not (args.print_command or args.slurm),
                           slurm=args.slurm)
    cfg, name = resolved.cfg, resolved.preset
    run_dir = args.run_dir or new_run_dir(name, runs_root(args.runs_root))
    if args.print_command or args.slurm:
        # The printed command reads the run folder's preset.toml: it must exist for the command to work.
        run_dir = _prepare_run_dir(cfg, run_dir, explicit=args.run_dir is not None)
        run_id = run_id_of(run_dir)
        # Absolute: the command is started on other nodes (or later, elsewhere) from any directory.
        run_dir = run_dir.absolute()
        if args.slurm:
            sys.stdout.write(slurm_script(cfg, run_dir, run_id))
            print(f"# wrote {run_dir / PRESET_FILE}; submit with `sbatch`, follow with `shardconsole attach "
                  f"{run_dir}`; {run_dir} must be on a filesystem every node shares", file=sys.stderr)
            return 0
        print(format_argv(build_argv(cfg, run_dir, run_id)))
        where = (f"run this on each of the {cfg.parallel.nnodes} nodes; {run_dir} must be on a shared filesystem"
                 if cfg.parallel.nnodes > 1 else "run it here")
        print(f"# wrote {run_dir / PRESET_FILE}; {where}; follow with `shardconsole attach {run_dir}`",
              file=sys.stderr)
        return 0
    if not args.force:
        preflight.check_host_memory(resolved, preflight.check_model(resolved))
    run_dir = _prepare_run_dir(cfg, run_dir, explicit=args.run_dir is not None, launch=resolved)
    from shardconsole import headless
    return headless.run(cfg, run_dir, run_dir.resolve().name)


def _prepare_run_dir(cfg: C.RunConfig, run_dir: Path, explicit: bool = True,
                     launch: settings.Resolved | None = None) -> Path:
    """Create the run folder with the resolved preset, atomically (session/rundir.py); returns it (a
    default name taken in the same second gets a suffix). launch (the settings of a run that starts
    here): a fixed master_port in use or an unwritable run/checkpoint folder is refused first."""
    from shardconsole.session import rundir
    if launch is not None:
        rundir.check_port_free(cfg, launch.origin)
        rundir.check_writable(cfg, run_dir, launch.origin)
    return rundir.create_run_dir(cfg, run_dir, explicit=explicit)


def _open_console(resolved: settings.Resolved, root: Path | None = None) -> int:
    try:
        from shardconsole.console.app import run_console
    except ImportError as e:
        print(f"shardconsole: the console is not available ({e}); use --headless", file=sys.stderr)
        return 1
    return run_console(resolved=resolved, runs_root=root)


def _run_folder(ref: str) -> Path:
    """A run folder from a path or a run id under the runs root (history/index.find_run)."""
    from shardconsole.history.index import find_run
    try:
        return find_run(ref)
    except ValueError as e:
        raise UsageError(str(e)) from None


def cmd_presets(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="shardconsole presets", description="list built-in and user presets")
    ap.parse_args(argv)
    infos = preset_store.list_presets()
    # A name outside the rule (a file put there by hand: a newline, a space) is shown quoted, on its line.
    names = [i.name if preset_store.valid_name(i.name) else ascii(i.name) for i in infos]
    width = max((len(n) for n in names), default=10)
    for name, i in zip(names, infos):
        print(f"{name:<{width}}  {i.origin:<8}  {i.description}")
    print(f"\nuser presets folder: {preset_store.user_dir()}", file=sys.stderr)
    return 0


def cmd_attach(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="shardconsole attach", description="follow a run started earlier")
    ap.add_argument("run_dir", metavar="RUN", help="a run folder, or a run id under the runs root")
    ap.add_argument("--headless", action="store_true")
    args = ap.parse_args(argv)
    run_dir = _run_folder(args.run_dir)
    try:
        job = open_run(run_dir)
    except ValueError as e:
        raise UsageError(str(e)) from None
    if args.headless and job.external:
        print(f"following {run_dir} (started elsewhere; Ctrl-C detaches)", file=sys.stderr)
    if args.headless:
        from shardconsole import headless
        return headless.follow(job, run_dir, run_id_of(run_dir))
    try:
        from shardconsole.console.app import run_console
    except ImportError as e:
        print(f"shardconsole: the console is not available ({e}); use --headless", file=sys.stderr)
        return 1
    return run_console(attach=run_dir)


def cmd_stop(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="shardconsole stop",
                                 description="stop a run of this machine from any shell: every rank ended, "
                                             "GPUs released (exit 0); a second Ctrl-C skips a checkpoint save")
    ap.add_argument("run_dir", metavar="RUN", help="a run folder, or a run id under the runs root")
    args = ap.parse_args(argv)
    from shardconsole.session.stop import StopRefused, stop_folder
    try:
        return stop_folder(_run_folder(args.run_dir), sys.stderr)
    except StopRefused as e:
        raise UsageError(str(e)) from None


SUBCOMMANDS = {"presets": cmd_presets, "attach": cmd_attach, "stop": cmd_stop}

# Subcommands in their own modules, imported only when named ("module:function"): start-up stays
# as light as the console needs, and each command's module owns its parser.
LAZY_SUBCOMMANDS = {
    "tune": "shardconsole.tune.cli:cmd_tune",
    "runs": "shardconsole.history.cli:cmd_runs",
    "compare": "shardconsole.history.cli:cmd_compare",
    "doctor": "shardconsole.doctor:cmd_doctor",
    "settings": "shardconsole.settings_cli:cmd_settings",
}


def _lazy(target: str):
    def command(argv: list[str]) -> int:
        import importlib
        module, func = target.split(":")
        return getattr(importlib.import_module(module), func)(argv)
    return command


def _register_optional() -> None:
    """Subcommands that live in their own modules (kept out of start-up when unused)."""
    for name, target in LAZY_SUBCOMMANDS.items():
        SUBCOMMANDS.setdefault(name, _lazy(target))
    try:
        from shardconsole import ds_json
        SUBCOMMANDS.setdefault("export", ds_json.cmd_export)
        SUBCOMMANDS.setdefault("import", ds_json.cmd_import)
    except ImportError:
        pass
    try:
        from shardconsole import plan_cli
        SUBCOMMANDS.setdefault("plan", plan_cli.cmd_plan)
    except ImportError:
        pass
    from shardconsole import resume_cli
    SUBCOMMANDS.setdefault("resume", resume_cli.cmd_resume)
    from shardconsole import export_model
    SUBCOMMANDS.setdefault("export-model", export_model.cmd_export_model)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    from shardconsole.session.signals import Detach, front_end_signals, quiet_stdout
    try:
        with front_end_signals():
            return _dispatch(argv)
    except BrokenPipeError:     # output into a closed pipe (`| head -1`): quiet, as a Unix tool is
        quiet_stdout()
        return 141
    except Detach:
        return 129


def _dispatch(argv: list[str]) -> int:
    from shardconsole import __version__
    from shardconsole.torch_version import torch_problem, version_line
    if argv[:1] == ["-V"] or (argv[:1] and argv[0].startswith("-") and "--version" in argv):
        print(version_line(__version__))
        problem = torch_problem()
        if problem:
            print(f"shardconsole: {problem}", file=sys.stderr)
        return 0
    problem = torch_problem()
    if problem and argv[:1] not in (["-h"], ["--help"]):
        print(f"shardconsole: error: {problem}", file=sys.stderr)
        return 2
    try:
        if argv and not argv[0].startswith("-"):
            _register_optional()
            if argv[0] not in SUBCOMMANDS:
                raise UsageError(f"unknown command {argv[0]!r}; commands: {', '.join(sorted(SUBCOMMANDS))}, "
                                 f"or options such as --preset NAME --headless")
            return SUBCOMMANDS[argv[0]](argv[1:])
        return cmd_run(argv)
    except (C.ConfigError, ModelError, UsageError) as e:
        print(f"shardconsole: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def entry() -> None:
    sys.exit(main())


if __name__ == "__main__":
    entry()
