"""`train.export_dir`: the Hugging Face folder written at the end of the run straight from the trained
state, one tensor at a time, without a checkpoint.

Every rank walks the model's state dict in one order; each sharded tensor is gathered whole
(DTensor.full_tensor, a collective) and only rank 0 keeps it, converts it to train.export_dtype and
appends its bytes to the open safetensors file, then drops it. The safetensors header comes first and
needs every tensor's shape and dtype, which the sharded tensors know without gathering, so no file is
ever held in memory: the host peak of the export is training's plus one full tensor (and its converted
copy). The folder is written beside export_dir and renamed at the end, as export-model writes it.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Callable

import torch

from shardconsole.backends.checkpoint import save_stream
from shardconsole.backends.rank import run_folder
from shardconsole.backends.rank.common import Rank
from shardconsole.runlog.checkpoint_files import make_private
from shardconsole.settings.data import prompt_format
from shardconsole.settings.values import format_size

# What a model folder's tokenizer may consist of (fast and slow tokenizers, chat templates); export-model
# copies the same.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "tokenizer.model", "spiece.model", "vocab.json", "vocab.txt", "merges.txt",
                   "chat_template.jinja", "chat_template.json")
TOKENIZER_DIRS = ("additional_chat_templates",)


def copy_tokenizer(src: Path, folder: Path) -> None:
    """The model folder's tokenizer files and chat templates, copied beside an export's weights."""
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copy2(src / name, folder / name)
    for name in TOKENIZER_DIRS:
        if (src / name).is_dir():
            shutil.copytree(src / name, folder / name)
SAFETENSORS_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}
MAX_SHARD_BYTES = 5 * 10**9          # export-model's default --max-shard-size
PREFIX = "lm."                       # the ranks train CausalLMLoss(lm): the HF model's keys under "lm."


def export_dtype(r: Rank) -> torch.dtype:
    """train.export_dtype, else the kept weights' own dtype (export-model's --dtype default): bf16 for bf16
    masters and for adam-mini's split fp32 ones (their bf16 part, the folder a Hub model is)."""
    name = r.cfg.train.export_dtype or ("bf16" if r.cfg.kept_bytes == 2 else "fp32")
    return torch.bfloat16 if name == "bf16" else torch.float32


def hf_config(r: Rank):
    """The config the ranks built the model from, without their run-time switches."""
    from shardconsole.backends.model.modeling import transformers_config
    return transformers_config(r.spec)


def _kept_keys(config) -> set[str]:
    """The keys the Hugging Face model saves (its state dict less the tied copies); rank 0 only."""
    from transformers import AutoModelForCausalLM
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    keys = set(model.state_dict())
    if getattr(config.get_text_config(), "tie_word_embeddings", False):
        tied = getattr(model, "_tied_weights_keys", None) or {}
        keys -= set(tied)
    return keys


def _plan(entries: list[tuple[str, tuple, torch.dtype]], max_bytes: int) -> list[list[tuple[str, tuple, torch.dtype]]]:
    shards: list[list] = [[]]
    size = 0
    for e in entries:
        n = _nbytes(e[1], e[2])
        if shards[-1] and size + n > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(e)
        size += n
    return shards


def _nbytes(shape: tuple, dtype: torch.dtype) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n * torch.empty((), dtype=dtype).element_size()


def _header(entries: list[tuple[str, tuple, torch.dtype]]) -> bytes:
    head: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape, dtype in entries:
        n = _nbytes(shape, dtype)
        head[name] = {"dtype": SAFETENSORS_DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    text = json.dumps(head, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)          # the data starts 8-byte aligned
    return struct.pack("<Q", len(text)) + text


@dataclass
class FullTensors:
    """A trained model's tensors under the Hugging Face model's names, each gathered whole when asked:
    `full(name)` may be a collective (FSDP2's full_tensor, ZeRO's gathers), so every rank asks for every
    entry, in `entries` order. How an engine gathers is its own (fsdp_engine, ds_engine); the writing is
    this module's."""
    entries: list[tuple[str, tuple[int, ...], torch.dtype]]     # name, shape, dtype as trained
    full: Callable[[str], torch.Tensor]


def of_state_dict(state: dict[str, torch.Tensor]) -> FullTensors:
    """FSDP2's state dict (DTensor shards under "lm."): gathered with full_tensor."""
    names = [k for k in state if k.startswith(PREFIX)]
    entries = [(k[len(PREFIX):], tuple(state[k].shape), state[k].dtype) for k in names]
    return FullTensors(entries, lambda name: _full(state[PREFIX + name]))


def export(r: Rank, src: FullTensors, step: int) -> Path:
    """Every rank: write train.export_dir as a Hugging Face model folder from `src`. Returns it."""
    out = Path(r.cfg.train.export_dir).expanduser()
    dtype = export_dtype(r)
    config = hf_config(r)
    kept = _kept_keys(config)             # on every rank: a refusal here is every rank's, before any collective
    entries = [(n, shape, dtype if dt.is_floating_point else dt) for n, shape, dt in src.entries]
    missing = sorted(kept - {n for n, _, _ in entries})
    if missing:
        raise RuntimeError(f"the trained model lacks {', '.join(missing[:3])} of {type(config).__name__}")
    entries = [e for e in entries if e[0] in kept]
    total = sum(_nbytes(s, d) for _, s, d in entries)

    def write(tmp: Path) -> None:
        _write_tensors(r, src, entries, tmp)
        if r.rank == 0:
            _write_folder_files(r, config, dtype, tmp, step)

    written_to(r, out, step, total, write)
    if r.rank == 0:
        r.event("exported", f"{out}: {format_size(total)} in {str(dtype).removeprefix('torch.')}")
    return out


def written_to(r: Rank, out: Path, step: int, total: int, write: Callable[[Path], None]) -> None:
    """Every rank: `write(tmp)` fills a hidden folder beside `out` (rank 0 made it), renamed to `out` when
    complete; a failure leaves no folder, and a full disk is named as one."""
    run_folder.follow_move(r)
    out = run_folder.rebased(r, out)        # an export_dir in a run folder renamed since goes with it
    tmp = out.parent / f".{out.name[:200]}.partial-{os.getpid()}"     # room for the suffix in 255 characters
    private = r.cfg.train.checkpoint_private
    r.phase("saving checkpoint")
    watch = None
    try:
        if r.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True, mode=0o700 if private else 0o777)
            watch = save_stream.SaveWatch(r, step, "export", tmp, total)
        write(tmp)
        if r.rank == 0:
            if r.cfg.train.export_gguf and not r.cfg.train.export_adapter:
                _write_gguf(r, tmp, out)
            if private:
                make_private(tmp)      # the trained model, readable by its owner alone (train.checkpoint_private)
            if out.exists():
                out.rmdir()            # refused before launch unless empty
            os.replace(tmp, out)
            if watch is not None:
                watch.finish(out)
    except BaseException as e:
        if watch is not None:
            watch.finish()
        shutil.rmtree(tmp, ignore_errors=True)
        free = save_stream.free_bytes(out.parent)
        if save_stream.disk_full_in(e, free, total):
            raise save_stream.DiskFullError(
                errno.ENOSPC, f"disk full at the export of step {step}: {save_stream.full_words(out.parent, total)}") from e
        raise
    torch.distributed.barrier()


