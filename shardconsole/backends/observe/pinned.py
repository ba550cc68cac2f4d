"""A rank's page-locked host memory, for the offload view's line (step_timing.StepTiming.report): what CUDA
pinned through its driver, which the kernel's VmLck does not count, and VmLck itself."""

from __future__ import annotations

from typing import Any

import torch

from shardconsole.backends.rank.common import Rank


def pinned_bytes(r: Rank, shard_arena: Any) -> int | None:
    """This rank's page-locked host memory. CUDA pins through its driver (cudaHostAlloc for torch's
    pinned cache, cudaHostRegister for the host arena), which Linux does not count in VmLck: on the
    H200 VmLck read 0 while the arena held 37.6 GiB pinned. So: the arena's region when it is pinned,
    plus torch's pinned-memory allocator (FSDP2's host gradients, DeepSpeed's pinned buffers), plus
    VmLck for anything mlock'd. CPU ranks pin nothing: VmLck alone."""
    total = _locked_bytes()
    if not r.is_cuda:
        return total
    total = total or 0
    arena = getattr(shard_arena, "arena", None)
    if arena is not None and arena.pinned:
        total += arena.nbytes
    try:
        stats = torch.cuda.host_memory_stats()
    except (AttributeError, RuntimeError):     # a torch without the host allocator's stats
        return total
    # the blocks the allocator owns (handed out and cached), rounded as CUDA pinned them; the key's
    # spelling differs between torch releases
    for key in ("allocated_bytes.current", "allocated_bytes.all.current", "reserved_bytes.current"):
        if key in stats:
            return total + int(stats[key])
    return total


def _locked_bytes() -> int | None:
    """This rank's page-locked host memory (VmLck: CUDA's pinned buffers on Linux)."""
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("VmLck:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None
