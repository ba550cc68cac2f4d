"""FSDP2's offloaded state in one page-locked host region (fsdp.host_arena), instead of one pinned block
per tensor.

torch pins host memory through a caching allocator that rounds every block up to a power of two, and
FSDP2 pins each shard on its own (`.pin_memory()` in FSDPParam.reset_sharded_param): a 7B model's fp32
shards take ~40 GB pinned for 28 GB of data. Pinning is what makes the copies to and from the GPU run at
the bus's speed (unpinned, the 7B fp32-master step fell from 4.3k to 0.5k tokens/s), so the waste decided
what fits on a 125 GiB host.

Here one plain allocation holds, at 4 KiB-aligned offsets:
- every offloaded shard (FSDPParam._sharded_param_data and the DTensor's local tensor are views of it),
- Adam's states (exp_avg, exp_avg_sq, and the Kahan compensation of master_update.RoundedAdamW; or
  adam_mini.AdamMini's, shaped as its `layout` says), placed
  in the optimizer's state before its first step so it never allocates its own,
- the compute-dtype copy of the shards (offload.ComputeCopy), when it is used,
and the whole region is page-locked where it is (cudaHostRegister: no copy, no rounding). On CPU ranks
nothing is pinned but the same layout is used, so the tests run this code.

The gradients are not in it: FSDP2 copies each reduced gradient to a fresh `.to("cpu", non_blocking=True)`
tensor inside its reduce-scatter (no hook lets the caller choose the destination), so they still come
from torch's pinned cache, rounded; they are freed and reused each step.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

ALIGN = 4096        # bytes: a page, so every view starts on its own page (DMA and vector loads aligned)
STATE_NAMES = {"stochastic": ("exp_avg", "exp_avg_sq"), "nearest": ("exp_avg", "exp_avg_sq"),
               "kahan": ("exp_avg", "exp_avg_sq", "compensation"), "fp32": ("exp_avg", "exp_avg_sq")}


# a local shard -> {state name: (shape, dtype)}
Layout = Callable[[torch.Tensor], dict[str, tuple[tuple[int, ...], torch.dtype]]]


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


class Arena:
    """One host buffer handed out as typed views; page-locked in place when `pin`."""

    def __init__(self, nbytes: int, pin: bool) -> None:
        # Allocated, not touched: the pages come into memory as they are written, or when `pin` locks them.
        self.buf = torch.empty(max(nbytes, 1), dtype=torch.uint8)
        self.used = 0
        self.want_pin = pin and nbytes > 0
        self.pinned = False
        self.pin_error = ""

    def pin(self) -> None:
        """Page-lock the whole region (which brings every page of it into memory)."""
        if not self.want_pin or self.pinned:
            return
        from torch.cuda import _pin_memory_utils
        try:
            _pin_memory_utils.pin_memory(self.buf.data_ptr(), self.buf.numel())
            self.pinned = True
        except RuntimeError as e:     # the run still trains, with pageable copies (slower): said by describe
            self.pin_error = str(e).splitlines()[0][:200]

    @property
    def nbytes(self) -> int:
        return self.buf.numel()

    def take(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        size = numel * dtype.itemsize
        start = self.used
        if start + size > self.buf.numel():
            raise RuntimeError(f"host arena full: {start + size} of {self.buf.numel()} bytes asked")
        self.used = _aligned(start + size)
        return self.buf[start:start + size].view(dtype)

    def holds(self, t: torch.Tensor) -> bool:
        lo = self.buf.data_ptr()
        return t.numel() == 0 or lo <= t.data_ptr() < lo + self.buf.numel()


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


class ShardArena:
    """The arena of one FSDP2 model: its offloaded shards moved in at construction, the optimizer's states
    by `place_states`, the compute copy by `take_copy`."""

    def __init__(self, model: torch.nn.Module, *, pin: bool, rounding: str, copy_dtype: torch.dtype | None,
                 grads_pinned: bool, layout: Layout | None = None) -> None:
        from shardconsole.backends.offload.host_copy import fsdp_params
        self.params = [fp for fp in fsdp_params(model) if fp.offload_to_cpu]
        names = STATE_NAMES[rounding]
        # each state's (shape, dtype) for a local shard: the optimizer's own layout (adam_mini.layout), or
        # Adam's: every state shaped and typed like the shard
        self.layout: Layout = layout or (lambda local: {n: (tuple(local.shape), local.dtype) for n in names})
        shard_bytes = [_aligned(fp._sharded_param_data.numel() * fp._sharded_param_data.element_size())
                       for fp in self.params]
        state_bytes = [sum(_aligned(math.prod(shape) * dtype.itemsize)
                           for shape, dtype in self.layout(_local(fp.sharded_param)).values()) for fp in self.params]
        copy_bytes = [_aligned(fp._sharded_param_data.numel() * copy_dtype.itemsize) if copy_dtype else 0
                      for fp in self.params]
        self.bytes = {"shards": sum(shard_bytes), "optimizer states": sum(state_bytes),
                      "compute copy": sum(copy_bytes)}
        self.arena = Arena(sum(self.bytes.values()), pin)
        with torch.no_grad():
            for fp in self.params:
                self._move_shard(fp)        # each shard's old memory goes as its copy comes in
        # Locked after the shards moved in, not before: locking touches every page of the region, so locking
        # first held the whole region and every old shard at once (8B, 6 bytes a parameter: 61 GiB at the
        # build for 45 GiB of training; measured on the H100, benchmarks/results/issue60)
        self.arena.pin()
        # FSDP2 copies gradients to the host without blocking only into pinned memory (its pin_memory
        # flag); the policy said False so that it would not pin the shards itself.
        for fp in self.params:
            fp.pin_memory = grads_pinned
        self.slots: dict[int, dict[str, torch.Tensor]] = {}
        self.owner = {id(fp.sharded_param): fp for fp in self.params}
        for fp in self.params:
            local = _local(fp.sharded_param)
            self.slots[id(fp.sharded_param)] = {
                name: self.arena.take(math.prod(shape), dtype).view(shape)
                for name, (shape, dtype) in self.layout(local).items()}

    def _move_shard(self, fp) -> None:
        old = fp._sharded_param_data
        new = self.arena.take(old.numel(), old.dtype)
        new.copy_(old)
        local = fp.sharded_param._local_tensor
        length = local.size(0) if local.numel() else 0
        fp._sharded_param_data = new
        fp.sharded_param._local_tensor = new.view(fp.padded_sharded_param_size).narrow(0, 0, length)

    def take_copy(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return self.arena.take(numel, dtype)

    @torch.no_grad()
    def place_states(self, optim: torch.optim.Optimizer) -> int:
        """Give each offloaded parameter's optimizer state its arena slots: zeros before the first step
        (what AdamW would allocate), or the current values copied in (after a checkpoint load that left
        them elsewhere). Returns the number of tensors moved in."""
        from torch.distributed.tensor import DTensor
        moved = 0
        for group in optim.param_groups:
            for p in group["params"]:
                slots = self.slots.get(id(p))
                if slots is None:
                    continue
                state = optim.state[p]
                if "step" not in state:
                    state["step"] = torch.zeros((), dtype=torch.float32, device=_local(p).device)
                for name, slot in slots.items():
                    have = state.get(name)
                    if have is not None and _local(have).data_ptr() == slot.data_ptr():
                        continue
                    if have is None:
                        slot.zero_()
                    else:
                        slot.copy_(_local(have))
                    # FSDP2's own wrapper (or the optimizer's, for states not shaped like the shard):
                    # DTensor.from_local would move a host tensor to the mesh's device (the whole
                    # optimizer state onto the GPU).
                    if not isinstance(p, DTensor):
                        state[name] = slot
                    elif hasattr(optim, "state_tensor"):
                        state[name] = optim.state_tensor(p, slot)
                    else:
                        state[name] = self.owner[id(p)].to_sharded_dtensor(slot)
                    moved += 1
        return moved

    def check(self, optim: torch.optim.Optimizer | None = None) -> list[str]:
        """What is not where the arena put it (FSDP2 re-pinned a shard, an optimizer re-allocated a
        state): one line each; empty when everything is in place."""
        out = [f"shard {i} left the arena" for i, fp in enumerate(self.params)
               if not self.arena.holds(fp._sharded_param_data)]
        if optim is not None:
            for p, state in optim.state.items():
                for name in self.slots.get(id(p), {}):
                    if name in state and not self.arena.holds(_local(state[name])):
                        out.append(f"optimizer state {name} of a {tuple(p.shape)} parameter left the arena")
        return out

    def watch(self, model: torch.nn.Module, warn) -> None:
        """After the first forward (FSDP2's lazy init re-checks every shard and would re-pin one it took
        for unpinned), say once if a shard left the arena: the run is right, the memory is not as planned."""
        def once(*_):
            handle.remove()
            problems = self.check()
            if problems:
                warn(f"host arena: {len(problems)} of {len(self.params)} shards were moved out of it by FSDP2 "
                     f"(first: {problems[0]}); host memory is higher than planned")
        handle = model.register_forward_hook(once)

    def describe(self) -> str:
        def size(n: int) -> str:
            return f"{n / 2**30:,.2f} GiB" if n >= 2**30 else f"{n / 2**20:,.1f} MiB"
        parts = ", ".join(f"{k} {size(v)}" for k, v in self.bytes.items() if v)
        how = ("page-locked" if self.arena.pinned else f"NOT pinned: {self.arena.pin_error}" if self.arena.pin_error
               else "not pinned: no GPU")
        return f"host arena: {size(self.arena.nbytes)} in one region ({how}): {parts}"
