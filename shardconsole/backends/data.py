"""Batches for the ranks: synthetic tokens, a text/jsonl file, or a pre-tokenized token file.

Each rank reads its own shard: sample i of a step goes to rank (i mod world), so ranks never read
the same window. Batches are built on the host and moved with non_blocking copies from pinned memory
when the device is a GPU.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from shardconsole.config import RunConfig


class DataError(ValueError):
    pass


class SyntheticTokens:
    """Sequences a model can learn, so a falling loss means training works (not just "it ran").

    Each sequence reads a fixed random ordering of the vocabulary from a random start position:
    x[t] = perm[(start + t) mod vocab], so the next token is a fixed function of the current one. The loss starts near ln(vocab) and falls towards 0 as the model learns the
    permutation; the compute per token is that of any data, which is what memory and speed tuning need.
    """

    def __init__(self, vocab: int, seq_len: int, seed: int, rank: int) -> None:
        self.vocab, self.seq_len = vocab, seq_len
        g = torch.Generator().manual_seed(seed)            # same permutation on every rank
        self.perm = torch.randperm(vocab, generator=g)
        self.gen = torch.Generator().manual_seed(seed * 1000 + rank + 1)   # different samples per rank

    def batch(self, micro_batch: int) -> torch.Tensor:
        start = torch.randint(0, self.vocab, (micro_batch, 1), generator=self.gen)
        return self.perm[(start + torch.arange(self.seq_len + 1)) % self.vocab]


class TokenWindows:
    """Windows of seq_len+1 tokens over one long token array, strided across ranks."""

    def __init__(self, tokens: np.ndarray, seq_len: int, seed: int, rank: int, world: int, source: str) -> None:
        self.tokens, self.seq_len = tokens, seq_len
        self.n_windows = (len(tokens) - 1) // seq_len
        if self.n_windows < world:
            raise DataError(f"{source}: {len(tokens)} tokens make {self.n_windows} samples of "
                            f"{seq_len + 1} tokens, fewer than the {world} ranks; lower data.seq_len")
        self.rank, self.world = rank, world
        self.order = np.random.default_rng(seed).permutation(self.n_windows)
        self.pos = rank

    def batch(self, micro_batch: int) -> torch.Tensor:
        rows = []
        for _ in range(micro_batch):
            w = int(self.order[self.pos % self.n_windows])
            self.pos += self.world
            rows.append(np.asarray(self.tokens[w * self.seq_len: w * self.seq_len + self.seq_len + 1],
                                   dtype=np.int64))
        return torch.from_numpy(np.stack(rows))


def _read_text(path: Path, text_key: str) -> str:
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise DataError(f"{path}: cannot read: {e.strerror}") from None
    if b"\x00" in raw[:65536]:
        raise DataError(f"{path}: not a text file (it holds NUL bytes); for token ids use data.source = \"tokens\"")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not UTF-8 text (byte {e.start})") from None
    if path.suffix == ".jsonl":
        parts = []
        for n, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError:
                raise DataError(f"{path}:{n}: not a JSON object (a .jsonl file holds one per line)") from None
            if not isinstance(obj, dict) or not isinstance(obj.get(text_key), str):
                raise DataError(f"{path}:{n}: no string field {text_key!r} (set data.text_key)")
            parts.append(obj[text_key])
        text = "\n\n".join(parts)
    return text


def tokenize(text: str, model_path: str | None, vocab: int) -> np.ndarray:
    """With the model folder's tokenizer when it has one; else UTF-8 bytes (needs vocab >= 256)."""
    if model_path is not None:
        try:
            from transformers import AutoTokenizer
            tok = AutoTokenizer.from_pretrained(model_path, local_files_only=True)
            ids = tok(text, add_special_tokens=False)["input_ids"]
            return np.asarray(ids, dtype=np.int64)
        except (OSError, ValueError):
            pass   # no usable tokenizer in the folder: fall back to bytes
    if vocab < 256:
        raise DataError(f"text data without a tokenizer is read as bytes, which needs vocab_size >= 256 (model has {vocab})")
    return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int64)


def make_source(cfg: RunConfig, vocab: int, model_path: str | None, rank: int, world: int):
    d, seed = cfg.data, cfg.train.seed
    if d.source == "synthetic":
        return SyntheticTokens(vocab, d.seq_len, seed, rank)
    path = Path(d.path).expanduser()
    if not path.is_file():
        raise DataError(f"[data] path: {path}: no such file")
    if d.source == "text":
        tokens = tokenize(_read_text(path, d.text_key), model_path, vocab)
    else:
        dtype = np.uint16 if d.token_dtype == "uint16" else np.uint32
        if path.stat().st_size % np.dtype(dtype).itemsize:
            raise DataError(f"{path}: size is not a multiple of {np.dtype(dtype).itemsize} bytes "
                            f"({d.token_dtype} tokens); check data.token_dtype")
        tokens = np.memmap(path, dtype=dtype, mode="r")
    if len(tokens) and int(tokens.max() if len(tokens) < 50_000_000 else tokens[:1_000_000].max()) >= vocab:
        raise DataError(f"{path}: token ids reach {int(tokens.max())} but the model's vocab_size is {vocab}")
    return TokenWindows(tokens, d.seq_len, seed, rank, world, str(path))


def next_batch(source, micro_batch: int, device: torch.device) -> torch.Tensor:
    """The next batch on the rank's device: from pinned host memory, without blocking, on a GPU."""
    batch = source.batch(micro_batch)
    if device.type == "cuda":
        batch = batch.pin_memory()
    return batch.to(device, non_blocking=True)
