"""What makes a checkpoint folder complete, standard library only: the ranks (backends/checkpoint/checkpoints.py),
export-model (export_model/checkpoint.py) and the console's step chooser judge a step folder by this one
test, so a folder the ranks would skip on resume is never offered to export or chat either.

A save writes step_<N>.partial/ and renames it once rank 0 wrote the manifest (MANIFEST: the step, the
data position, the world size and every file with its size and its xxh3-128 checksum); a folder truncated
later is told from a complete one by the sizes the manifest lists (why_incomplete: cheap, no read), and a
file changed in place (same size, other bytes: torch.load checks no CRC, and a flipped block loads as NaN
weights) by its checksum (why_corrupt: reads every byte, so only resume and export call it, on the one
folder they are about to load). Checkpoints written before checksums existed still load, said unverified.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Iterable

MANIFEST = "shardconsole.json"
STEP_PREFIX = "step_"           # step_<N>: a complete save; step_<N>.partial, step_<N>.replaced[K]: never loaded
CHECKSUM = "xxh3_128"           # the manifest's "checksums" hold "<CHECKSUM>:<hex>" per file
_CHUNK = 8 << 20


def step_of(name: str) -> int | None:
    """The step of a step folder's name (step_00000010 -> 10); None for every other name: a save still
    being written (.partial), one set aside (.replaced), a temporary file, step_x. The ranks, resume,
    export-model and the run list read step folders by this one test, so none of them loads, lists or
    prunes a folder another would skip."""
    if not name.startswith(STEP_PREFIX):
        return None
    digits = name[len(STEP_PREFIX):]
    return int(digits) if digits.isdigit() and digits.isascii() else None


def step_folders(root: Path) -> list[tuple[int, Path]]:
    """(step, folder) of the step folders in `root`, newest (highest step) first, complete or not; []
    when `root` is no folder or cannot be read."""
    found = []
    try:
        for p in root.iterdir():
            step = step_of(p.name)
            if step is not None and p.is_dir():
                found.append((step, p))
    except OSError:
        return []
    return sorted(found, reverse=True)


def why_incomplete(path: Path, backend: str) -> str | None:
    """None when the folder holds a complete checkpoint, else what is wrong with it."""
    manifest = path / MANIFEST
    if manifest.is_file():
        try:
            meta = json.loads(manifest.read_text())
            files = dict(meta["files"])
        except (OSError, ValueError, KeyError, TypeError):
            return f"its {MANIFEST} is unreadable"
        altered = why_manifest_altered(meta)
        if altered is not None:
            return altered
        if meta.get("backend") != backend:
            return f"written by a {meta.get('backend')} run, this run is {backend}"
        for name, size in files.items():
            f = path / name
            if not f.is_file():
                return f"{name} is missing"
            if f.stat().st_size != size:
                return f"{name} is truncated ({f.stat().st_size} of {size} bytes)"
        return None
    # Written before manifests: only the backend's own marker can be checked. Unless an older step of the
    # same folder has a manifest: saves come in step order, so this one was written with one and lost it
    # (it was loaded unverified as "saved before shardconsole wrote them").
    older = _older_with_manifest(path)
    if older is not None:
        return f"its {MANIFEST} is missing (the older {older.name} has one: this one was saved with it)"
    if (path / "rank_state").is_dir():      # checkpoints.RANK_STATE_DIR: it came in with the manifest
        return f"its {MANIFEST} is missing (its rank_state/ was written with one)"
    if backend == "fsdp":
        meta_file = path / ".metadata"
        return None if meta_file.is_file() and meta_file.stat().st_size > 0 else "no DCP .metadata (empty or cut short)"
    if (path / "latest").is_file():
        return None
    return "no DeepSpeed 'latest' file (empty, cut short, or written by an FSDP run)"


def _older_with_manifest(path: Path) -> Path | None:
    """A step folder beside `path`, of an earlier step, whose manifest is of the checksum era."""
    step = step_of(path.name)
    if step is None:
        return None
    for older, p in step_folders(path.parent):
        if older >= step:
            continue
        try:
            meta = json.loads((p / MANIFEST).read_text())
        except (OSError, ValueError):
            continue
        if isinstance(meta, dict) and (meta.get("checksums") or MANIFEST_SUM in meta):
            return p
    return None


# What the checkpoint's tensors were made with: a resume that changes one of them fails after the launch
# with DCP's "Size mismatch" or an optimizer state of another kind (a crash at the first step). The save
# records them in its manifest ("shapes"), so a resume compares with the checkpoint itself, not only with
# preset.toml, which a hand edit may have changed since (session/resume.py).
SHAPE_KEYS = (("model", "name"), ("parallel", "backend"), ("train", "method"), ("lora", "rank"),
              ("lora", "target_modules"), ("lora", "modules_to_save"), ("optim", "name"))


def shapes_of(cfg) -> dict:
    """{"table.key": value} of SHAPE_KEYS in a run's settings, as JSON would give them back."""
    return json.loads(json.dumps({f"{t}.{k}": getattr(getattr(cfg, t), k) for t, k in SHAPE_KEYS}))


