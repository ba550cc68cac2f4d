"""One streaming pass over a text data file before launch: its encoding, every record's shape, one record
format for the whole file, and how many records it holds, each failure named by file and line.

The ranks apply the same rules as they tokenize (backends/data/corpus.py imports the format rules from here),
but a rank finds a bad line only after the launch, torch's import and the tokenizer load (50-100 s);
this pass finds it in about a second. Files past SCAN_BYTES are read up to there (the front ends must
stay quick on a 100 GB corpus); the ranks check the rest as they read. Standard library only.
"""

from __future__ import annotations

import codecs
import csv
import io
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, cast

FORMATS = ("text", "chat", "prompt_completion", "alpaca")
ROLES = ("system", "user", "assistant", "tool")
SHAREGPT_ROLES = {"human": "user", "gpt": "assistant", "system": "system", "user": "user",
                  "assistant": "assistant", "tool": "tool", "function_call": "assistant", "observation": "tool"}
TEXT_SPLITS = ("blank_line", "line", "file")
# Tokenizing: the longest text one tokenizer call gets, the text of records tokenized together, and
# what a fast tokenizer holds per character of a call (offsets, words, merges; 60 bytes measured with a
# byte-level BPE here, 200 with a 32k-vocabulary one on a 50 MB record: 9.9 GiB). The planner adds
# the product to the building rank's host memory before training.
TOKENIZE_CHUNK_CHARS = 1 << 16
TOKENIZE_BATCH_CHARS = 1 << 20
TOKENIZER_BYTES_PER_CHAR = 200
TOKENIZE_WORK_BYTES = TOKENIZE_BATCH_CHARS * TOKENIZER_BYTES_PER_CHAR
# A pass over this much of a file takes about a second here (json.loads per line, 2 cores).
SCAN_BYTES = 64 << 20
_SPLIT_WORDS = {"blank_line": "one record per block of lines between blank lines",
                "line": "one record per non-empty line", "file": "the whole file as one record"}


class ScanError(ValueError):
    """One line: "file:line: what is wrong" (or "file: ..." for the whole file)."""


@dataclass
class Scan:
    records: int = 0
    formats: dict[str, str] = field(default_factory=dict)    # format -> where its first record is
    complete: bool = True          # False: only the first SCAN_BYTES were read
    split: str = ""                # a .txt file: how it became records, in words
    notes: list[str] = field(default_factory=list)     # warnings for the launch to print (pairs alike)
    # Another record rule in place of the SFT formats' (settings/data/pair_records.check for preference records)
    check: Callable[[dict[str, Any], str], None] | None = field(default=None, repr=False, compare=False)

    @property
    def format(self) -> str:
        return next(iter(self.formats), "")


def format_of(columns: Any, text_key: str) -> str | None:
    """The record format its columns (or a record's keys) name, in the ranks' order; None: none."""
    cols = set(columns)
    if "messages" in cols or "conversations" in cols:
        return "chat"
    if {"prompt", "completion"} <= cols:
        return "prompt_completion"
    if {"instruction", "output"} <= cols:
        return "alpaca"
    if text_key in cols:
        return "text"
    return None


def no_format(columns: Any, text_key: str, where: str) -> str:
    # chosen and rejected: preference pairs (pair_records.PAIR_FIELDS, which imports this module), not SFT
    # records; the user most likely meant a preference objective, so the line says which setting
    pairs = ("; these are preference pairs (chosen / rejected): train on them with train.objective=dpo "
             "(or orpo)") if {"chosen", "rejected"} <= set(columns) else ""
    return (f"{where}: no known record format in the columns {sorted(columns)}: expected {text_key!r} "
            f"(text, data.text_key), 'messages' (chat), 'prompt' and 'completion', or 'instruction' and "
            f"'output' (alpaca){pairs}")


