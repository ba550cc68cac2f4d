"""Tokenize once per machine, not once per rank: the token ids and per-token flags of the training (and
held-out) records, in a cache folder keyed by everything that changes them.

The key hashes the data file's content (every file of a save_to_disk folder), the eval file's, the model
folder's tokenizer files (and so its chat template), the built-in plain template, data.text_key,
data.seq_len, the eval split (eval_fraction and train.seed) and this module's format version. The first
rank to take the key's file lock builds the entry (progress lines in its log) into a temporary folder
and renames it into place; the other ranks wait on the lock and then find it. Every rank then
memory-maps the arrays: host memory does not grow with the corpus.

Cache folder: $SHARDCONSOLE_CACHE_DIR/tokens, else platformdirs' user cache dir for shardconsole.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from shardconsole.backends.data import corpus
from shardconsole.backends.data.corpus import DataError
from shardconsole.settings.data.data_check import TOKENIZER_FILES, tokenizer_dir
# The hashes live with the settings layer: a resume compares them before launch (session/resume_data.py).
from shardconsole.settings.data.data_hash import cache_dir, content_hash, hash_files as _hash_files, named_content_hash

FORMAT_VERSION = 2     # 2: blank text records dropped, data.text_split, CSV chats as JSON strings
META = "meta.json"
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".msgpack", ".h5")


def cache_root() -> Path:
    return cache_dir() / "tokens"


def tokenizer_hash(model_path: str | None) -> str:
    """The model folder's files other than weights: tokenizer files, chat template, config."""
    if model_path is None:
        return "bytes"
    base = Path(model_path).expanduser()
    h = hashlib.sha256()
    _hash_files(h, sorted(p for p in base.iterdir() if p.is_file() and not p.name.endswith(_WEIGHT_SUFFIXES)
                          and not p.name.endswith(".index.json")), base)
    return h.hexdigest()


def cache_key(d, seed: int, model_path: str | None, vocab: int) -> str:
    parts = {
        "version": FORMAT_VERSION, "data": content_hash(Path(d.path).expanduser()),
        "eval": content_hash(Path(d.eval_path).expanduser()) if d.eval_path else "",
        "tokenizer": tokenizer_hash(model_path), "plain_template": corpus.PLAIN_TEMPLATE,
        "text_key": d.text_key, "text_split": d.text_split, "seq_len": d.seq_len, "vocab": vocab,
        "eval_fraction": d.eval_fraction, "seed": seed if d.eval_fraction else None,
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:32]


@dataclass
class Split:
    ids: np.ndarray       # token ids, memory-mapped
    flags: np.ndarray     # corpus.LOSS | corpus.DOC_START per token, memory-mapped
    records: int


@dataclass
class Entry:
    folder: Path
    meta: dict
    train: Split
    eval: Split | None
    built_here: bool


def built_once(key: str, build: Callable[[Path], None], log: Callable[[str], None]) -> tuple[Path, bool]:
    """The cache folder of `key` (it holds META once complete), built by the first rank to take its lock
    while the others wait on it; (folder, whether this rank built it). The token and the pair caches share it."""
    root = cache_root()
    root.mkdir(parents=True, exist_ok=True)
    folder = root / key
    built = False
    if not (folder / META).is_file():
        with open(root / f"{key}.lock", "a") as lock:
            t0 = time.monotonic()
            fcntl.flock(lock, fcntl.LOCK_EX)      # held by the building rank; the others wait here
            if time.monotonic() - t0 > 1:
                log(f"data: waited {time.monotonic() - t0:.1f} s for another rank to tokenize")
            if not (folder / META).is_file():
                build(folder)
                built = True
    return folder, built