def _write_gguf(r: Rank, tmp: Path, out: Path) -> None:
    """train.export_gguf: the finished Hugging Face folder converted into model-TYPE.gguf beside it, and
    its Ollama Modelfile; rank 0, from the files just written (one tensor in memory at a time)."""
    from shardconsole.backends.checkpoint import gguf_file, gguf_vocab
    outtype = r.cfg.train.export_gguf
    assert outtype is not None
    name = f"model-{outtype}.gguf"
    w = gguf_file.write_gguf(tmp, tmp / name, outtype, out.name)
    (tmp / "Modelfile").write_text(gguf_vocab.modelfile_text(name, tmp))
    r.event("exported", f"{out / name}: {w.arch}, {w.n_tensors} tensors, {format_size(w.n_bytes)}")


def _write_tensors(r: Rank, src: FullTensors, entries: list, tmp: Path) -> None:
    """All ranks gather every tensor of `src` in its order (the collectives must match); rank 0 writes
    the kept ones (`entries`), shard file by shard file."""
    if r.rank != 0:
        for name, _, _ in src.entries:
            src.full(name)
        return
    shards = _plan(entries, MAX_SHARD_BYTES)
    files = ["model.safetensors"] if len(shards) == 1 else [
        f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    where = {e[0]: (i, e[2]) for i, shard in enumerate(shards) for e in shard}
    streams: dict[int, BinaryIO] = {}
    try:
        for name, _, _ in src.entries:
            t = src.full(name)
            if name not in where:
                continue
            i, dtype = where[name]
            if i not in streams:
                for j in [j for j in streams if j < i]:
                    streams.pop(j).close()
                streams[i] = open(tmp / files[i], "wb")
                streams[i].write(_header(shards[i]))
            t = t.detach().to("cpu", dtype).contiguous()
            streams[i].write(t.view(torch.uint8).numpy().data if t.numel() else b"")
            del t
    finally:
        for f in streams.values():
            f.close()
    if len(files) > 1:
        weight_map = {e[0]: files[i] for i, shard in enumerate(shards) for e in shard}
        total = sum(_nbytes(e[1], e[2]) for shard in shards for e in shard)
        (tmp / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def say_prompt_format(r: Rank, folder: Path) -> None:
    """The export of a run whose prompts trained as plain text says so, as export-model's does, for chat
    to give them the same way (settings/data/prompt_format.py)."""
    meta = getattr(r.data_state.entry, "meta", None) or {}
    if prompt_format.raw_prompts(meta.get("format", ""), meta.get("template", "")):
        prompt_format.write_raw(folder)


def _write_folder_files(r: Rank, config, dtype: torch.dtype, tmp: Path, step: int) -> None:
    from transformers import GenerationConfig
    config.torch_dtype = dtype
    config.save_pretrained(tmp)
    src = Path(r.spec.path) if r.spec.path is not None else None
    if src is not None and (src / "generation_config.json").is_file():
        GenerationConfig.from_pretrained(src, local_files_only=True).save_pretrained(tmp)
    else:
        GenerationConfig.from_model_config(config).save_pretrained(tmp)
    if src is not None:
        copy_tokenizer(src, tmp)
    say_prompt_format(r, tmp)
    preset = (r.run_dir / "preset.toml").read_text().rstrip() if (r.run_dir / "preset.toml").is_file() else ""
    (tmp / "README.md").write_text("\n".join([
        f"# {Path(r.cfg.train.export_dir).name}", "",
        f"Written by shardconsole at the end of run `{r.run_id}` ({r.run_dir.resolve()}), from the trained "
        f"state after step {step} (train.export_dir).", "",
        f"- model: {r.spec.name} ({type(config).__name__}), weights in {str(dtype).removeprefix('torch.')}",
        "", "## Load", "", "```python", "from transformers import AutoModelForCausalLM",
        f"model = AutoModelForCausalLM.from_pretrained({str(Path(r.cfg.train.export_dir).expanduser())!r})",
        "```", "", "## The run's settings (its preset.toml)", "", "```toml", preset, "```", ""]))
