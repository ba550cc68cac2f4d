"""How a run ended when its metrics.jsonl is gone (deleted after the run, or with the run's lines in it).

The stream is where the ranks say how the run ended; without it a later attach saw only a launcher
that was gone and called a finished run "killed or crashed". The run folder holds other evidence:
each rank also writes its end line into its own log (backends/__main__.py, observe/failures.py),
and the checkpoints say which step was saved last. `verdict` reads them, newest session only, and
says where its answer came from; when nothing tells, it says plainly that the metrics were deleted.

Front-end side: standard library, the settings layer and the run log only.
"""

from __future__ import annotations

from pathlib import Path

from shardconsole.runlog import protocol as P
from shardconsole.runlog.checkpoint_files import step_folders, why_incomplete
from shardconsole.runlog.runfolder import RunFolder, read_json
from shardconsole.settings import config as C

LOG_TAIL = 256 << 10      # an end line is among a log's last lines (teardown warnings follow it)


def _end_lines(log: Path, session: str) -> list[P.Message]:
    """The finished / failed lines of `session` in a rank's log (its last LOG_TAIL bytes)."""
    try:
        with open(log, "rb") as fh:
            fh.seek(0, 2)
            fh.seek(max(0, fh.tell() - LOG_TAIL))
            text = fh.read()
    except OSError:
        return []
    found: list[P.Message] = []
    for raw in text.splitlines():
        if not raw.startswith(b'{"v":'):
            continue
        try:
            msg = P.decode(raw)
        except P.DecodeError:
            continue
        if isinstance(msg, (P.Finished, P.Failed)) and msg.run == session:
            found.append(msg)
    return found


def _newest_checkpoint(folder: RunFolder) -> tuple[int, int] | None:
    """(newest complete step, train.steps) from the folder's settings and checkpoints; None if unknown."""
    try:
        cfg = C.load(folder.preset)
    except (C.ConfigError, OSError):
        return None
    ckpt = folder.checkpoints(cfg.train.checkpoint_dir)
    try:
        steps = [step for step, p in step_folders(ckpt) if why_incomplete(p, cfg.parallel.backend) is None]
    except OSError:
        return None
    return (max(steps), cfg.train.steps) if steps else None


def verdict(run_dir: Path) -> tuple[str, str] | None:
    """(cause, message) of a run whose metrics.jsonl is gone, from the rest of its folder; None when the
    stream is there (its lines decide) or the folder is not a launched run's."""
    folder = RunFolder(Path(run_dir))
    session = str(read_json(folder.job).get("run_id") or "")
    if folder.metrics.exists() or not session or not folder.path.is_dir():
        return None
    if not any(folder.logs.glob("rank*.log")):
        # no rank ever started (a rendezvous nobody hosts): there was no stream to delete
        return None
    gone = f"{folder.metrics.name} was deleted (the run's curves with it)"
    ends = [m for log in sorted(folder.logs.glob("rank*.log")) for m in _end_lines(log, session)]
    failed = [m for m in ends if isinstance(m, P.Failed)]
    if failed:
        f = min(failed, key=lambda m: m.t)        # the earliest failure names the cause
        return f.cause, (f"run failed ({f.cause}) on rank {f.rank}" + (f" at step {f.step}" if f.step else "")
                         + f": {f.exc_type + ': ' if f.exc_type else ''}{f.message}\n  (from the rank's log: {gone})"
                         + (f"\n  try: {f.hint}" if f.hint else "") + f"\n  log: {folder.rank_log(f.rank)}")
    done = next((m for m in ends if isinstance(m, P.Finished)), None)
    if isinstance(done, P.Finished):
        return "ok", f"finished: {done.steps} steps (rank 0's log says so; {gone}); run folder {run_dir}"
    saved = _newest_checkpoint(folder)
    if saved is not None and saved[0] >= saved[1]:
        return "ok", (f"finished: its final checkpoint (step {saved[0]} of {saved[1]}) is complete; {gone}; "
                      f"run folder {run_dir}")
    where = (f"; its newest complete checkpoint is step {saved[0]} of {saved[1]} (`shardconsole resume "
             f"{run_dir}` continues from it)" if saved else "; it saved no complete checkpoint")
    return "crash", f"{gone}: how the run ended is not known{where}\n  launcher log: {folder.launcher_log}"
