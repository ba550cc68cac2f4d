"""The doctor's saved P2P verdict, read by every launch on this machine (launch_command.launch_env).

Standard library only (user_folders aside): a launch must not import torch to read one JSON file.
`shardconsole doctor` writes doctor.json in the cache folder ($SHARDCONSOLE_CACHE_DIR, else the per-user
cache, as the token cache) after its all-reduce with and without P2P; a launch whose host matches and
whose verdict says P2P is broken sets NCCL_P2P_DISABLE=1, and rank 0 says so in the stream.
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

from shardconsole.user_folders import cache_dir

VERDICT_FILE = "doctor.json"
P2P_NOTE_ENV = "SHARDCONSOLE_P2P_NOTE"   # why NCCL_P2P_DISABLE=1 was set, for rank 0 to announce


def saved_verdict() -> dict | None:
    try:
        body = json.loads((cache_dir() / VERDICT_FILE).read_text())
    except (OSError, ValueError):
        return None
    return body if isinstance(body, dict) else None


def p2p_broken_here() -> str:
    """Why NCCL's P2P must be off on this machine ("" when the doctor found it working or never ran here)."""
    v = saved_verdict()
    if not v or v.get("host") != socket.gethostname() or v.get("p2p_broken") is not True:
        return ""
    when = time.strftime("%Y-%m-%d %H:%M", time.localtime(float(v.get("t") or 0)))
    return (f"NCCL_P2P_DISABLE=1 set for this run: `shardconsole doctor` found peer-to-peer broken on this "
            f"machine on {when} ({v.get('detail', '')}); run the doctor again after a driver or BIOS change")


def save_verdict(uuids: list[str], broken: bool, detail: str) -> Path:
    path = cache_dir() / VERDICT_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"host": socket.gethostname(), "gpus": uuids, "p2p_broken": broken,
                               "detail": detail, "t": time.time()}))
    os.replace(tmp, path)
    return path
