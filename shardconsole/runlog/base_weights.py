"""The fingerprint of a LoRA run's base weights, recorded in each checkpoint's manifest (issue 64 item 4).

A LoRA checkpoint holds the adapters alone: a resume loads them onto whatever the base folder holds
now, and a base re-downloaded at another revision, or overwritten by a merge, trains on without a
word. The ranks record the fingerprint at the save (backends/checkpoint/checkpoints.finish_checkpoint);
`resume` compares it with the folder's before launch (session/resume.py) and refuses a change.

Per weight file: its name, its size, and an xxh3-128 of its head (a safetensors file's header: every
tensor's name, dtype, shape and offsets) and of 64 evenly spread 64 KiB blocks. Not its mtime: a copy
(cp -r, rsync without -t) changes it and leaves the weights as they were. Not every byte: a base of
tens of GiB would be read in full at every save and resume; other weights of one shape (another
revision, a merge) differ in nearly every block, so the sampled blocks see them.
Standard library but xxhash (loaded by the callers that fingerprint).
"""

from __future__ import annotations

import json
from pathlib import Path

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".safetensors.index.json", ".bin.index.json")
_BLOCK, _BLOCKS, _HEAD = 64 << 10, 64, 1 << 20


def weight_files(folder: Path) -> list[Path]:
    """The folder's weight files and their indexes (top level: Hugging Face's shards live there)."""
    try:
        return sorted(p for p in folder.iterdir() if p.is_file() and p.name.endswith(WEIGHT_SUFFIXES))
    except OSError:
        return []


def _head_bytes(fh, size: int) -> int:
    """How much of the file's start to hash: a safetensors header whole (8-byte length, then JSON), else 1 MiB."""
    first = fh.read(8)
    fh.seek(0)
    n = int.from_bytes(first, "little") + 8 if len(first) == 8 else 0
    return min(size, n if 8 < n <= 100 << 20 else _HEAD)


def fingerprint(folder: Path) -> dict | None:
    """{"files": n, "bytes": total, "digest": "<hex>"} of the folder's weight files; None without any
    (a catalog model: its weights are drawn from the seed, nothing to compare)."""
    import xxhash
    files = weight_files(folder)
    if not files:
        return None
    whole, total = xxhash.xxh3_128(), 0
    for f in files:
        size = f.stat().st_size
        total += size
        whole.update(f"{f.name}\0{size}\0".encode())
        with open(f, "rb") as fh:
            whole.update(fh.read(_head_bytes(fh, size)))
            for i in range(_BLOCKS):
                fh.seek(size * i // _BLOCKS)
                whole.update(fh.read(_BLOCK))
    return {"files": len(files), "bytes": total, "digest": whole.hexdigest()}


def base_folder(model_name: str) -> Path | None:
    """model.name as a local folder (None for a catalog name)."""
    path = Path(model_name).expanduser()
    return path if path.is_dir() else None


def why_changed(saved: dict | None, folder: Path) -> str | None:
    """None when the folder's weights are those `saved` fingerprinted (or nothing was recorded: a
    checkpoint from before fingerprints), else what differs, in words."""
    if not isinstance(saved, dict) or "digest" not in saved:
        return None
    now = fingerprint(folder)
    if now is None:
        return "its weight files are gone"
    if now["digest"] == saved["digest"]:
        return None
    if (now["files"], now["bytes"]) != (saved.get("files"), saved.get("bytes")):
        return (f"its weight files changed ({saved.get('files')} file(s) of {saved.get('bytes')} bytes at the save, "
                f"{now['files']} of {now['bytes']} now)")
    return "its weight files hold other bytes than at the save (same files and sizes)"


def saved_fingerprint(checkpoint: Path, manifest_name: str) -> dict | None:
    try:
        base = json.loads((checkpoint / manifest_name).read_text()).get("base")
    except (OSError, ValueError, AttributeError):
        return None
    return base if isinstance(base, dict) else None


_taken: dict[str, dict | None] = {}     # this process's fingerprint of its base, taken once


def of_run(model_name: str, adapters: bool) -> dict | None:
    """The ranks' record for a save's manifest: a LoRA run's base fingerprinted at its first save (the
    weights it loaded), None for a full fine-tune or a catalog model."""
    folder = base_folder(model_name)
    if not adapters or folder is None:
        return None
    if model_name not in _taken:
        _taken[model_name] = fingerprint(folder)
    return _taken[model_name]


def why_other_base(model_name: str, adapters: bool, manifest: dict) -> str | None:
    """None when a LoRA checkpoint's adapters go onto the base they were trained on, else one line."""
    folder = base_folder(model_name)
    if not adapters or folder is None:
        return None
    why = why_changed(manifest.get("base"), folder)
    return None if why is None else f"the base model {folder}: {why} (the adapters were trained on the earlier weights)"
