"""Summaries of ended runs kept between commands, so `shardconsole runs` does not re-read every stream.

One small JSON file per run folder under the user's cache (user_folders.run_summaries_dir), keyed by
the stream's size and modification time: a run that grows (a resume) is read again. Only ended runs are kept (finished, stopped, failed): a running run's status
comes from its processes, which a cache cannot know. Never raises: a cache that cannot be read or
written only costs the reading.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from shardconsole.user_folders import run_summaries_dir

VERSION = 3       # 2: a stopped run's step is the step it stopped and saved at; 3: a refused resume keeps the end before it
FIELDS = ("status", "cause", "detail", "step", "steps", "tokens_per_s", "mfu", "peak_gpu_bytes", "peak_host_bytes",
          "last_loss", "eval_loss", "loss", "eval", "throughput", "bad_lines")
KEPT = ("finished", "stopped", "failed")


def _key(metrics: Path) -> list[Any] | None:
    try:
        st = metrics.stat()
    except OSError:
        return None
    return [VERSION, str(metrics.resolve()), st.st_size, st.st_mtime_ns]


def _file(metrics: Path) -> Path:
    return run_summaries_dir() / (hashlib.sha1(str(metrics.resolve()).encode()).hexdigest()[:20] + ".json")


def load(metrics: Path) -> dict[str, Any] | None:
    key = _key(metrics)
    if key is None:
        return None
    try:
        data = json.loads(_file(metrics).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or data.get("key") != key or not isinstance(data.get("summary"), dict):
        return None
    return data["summary"]


def store(metrics: Path, summary: Any) -> None:
    if summary.status not in KEPT:
        return
    key = _key(metrics)
    if key is None:
        return
    body = {"key": key, "summary": {f: getattr(summary, f) for f in FIELDS}}
    target = _file(metrics)
    tmp = target.with_name(f"{target.name}.{os.getpid()}.tmp")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(body))
        os.replace(tmp, target)
    except OSError:
        try:
            tmp.unlink()
        except OSError:
            pass


def apply(summary: Any, cached: dict[str, Any]) -> bool:
    """The cached fields onto a summary; False when the cache holds something else than expected."""
    try:
        for f in FIELDS:
            value = cached[f]
            if f in ("loss", "eval", "throughput"):
                value = [(int(x), float(y)) for x, y in value]
            setattr(summary, f, value)
    except (KeyError, TypeError, ValueError):
        return False
    return True