MANIFEST_SUM = "manifest_checksum"     # the manifest's own checksum, over every other key


def manifest_checksum(meta: dict) -> str:
    """The checksum of a manifest's every key but its own (canonical JSON: the order the keys were
    written in does not matter, any value does)."""
    import xxhash
    body = json.dumps({k: v for k, v in meta.items() if k != MANIFEST_SUM}, sort_keys=True)
    return f"{CHECKSUM}:{xxhash.xxh3_128(body.encode()).hexdigest()}"


def why_manifest_altered(meta: dict) -> str | None:
    """None when the manifest is as its save wrote it. Everything a resume takes from it (the step, the
    data position, the files and their checksums, the run) is covered by its own checksum: a one-digit
    edit of samples_consumed would move the data position unseen. A manifest of the checksum era (it
    names its run_dir: both came in one release) that has no checksums lost them: it is damaged, not
    an old checkpoint to load unverified."""
    want = meta.get(MANIFEST_SUM)
    if want is not None:
        if want != manifest_checksum(meta):
            return f"its {MANIFEST} was changed after the save (it does not match its own checksum)"
        if not meta.get("checksums"):
            return f"its {MANIFEST} lists no file checksums"
        return None
    if "run_dir" in meta and not meta.get("checksums"):
        return f"its {MANIFEST} lost its file checksums (it was written with them)"
    return None


def safe_reason(text: str) -> str:
    """A load error's text without torch's advice to load the file with weights_only=False: what it
    refused (the global it names) is kept, the way around the refusal is not."""
    if "weights_only" not in text and "Weights only load failed" not in text:
        return text
    import re
    found = re.search(r"GLOBAL ([\w.]+)|(Unsupported operand \d+)", text)
    what = (f"global {found.group(1)}" if found and found.group(1) else found.group(2) if found
            else "it is not plain tensors and containers")
    head = re.split(r"Weights only load failed|[^.;:]*weights_only", text)[0]
    return f"{head}a pickle that would build more than tensors was refused ({what}); do not load this file"


def make_private(folder: Path) -> None:
    """The folder and everything in it readable by its owner alone (0700 folders, 0600 files): a
    checkpoint is the trained model (train.checkpoint_private)."""
    for p in [folder, *folder.rglob("*")]:
        try:
            os.chmod(p, 0o700 if p.is_dir() else 0o600)
        except OSError:
            pass


def listed_bytes(path: Path) -> int | None:
    """The checkpoint's size as its manifest lists it (no walk of the folder); None without one."""
    try:
        return sum(int(size) for size in json.loads((path / MANIFEST).read_text())["files"].values())
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def checksums(path: Path) -> dict[str, str] | None:
    """The manifest's {file: "xxh3_128:<hex>"}; None for a checkpoint saved before checksums existed."""
    try:
        sums = json.loads((path / MANIFEST).read_text()).get("checksums")
    except (OSError, ValueError, AttributeError):
        return None
    return dict(sums) if isinstance(sums, dict) and sums else None


