"""Every environment variable shardconsole reads, and the one checked reader they all go through.

A variable is read with `read(name)` (its typed value, its default when unset or blank) anywhere: the
front ends, the planner, the launcher, the ranks (backends/rank/knobs.py). `check(env)` reads them all:
the command line calls it before it does anything, so a value the ranks or torchrun cannot use is one line
naming the variable, its value and what is allowed, exit 2, before a launch: the ranks then never meet
one. docs/ENVIRONMENT.md documents the same names (tests/test_envvars.py holds the two equal).

Standard library only, and at the package's top: the machine's readings, the settings, the planner and
the ranks all import it, and it imports none of them.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping


class EnvError(ValueError):
    """An environment variable with a value shardconsole cannot use; str() is the one line to show."""


@dataclass(frozen=True)
class Var:
    name: str
    parse: Callable[[str], Any]    # the raw text (stripped, non-empty) -> the value; ValueError when unusable
    allowed: str                   # what a refusal says is allowed
    default: Any = None
    front: bool = True             # checked by the front end before launch (False: the launcher sets it)


def _number(lo: float, hi: float = math.inf, whole: bool = False, above: bool = False) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        value: Any = int(text) if whole else float(text)
        # nan and inf parse as floats; neither is a count of seconds or GB/s
        if not math.isfinite(value) or value > hi or (value <= lo if above else value < lo):
            raise ValueError(text)
        return value
    return parse


def _choice(*words: str) -> Callable[[str], str]:
    def parse(text: str) -> str:
        if text not in words:
            raise ValueError(text)
        return text
    return parse


def _flag(text: str) -> bool:
    return _choice("0", "1")(text) == "1"


def _ints(text: str) -> tuple[int, ...]:
    values = tuple(int(v) for v in text.split(",") if v.strip())
    if not values or min(values) < 1:
        raise ValueError(text)
    return values


def _span(text: str) -> tuple[int, int]:
    first, dash, last = text.partition("-")
    span = (int(first), int(last if dash else first))
    if not 1 <= span[0] <= span[1]:
        raise ValueError(text)
    return span


FAULT_KINDS = ("oom", "oom_load", "kill", "sleep", "nan", "overflow", "raise", "slow_save", "pace")
FAULT_KEYS = ("rank", "step", "ms")


def _faults(text: str) -> str:
    """The grammar of backends/rank/faults.py's parse, checked here (that module imports torch)."""
    for part in filter(None, (p.strip() for p in text.split(";"))):
        kind, _, args = part.partition("@")
        if kind.strip() not in FAULT_KINDS:
            raise ValueError(part)
        for item in filter(None, args.split(",")):
            key, eq, value = item.partition("=")
            if key.strip() not in FAULT_KEYS or not eq or int(value) < 0:
                raise ValueError(part)
    return text


def _text(text: str) -> str:
    return text


def _folder(text: str) -> Path:
    """A folder shardconsole writes in: one there, or a path where one can be made (its first existing
    parent a folder). /dev/null is neither: a rank writing its cache there failed mid-run."""
    path = Path(text).expanduser()
    try:
        at = _nearest(path)
    except OSError:
        return path      # another user's folder cannot be looked at: a command that needs it says so
    if not at.is_dir():
        raise ValueError(text)
    return path


def _nearest(path: Path) -> Path:
    """path, or its nearest parent that exists."""
    at = path
    while not at.exists() and at != at.parent:
        at = at.parent
    return at


def _file(text: str) -> Path:
    path = Path(text).expanduser()
    try:
        bad = path.is_dir() or (path.parent.exists() and not path.parent.is_dir())
    except OSError:
        return path      # as _folder
    if bad:
        raise ValueError(text)
    return path


