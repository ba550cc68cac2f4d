"""`shardconsole resume RUN [--set table.key=value ...]`: continue a stopped, failed or finished run
in its own folder, through the same headless path as a new run (session/resume.py prepares it). RUN is
a run folder or a run id under the runs root (or a part of one that names one run), as for attach."""

from __future__ import annotations

import argparse


def cmd_resume(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(
        prog="shardconsole resume",
        description="continue a run from its newest complete checkpoint, in the same folder (its metrics.jsonl "
                    "grows; the previous settings are kept as preset.toml.prev)")
    ap.add_argument("run", metavar="RUN", help="a run folder, or a run id (or a unique part of one) under the runs root")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="TABLE.KEY=VALUE",
                    help="change a setting for the rest of the run, e.g. train.steps=200")
    ap.add_argument("--slurm", action="store_true",
                    help="write an sbatch script that continues the run on a cluster (submit with sbatch) "
                         "instead of running it here")
    ap.add_argument("--force", action="store_true",
                    help="resume even when the free space for the checkpoints and the export is too small")
    ap.add_argument("--print-command", action="store_true",
                    help="print the command that continues the run on each of its nodes (one session id for "
                         "all) instead of running it here")
    args = ap.parse_args(argv)
    from shardconsole.history.index import find_run
    try:
        args.run_dir = find_run(args.run)
    except ValueError as e:
        from shardconsole.settings.config import ConfigError      # one line, exit 2 (cli.main prints it)
        raise ConfigError(str(e)) from None
    _refuse_other_objective(args.run_dir, args.overrides)
    import sys
    from shardconsole.launch.owner import owning
    from shardconsole.session.resume import prepare_resume, resume_run_id
    from shardconsole.settings.schedule import schedule_text
    if args.slurm:
        # The job's first node is node 0; the script's first step names the session (session/cluster.py).
        with owning(args.run_dir, "`shardconsole resume --slurm`"):
            cfg = prepare_resume(args.run_dir, [*args.overrides, "parallel.rendezvous=slurm"])
        print(schedule_text(cfg), file=sys.stderr, flush=True)
        from shardconsole.cli.run import write_slurm_script
        write_slurm_script(cfg, args.run_dir.absolute(), args.run_dir.resolve().name)
        return 0
    if args.print_command:
        with owning(args.run_dir, "`shardconsole resume --print-command`"):
            cfg = prepare_resume(args.run_dir, args.overrides)
        print(schedule_text(cfg), file=sys.stderr, flush=True)
        from shardconsole.launch.command import build_argv, child_env, format_argv
        # One session id for every node: it is the rendezvous id too when parallel.rdzv_id is empty.
        print(format_argv(["env", *(f"{k}={v}" for k, v in sorted(child_env(cfg, base={}).items())),
                           *build_argv(cfg, args.run_dir.absolute(), resume_run_id(args.run_dir))]))
        return 0
    _refuse_several_nodes(args.run_dir, args.overrides)
    from shardconsole import headless
    from shardconsole.session import preflight
    from shardconsole.session.run import RunSession
    # The folder's owner from the preparation on: the launch hands the lock to the launcher, so a second
    # resume (or launch) meanwhile is refused in one line (FolderInUse, exit 2).
    session = RunSession.resume(args.run_dir, args.overrides, check=None if args.force else (
        lambda c, source: preflight.check_disk_of(c, args.run_dir, source)),
        before_launch=lambda cfg: print(schedule_text(cfg), file=sys.stderr, flush=True))
    return headless.follow(session)


def _refuse_several_nodes(run_dir, overrides: list[str]) -> None:
    """A run of several nodes continues on all of them: one agent here would wait for the others until
    the rendezvous times out. Refused before anything is written (exit 2)."""
    from shardconsole.runlog.runfolder import RunFolder
    from shardconsole.settings import config as C
    from shardconsole.settings import resolve as settings
    folder = RunFolder(run_dir)
    try:
        nnodes = settings.resolve_doc(C.load_toml(folder.preset), folder.path.name, folder.preset,
                                      list(overrides)).cfg.parallel.nnodes
    except (C.ConfigError, OSError):
        return      # prepare_resume says what is wrong with the folder, in its words
    if nnodes > 1:
        raise C.ConfigError(f"{folder.path}: a run of {nnodes} nodes continues on all of them: `shardconsole "
                            f"resume RUN --slurm` writes the sbatch script, `--print-command` the command for each "
                            f"node; --set parallel.nnodes=1 continues it here (FSDP2 reshards; DeepSpeed needs "
                            f"the same rank count)",
                            source=str(folder.preset), table="parallel", key="nnodes")


def _refuse_other_objective(run_dir, overrides: list[str]) -> None:
    """train.objective is what the checkpoints were trained for and what the data's records are read as:
    a DPO run resumed as SFT failed after the launch with a record-format message that never named the
    setting. Refused here, before anything is written (exit 2), naming both objectives."""
    from shardconsole.runlog.runfolder import RunFolder
    from shardconsole.settings import config as C
    from shardconsole.settings import resolve as settings
    folder = RunFolder(run_dir)
    try:
        doc = C.load_toml(folder.preset)
        resolved = settings.resolve_doc(doc, folder.path.name, folder.preset, list(overrides))
    except (C.ConfigError, OSError):
        return      # prepare_resume says what is wrong with the folder, in its words
    was = str(((doc.get("train") or {}).get("objective")) or C.RunConfig().train.objective)
    now = resolved.cfg.train.objective
    if now != was and "sft" in (now, was):      # dpo and orpo read the same pairs
        records = "pairs" if was != "sft" else "SFT records"
        raise resolved.error("train", "objective", f"{now!r}, but the run's checkpoints were trained with "
                             f"train.objective = {was!r} ({folder.preset}), and a resume reads the same records, as "
                             f"{records}; keep {was!r}, or start a new run from the run's weights "
                             f"(`shardconsole export-model {folder.path} -o DIR`, then model.name = DIR)")