def turns(raw: Any, where: str) -> list[dict[str, str]]:
    """A chat record's `messages` or `conversations` as [{role, content}]. A string is read as JSON (a CSV
    cell can hold only text: a `messages` column of JSON strings is the usual way to put chats in one)."""
    field_name, value = raw
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except (json.JSONDecodeError, RecursionError) as e:
            raise ScanError(f"{where}: field {field_name!r}: a string that is not JSON ({getattr(e, 'msg', e)}); "
                            f"it must be a list of turns, or a JSON string of one") from None
    if not isinstance(value, list) or not value:
        raise ScanError(f"{where}: field {field_name!r}: expected a non-empty list of turns")
    out = []
    for j, m in enumerate(value):
        if not isinstance(m, dict):
            raise ScanError(f"{where}: field {field_name!r}[{j}]: expected an object with role and content")
        if field_name == "conversations" and "from" in m:
            role, content = SHAREGPT_ROLES.get(cast(Any, m.get("from"))), m.get("value")     # any JSON value
        else:
            role, content = m.get("role"), m.get("content")
        if role not in ROLES:
            raise ScanError(f"{where}: field {field_name!r}[{j}].role: {role!r}; use one of {', '.join(ROLES)}")
        if not isinstance(content, str):
            raise ScanError(f"{where}: field {field_name!r}[{j}].content: expected a string, got "
                            f"{type(content).__name__}")
        out.append({"role": role, "content": content})
    if not any(m["role"] == "assistant" for m in out):
        raise ScanError(f"{where}: field {field_name!r}: no assistant turn, so no token would be under loss")
    return out


def chat_field(rec: dict[str, Any]) -> tuple[str, Any]:
    name = "messages" if rec.get("messages") is not None else "conversations"
    return name, rec.get(name)


def string(rec: dict[str, Any], name: str, where: str) -> str:
    v = rec.get(name)
    if not isinstance(v, str):
        what = "missing" if v is None else f"expected a string, got {type(v).__name__}"
        raise ScanError(f"{where}: field {name!r}: {what}")
    return v


def check_record(rec: dict[str, Any], fmt: str, text_key: str, where: str) -> None:
    """The fields the ranks read from a record of this format have the types they need."""
    if fmt == "text":
        string(rec, text_key, where)
    elif fmt == "prompt_completion":
        string(rec, "prompt", where)
        string(rec, "completion", where)
    elif fmt == "alpaca":
        string(rec, "instruction", where)
        string(rec, "output", where)
        inp = rec.get("input")
        if inp is not None and not isinstance(inp, str):
            raise ScanError(f"{where}: field 'input': expected a string, got {type(inp).__name__}")
    else:
        turns(chat_field(rec), where)


def scan(path: Path, kind: str, text_key: str, text_split: str = "blank_line",
         budget_bytes: int | None = SCAN_BYTES, check: Callable[[dict[str, Any], str], None] | None = None) -> Scan:
    """Read the file's records (up to budget_bytes; None: all) and check each. ScanError names the first
    problem by file and line; a file of no records is one. `check`: the rule each record must pass
    instead of the SFT formats' (preference records)."""
    with path.open("rb") as raw:
        lines = _decoded_lines(raw, path, budget_bytes)
        out = Scan(check=check)
        if kind == "text":
            _scan_text(lines, out, text_split)
        elif kind == "csv":
            _scan_csv(lines, path, out, text_key)
        else:
            _scan_json(lines, path, out, text_key)
        out.complete = not lines.truncated
    if out.records == 0 and out.complete:
        what = {"text": "no text (only blank lines)", "csv": "a header and no rows"}.get(kind, "no records")
        raise ScanError(f"{path}: {what}: there is nothing to train on")
    return out


class _Lines:
    """The file's lines as text, checked as UTF-8 (and free of NUL) while they stream by."""

    def __init__(self, raw: io.BufferedReader, path: Path, budget_bytes: int | None) -> None:
        self.raw, self.path, self.budget = raw, path, budget_bytes
        self.truncated = False
        self.number = 0

    def __iter__(self) -> Iterator[str]:
        decoder = codecs.getincrementaldecoder("utf-8")()
        read = 0
        for self.number, line in enumerate(self.raw, 1):
            read += len(line)
            if b"\x00" in line:
                raise ScanError(f"{self.path}:{self.number}: not a text file (it holds NUL bytes); for token "
                                f"ids use data.source = \"tokens\"")
            try:
                text = decoder.decode(line)
            except UnicodeDecodeError as e:
                raise ScanError(f"{self.path}:{self.number}: not UTF-8 text (byte {e.start} of the line, "
                                f"{read - len(line) + e.start} of the file)") from None
            yield text
            if self.budget is not None and read >= self.budget:
                self.truncated = self.raw.read(1) != b""
                return
        try:
            decoder.decode(b"", final=True)
        except UnicodeDecodeError:
            raise ScanError(f"{self.path}:{self.number}: not UTF-8 text (the file ends inside a character)") from None


def _decoded_lines(raw: io.BufferedReader, path: Path, budget_bytes: int | None) -> _Lines:
    return _Lines(raw, path, budget_bytes)