_WHOLE = "a whole number 0 or more"
_FLAG = "1 or 0"
VARS: dict[str, Var] = {v.name: v for v in (
    # Where files go (front ends and ranks)
    Var("SHARDCONSOLE_RUNS_ROOT", _folder, "a folder (or a path where one can be made)"),
    Var("SHARDCONSOLE_PRESETS_DIR", _folder, "a folder (or a path where one can be made)"),
    # whether the ranks can write their token cache there is the launch's check (session/rundir.py)
    Var("SHARDCONSOLE_CACHE_DIR", _folder, "a folder (or a path where one can be made)"),
    Var("SHARDCONSOLE_SPEEDS_FILE", _file, "a file path whose parent is a folder"),
    # The planner
    Var("SHARDCONSOLE_HOST_GBPS", _number(0, above=True), "a number of GB/s above 0"),
    # Set by the launch for the ranks: a user's own value of these is theirs to get right, but torchrun and
    # the ranks read them as numbers, so a front end refuses a bad one (torchrun's own was a traceback)
    Var("RANK", _number(0, whole=True), _WHOLE, 0, front=False),
    Var("LOCAL_RANK", _number(0, whole=True), _WHOLE, 0, front=False),
    Var("WORLD_SIZE", _number(1, whole=True), "a whole number 1 or more", 1, front=False),
    Var("GROUP_RANK", _number(0, whole=True), _WHOLE, 0, front=False),
    Var("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", _number(0, whole=True), "a whole number of seconds 0 or more", 30),
    Var("SHARDCONSOLE_KILL_WAIT_S", _number(0), "a number of seconds 0 or more"),
    Var("SHARDCONSOLE_P2P_NOTE", _text, "any text", ""),
    # OpenMP's own form: a count, or counts per nesting level (4,2)
    Var("OMP_NUM_THREADS", _ints, "a whole number 1 or more (or N,M,... one a nesting level)"),
    Var("DS_ACCELERATOR", _choice("cpu", "cuda"), "cpu or cuda"),
    Var("SLURM_JOB_ID", _text, "any text", "", front=False),
    # Benchmarks and tests
    Var("SHARDCONSOLE_STREAM", _choice("on", "off"), "on or off", "on"),
    Var("SHARDCONSOLE_FAULT", _faults, f"kind@key=N,...;... with kinds {', '.join(FAULT_KINDS)} and keys "
                                       f"{', '.join(FAULT_KEYS)}", ""),
    Var("SHARDCONSOLE_PROFILE", _span, "steps A-B with 1 <= A <= B (or one step A)"),
    Var("SHARDCONSOLE_PHASE_TIMES", _flag, _FLAG, False),
    Var("SHARDCONSOLE_OFFLOAD_VIEW", _choice("on", "off"), "on or off", "on"),
    Var("SHARDCONSOLE_OVERLAP_THREADS", _ints, "N or N,M,... thread counts of 1 or more", ()),
    Var("SHARDCONSOLE_OVERLAP_NICE", _number(-20, 19, whole=True), "a whole number from -20 to 19", 10),
    Var("SHARDCONSOLE_OVERLAP_PIN", _flag, _FLAG, False),
    Var("SHARDCONSOLE_OVERLAP_SPIN", _flag, _FLAG, False),
    Var("SHARDCONSOLE_OVERLAP_SWITCH_S", _number(0), "a number of seconds 0 or more", 0.0),
    Var("SHARDCONSOLE_FP8_EMULATE", _flag, _FLAG, False),
    # Other tools' variables that shardconsole reads too
    Var("WANDB_MODE", _choice("online", "offline", "disabled", "dryrun", "run", "shared"),
        "online, offline, disabled, dryrun, run or shared", "offline"),
    Var("WANDB_PROJECT", _text, "any text"),
    Var("MLFLOW_TRACKING_URI", _text, "an MLflow tracking URI (file:, sqlite:, http(s):)"),
    Var("TORCH_EXTENSIONS_DIR", _folder, "a folder (or a path where one can be made)"),
    Var("TORCH_CUDA_ARCH_LIST", _text, "any text", ""),
)}


def read(name: str, env: Mapping[str, str] | None = None) -> Any:
    """The variable's value, checked: its default when unset or blank, else EnvError naming it."""
    var = VARS[name]
    raw = (os.environ if env is None else env).get(name, "")
    if not raw.strip():
        return var.default
    try:
        return var.parse(raw.strip())
    except ValueError:
        raise EnvError(f"environment variable {name}={raw!r}: expected {var.allowed}") from None


def check(env: Mapping[str, str] | None = None) -> None:
    """Every variable a user may set, read once: the first bad one is an EnvError (the front end's one
    line, exit 2). The launcher's own (RANK ...) are left out: torchrun sets them for each rank."""
    for var in VARS.values():
        if var.front:
            read(var.name, env)
