"""Which code the planner was calibrated on: a hash of the backend sources that decide how much memory
a run takes, stored beside the calibration data (benchmarks/data/plan_calibration_issue16.json).

The files, and why each one counts:
  backends/fsdp.py        what FSDP2 shards, keeps gathered, prefetches; where optimizer states live
  backends/deepspeed.py   how the ZeRO engine is built (zero.Init, z3 leaf modules, offload wiring)
  backends/modeling.py    how the model is built and which modules are gathered whole; the chunked loss
  backends/offload.py     FSDP2's host side: compute copy, device grad norm, host step buffers
  backends/pinned_arena.py  one pinned host arena for FSDP2's offloaded states (host RAM, rounding)
  backends/master_update.py the master update (bf16 master rounding: extra buffers on the host)
  backends/fsdp_step.py   the step's extra buffers (clip, fp16 scaler)
  backends/common.py      the memory cap (set_per_process_memory_fraction) and the device setup
  ds_json/export.py       the ds_config DeepSpeed receives (buckets, reuse distance, pinning)
The hash is over each file's syntax tree without docstrings (ast.dump), so a comment or docstring
edit does not ask for a new calibration, while any change of code does. tests/test_plan.py fails
when the hash of today's files differs from the calibration's, and names the files that changed.
Standard library only."""

from __future__ import annotations

import ast
import hashlib
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1]

MEMORY_SOURCES = ("backends/fsdp.py", "backends/deepspeed.py", "backends/modeling.py", "backends/offload.py",
                  "backends/pinned_arena.py", "backends/master_update.py", "backends/fsdp_step.py",
                  "backends/common.py", "ds_json/export.py")

CALIBRATION_FILE = PACKAGE.parent / "benchmarks" / "data" / "plan_calibration_issue16.json"


def _strip_docstrings(tree: ast.AST) -> ast.AST:
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if (isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and body
                and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
                and isinstance(body[0].value.value, str)):
            node.body = body[1:] or [ast.Pass()]
    return tree


def file_hash(rel: str, root: Path = PACKAGE) -> str:
    """The hash of one source's code (comments and docstrings left out); "missing" if it is gone."""
    path = root / rel
    try:
        tree = ast.parse(path.read_text(), filename=str(path))
    except FileNotFoundError:
        return "missing"
    return hashlib.sha256(ast.dump(_strip_docstrings(tree)).encode()).hexdigest()[:16]


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
