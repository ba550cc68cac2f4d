"""The run folder before and after a run: created once and atomically, checked for room to write, and
asked why its stream stopped.

- `create_run_dir`: two launches naming one --run-dir cannot both pass (the first to create
  preset.toml with O_EXCL wins); a default name taken by a launch in the same second gets a suffix.
- `check_writable` / `check_port_free`: what would otherwise fail minutes or hours into the run (a
  read-only checkpoint_dir at the first save, a fixed master_port in use at the rendezvous) is found
  before the launch, as one line naming the key.
- `stream_stopped_note`: a stream that ends without a finished or failed line, explained (a full disk
  writes nothing more to the stream, so the rank says it in its log, once).
- one owner per run folder: launch/owner.py's lock, which Job.start hands to the launcher.
No torch, no UI.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import socket
import tempfile
from pathlib import Path
from typing import Callable

from shardconsole.envvars import read
from shardconsole.settings import config as C
from shardconsole.settings.data.data_check import uses_records
from shardconsole.settings.models import CATALOG
from shardconsole.runlog.runfolder import PRESET_FILE, RunFolder

# The line MetricsWriter prints into a rank's log when the stream refuses a line (stream.py).
DROP_NOTE = re.compile(r"^shardconsole: metrics stream: .*?after step (\d+): (.+?); later lines", re.M)
_LOW_SPACE = 64 << 10      # the ranks' own floor (backends/observe/stream_health.LOW_SPACE): under it they stop
# A run folder's name is its run id: torchrun names a folder of its own <id>_<8 characters>, and a resumed
# session's id adds "-resume-<time>-<pid>" (about 40): a 255-byte name failed with torchelastic's
# ENAMETOOLONG traceback after the launch.
MAX_NAME_BYTES = 180


# The kernel's limits on a path (PATH_MAX, with its NUL) and on one name in it (NAME_MAX): a run folder near
# the first trained, then failed at its first save, whose files are the deepest the run writes.
PATH_MAX, NAME_MAX = 4096, 255


Origin = Callable[[str, str], str]     # settings.Resolved.origin: where a key's value came from


def _source(origin: Origin | None, table: str, key: str) -> str:
    return origin(table, key) if origin is not None else "settings"


class RunDirError(C.ConfigError):
    """A run folder that cannot be made or used: one line, exit 2 (the CLI catches ConfigError)."""


def create_run_dir(cfg: C.RunConfig, run_dir: Path, *, explicit: bool = True) -> Path:
    """Make run_dir with the resolved settings in it and return it. explicit (--run-dir given): a
    folder already holding a run is refused, except a multi-node run's agents joining one shared
    folder with the same settings. Not explicit (a default runs/<time>-<preset> name): a taken name
    gets the next suffix, -2, -3, ..."""
    where = f"--run-dir {run_dir}" if explicit else str(run_dir)
    check_path_length(cfg, run_dir, where)
    if len(run_dir.name.encode()) > MAX_NAME_BYTES:
        raise RunDirError(f"{where}: the folder's name is {len(run_dir.name.encode())} bytes; at most "
                          f"{MAX_NAME_BYTES} (the run id is the name, and torchrun's files and a resumed session's "
                          f"id add to it within the file system's 255)")
    cfg = anchor_paths(cfg)
    try:
        run_dir.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise RunDirError(f"{where}: cannot create {_first_missing(run_dir.parent)}: {e.strerror}") from None
    for n in range(1, 1000):
        path = run_dir if n == 1 else run_dir.with_name(f"{run_dir.name}-{n}")
        made = _claim(path, where)
        if made is not None:
            break
        if explicit:
            preset = path / PRESET_FILE
            if cfg.parallel.nnodes > 1 and _same_settings(preset, cfg):
                return path
            raise RunDirError(f"{where}: folder exists and holds a run or other files; pick a new one "
                              f"(or `shardconsole attach {path}`)")
    else:
        raise RunDirError(f"{where}: 999 run folders of this name exist")
    try:
        C.save(cfg, path / PRESET_FILE)
    except OSError as e:
        _unclaim(path, made)
        raise RunDirError(f"{where}: cannot write {path / PRESET_FILE}: {e.strerror}") from None
    if explicit:
        from shardconsole.session.runs_link import link_into_runs_root
        link_into_runs_root(path)
    return path


def longest_file(cfg: C.RunConfig) -> str:
    """The longest path the run writes under its folder: a rank's state in a save being written (when the
    checkpoints go in the run folder), or TensorBoard's events file, named with this host's name."""
    ranks = max(1, cfg.parallel.nnodes * cfg.parallel.nproc_per_node)
    events = f"events.out.tfevents.{'9' * 10}.{socket.gethostname()}.{'9' * 7}.0.shardconsole"
    if cfg.train.checkpoint_dir:
        return events
    steps = max(99_999_999, cfg.train.steps)
    return max(events, f"checkpoints/step_{steps:08d}.partial/rank_state/rank{ranks - 1}.json", key=len)


def check_path_length(cfg: C.RunConfig, run_dir: Path, where: str) -> None:
    """Refuse, before a launch, a run folder whose deepest file would pass PATH_MAX or a name in whose
    path passes NAME_MAX (ENAMETOOLONG at the first save, after the training up to it)."""
    path = Path(run_dir).expanduser().absolute()
    for part in path.parts:
        if len(os.fsencode(part)) > NAME_MAX:
            raise RunDirError(f"{where}: a name in the path is {len(os.fsencode(part))} bytes, past the file "
                              f"system's {NAME_MAX}: pick a shorter one")
    longest = longest_file(cfg)
    full = len(os.fsencode(str(path / longest)))
    if full >= PATH_MAX:
        raise RunDirError(f"{where}: the path is {len(os.fsencode(str(path)))} bytes and the run writes {longest} "
                          f"under it, {full} bytes in all, past the file system's limit of {PATH_MAX - 1}: pick a "
                          f"path at least {full - PATH_MAX + 1} bytes shorter")


def check_run_dir(cfg: C.RunConfig, run_dir: Path, where: str) -> None:
    """The run folder itself, before any check of what goes in it: a path too long, or one that cannot be
    made (/proc/x) is the run folder's fault, said naming it (the checkpoint folder's disk check, which
    sits under it, blamed the preset's train.checkpoint_dir)."""
    check_path_length(cfg, run_dir, where)
    _probe(Path(run_dir), lambda why: RunDirError(f"{where}: {why}"), min_free=_LOW_SPACE, min_files=run_files(cfg))


