"""The environment variables that steer a rank, read once at its start into one typed, frozen object.

Every variable a rank reads is here (docs/ENVIRONMENT.md lists them with who sets them), so a knob is
found in one place and a wrong value is one line naming the variable, not a ValueError deep in a step.
The launcher's own (RANK, LOCAL_RANK, WORLD_SIZE, GROUP_RANK, TORCH_ELASTIC_SHUTDOWN_TIMEOUT) and
shardconsole's (SHARDCONSOLE_*) alike. Standard library only.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping

from shardconsole.machine.doctor_verdict import P2P_NOTE_ENV

HOST_NICE = 10      # the overlapped host step's nice value (offload/overlap.py says why)


class KnobError(ValueError):
    """An environment variable with a value the rank cannot use; the message names it."""


def _int(env: Mapping[str, str], name: str, default: int) -> int:
    raw = env.get(name, "").strip()
    if not raw:
        return default
    try:
        return int(raw)
    except ValueError:
        raise KnobError(f"environment variable {name}={raw!r}: expected a whole number") from None


def _float(env: Mapping[str, str], name: str, default: float | None) -> float | None:
    raw = env.get(name, "").strip()
    if not raw:
        return default
    try:
        return float(raw)
    except ValueError:
        raise KnobError(f"environment variable {name}={raw!r}: expected a number of seconds") from None


def _ints(env: Mapping[str, str], name: str) -> tuple[int, ...]:
    raw = env.get(name, "")
    try:
        return tuple(int(v) for v in raw.split(",") if v.strip())
    except ValueError:
        raise KnobError(f"environment variable {name}={raw!r}: expected N or N,M,... thread counts") from None


def _span(env: Mapping[str, str], name: str) -> tuple[int, int] | None:
    raw = env.get(name, "").strip()
    if not raw:
        return None
    first, dash, last = raw.partition("-")
    try:
        span = (int(first), int(last if dash else first))
    except ValueError:
        span = (0, -1)
    if not 1 <= span[0] <= span[1]:
        raise KnobError(f"environment variable {name}={raw!r}: expected steps A-B with 1 <= A <= B (or one step A)")
    return span


@dataclass(frozen=True)
class Knobs:
    # Set by the launcher (torchrun, the deepspeed launcher, Slurm's script)
    rank: int = 0                      # RANK
    local_rank: int = 0                # LOCAL_RANK
    world: int = 1                     # WORLD_SIZE
    node: int = 0                      # GROUP_RANK: torchrun's node rank; each node writes its own stream file
    launcher_grace_s: float = 30.0     # TORCH_ELASTIC_SHUTDOWN_TIMEOUT: torchrun's SIGTERM -> SIGKILL wait
    kill_wait_s: float | None = None   # SHARDCONSOLE_KILL_WAIT_S: Slurm's KillWait, exported by the sbatch script
    p2p_note: str = ""                 # SHARDCONSOLE_P2P_NOTE: why the launch turned NCCL's P2P off
    # Benchmarks' and tests' switches
    stream: bool = True                # SHARDCONSOLE_STREAM=off: no metrics written (benchmarks/gpu_runs.py --overhead)
    faults: str = ""                   # SHARDCONSOLE_FAULT: test faults (rank/faults.py)
    phase_times: bool = False          # SHARDCONSOLE_PHASE_TIMES=1: rank 0 logs each step's phases
    offload_view: bool = True          # SHARDCONSOLE_OFFLOAD_VIEW=off: no offload view (its cost measured)
    overlap_threads: tuple[int, ...] = ()   # SHARDCONSOLE_OVERLAP_THREADS=N[,M..]: the host step's threads
    overlap_pin: bool = False          # SHARDCONSOLE_OVERLAP_PIN=1: the host thread on the last cores
    overlap_spin: bool = False         # SHARDCONSOLE_OVERLAP_SPIN=1: the main thread polls the host step
    overlap_switch_s: float = 0.0      # SHARDCONSOLE_OVERLAP_SWITCH_S: the interpreter's GIL switch interval
    overlap_nice: int = HOST_NICE      # SHARDCONSOLE_OVERLAP_NICE=N: the host step's nice value (0: the rank's)
    fp8_emulate: bool = False          # SHARDCONSOLE_FP8_EMULATE=1: precision.fp8 emulated (model/float8.py)
    profile_steps: tuple[int, int] | None = None   # SHARDCONSOLE_PROFILE=A-B: torch's profiler (observe/profile.py)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> "Knobs":
        e = os.environ if env is None else env
        return cls(
            rank=_int(e, "RANK", 0), local_rank=_int(e, "LOCAL_RANK", 0), world=_int(e, "WORLD_SIZE", 1),
            node=_int(e, "GROUP_RANK", 0),
            launcher_grace_s=_float(e, "TORCH_ELASTIC_SHUTDOWN_TIMEOUT", 30.0) or 30.0,
            kill_wait_s=_float(e, "SHARDCONSOLE_KILL_WAIT_S", None),
            p2p_note=e.get(P2P_NOTE_ENV, ""),
            stream=e.get("SHARDCONSOLE_STREAM", "on") != "off",
            faults=e.get("SHARDCONSOLE_FAULT", ""),
            phase_times=e.get("SHARDCONSOLE_PHASE_TIMES") == "1",
            offload_view=e.get("SHARDCONSOLE_OFFLOAD_VIEW", "on") != "off",
            overlap_threads=_ints(e, "SHARDCONSOLE_OVERLAP_THREADS"),
            overlap_pin=e.get("SHARDCONSOLE_OVERLAP_PIN", "") == "1",
            overlap_spin=e.get("SHARDCONSOLE_OVERLAP_SPIN", "") == "1",
            overlap_switch_s=_float(e, "SHARDCONSOLE_OVERLAP_SWITCH_S", 0.0) or 0.0,
            overlap_nice=_int(e, "SHARDCONSOLE_OVERLAP_NICE", HOST_NICE),
            fp8_emulate=e.get("SHARDCONSOLE_FP8_EMULATE", "") == "1",     # settings.values.FP8_EMULATE_ENV
            profile_steps=_span(e, "SHARDCONSOLE_PROFILE"))
