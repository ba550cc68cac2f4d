"""Records in: a local file or save_to_disk folder read through `datasets` (offline, never the Hub), its
record format detected, and each record turned into token ids with a per-token loss flag.

Formats (detected from the columns, in this order):
  chat               `messages`: a list of {role, content}, rendered by the tokenizer's chat template;
                     loss on the assistant turns only (their text and the template's end-of-turn marker).
                     ShareGPT's `conversations` ({from, value}; human/gpt) is read as chat too.
  prompt_completion  `prompt`, `completion`: loss on the completion only.
  alpaca             `instruction`, optional `input`, `output`: rendered as a two-turn chat (user: the
                     instruction, a blank line and the input; assistant: the output), loss on the output.
  text               data.text_key (default `text`): loss on every token. A .txt file is one record per
                     block of lines separated by a blank line.
Every record ends with the tokenizer's EOS (under loss when the record's last part is). A base model's
tokenizer without a chat template renders chats with PLAIN_TEMPLATE ("User: ...", "Assistant: ...").
Without a tokenizer (a catalog model, or a folder without tokenizer files) text is UTF-8 bytes and EOS
is byte 0 (NUL, which text files never hold).
"""

from __future__ import annotations

import errno
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np

from shardconsole.settings.data.data_check import locate
from shardconsole.backends.rank.errors import DataError, DiskFullError  # noqa: F401  (raised here; re-exported)
from shardconsole.settings.data.data_scan import FORMATS, ROLES, SHAREGPT_ROLES, ScanError  # noqa: F401 (re-exported)
from shardconsole.settings.data import data_scan
PLAIN_TEMPLATE_NAME = "shardconsole-plain"
PLAIN_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] | capitalize }}: {{ m['content'] }}\n\n{% endfor %}"
    "{% if add_generation_prompt %}Assistant: {% endif %}"
)
# Bits of the per-token flag array kept beside the token ids.
LOSS, DOC_START = 1, 2
BYTES_EOS = 0


# DataError lives in rank/errors.py (cause "config_error").


# ---------------------------------------------------------------------------------------------------
# Reading

def _text_dataset(path: Path, text_key: str, text_split: str, scratch: Path):
    """A .txt file's records split by data_scan.text_records (the rule the check before launch counts
    by), written to Arrow as they stream (a large file is never held in memory)."""
    import datasets

    def gen():
        with path.open(encoding="utf-8", newline="") as fh:
            for text in data_scan.text_records(fh, text_split):
                yield {text_key: text}
    features = datasets.Features({text_key: datasets.Value("string")})
    return datasets.Dataset.from_generator(gen, features=features, cache_dir=str(scratch / "txt"))


def _disk_full(e: BaseException) -> bool:
    """ENOSPC / EDQUOT anywhere in the exception's chain."""
    seen: BaseException | None = e
    for _ in range(16):
        if seen is None:
            return False
        if isinstance(seen, OSError) and seen.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def load_records(value: str, key: str, text_key: str, scratch: Path, text_split: str = "blank_line"):
    """The records of data.<key> as a datasets.Dataset, and a function naming where record i came from."""
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")    # runs never reach the network
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import datasets
    datasets.disable_progress_bars()
    path, kind = locate(value, key)
    where = record_where(path, kind)
    try:
        if kind == "saved":
            ds = datasets.load_from_disk(str(path))
            if isinstance(ds, datasets.DatasetDict):
                split = "train" if "train" in ds else (next(iter(ds)) if len(ds) == 1 else None)
                if split is None:
                    raise DataError(f"[data] {key}: {path}: a DatasetDict with splits {list(ds)} and no "
                                    f"'train': save the split to train on")
                ds = ds[split]
        elif kind == "text":
            ds = _text_dataset(path, text_key, text_split, scratch)
        else:
            ds = datasets.load_dataset(kind, data_files=str(path), split="train", cache_dir=str(scratch))
    except DataError:
        raise
    except Exception as e:
        if _disk_full(e):
            # the records are fine: `datasets` could not write its cache beside the token cache (it was called
            # "cannot read its records" of a full disk)
            full = DiskFullError(errno.ENOSPC, f"[data] {key}: the disk holding {scratch} is full: `datasets` could "
                                 f"not write its cache of {path} there")
            full.hint = "free space there, or set SHARDCONSOLE_CACHE_DIR to a folder on a larger disk; nothing was trained"
            raise full from None
        if kind in ("json", "csv", "text"):
            # `datasets` names no line (a bad JSON line, bytes that are not UTF-8): the scan finds it
            try:
                data_scan.scan(path, kind, text_key, text_split, budget_bytes=None)
            except ScanError as bad:
                raise DataError(f"[data] {key}: {bad}") from None
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        raise DataError(f"[data] {key}: {path}: cannot read its records: {first}") from None
    return ds, path, where