def anchor_paths(cfg: C.RunConfig) -> C.RunConfig:
    """The settings with every relative path made absolute (relative to the directory the run is
    started from, as the ranks read them), for the run folder's preset.toml: `shardconsole resume`,
    `attach` and `export-model` then work from any directory."""
    cfg = C.copy(cfg)
    name = cfg.model.name
    if name not in CATALOG and Path(name).expanduser().exists() and not Path(name).is_absolute():
        cfg.model.name = str(Path(cfg.model.name).expanduser().resolve())
    if cfg.data.tokenizer not in ("", "bytes") and not Path(cfg.data.tokenizer).expanduser().is_absolute():
        cfg.data.tokenizer = str(Path(cfg.data.tokenizer).expanduser().absolute())
    for section, key in (("data", "path"), ("data", "eval_path"), ("train", "checkpoint_dir"),
                         ("deepspeed", "nvme_path")):
        table = getattr(cfg, section)
        value = getattr(table, key, "")
        # data.path may name several sources, comma-separated (settings/data_mix.py): each is anchored
        parts = [p.strip() for p in value.split(",")] if (section, key) == ("data", "path") else [value]
        parts = [str(Path(p).expanduser().absolute()) if p and not Path(p).expanduser().is_absolute()
                 and "://" not in p else p for p in parts]
        setattr(table, key, ",".join(parts))
    # GRPO's reward files (FILE.py:FUNCTION, comma-separated): the ranks import them from the run's directory
    if cfg.grpo.reward:
        cfg.grpo.reward = ",".join(f"{_absolute(path)}:{fn}" if path else fn
                                   for path, fn in cfg.grpo.reward_specs())
    return cfg


def _absolute(path: str) -> str:
    p = Path(path).expanduser()
    return path if p.is_absolute() else str(p.absolute())


