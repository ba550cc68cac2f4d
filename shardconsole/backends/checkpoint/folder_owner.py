"""Whose checkpoint folder it is: a train.checkpoint_dir shared by several runs (outside their run folders)
names the run that saves into it (its owner file, runlog/checkpoint_files.py), and the ranks refuse to load
from or save into a folder another run holds, or one inside another run's folder. The front end checks the
same before launch (session/checkpoint_owner.py); this is the ranks' side, for the race of two launches and
a run started from --print-command's line. Apart from checkpoints.py because it is one rule with its own
file, read at resume and written at save."""

from __future__ import annotations

from pathlib import Path

from shardconsole.backends.rank import run_folder
from shardconsole.backends.rank.common import Rank
from shardconsole.backends.rank.errors import CheckpointError
from shardconsole.runlog.checkpoint_files import loadable_runs, other_run_folder, read_owner, shared_folder, write_owner


def loadable_runs_of(r: Rank, folder: Path) -> set[str] | None:
    """The runs whose checkpoints this run may load from a shared train.checkpoint_dir (None: the run
    folder's own checkpoints/, all of them). A folder another run holds is refused (the front end refuses
    it before launch; this is the race of two launches)."""
    if not shared_folder(folder, r.run_dir):
        return None
    here = str(r.run_dir.resolve())
    refuse_other_run_folder(r, folder)
    owner = read_owner(folder)
    if owner is not None and owner["run_dir"] != here:
        raise CheckpointError(f"{folder}: train.checkpoint_dir belongs to run {owner['run_dir']}, not this one "
                              f"({here}): one checkpoint folder per run")
    return loadable_runs(folder) | {here}



def refuse_other_run_folder(r: Rank, folder: Path) -> None:
    """The ranks' side of the front end's check (session/checkpoint_owner.py), for a run launched without
    it (--print-command's line): never load or save inside another run's folder."""
    inside = other_run_folder(folder, r.run_dir)
    if inside is not None:
        raise CheckpointError(f"{folder}: train.checkpoint_dir is inside run folder {inside}, whose checkpoints "
                              f"are its own: one checkpoint folder per run")



def claim(r: Rank, folder: Path) -> None:
    """Rank 0 before a save into a shared train.checkpoint_dir: the folder names this run (the front end
    wrote it before launch; a run started from --print-command's line writes it here), or the save is
    refused: another run's pruning and removal of partial saves would reach this run's."""
    if not shared_folder(folder, r.run_dir):
        return
    here = str(r.run_dir.resolve())
    refuse_other_run_folder(r, folder)
    owner = read_owner(folder)
    if owner is None:
        write_owner(folder, r.run_dir)
    elif owner["run_dir"] in run_folder.started_in():      # this run, its folder renamed since: it follows
        write_owner(folder, r.run_dir, [owner["run_dir"], *(owner.get("inherited") or [])])
    elif owner["run_dir"] != here:
        raise CheckpointError(f"{folder}: train.checkpoint_dir belongs to run {owner['run_dir']}, not this one "
                              f"({here}): not saving into another run's checkpoint folder")