def open_entry(d, seed: int, model_path: str | None, has_tokenizer: bool, vocab: int,
               log: Callable[[str], None]) -> Entry:
    """The cache entry for these settings: built by the first rank to ask, memory-mapped by all."""
    if model_path is not None and not has_tokenizer and not d.tokenizer:
        raise DataError(f"[model] name: {model_path}: no tokenizer files ({', '.join(TOKENIZER_FILES)}); name one "
                        f"with data.tokenizer = \"FOLDER\", or data.tokenizer = \"bytes\" for UTF-8 bytes")
    model_path = tokenizer_dir(d, model_path, has_tokenizer)      # from here on: the tokenizer's folder
    has_tokenizer = model_path is not None
    folder, built = built_once(cache_key(d, seed, model_path, vocab),
                               lambda f: _build(f, d, seed, model_path, has_tokenizer, vocab, log), log)
    meta = json.loads((folder / META).read_text())
    dtype = np.dtype(meta["dtype"])

    def split(name: str) -> Split | None:
        info = meta["splits"].get(name)
        if info is None:
            return None
        n = info["tokens"]
        # np.memmap refuses an empty file; an empty split has no tokens to map.
        if not n:
            return Split(np.zeros(0, dtype), np.zeros(0, np.uint8), info["records"])
        ids = np.memmap(folder / f"{name}.ids", dtype=dtype, mode="r", shape=(n,))
        flags = np.memmap(folder / f"{name}.flags", dtype=np.uint8, mode="r", shape=(n,))
        return Split(ids, flags, info["records"])
    train = split("train")
    if train is None:       # written by every build: a cache entry edited by hand
        raise DataError(f"{folder}: a token cache entry without its train split; remove the folder to rebuild it")
    return Entry(folder, meta, train, split("eval"), built)


class _Writer:
    def __init__(self, folder: Path, name: str, dtype) -> None:
        self.ids = open(folder / f"{name}.ids", "wb")
        self.flags = open(folder / f"{name}.flags", "wb")
        self.dtype, self.records, self.tokens, self.loss_tokens = dtype, 0, 0, 0

    def add(self, ids: np.ndarray, flags: np.ndarray) -> None:
        self.ids.write(ids.astype(self.dtype).tobytes())
        self.flags.write(flags.tobytes())
        self.records += 1
        self.tokens += len(ids)
        self.loss_tokens += int((flags & corpus.LOSS).astype(bool).sum())

    def close(self) -> dict:
        self.ids.close()
        self.flags.close()
        return {"records": self.records, "tokens": self.tokens, "loss_tokens": self.loss_tokens}