def _claim(path: Path, where: str) -> bool | None:
    """Take path for this launch: True (the folder was created here), False (an empty folder the
    user made, taken), None (someone else's). The O_EXCL create of preset.toml is the one atomic
    step that two racing launches cannot both pass."""
    created = True
    try:
        path.mkdir()
    except FileExistsError:
        created = False
        if not path.is_dir():
            return None
    except OSError as e:
        raise RunDirError(f"{where}: cannot create {path}: {e.strerror}") from None
    try:
        fd = os.open(path / PRESET_FILE, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    except FileExistsError:
        return None
    except OSError as e:
        if created:
            _rmdir(path)
        raise RunDirError(f"{where}: cannot write in {path}: {e.strerror}") from None
    os.close(fd)
    if not created and any(p.name != PRESET_FILE for p in path.iterdir()):
        (path / PRESET_FILE).unlink(missing_ok=True)
        return None
    return created


def _unclaim(path: Path, created: bool) -> None:
    try:
        (path / PRESET_FILE).unlink(missing_ok=True)
    except OSError:
        pass
    if created:
        _rmdir(path)


def _rmdir(path: Path) -> None:
    try:
        path.rmdir()
    except OSError:
        pass


def _same_settings(preset: Path, cfg: C.RunConfig) -> bool:
    try:
        return preset.is_file() and C.dumps(C.load(preset)) == C.dumps(cfg)
    except (C.ConfigError, OSError):
        return False


def _first_missing(path: Path) -> Path:
    """The folder whose creation fails: the nearest one that does not exist yet, else path."""
    missing = path
    for p in [path, *path.parents]:
        if p.exists():
            break
        missing = p
    return missing


def check_writable(cfg: C.RunConfig, run_dir: Path, origin: Origin | None = None) -> None:
    """Refuse, before a launch, a run folder or a checkpoint folder this process cannot write (a
    read-only mount, a folder of another user, a path through a file). Probes by creating and removing
    a file: permission bits alone do not say it (root, read-only mounts, ACLs)."""
    _probe(run_dir, lambda why: RunDirError(f"run folder {run_dir}: {why}"), min_free=_LOW_SPACE,
           min_files=run_files(cfg))
    _check_export_dir(cfg, origin)
    _check_cache_dir(cfg)
    if not _saves_checkpoints(cfg):
        return
    ckpt = RunFolder(run_dir).checkpoints(cfg.train.checkpoint_dir)
    _probe(ckpt, lambda why: C.ConfigError(f"{ckpt}: {why}", source=_source(origin, "train", "checkpoint_dir"),
                                           table="train", key="checkpoint_dir"), min_files=save_files(cfg))


def _check_cache_dir(cfg: C.RunConfig) -> None:
    """$SHARDCONSOLE_CACHE_DIR takes the ranks' token cache of a run on records: /proc/x (a path a folder
    cannot be made at) crashed rank 0 with FileNotFoundError. The variable's shape is checked with every
    command (envvars.check); whether this user can write there, here, for a launch that writes it."""
    path = read("SHARDCONSOLE_CACHE_DIR")
    if path is None or not uses_records(cfg):
        return
    _probe(path, lambda why: RunDirError(f"environment variable SHARDCONSOLE_CACHE_DIR={str(path)!r}: {why}; the "
                                         f"ranks keep the token cache there"))


def save_files(cfg: C.RunConfig) -> int:
    """The files and folders one save makes (each rank's shard and state, the manifest, the metadata and
    the folders), the figure that decides a file system out of inodes: its bytes may be plenty (a run
    that failed at its first save was told "needs 1.5 MiB, 48.1 MiB free")."""
    ranks = max(1, cfg.parallel.nnodes * cfg.parallel.nproc_per_node)
    return 2 * ranks + 6 if _saves_checkpoints(cfg) else 0


def run_files(cfg: C.RunConfig) -> int:
    """The files the run folder holds (settings, stream, logs, TensorBoard's, the launcher's) and, where the
    checkpoints go in it, one save's."""
    ranks = max(1, cfg.parallel.nnodes * cfg.parallel.nproc_per_node)
    return 12 + ranks + (0 if cfg.train.checkpoint_dir else save_files(cfg))


def check_resume_writable(cfg: C.RunConfig, run_dir: Path, source: str) -> None:
    """`resume`: the run folder and the checkpoint folder it saves into still writable (a folder made
    read-only since, a mount remounted ro): found before the launch, not at the first save after hours
    of training."""
    _probe(Path(run_dir), lambda why: RunDirError(f"run folder {run_dir}: {why}"), min_free=_LOW_SPACE)
    ckpt = RunFolder(run_dir).checkpoints(cfg.train.checkpoint_dir)
    _probe(ckpt, lambda why: C.ConfigError(f"{ckpt}: {why}; the resumed run could not save there",
                                           source=source, table="train", key="checkpoint_dir"))


def _check_export_dir(cfg: C.RunConfig, origin: Origin | None) -> None:
    """train.export_dir is written at the end of the run: a folder that already holds files would be
    refused then, after the whole training, so it is refused now (as export-model's -o)."""
    text = getattr(cfg.train, "export_dir", "")
    if not text:
        return
    path = Path(text).expanduser()
    def error(why: str) -> C.ConfigError:
        return C.ConfigError(f"{path}: {why}", source=_source(origin, "train", "export_dir"),
                             table="train", key="export_dir")
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        raise error("exists and is not an empty folder; pick a new one (the export never overwrites)")
    _probe(path, error)


def _saves_checkpoints(cfg: C.RunConfig) -> bool:
    t = cfg.train
    return bool(getattr(t, "checkpoint_every", 0) or getattr(t, "save_final", "none") != "none"
                or getattr(t, "save_on_stop", False) or getattr(t, "resume", False))


def _probe(path: Path, error, min_free: int = 0, min_files: int = 0) -> None:
    """`path` (or the folder that would hold it) takes a new file; min_free: and its disk has that many
    bytes free (the run folder: the ranks stop a run whose stream's disk has under _LOW_SPACE, so a launch
    there would stop at its first step boundary)."""
    path = path.expanduser()
    target = path
    while not target.exists():
        if target.parent == target:
            break
        target = target.parent
    if not target.is_dir():
        raise error(f"{target} is not a folder, so nothing can be created under it")
    try:
        fd, tmp = tempfile.mkstemp(dir=target, prefix=".shardconsole-probe-")
        os.close(fd)
        os.unlink(tmp)
    except OSError as e:
        files = _files_free(target)
        if e.errno in (errno.ENOSPC, errno.EDQUOT) and files == 0:
            raise error(f"its file system ({target.resolve()}) is out of inodes: no new file can be made there, "
                        f"whatever bytes are free; remove files there, or pick a folder on another disk") from None
        what = "cannot be created" if target != path else "is not writable"
        raise error(f"{what} ({target.resolve()}: {e.strerror})") from None
    files = _files_free(target)
    if files is not None and files < min_files:
        raise error(f"its file system ({target.resolve()}) has {files} inodes free (new files it can hold), under "
                    f"the {min_files} new files the run makes there up to its first save; remove files there, or "
                    f"pick a folder on another disk")
    try:
        free = shutil.disk_usage(target).free
    except OSError:
        return
    if free < min_free:
        raise error(f"its disk ({target.resolve()}) has {free >> 10} KiB free, under the {min_free >> 10} KiB the "
                    f"stream needs: the ranks would stop at their first step; free space there, or pick a folder "
                    f"on another disk")


def _files_free(path: Path) -> int | None:
    """The inodes free to this user on path's file system; None where it does not count them (f_files 0:
    btrfs and some network file systems have no fixed number)."""
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return st.f_favail if st.f_files else None


def check_port_free(cfg: C.RunConfig, origin: Origin | None = None) -> None:
    """A fixed parallel.master_port of a one-node run must be free here: two runs sharing one would
    meet in one rendezvous, and the loser dies with EADDRINUSE on the last line of its log."""
    port = cfg.parallel.master_port
    if not port or cfg.parallel.nnodes > 1:
        return
    for family, host in ((socket.AF_INET, "127.0.0.1"), (socket.AF_INET, "0.0.0.0")):
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)   # as TCPStore does: TIME_WAIT is fine
            try:
                s.bind((host, port))
            except OSError as e:
                if e.errno != errno.EADDRINUSE:
                    continue
                raise C.ConfigError(f"port {port} is already in use on this machine (another run or program "
                                    f"listens on it); pick a free port, or 0 for any",
                                    source=_source(origin, "parallel", "master_port"), table="parallel",
                                    key="master_port") from None


