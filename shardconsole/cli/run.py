"""`shardconsole [--preset NAME|FILE] [--set table.key=value ...] [--headless | --print-command | --slurm]`:
the console, or the same job without a UI, or its command line / sbatch script written out."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from shardconsole.cli.commands import command_names
from shardconsole.cli.errors import UsageError
from shardconsole.launch.command import child_env
from shardconsole.user_folders import runs_root
from shardconsole.runlog.runfolder import RunFolder
from shardconsole.launch.job import PRESET_FILE, build_argv, format_argv, new_run_dir, run_id_of, slurm_script
from shardconsole.session import preflight
from shardconsole.session.gpu_checks import gpu_overrun
from shardconsole.settings import config as C
from shardconsole.settings import resolve as settings
from shardconsole.settings.resolve import DEFAULT_PRESET


def _run_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="shardconsole",
        description="A terminal console for PyTorch FSDP2 and DeepSpeed ZeRO training. Subcommands: "
                    f"{', '.join(command_names())} (see `shardconsole SUBCOMMAND --help`).")
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
    ap.add_argument("--run-dir", type=Path, default=None,
                    help="run folder (default: <runs root>/<time>-<preset>); in the console, the first launch's")
    ap.add_argument("--runs-root", default=None, metavar="DIR",
                    help="where new run folders go (default: $SHARDCONSOLE_RUNS_ROOT, else the per-user folder "
                         "`shardconsole runs` prints)")
    ap.add_argument("--force", action="store_true",
                    help="--headless: launch even when the planner says the GPU's memory (a GPU found here or "
                         "memory.gpu_memory_limit), the host's RAM, or the free space for the checkpoints and the "
                         "export, is too small")
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
        from shardconsole.machine.probes import gpu_count
        gpus = gpu_count()
    for warning in preflight.check_launch(r, gpu_count=gpus):
        print(f"shardconsole: {warning}", file=sys.stderr)
    r, fitted = preflight.fit_micro_batch(r, gpus)
    if fitted:
        print(f"shardconsole: {fitted}", file=sys.stderr)
    unneeded = preflight.offload_not_needed(r, gpus)
    if unneeded:
        print(f"shardconsole: {unneeded}", file=sys.stderr)
    return r


def cmd_run(argv: list[str]) -> int:
    args = _run_parser().parse_args(argv)
    if not args.headless and not args.print_command and not args.slurm:
        # Bad input stops here (exit 2); the console checks the machine (NVML) in a worker after its
        # first paint and runs the same preflight before it launches.
        return _open_console(settings.resolve(args.preset or DEFAULT_PRESET, settings.from_cli(args.overrides)),
                             runs_root(args.runs_root), args.run_dir)
    if args.headless and (args.print_command or args.slurm):
        raise UsageError("--headless runs the job here; --print-command and --slurm only write it out: pick one")
    # A command or a batch script is for the machines that will run it, not for this one's GPUs.
    resolved = load_config(args.preset, args.overrides, here=not (args.print_command or args.slurm),
                           slurm=args.slurm)
    cfg, name = resolved.cfg, resolved.preset
    p = cfg.parallel
    if not args.slurm and p.rendezvous == "slurm" and p.nnodes > 1 and not p.rdzv_endpoint:
        raise C.ConfigError("nnodes > 1 with rendezvous = \"slurm\": node 0 is the job's first node, known only "
                            "inside a Slurm job: use --slurm, or set parallel.rdzv_endpoint",
                            source=resolved.origin("parallel", "rendezvous"), table="parallel", key="rendezvous")
    run_dir = args.run_dir or new_run_dir(name, runs_root(args.runs_root))
    from shardconsole.session import rundir
    rundir.check_run_dir(cfg, run_dir, f"--run-dir {run_dir}" if args.run_dir else str(run_dir))
    if args.print_command or args.slurm:
        # The printed command reads the run folder's preset.toml: it must exist for the command to work.
        run_dir = _prepare_run_dir(cfg, run_dir, explicit=args.run_dir is not None)
        # `runs` lists it as prepared (not "unknown") until its ranks write; `runs --prune` removes it then
        RunFolder(run_dir).write_origin(name, "slurm" if args.slurm else "print-command")
        run_id = run_id_of(run_dir)
        # Absolute: the command is started on other nodes (or later, elsewhere) from any directory.
        run_dir = run_dir.absolute()
        if args.slurm:
            write_slurm_script(cfg, run_dir, run_id)
            return 0
        # With the variables the Slurm script exports: a node started by hand gets the same save budget.
        print(format_argv(["env", *(f"{k}={v}" for k, v in sorted(child_env(cfg, base={}).items())),
                           *build_argv(cfg, run_dir, run_id)]))
        where = (f"run this on each of the {cfg.parallel.nnodes} nodes; {run_dir} must be on a shared filesystem"
                 if cfg.parallel.nnodes > 1 else "run it here")
        print(f"# wrote {run_dir / PRESET_FILE}; {where}; follow with `shardconsole attach {run_dir}`",
              file=sys.stderr)
        return 0
    if p.nnodes > 1 and p.rdzv_endpoint:
        from shardconsole.session import network
        network.check_multi_node(cfg, p.rdzv_endpoint.rsplit(":", 1)[0].strip("[]"),
                                 resolved.origin("parallel", "rdzv_endpoint"))
    if not args.force:
        spec = preflight.check_model(resolved)
        # the run's own plan against the GPU memory it knows (a GPU here, or the settings' cap)
        gpu_over = gpu_overrun(resolved, spec)
        if gpu_over is not None:
            raise gpu_over
        preflight.check_host_memory(resolved, spec)
        preflight.check_disk(resolved, run_dir)
    from shardconsole import headless
    from shardconsole.session.run import RunSession
    return headless.follow(RunSession.start(resolved, run_dir, explicit=args.run_dir is not None))


def write_slurm_script(cfg: C.RunConfig, run_dir: Path, run_id: str) -> None:
    """The sbatch script on stdout, what to do with it on stderr (also `resume RUN --slurm`)."""
    sys.stdout.write(slurm_script(cfg, run_dir, run_id, host_bytes=_host_bytes(cfg)))
    print(f"# wrote {run_dir / PRESET_FILE}; submit with `sbatch`, follow with `shardconsole attach "
          f"{run_dir}`; {run_dir} must be on a filesystem every node shares", file=sys.stderr)


def _host_bytes(cfg: C.RunConfig) -> int | None:
    """The planner's host RAM of one node of this run (Slurm's --mem), or None when it cannot say."""
    try:
        from shardconsole import plan
        from shardconsole.settings.models import resolve as resolve_model
        hw = plan.Hardware(gpus=cfg.parallel.nproc_per_node, gpu_memory_bytes=0, host_memory_bytes=0)
        return int(plan.estimate(cfg, resolve_model(cfg.model.name), hw).host_peak_bytes)
    except Exception:     # a model the planner cannot read: the script asks for no --mem
        return None


def _prepare_run_dir(cfg: C.RunConfig, run_dir: Path, explicit: bool = True) -> Path:
    """Create the run folder with the resolved preset, atomically (session/rundir.py); returns it (a
    default name taken in the same second gets a suffix). A run that starts here makes its folder in
    session/run.RunSession.start."""
    from shardconsole.session import checkpoint_owner, rundir
    checkpoint_owner.check(cfg, run_dir, "settings", new_run=True)
    checkpoint_owner.check_run_dir(run_dir, f"--run-dir {run_dir}" if explicit else str(run_dir))
    run_dir = rundir.create_run_dir(cfg, run_dir, explicit=explicit)
    checkpoint_owner.claim(cfg, run_dir)
    return run_dir


def _open_console(resolved: settings.Resolved, root: Path | None = None, run_dir: Path | None = None) -> int:
    try:
        from shardconsole.console.app import run_console
    except ImportError as e:
        print(f"shardconsole: the console is not available ({e}); use --headless", file=sys.stderr)
        return 1
    return run_console(resolved=resolved, runs_root=root, run_dir=run_dir)
