"""The content hash of a data file or folder: what a checkpoint records of its data, what the token
cache keys on, and what a resume compares before launch. One definition for the ranks
(backends/data/token_cache.py) and the front ends (session/resume_data.py), so the two never disagree.

Standard library, xxhash and platformdirs only: no torch, datasets or numpy.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path

from shardconsole.user_folders import cache_dir  # noqa: F401  (backends/data/token_cache.py imports it from here)


def hash_files(h, files: list[Path], base: Path) -> None:
    for f in files:
        h.update(str(f.relative_to(base)).encode() + b"\0")
        with f.open("rb") as fh:
            while block := fh.read(1 << 20):
                h.update(block)
        h.update(b"\0")


def content_hash(path: Path) -> str:
    """sha256 of a file's bytes, or of a folder's file names and contents. Remembered beside the cache
    under an xxh3 hash of the same bytes (about ten times faster than sha256 here), never under the
    file's stat: an edit that keeps the size and puts the mtime back (`cp -p`, `rsync -t`) still
    changes the key, and a 100 GB corpus costs one fast read per start, not a sha256 per rank."""
    path = path.resolve()
    fast = _xxh3(path)
    memo = cache_dir() / "hashes" / f"{hashlib.sha256(str(path).encode()).hexdigest()[:32]}.json"
    try:
        known = json.loads(memo.read_text())
        if known["xxh3"] == fast:
            return known["sha256"]
    except (OSError, ValueError, KeyError, TypeError):
        pass
    digest = _sha256(path)
    try:
        memo.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=memo.parent, suffix=".tmp")
        with os.fdopen(fd, "w") as fh:
            json.dump({"xxh3": fast, "sha256": digest}, fh)
        os.replace(tmp, memo)
    except OSError:
        pass    # only a shortcut for the next start
    return digest


def _hash_path(h, path: Path) -> None:
    """A folder: its files' names (relative to it) and contents. A file: its bytes alone, so that the
    sha256 a checkpoint records is `sha256sum`'s, and a byte-identical copy under another name or folder
    is the same data (with its name hashed in, a resume on such a copy was refused as "content changed")."""
    if path.is_dir():
        hash_files(h, sorted(p for p in path.rglob("*") if p.is_file()), path)
        return
    with path.open("rb") as fh:
        while block := fh.read(1 << 20):
            h.update(block)


def _xxh3(path: Path) -> str:
    import xxhash      # a dependency of datasets, and of ours: the fast full-content check
    h = xxhash.xxh3_128()
    _hash_path(h, path)
    return h.hexdigest()


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    _hash_path(h, path)
    return h.hexdigest()


def named_content_hash(path: Path) -> str:
    """The hash checkpoints recorded before HASHED (a file's name hashed with its bytes): read only to
    resume a checkpoint of then, once."""
    path = Path(path).resolve()
    if path.is_dir():
        return _sha256(path)
    h = hashlib.sha256()
    hash_files(h, [path], path.parent)
    return h.hexdigest()


# How a checkpoint's data sha256 was taken: "bytes", a file's bytes alone (_hash_path). A checkpoint
# without it hashed the file's name too (named_content_hash).
HASHED = "bytes"


def same_content(saved: dict, path: Path, now_sha256: str) -> bool:
    """Whether the data a checkpoint recorded (its manifest's "data": sha256, hashed) is the content
    now at path, whose content_hash is now_sha256."""
    if saved["sha256"] == now_sha256:
        return True
    if saved.get("hashed") == HASHED:
        return False
    # A checkpoint of before HASHED: its hash named the file; read it once that way (only on a mismatch).
    return saved["sha256"] == named_content_hash(path.expanduser())