def file_checksum(f: Path) -> str:
    """A file's checksum as the manifest writes it, read in 8 MiB pieces (the page cache does the rest)."""
    import xxhash       # a C extension: loaded by the few commands that verify, not by every importer
    h = xxhash.xxh3_128()
    with open(f, "rb") as fh:
        while chunk := fh.read(_CHUNK):
            h.update(chunk)
    return f"{CHECKSUM}:{h.hexdigest()}"


def why_corrupt(path: Path, names: Iterable[str] | None = None) -> str | None:
    """None when every listed file (or those of `names`) has the checksum its manifest recorded, else
    one line naming the first file that does not. A checkpoint without checksums is not judged here
    (checksums(path) is None: the caller says it loads unverified)."""
    sums = checksums(path)
    if sums is None:
        return None
    for name in sorted(sums if names is None else names):
        want = sums.get(name)
        if want is None:
            continue
        try:
            got = file_checksum(path / name)
        except OSError as e:
            return f"{name} cannot be read to verify its checksum ({e.strerror or e})"
        if got != want:
            return f"{name} does not match its checksum (its bytes changed after the save: {got} != {want})"
    return None


# ---------------------------------------------------------------------------------------------------
# Whose checkpoint folder: a train.checkpoint_dir outside the run folder can be named by several runs,
# and two runs in one folder prune each other's saves and resume each other's steps. The folder names
# its run in OWNER (the run folder's resolved path); a run that continued another's checkpoints (a new
# run with train.resume = true) took it over and lists the earlier owners in "inherited".

OWNER = ".shardconsole-run.json"


def shared_folder(checkpoints: Path, run_dir: Path) -> bool:
    """A checkpoint folder outside the run folder (train.checkpoint_dir): one another run could name.
    The run folder's own checkpoints/ belongs to the folder, wherever it was copied or moved."""
    try:
        return not checkpoints.resolve().is_relative_to(run_dir.resolve())
    except OSError:
        return True


def other_run_folder(checkpoints: Path, run_dir: Path) -> Path | None:
    """The run folder other than run_dir that `checkpoints` resolves into (symlinks and relative parts
    followed), None when none: that run's own checkpoints/ or any folder inside it. Such a folder is
    never shared, whatever it holds yet: that run saves, prunes and resumes there without looking at
    an owner file (its checkpoints/ is its own), so a second run in it mixes both runs' steps even
    before the first save. A run folder is a folder with a preset.toml (the one file `resume` needs)."""
    from shardconsole.runlog.runfolder import PRESET_FILE
    try:
        here, where = run_dir.resolve(), checkpoints.resolve()
    except (OSError, RuntimeError):
        return None
    for folder in (where, *where.parents):
        if folder == here:
            return None         # inside this run's own folder (this run nested in another is its own)
        try:
            if (folder / PRESET_FILE).is_file():
                return folder
        except OSError:
            continue
    return None


def read_owner(checkpoints: Path) -> dict | None:
    try:
        owner = json.loads((checkpoints / OWNER).read_text())
    except (OSError, ValueError):
        return None
    return owner if isinstance(owner, dict) and isinstance(owner.get("run_dir"), str) else None


def loadable_runs(checkpoints: Path) -> set[str]:
    """The run folders whose checkpoints the owner may load: its own and those it took over."""
    owner = read_owner(checkpoints) or {}
    return {str(p) for p in [owner.get("run_dir"), *(owner.get("inherited") or [])] if p}


def write_owner(checkpoints: Path, run_dir: Path, inherited: Iterable[str] = ()) -> None:
    """Name `run_dir` the folder's run (atomically: a reader sees the old file or the new one)."""
    checkpoints.mkdir(parents=True, exist_ok=True)
    tmp = checkpoints / f"{OWNER}.{os.getpid()}"
    tmp.write_text(json.dumps({"run": run_dir.resolve().name, "run_dir": str(run_dir.resolve()),
                               "inherited": sorted(set(inherited))}))
    os.replace(tmp, checkpoints / OWNER)