def record_where(path: Path, kind: str) -> Callable[[int], str]:
    """Record index -> "file:line" for JSON Lines (blank lines skipped), else "file: record N"."""
    if path.suffix.lower() == ".jsonl":
        lines: list[int] = []

        def at(i: int) -> str:
            if not lines:
                with path.open(encoding="utf-8", errors="replace") as fh:
                    lines.extend(n for n, line in enumerate(fh, 1) if line.strip())
            return f"{path}:{lines[i]}" if i < len(lines) else f"{path}: record {i + 1}"
        return at
    if kind == "csv":
        return lambda i: f"{path}: row {i + 1}"
    return lambda i: f"{path}: record {i + 1}"


def detect_format(columns: list[str], text_key: str, where: str) -> str:
    fmt = data_scan.format_of(columns, text_key)
    if fmt is None:
        raise DataError(data_scan.no_format(columns, text_key, where))
    return fmt


# ---------------------------------------------------------------------------------------------------
# Records to text segments (text, under loss)

class Renderer:
    """Record -> [(text, under_loss)], for one format, with a tokenizer's chat template or PLAIN_TEMPLATE."""

    def __init__(self, fmt: str, text_key: str, tokenizer) -> None:
        self.fmt, self.text_key, self.tok = fmt, text_key, tokenizer
        own = getattr(tokenizer, "chat_template", None) if tokenizer is not None else None
        self.template = own if isinstance(own, str) and own else PLAIN_TEMPLATE
        self.template_name = ("tokenizer's chat template" if self.template is own else PLAIN_TEMPLATE_NAME) \
            if fmt in ("chat", "alpaca") else ""
        self._jinja: Any = None       # jinja2's sandboxed Template, made on first use

    def _render(self, messages: list[dict], generation_prompt: bool) -> str:
        if self.tok is not None:
            return self.tok.apply_chat_template(messages, chat_template=self.template, tokenize=False,
                                                add_generation_prompt=generation_prompt)
        if self._jinja is None:
            from jinja2.sandbox import ImmutableSandboxedEnvironment
            self._jinja = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True).from_string(self.template)
        return self._jinja.render(messages=messages, add_generation_prompt=generation_prompt)

    def segments(self, rec: dict[str, Any], where: str) -> list[tuple[str, bool]]:
        try:
            return self._segments(rec, where)
        except ScanError as e:      # the field rules are data_scan's, shared with the check before launch
            raise DataError(str(e)) from None

    def _segments(self, rec: dict[str, Any], where: str) -> list[tuple[str, bool]]:
        if self.fmt == "text":
            return [(_string(rec, self.text_key, where), True)]
        if self.fmt == "prompt_completion":
            return [(_string(rec, "prompt", where), False), (_string(rec, "completion", where), True)]
        if self.fmt == "alpaca":
            inp = rec.get("input")
            if inp is not None and not isinstance(inp, str):
                raise DataError(f"{where}: field 'input': expected a string, got {type(inp).__name__}")
            user = _string(rec, "instruction", where) + (f"\n\n{inp}" if inp else "")
            return self.chat([{"role": "user", "content": user},
                              {"role": "assistant", "content": _string(rec, "output", where)}], where)
        return self.chat(_messages(rec, where), where)

    def chat(self, messages: list[dict], where: str) -> list[tuple[str, bool]]:
        """Render turn by turn: each turn's text is the growth of the rendered conversation, so the
        assistant's text and end-of-turn marker are under loss and the template's headers are not."""
        out: list[tuple[str, bool]] = []
        prev = ""
        try:
            for i, m in enumerate(messages):
                if m["role"] == "assistant":
                    head = self._render(messages[:i], True)
                    full = self._render(messages[:i + 1], False)
                    if not head.startswith(prev) or not full.startswith(head):
                        raise DataError(f"{where}: field 'messages': the chat template does not render this "
                                        f"conversation turn by turn, so the assistant's tokens cannot be found")
                    out += [(head[len(prev):], False), (full[len(head):], True)]
                else:
                    full = self._render(messages[:i + 1], False)
                    if not full.startswith(prev):
                        raise DataError(f"{where}: field 'messages': the chat template does not render this "
                                        f"conversation turn by turn, so the assistant's tokens cannot be found")
                    out.append((full[len(prev):], False))
                prev = full
        except DataError:
            raise
        except Exception as e:   # the template's own raise_exception, jinja errors
            raise DataError(f"{where}: field 'messages': the chat template fails on it: {str(e)[:160]}") from None
        return [s for s in out if s[0]]


def _string(rec: dict, field: str, where: str) -> str:
    return data_scan.string(rec, field, where)


def _messages(rec: dict, where: str) -> list[dict]:
    return data_scan.turns(data_scan.chat_field(rec), where)


# ---------------------------------------------------------------------------------------------------
# Segments to tokens