def stream_stopped_cause(run_dir: Path) -> str:
    """The failure class of a stream that ended without a finished or failed line: run_folder_gone,
    disk_full (the run folder's disk is full now, or a rank's log says a line was refused for want of
    space), else crash."""
    if not Path(run_dir).is_dir():
        return "run_folder_gone"
    note = stream_stopped_note(run_dir)
    return "disk_full" if ("No space left" in note or "quota" in note.lower() or "is full" in note) else "crash"


def stream_stopped_note(run_dir: Path) -> str:
    """Why the stream of a run ended without a finished or failed line, when the run folder can say:
    "the stream stopped at step N: No space left on device (logs/rank0.log)", or a full disk seen
    now. '' when nothing explains it (then it was a crash)."""
    folder = RunFolder(run_dir)
    if not Path(run_dir).is_dir():
        return f"the run folder {run_dir} is gone (deleted while the run was going)"
    found = []
    for log in sorted(folder.logs.glob("rank*.log")):
        try:
            with open(log, "rb") as fh:
                text = fh.read().decode("utf-8", "replace")
        except OSError:
            continue
        for m in DROP_NOTE.finditer(text):
            found.append((int(m.group(1)), m.group(2), log))
            break
    if found:
        # the rank that had come furthest: a rank that writes no step lines knows the step from its others
        step, why, log = max(found, key=lambda f: f[0])
        return f"the stream stopped at step {step}: {why} ({log.relative_to(run_dir)})"
    try:
        free = shutil.disk_usage(run_dir).free
    except OSError:
        return ""
    if free < _LOW_SPACE:
        return (f"the disk holding {run_dir} is full ({free} bytes free): the stream and the rank logs could "
                f"not be written")
    return ""

