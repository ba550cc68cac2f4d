"""`export-model --gguf TYPE`: the GGUF file (backends/checkpoint/gguf_file.py) and an Ollama Modelfile
beside it, written into an export folder; or a Hugging Face model folder (a fine-tuned export, any
folder of the six families) converted alone into a new folder.

    ollama create mymodel -f OUT/Modelfile      llama-cli -m OUT/model-q8_0.gguf
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from shardconsole.backends.checkpoint.gguf_file import write_gguf
from shardconsole.backends.checkpoint.gguf_vocab import modelfile_text
from shardconsole.export_model.checkpoint import ExportError
from shardconsole.settings.gguf_kinds import GgufKindError
from shardconsole.settings.values import format_size


def file_name(outtype: str) -> str:
    return f"model-{outtype}.gguf"


def add_gguf(folder: Path, outtype: str, title: str) -> str:
    """Into the Hugging Face folder `folder`: model-<type>.gguf and its Modelfile. The summary line's part."""
    name = file_name(outtype)
    try:
        w = write_gguf(folder, folder / name, outtype, title)
    except GgufKindError as e:
        raise ExportError(f"--gguf {outtype}: {e}") from None
    (folder / "Modelfile").write_text(modelfile_text(name, folder))
    return f"{name} ({w.arch}, {w.n_tensors} tensors, {format_size(w.n_bytes)}) and a Modelfile"


def is_model_folder(path: Path) -> bool:
    """A Hugging Face model folder rather than a run (no preset.toml, a config.json)."""
    return path.is_dir() and (path / "config.json").is_file() and not (path / "preset.toml").is_file()


def folder_to_gguf(src: Path, out: Path, outtype: str) -> str:
    """`export-model FOLDER -o OUT --gguf TYPE`: OUT made whole (a hidden folder renamed at the end) with
    the GGUF and its Modelfile, nothing else. The line to print."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ExportError(f"-o {out}: exists and is not an empty folder; pick a new one")
    tmp = out.parent / f".{out.name[:200]}.partial-{os.getpid()}"
    try:
        tmp.mkdir(parents=True)
        name = file_name(outtype)
        try:
            w = write_gguf(src, tmp / name, outtype, out.name)
        except GgufKindError as e:
            raise ExportError(f"--gguf {outtype}: {e}") from None
        except OSError as e:
            raise ExportError(f"-o {out}: writing failed: {e}") from None
        (tmp / "Modelfile").write_text(modelfile_text(name, src))
        if out.exists():
            out.rmdir()
        os.replace(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return (f"wrote {out}: {name} ({w.arch}, {w.n_tensors} tensors, {format_size(w.n_bytes)}) and a Modelfile, "
            f"from {src}")
