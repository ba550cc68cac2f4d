"""Which code the planner was calibrated on: a hash of the backend sources that decide how much memory
a run takes, stored beside the calibration data (benchmarks/data/plan_calibration_issue16.json).

The files, and why each one counts:
  backends/engine/fsdp.py        what FSDP2 shards, keeps gathered, prefetches; where optimizer states live
  backends/engine/fsdp_engine.py  the FSDP2 step: gradient sync per micro-batch, the host step, the save
  backends/engine/deepspeed.py   how the ZeRO engine is built (zero.Init, z3 leaf modules, offload wiring)
  backends/engine/ds_engine.py   deepspeed.initialize and the ZeRO step
  backends/model/modeling.py    how the model is built and which modules are gathered whole; the chunked loss
  backends/offload/host_copy.py     FSDP2's host side: compute copy, device grad norm, host step buffers
  backends/offload/pinned_arena.py  one pinned host arena for FSDP2's offloaded states (host RAM, rounding)
  backends/optim/master_update.py the master update (bf16 master rounding: extra buffers on the host)
  backends/engine/fsdp_step.py   the step's extra buffers (clip, fp16 scaler)
  backends/rank/common.py      the memory cap (set_per_process_memory_fraction) and the device setup
  ds_json/export.py       the ds_config DeepSpeed receives (buckets, reuse distance, pinning)
The hash is over each file's tokens without comments, blank lines and docstrings: the same on every
Python (3.11 here, 3.12 on the GPU machine; ast.dump and ast.unparse differ between them), so a comment
or docstring edit does not ask for a new calibration, while any change of code does. tests/test_plan.py fails
when the hash of today's files differs from the calibration's, and names the files that changed.
Standard library only."""

from __future__ import annotations

import hashlib
import io
import tokenize
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1]

MEMORY_SOURCES = ("backends/engine/fsdp.py", "backends/engine/fsdp_engine.py", "backends/engine/deepspeed.py",
                  "backends/engine/ds_engine.py", "backends/model/modeling.py", "backends/offload/host_copy.py",
                  "backends/offload/pinned_arena.py", "backends/optim/master_update.py", "backends/engine/fsdp_step.py",
                  "backends/engine/fsdp_checkpoint.py", "backends/engine/fsdp_update.py", "backends/rank/common.py",
                  "ds_json/export.py")

CALIBRATION_FILE = PACKAGE.parent / "benchmarks" / "data" / "plan_calibration_issue16.json"


_SKIP = {tokenize.COMMENT, tokenize.NL, tokenize.ENCODING, tokenize.ENDMARKER}
_BREAK = {"NEWLINE", "INDENT", "DEDENT", None}


def _tokens(text: str) -> list[tuple[str, str]]:
    """The file's tokens without comments and blank lines, an f-string one STRING token on every
    Python (3.12 splits it into parts), and without string statements (docstrings)."""
    lines = text.splitlines(keepends=True)
    starts = [0]
    for line in lines:
        starts.append(starts[-1] + len(line))
    out: list[tuple[str, str]] = []
    fstart = None
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        name = tokenize.tok_name[tok.type]
        if name == "FSTRING_START":
            fstart = fstart or tok.start
            continue
        if fstart is not None:
            if name == "FSTRING_END":
                a = starts[fstart[0] - 1] + fstart[1]
                b = starts[tok.end[0] - 1] + tok.end[1]
                out.append(("STRING", text[a:b]))
                fstart = None
            continue
        if tok.type in _SKIP:
            continue
        out.append((name, tok.string if name not in ("INDENT", "DEDENT", "NEWLINE") else ""))
    kept: list[tuple[str, str]] = []
    for k, (name, string) in enumerate(out):
        prev = kept[-1][0] if kept else None
        nxt = out[k + 1][0] if k + 1 < len(out) else None
        if name == "STRING" and prev in _BREAK and nxt in ("NEWLINE", None):
            continue
        kept.append((name, string))
    return _without_imports(kept)


def _without_imports(tokens: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """The tokens less every import statement: where a module is imported from decides no memory, so
    moving a module to another package does not stale the calibration."""
    out: list[tuple[str, str]] = []
    skipping = False
    for name, string in tokens:
        if skipping:
            skipping = name != "NEWLINE"
            continue
        if name == "NAME" and string in ("import", "from") and (not out or out[-1][0] in _BREAK):
            skipping = True
            continue
        out.append((name, string))
    return out


def file_hash(rel: str, root: Path = PACKAGE) -> str:
    """The hash of one source's code (comments, blank lines and docstrings left out); "missing" if it
    is gone."""
    try:
        text = (root / rel).read_text()
    except FileNotFoundError:
        return "missing"
    return hashlib.sha256("\x1f".join(f"{n}:{s}" for n, s in _tokens(text)).encode()).hexdigest()[:16]


def code_version(root: Path = PACKAGE) -> dict[str, object]:
    """{"hash": one hash over every file, "files": {file: its hash}}."""
    files = {rel: file_hash(rel, root) for rel in MEMORY_SOURCES}
    whole = hashlib.sha256("".join(f"{k}={v};" for k, v in files.items()).encode()).hexdigest()[:16]
    return {"hash": whole, "files": files}


def changed_since(recorded: dict[str, object], root: Path = PACKAGE) -> list[str]:
    """The memory-relevant files whose code differs from what the calibration recorded."""
    now = code_version(root)["files"]
    old = recorded.get("files") or {}
    assert isinstance(now, dict) and isinstance(old, dict)
    return [f for f in sorted(set(now) | set(old)) if now.get(f) != old.get(f)]
