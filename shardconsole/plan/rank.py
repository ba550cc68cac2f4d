"""RankMemory: one rank's memory at each moment of a step, GPU and host, part by part. Built by
fsdp_rank.fsdp_rank_memory and deepspeed_rank.deepspeed_rank_memory (and estimator._cpu_ranks for CPU
ranks); read by
estimator.estimate."""

from __future__ import annotations

from dataclasses import dataclass, field


# ---------------------------------------------------------------------------------------------------
# One rank's memory over the moments of a step

@dataclass
class RankMemory:
    gpu: dict[str, dict[str, int]]          # moment -> part -> compute-stream allocated bytes
    host: dict[str, dict[str, int]]         # moment -> part -> bytes of one rank's RSS
    notes: list[str] = field(default_factory=list)
    side: dict[str, int] = field(default_factory=dict)   # pools held beside the compute stream's peak
    side_live: dict[str, int] = field(default_factory=dict)   # moment -> bytes of those pools in use then
