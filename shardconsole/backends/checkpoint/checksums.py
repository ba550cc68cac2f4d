"""Each checkpoint file's checksum (xxh3-128), for the manifest (runlog/checkpoint_files.why_corrupt reads
it back at resume and export).

DCP's shard files are hashed while StreamingWriter writes them (HashingFile: every byte passes through
the hash on its way to the file; no second read): the writer returns them to the save (run_save's
write), which hands them to collect() at the manifest. The files other code writes (DCP's small .metadata,
each rank's JSON state, and DeepSpeed's engine.save_checkpoint files, which DeepSpeed writes itself
through torch.save on a path) are hashed after their write, at the manifest: every rank hashes a share
of them, so a DeepSpeed checkpoint is read back once in all, split across the ranks, and mostly from the
page cache it was just written through.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch.distributed as dist
import xxhash

from shardconsole.runlog.checkpoint_files import CHECKSUM, file_checksum

class HashingFile:
    """A binary file opened for writing, seen through its hash: write() hashes what it writes. Only
    sequential writes (DCP's writer and torch.save's zip writer append); a seek would make the hash
    wrong, so there is none."""

    def __init__(self, raw) -> None:
        self.raw = raw
        self.hash = xxhash.xxh3_128()

    def write(self, data) -> int:
        n = self.raw.write(data)     # a buffered file: all of it, or an OSError
        self.hash.update(data)
        return n

    def tell(self) -> int:
        return self.raw.tell()

    def flush(self) -> None:
        self.raw.flush()

    def fileno(self) -> int:
        return self.raw.fileno()

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return False

    def done(self) -> str:
        """The file is whole: its checksum, as the manifest writes it."""
        return f"{CHECKSUM}:{self.hash.hexdigest()}"


def collect(folder: Path, names: list[str], streamed_here: dict[str, str], rank: int, world: int) -> dict[str, str]:
    """Every rank: the checksum of each of `names` (the files of the save in `folder`), from the hashes
    each rank streamed while it wrote (`streamed_here`: this rank's, name in `folder` -> checksum), the
    rest hashed now, split round-robin across the ranks. Every rank returns the whole map (a collective:
    all ranks call it, with the same names)."""
    base = Path(os.path.abspath(folder))
    mine = {n: streamed_here[n] for n in names if n in streamed_here}
    gathered: list[dict[str, str] | None] = [None] * world
    dist.all_gather_object(gathered, mine)
    streamed = {k: v for part in gathered for k, v in (part or {}).items()}
    rest = [n for n in names if n not in streamed]
    hashed = {n: file_checksum(base / n) for n in rest[rank::world]}
    dist.all_gather_object(gathered, hashed)
    return {**streamed, **{k: v for part in gathered for k, v in (part or {}).items()}}