CHUNK_CHARS = data_scan.TOKENIZE_CHUNK_CHARS      # the longest text one tokenizer call gets
BATCH_CHARS = data_scan.TOKENIZE_BATCH_CHARS      # records are tokenized together up to this much text


def pieces(text: str, size: int) -> Iterator[str]:
    """text in pieces of about size characters, each cut just before a whitespace that follows a
    non-whitespace (a word boundary for byte-level BPE's and SentencePiece's pre-tokenizers alike); a
    stretch without one is cut at 2 * size."""
    start, n = 0, len(text)
    while n - start > size:
        cut = start + size
        while cut < min(n, start + 2 * size) and not (text[cut].isspace() and not text[cut - 1].isspace()):
            cut += 1
        yield text[start:cut]
        start = cut
    if start < n:
        yield text[start:]


@dataclass
class Encoder:
    """Text -> ids with the model folder's tokenizer, or UTF-8 bytes without one."""
    tokenizer: Any
    eos: int
    name: str

    def encode(self, texts: list[str]) -> list[list[int]]:
        if not texts:
            return []
        if self.tokenizer is None:
            return [list(t.encode("utf-8")) for t in texts]
        if all(len(t) <= CHUNK_CHARS for t in texts):    # a batch holds at most BATCH_CHARS of text
            return self.tokenizer(texts, add_special_tokens=False)["input_ids"]
        # A fast tokenizer holds offsets, words and merges per character of a call's text: one 50 MB
        # record took a rank to 9.9 GiB. Long texts go in pieces cut where a word starts, so the
        # pre-tokenizer sees the same words and the ids are those of the whole text.
        out: list[list[int]] = []
        for t in texts:
            ids: list[int] = []
            for piece in pieces(t, CHUNK_CHARS):
                ids += self.tokenizer([piece], add_special_tokens=False)["input_ids"][0]
            out.append(ids)
        return out


def load_encoder(model_path: str | None, has_tokenizer: bool, vocab: int) -> Encoder:
    """The model folder's tokenizer; a folder whose tokenizer files do not load is an error (never a
    silent fallback to bytes, issue 22 item 12)."""
    if model_path is not None and has_tokenizer:
        from shardconsole.settings import config as C
        from shardconsole.settings.data.data_check import check_tokenizer
        try:
            check_tokenizer(model_path, "rank")
        except C.ConfigError as e:
            raise DataError(str(e).removeprefix("rank: ")) from None
        from transformers import AutoTokenizer
        try:
            tok = AutoTokenizer.from_pretrained(model_path, local_files_only=True)
        except Exception as e:
            first = (str(e).strip().splitlines() or [type(e).__name__])[0][:160]
            raise DataError(f"[model] name: {model_path}: the tokenizer does not load ({first})") from None
        if tok.eos_token_id is None:
            raise DataError(f"[model] name: {model_path}: the tokenizer has no eos_token; every record ends "
                            f"with one (set eos_token in tokenizer_config.json)")
        if len(tok) > vocab:
            raise DataError(f"[model] name: {model_path}: the tokenizer has {len(tok)} tokens but the model's "
                            f"vocab_size is {vocab}")
        return Encoder(tok, int(tok.eos_token_id), f"{model_path} ({type(tok).__name__})")
    if vocab < 256:
        raise DataError(f"text data without a tokenizer is read as UTF-8 bytes, which needs vocab_size >= 256 "
                        f"(the model has {vocab})")
    return Encoder(None, BYTES_EOS, "bytes")


def tokenize_records(records: Iterator[tuple[int, dict]], renderer: Renderer, enc: Encoder, where,
                     chunk: int = 512) -> Iterator[tuple[int, np.ndarray, np.ndarray]]:
    """(record index, ids, flags) per record, tokenized a chunk of records at a time (the fast
    tokenizer batches). flags: LOSS on tokens a model should learn to predict, DOC_START on the first
    token of each record (never under loss: nothing in the record comes before it)."""
    batch: list[tuple[int, list[tuple[str, bool]]]] = []

    def flush():
        texts = [t for _, segs in batch for t, _ in segs]
        ids_iter = iter(enc.encode(texts))
        for i, segs in batch:
            ids: list[int] = []
            flags: list[int] = []
            for _, loss in segs:
                part = next(ids_iter)
                ids += part
                flags += [LOSS if loss else 0] * len(part)
            ids.append(enc.eos)
            flags.append(LOSS if segs and segs[-1][1] else 0)
            flags[0] = DOC_START
            yield i, np.asarray(ids, dtype=np.int64), np.asarray(flags, dtype=np.uint8)
        batch.clear()

    chars = 0
    for i, rec in records:
        segs = renderer.segments(rec, where(i))
        batch.append((i, segs))
        chars += sum(len(t) for t, _ in segs)
        if len(batch) >= chunk or chars >= BATCH_CHARS:
            yield from flush()
            chars = 0
    yield from flush()
