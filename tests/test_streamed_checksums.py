"""A save's streamed checksums are returned by the writer that computed them (save_stream.StreamingWriter
.checksums, handed by the engine's write to run_save and the manifest), not left in a module global for
the manifest to find: two saves in one process keep their own, and each is the file's checksum as
resume and export recompute it from the bytes (runlog/checkpoint_files.file_checksum)."""

from __future__ import annotations

import torch
import torch.distributed.checkpoint as dcp

from shardconsole.backends.checkpoint import checksums
from shardconsole.backends.checkpoint.save_stream import StreamingWriter
from shardconsole.runlog.checkpoint_files import file_checksum


def test_each_writer_returns_the_checksums_of_the_files_it_wrote(tmp_path):
    writers = []
    for n, folder in enumerate((tmp_path / "a", tmp_path / "b")):
        writer = StreamingWriter(folder)
        dcp.save({"w": torch.arange(1000, dtype=torch.float32) + n, "step": torch.tensor(n)},
                 storage_writer=writer, no_dist=True)
        writers.append((folder, writer))
    for folder, writer in writers:
        shards = sorted(p.name for p in folder.iterdir() if p.suffix == ".distcp")
        assert shards and sorted(writer.checksums) == shards
        for name, got in writer.checksums.items():
            assert got == file_checksum(folder / name)
    assert writers[0][1].checksums != writers[1][1].checksums
    # nothing of a save stays behind in the module for the next one to pick up
    assert not [k for k, v in vars(checksums).items() if isinstance(v, (dict, list, set)) and not k.startswith("__")]
