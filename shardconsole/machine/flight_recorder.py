"""Which collective each rank of a hung run is in: torch's flight recorder, asked for on a hang.

torch keeps a ring buffer of every collective a process group issued (TORCH_FR_BUFFER_SIZE, older
releases TORCH_NCCL_TRACE_BUFFER_SIZE, which newer ones still read but warn about in every rank's log:
launch_command.child_env sets the one the installed torch reads, `buffer_env_var`; gloo and NCCL alike
in torch 2.13). Python stacks say "rank 0 waits in a collective"; the recorder says which one (all_reduce #57
of the default group, its sizes) and that rank 1 never entered it (its last one is #56).

How it is asked for: the hang diagnosis (diagnose.where_ranks_are) writes the request file in the run's
logs folder next to its SIGUSR1 for the stacks; each rank has a daemon thread (`serve`, started at the
rank's start) that notices the request within half a second, even while its main thread is blocked in
a collective (torch releases the GIL there), and writes its buffer as JSON to logs/rank<N>.collectives.json.
Standard library only: the front end reads the dumps, the ranks pass in torch's dump function.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Callable
from pathlib import Path

BUFFER_ENTRIES = "2000"
ENV_VARS = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")      # the new name, the old one
# Where torch's C++ side reads the variable (getCvarInt over the names, the first one current): the
# header ships with the wheel, so the name is known without importing torch (seconds, in a front end).
_FR_HEADER = ("include", "torch", "csrc", "distributed", "c10d", "FlightRecorder.hpp")
REQUEST_FILE = "collectives.request"


def buffer_env_var(torch_dir: Path | None = None) -> str:
    """The buffer-size variable the installed torch reads without a deprecation warning: the new name
    where its FlightRecorder.hpp names it, else the old one (torch before the rename; no torch here)."""
    if torch_dir is None:
        import importlib.util
        spec = importlib.util.find_spec("torch")      # finds the package without running it
        locations = list(spec.submodule_search_locations or []) if spec else []
        torch_dir = Path(locations[0]) if locations else None
    try:
        header = torch_dir.joinpath(*_FR_HEADER).read_text(errors="replace") if torch_dir else ""
    except OSError:
        header = ""
    return ENV_VARS[0] if f'"{ENV_VARS[0]}"' in header else ENV_VARS[1]


def dump_path(logs: Path, rank: int) -> Path:
    return logs / f"rank{rank}.collectives.json"


def serve(logs: Path, rank: int, dump: Callable[[], bytes], every_s: float = 0.5) -> threading.Thread:
    """Start the rank's daemon thread that answers dump requests."""
    request = logs / REQUEST_FILE

    def loop() -> None:
        seen = _mtime(request)
        stop = threading.Event()
        while not stop.wait(every_s):
            now = _mtime(request)
            if now is None or now == seen:
                continue
            seen = now
            try:
                data = dump()
            except Exception as e:   # no recorder in this build, a group torn down: say so in the dump
                data = json.dumps({"error": f"{type(e).__name__}: {e}"}).encode()
            out = dump_path(logs, rank)
            tmp = out.with_suffix(".tmp")
            try:
                tmp.write_bytes(data)
                os.replace(tmp, out)
            except OSError:
                pass

    t = threading.Thread(target=loop, name="flight-recorder", daemon=True)
    t.start()
    return t


def _mtime(p: Path) -> int | None:
    try:
        return p.stat().st_mtime_ns
    except OSError:
        return None


def request(logs: Path) -> float:
    """Ask every rank for a dump; returns the time asked (dumps older than that are stale)."""
    import time
    asked = time.time()
    try:
        (logs / REQUEST_FILE).write_text(f"{asked}\n")
    except OSError:
        pass
    return asked


def read(logs: Path, rank: int, since: float) -> list[dict] | None:
    """The rank's collectives (oldest first) from a dump written after `since`; None when there is none."""
    p = dump_path(logs, rank)
    try:
        if p.stat().st_mtime < since - 1.0:
            return None
        body = json.loads(p.read_text(errors="replace"))
    except (OSError, ValueError):
        return None
    entries = body.get("entries") if isinstance(body, dict) else None
    return [e for e in entries if isinstance(e, dict)] if isinstance(entries, list) else None


def _name(e: dict) -> str:
    group = e.get("process_group")
    group = group[1] if isinstance(group, list) and len(group) > 1 else "?"
    sizes = e.get("input_sizes") or []
    size = f", sizes {sizes[:2]}{'…' if len(sizes) > 2 else ''}" if sizes else ""
    return f"{e.get('profiling_name', '?')} #{e.get('collective_seq_id', '?')} of {group}{size}"


def _pending(e: dict) -> bool:
    # NCCL's watchdog moves an entry to "completed"; gloo leaves state "scheduled" and marks finished work
    # retired: an entry neither completed nor retired has not finished on this rank.
    return e.get("state") != "completed" and not e.get("retired", False) and not e.get("is_p2p", False)


def _group(e: dict) -> str:
    g = e.get("process_group")
    return str(g[0]) if isinstance(g, list) and g else "?"


def where(entries: list[dict]) -> tuple[str, tuple[str, int] | None]:
    """(what this rank is in or last finished, (process group, sequence number) it waits in or None).
    Sequence numbers count per process group."""
    colls = [e for e in entries if not e.get("is_p2p", False)]
    if not colls:
        return "no collective recorded", None
    pending = [e for e in colls if _pending(e)]
    if pending:
        e = pending[0]
        return f"in {_name(e)} ({e.get('state', '')})", (_group(e), int(e.get("collective_seq_id") or 0))
    return f"not in a collective (last finished: {_name(colls[-1])})", None


def summary(dumps: dict[int, list[dict] | None]) -> str:
    """One line naming the collective each rank is stuck in, and the ranks that never entered it."""
    found = {r: where(e) for r, e in dumps.items() if e is not None}
    waiting = {r: gs for r, (_, gs) in found.items() if gs is not None}
    group, seq = min(waiting.values(), key=lambda gs: gs[1]) if waiting else ("", 0)
    parts, absent = [], []
    for rank in sorted(dumps):
        entries = dumps[rank]
        if entries is None:
            parts.append(f"rank {rank}: no flight recorder dump")
            continue
        text = found[rank][0]
        same = [x for x in entries if not x.get("is_p2p", False) and _group(x) == group]
        if waiting and rank not in waiting and all(int(x.get("collective_seq_id") or 0) < seq for x in same):
            absent.append(rank)
            if same:
                text = f"not in a collective (last finished in that group: {_name(same[-1])})"
        parts.append(f"rank {rank} {text}")
    if absent:
        parts.append(f"rank(s) {', '.join(map(str, absent))} never entered collective #{seq} "
                     f"(the others wait for them)")
    return "collectives: " + "; ".join(parts)
