"""One run per checkpoint folder, checked before a launch (issue 46).

A train.checkpoint_dir outside the run folder can be named by several runs. Two runs writing into one
prune each other's saves, remove each other's half-written ones, and a resume loads the other's newest
step. The folder names its run (runlog/checkpoint_files.OWNER); a new run pointed at a folder that
names another is refused before launch, in one line naming the setting, unless it continues from those
checkpoints (train.resume = true) while that run is over: it then takes the folder over, and the earlier
run no longer resumes there. The ranks check the same file before every save and load (the race of two
launches at once), and load only the checkpoints of the runs the folder's owner took over.
A folder inside another run's folder (its own checkpoints/, however named: a symlink, a relative path,
before that run's first save) is never shared and never taken over: that run saves, prunes and resumes
there without an owner file (runlog/checkpoint_files.other_run_folder, the one test, here and in the ranks).
"""

from __future__ import annotations

from pathlib import Path

from shardconsole.runlog.checkpoint_files import STEP_PREFIX, other_run_folder, read_owner, shared_folder, write_owner
from shardconsole.runlog.runfolder import PRESET_FILE, RunFolder, read_json
from shardconsole.settings import config as C


def _checkpoints(cfg: C.RunConfig, run_dir: Path) -> Path:
    return RunFolder(run_dir).checkpoints(cfg.train.checkpoint_dir)


def _still_running(run_dir: Path) -> str:
    """What of that run still runs ('' when nothing): its launcher (identity checked) or any rank of it."""
    if not run_dir.is_dir():
        return ""
    from shardconsole.launch import process_identity as PI
    from shardconsole.launch.job import Job
    try:
        if Job.from_run_dir(run_dir).launcher_state()[0] == "ours":
            return "its launcher is running"
    except (OSError, ValueError, KeyError, TypeError):
        pass
    ranks = PI.folder_ranks(run_dir)
    return f"rank process(es) {', '.join(map(str, sorted(ranks)))} of it are training" if ranks else ""


def why_refused(cfg: C.RunConfig, run_dir: Path, *, new_run: bool) -> str | None:
    """None when this run may use its checkpoint folder, else the one line saying whose it is.
    new_run: a run being started (train.resume = true may take over the folder of a run that is over);
    False: `resume` of this run folder, which must still own it."""
    ckpt = _checkpoints(cfg, run_dir)
    if not shared_folder(ckpt, run_dir):
        return None
    inside = other_run_folder(ckpt, run_dir)
    if inside is not None:
        return (f"{ckpt}: inside run folder {inside}, whose checkpoints are its own (each run would prune and "
                f"resume the other's steps); pick a train.checkpoint_dir outside every run folder, or continue "
                f"that run with `shardconsole resume {inside}`")
    here = str(run_dir.resolve())
    owner = read_owner(ckpt)
    if owner is not None and owner["run_dir"] != here:
        other = owner["run_dir"]
        if _renamed_from(run_dir, other):
            return None         # this very run, its folder renamed since: claim() names the new path
        running = _still_running(Path(other))
        if running:
            return (f"{ckpt}: the checkpoint folder of run {other}, which is still going ({running}); one "
                    f"checkpoint folder per run: pick another train.checkpoint_dir")
        if not new_run:
            return (f"{ckpt}: run {other} took this checkpoint folder over (it continued from these checkpoints); "
                    f"resume that run, or this one with another train.checkpoint_dir")
        if not cfg.train.resume:
            return (f"{ckpt}: holds the checkpoints of run {other}; one checkpoint folder per run (its saves and "
                    f"pruning would mix with this run's): pick another train.checkpoint_dir, or set "
                    f"train.resume = true to continue from them (this run then takes the folder over)")
        return None
    if owner is None and new_run and not cfg.train.resume and _has_steps(ckpt):
        return (f"{ckpt}: holds checkpoints of an earlier run; one checkpoint folder per run: pick another "
                f"train.checkpoint_dir, or set train.resume = true to continue from them")
    return None


def _renamed_from(run_dir: Path, other: str) -> bool:
    """Whether run folder `other` is this one before a rename or a move: this folder's job.json was written
    there (its launch's path), and nothing there is a run folder now. A resume of a renamed run was
    refused as if another run had taken its checkpoint folder over."""
    launched = str(read_json(RunFolder(run_dir).job).get("run_dir") or "")
    if not launched or (Path(other) / PRESET_FILE).exists():
        return False
    return other in (launched, str(Path(launched).resolve()))


def _has_steps(ckpt: Path) -> bool:
    try:
        return any(p.name.startswith(STEP_PREFIX) for p in ckpt.iterdir())     # .partial ones too
    except OSError:
        return False


def check(cfg: C.RunConfig, run_dir: Path, source: str, *, new_run: bool, export_source: str = "settings") -> None:
    """why_refused as the ConfigError of train.checkpoint_dir (exit 2, before anything is launched); and
    a train.export_dir inside another run's folder (export_source: where that value came from)."""
    why = why_refused(cfg, run_dir, new_run=new_run)
    if why is not None:
        raise C.ConfigError(why, source=source, table="train", key="checkpoint_dir")
    export = Path(cfg.train.export_dir).expanduser() if cfg.train.export_dir else None
    inside = other_run_folder(export, run_dir) if export is not None else None
    if inside is not None:
        # the same one test as a checkpoint folder's: that run's resume, prune and export-model treat
        # what is in its folder as its own
        raise C.ConfigError(f"{export}: inside run folder {inside}, whose files are its own; pick a "
                            f"train.export_dir outside every other run's folder", source=export_source,
                            table="train", key="export_dir")


def check_run_dir(run_dir: Path, where: str) -> None:
    """A new run folder inside another run's folder (its checkpoints/, its logs/, through a symlink or a
    relative path) is refused: that run's resume, prune and `runs` would meet this run's files, and
    deleting that run deletes this one. where: how the folder was named ("--run-dir X")."""
    try:
        above = run_dir.resolve().parents
    except (OSError, RuntimeError):
        return
    for folder in above:
        try:
            if (folder / PRESET_FILE).is_file():
                raise C.ConfigError(f"{where}: inside run folder {folder}; pick a folder outside every run folder")
        except OSError:
            continue


def claim(cfg: C.RunConfig, run_dir: Path) -> None:
    """After the checks, before the launch: the folder names this run; a run it took over from is
    listed, so the ranks load that run's checkpoints and no other's."""
    ckpt = _checkpoints(cfg, run_dir)
    if not shared_folder(ckpt, run_dir):
        return
    owner = read_owner(ckpt) or {}
    here = str(run_dir.resolve())
    if owner.get("run_dir") == here:
        return
    inherited = [*(owner.get("inherited") or []), *([owner["run_dir"]] if owner.get("run_dir") else [])]
    try:
        write_owner(ckpt, run_dir, inherited)
    except OSError:
        pass        # an unwritable folder is refused by check_writable, or its first save says so