def _build(folder: Path, d, seed: int, model_path: str | None, has_tokenizer: bool, vocab: int,
           log: Callable[[str], None]) -> None:
    scratch = Path(tempfile.mkdtemp(dir=folder.parent, prefix=f".{folder.name}."))
    try:
        out = scratch / "out"
        out.mkdir()
        enc = corpus.load_encoder(model_path, has_tokenizer, vocab)
        dtype = np.dtype(np.uint16 if vocab <= 1 << 16 else np.uint32)
        train, evalw = _Writer(out, "train", dtype), None
        ds, path, where = corpus.load_records(d.path, "path", d.text_key, scratch / "hf", d.text_split)
        fmt = corpus.detect_format(ds.column_names, d.text_key, str(path))
        renderer = corpus.Renderer(fmt, d.text_key, enc.tokenizer)
        n = len(ds)
        if n == 0:
            raise DataError(f"[data] path: {path}: no records")
        held = np.zeros(n, dtype=bool)
        # Too few records to hold out whole ones (one .txt document): hold out packed windows instead.
        by_windows = bool(d.eval_fraction) and n - max(1, round(n * d.eval_fraction)) < 1
        if d.eval_fraction and not by_windows:
            k = max(1, round(n * d.eval_fraction))
            held[np.random.default_rng(seed).permutation(n)[:k]] = True
            evalw = _Writer(out, "eval", dtype)
        log(f"data: tokenizing {path} ({n} records, format {fmt}) with {enc.name}")
        _tokenize_into(ds, renderer, enc, where, path.name, log, lambda i: evalw if held[i] else train)
        eval_fmt = None
        if d.eval_path:
            eds, epath, ewhere = corpus.load_records(d.eval_path, "eval_path", d.text_key, scratch / "hf",
                                                     d.text_split)
            eval_fmt = corpus.detect_format(eds.column_names, d.text_key, str(epath))
            if len(eds) == 0:
                raise DataError(f"[data] eval_path: {epath}: no records")
            evalw = _Writer(out, "eval", dtype)
            _tokenize_into(eds, corpus.Renderer(eval_fmt, d.text_key, enc.tokenizer), enc, ewhere,
                           epath.name, log, lambda i: evalw)
        splits = {"train": train.close(), **({"eval": evalw.close()} if evalw else {})}
        if by_windows:
            splits = _hold_out_windows(out, splits["train"], dtype, d, path)
        meta = {
            "version": FORMAT_VERSION, "source": str(path), "format": fmt, "eval_format": eval_fmt or fmt,
            "eval_split": "windows" if by_windows else "file" if d.eval_path else "records" if evalw else "",
            "data_sha256": content_hash(path), "records": n,       # what a checkpoint records of its data
            "tokenizer": enc.name, "template": renderer.template_name, "dtype": dtype.name,
            "seq_len": d.seq_len, "text_split": d.text_split if path.suffix.lower() == ".txt" else "",
            "splits": splits,
        }
        (out / META).write_text(json.dumps(meta, indent=1))
        try:
            os.rename(out, folder)
        except OSError:
            if not (folder / META).is_file():   # another machine sharing the folder won the race
                raise
        log(f"data: token cache written to {folder}")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _hold_out_windows(out: Path, train: dict, dtype, d, path: Path) -> dict:
    """The last data.eval_fraction of the packed windows (at least one) as the eval split: the train
    files are cut where they begin. For a file of too few records to hold out whole ones."""
    S, T = d.seq_len, train["tokens"]
    windows = (T - 1) // S if T > 1 else 0
    k = max(1, round(windows * d.eval_fraction))
    if windows - k < 1:
        raise DataError(f"[data] eval_fraction: {path}: {train['records']} record(s), {T} tokens make {windows} "
                        f"window(s) of {S + 1} tokens, too few to hold out {d.eval_fraction} of them and train on "
                        f"the rest; add data, lower data.seq_len, or set data.eval_fraction = 0")
    cut = (windows - k) * S + 1
    splits = {}
    for name, lo, hi in (("eval", cut, T), ("train", 0, cut)):
        ids = np.fromfile(out / "train.ids", dtype=dtype)[lo:hi]
        flags = np.fromfile(out / "train.flags", dtype=np.uint8)[lo:hi]
        ids.tofile(out / f"{name}.ids")
        flags.tofile(out / f"{name}.flags")
        splits[name] = {"records": train["records"] if name == "train" else 0, "tokens": int(hi - lo),
                        "loss_tokens": int((flags & corpus.LOSS).astype(bool).sum())}
        if name == "eval":
            splits[name]["windows"] = k
    return splits


def _tokenize_into(ds, renderer, enc, where, name: str, log, writer_of) -> None:
    n = len(ds)
    shown = -1
    tokens = 0
    for i, ids, flags in corpus.tokenize_records(enumerate(ds), renderer, enc, where):
        if int(ids.max()) >= 1 << (8 * writer_of(i).dtype.itemsize):
            raise DataError(f"{where(i)}: token id {int(ids.max())} does not fit the cache's {writer_of(i).dtype}")
        writer_of(i).add(ids, flags)
        tokens += len(ids)
        tenth = (i + 1) * 10 // n
        if tenth != shown:
            shown = tenth
            log(f"data: {name} [{'#' * tenth}{'.' * (10 - tenth)}] {tenth * 10:3d}% "
                f"{i + 1}/{n} records, {tokens} tokens")