def text_records(lines: Iterator[str], text_split: str) -> Iterator[str]:
    """A .txt file's records, the one rule for the scan and the ranks: blank_line, each block of lines
    between lines that are empty or only spaces; line, each line that is not blank; file, the whole
    file. Line breaks inside a record are kept, the one that ends it is not; blank records are none."""
    if text_split == "file":
        whole = "".join(lines)
        if whole.strip():
            yield whole.rstrip("\r\n")
        return
    block: list[str] = []
    for line in lines:
        if not line.strip():
            if block:
                yield "".join(block).rstrip("\r\n")
                block = []
            continue
        if text_split == "line":
            yield line.rstrip("\r\n")
        else:
            block.append(line)
    if block:
        yield "".join(block).rstrip("\r\n")


def _scan_text(lines: _Lines, out: Scan, text_split: str) -> None:
    out.split = _SPLIT_WORDS.get(text_split, text_split)
    out.formats["text"] = "line 1"
    for _ in text_records(iter(lines), text_split):
        out.records += 1


def _scan_json(lines: _Lines, path: Path, out: Scan, text_key: str) -> None:
    it = iter(lines)
    first = ""
    for first in it:
        if first.strip():
            break
    if first.lstrip().startswith("["):       # one JSON array: read whole (json has no streaming reader)
        text = first + "".join(it)
        if lines.truncated:
            return                             # past the budget: the ranks read it
        try:
            records = json.loads(text)
        except (json.JSONDecodeError, RecursionError) as e:
            raise ScanError(f"{path}:{getattr(e, 'lineno', '?')}: not valid JSON ({getattr(e, 'msg', 'nested too deep')})") from None
        if not isinstance(records, list):
            raise ScanError(f"{path}: expected a JSON array of records")
        for i, rec in enumerate(records):
            _record(rec, f"{path}: record {i + 1}", out, text_key)
        return
    number = lines.number
    for line in ([first] if first.strip() else []):
        _json_line(line, f"{path}:{number}", out, text_key)
    for line in it:
        if line.strip():
            _json_line(line, f"{path}:{lines.number}", out, text_key)


def _json_line(line: str, where: str, out: Scan, text_key: str) -> None:
    try:
        rec = json.loads(line)
    except json.JSONDecodeError as e:
        raise ScanError(f"{where}: not valid JSON ({e.msg}, column {e.colno})") from None
    except RecursionError:
        # datasets' reader would crash the rank on it (a segfault in its C parser), not say so
        raise ScanError(f"{where}: a record nested too deep to read (thousands of levels)") from None
    if not isinstance(rec, dict):
        raise ScanError(f"{where}: not a JSON object (a .jsonl file holds one per line)")
    _record(rec, where, out, text_key)


def _record(rec: Any, where: str, out: Scan, text_key: str) -> None:
    if not isinstance(rec, dict):
        raise ScanError(f"{where}: not a JSON object")
    if out.check is not None:
        out.check(rec, where)
        out.formats.setdefault("preference", where)
        out.records += 1
        return
    fmt = format_of([k for k, v in rec.items() if v is not None], text_key)
    if fmt is None:
        raise ScanError(no_format(rec, text_key, where))
    if fmt not in out.formats:
        if out.formats:
            known, at = next(iter(out.formats.items()))
            raise ScanError(f"{where}: a {fmt} record in a file of {known} records ({at} is {known}): mixed "
                            f"record formats; keep one format per file (split it, or convert the records)")
        out.formats[fmt] = where
    check_record(rec, fmt, text_key, where)
    out.records += 1


def _scan_csv(lines: _Lines, path: Path, out: Scan, text_key: str) -> None:
    reader = csv.reader(lines)
    try:
        header = next(reader)
    except StopIteration:
        return
    except csv.Error as e:
        raise ScanError(f"{path}:1: not CSV ({e})") from None
    fmt = "preference" if out.check is not None else format_of(header, text_key)
    if fmt is None:
        raise ScanError(no_format(header, text_key, f"{path}:1 (the header)"))
    out.formats[fmt] = f"{path}:1"
    try:
        for row in reader:
            if not row:
                continue
            where = f"{path}:{lines.number}"
            if len(row) != len(header):
                raise ScanError(f"{where}: {len(row)} fields, the header has {len(header)}")
            rec = {k: (v if v != "" or k in (text_key, "prompt", "completion", "output") else None)
                   for k, v in zip(header, row)}
            (out.check or (lambda rec, where: check_record(rec, fmt, text_key, where)))(rec, where)
            out.records += 1
    except csv.Error as e:
        raise ScanError(f"{path}:{lines.number}: not CSV ({e})") from None
