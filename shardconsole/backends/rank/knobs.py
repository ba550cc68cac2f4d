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

from shardconsole.envvars import EnvError, read
from shardconsole.machine.doctor_verdict import P2P_NOTE_ENV

HOST_NICE = 10      # the overlapped host step's nice value (offload/overlap.py says why)


# A value a rank cannot use: the front end refuses it before launch (envvars.check), so a rank meets one only
# when started some other way; then its message is the same one line naming the variable.
KnobError = EnvError


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
    # Other tools'
    slurm_job: str = ""                # SLURM_JOB_ID: a stop of a Slurm job is continued by submitting it again
    cuda_arch_list: str = ""           # TORCH_CUDA_ARCH_LIST: DeepSpeed's op builder's (engine/deepspeed.py mends it)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> "Knobs":
        e = os.environ if env is None else env
        return cls(
            rank=read("RANK", e), local_rank=read("LOCAL_RANK", e), world=read("WORLD_SIZE", e),
            node=read("GROUP_RANK", e),
            launcher_grace_s=float(read("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", e)) or 30.0,
            kill_wait_s=read("SHARDCONSOLE_KILL_WAIT_S", e),
            p2p_note=read(P2P_NOTE_ENV, e),
            stream=read("SHARDCONSOLE_STREAM", e) != "off",
            faults=read("SHARDCONSOLE_FAULT", e),
            phase_times=read("SHARDCONSOLE_PHASE_TIMES", e),
            offload_view=read("SHARDCONSOLE_OFFLOAD_VIEW", e) != "off",
            overlap_threads=read("SHARDCONSOLE_OVERLAP_THREADS", e),
            overlap_pin=read("SHARDCONSOLE_OVERLAP_PIN", e),
            overlap_spin=read("SHARDCONSOLE_OVERLAP_SPIN", e),
            overlap_switch_s=read("SHARDCONSOLE_OVERLAP_SWITCH_S", e) or 0.0,
            overlap_nice=read("SHARDCONSOLE_OVERLAP_NICE", e),
            fp8_emulate=read("SHARDCONSOLE_FP8_EMULATE", e),     # settings.values.FP8_EMULATE_ENV
            profile_steps=read("SHARDCONSOLE_PROFILE", e),
            slurm_job=read("SLURM_JOB_ID", e),
            cuda_arch_list=read("TORCH_CUDA_ARCH_LIST", e))
