"""FSDP2 with CPU offload, fed more cheaply: what torch's CPUOffloadPolicy leaves on the table.

With offload, FSDP2 keeps the fp32 shards in pinned host memory and, before every all-gather (forward
and backward), copies them to the GPU as they are and casts them there (torch's
FSDPParam.all_gather_inputs): 4 bytes a parameter over PCIe, twice a step. DeepSpeed's offload moves
the bf16 copy it keeps on the host: 2 bytes. ComputeCopy gives FSDP2 the same: a host copy of every
shard in the compute dtype, refreshed after each optimizer step, which the all-gather copies instead.

`grad_norm` and `fold_clip_into_step` are the measured saving (1.3 s -> 0.28 s of a 3.1B step on the
H200 host): torch's CPU norm runs on one core, and clip_grad_norm_ then rewrites every host gradient.
Here the norm runs on every core, and fused AdamW divides each gradient by the clip factor as it reads
it (its `grad_scale`, the AMP hook), so the clip costs no pass of its own.

With offload the gradients reach the host only to be read again by the norm: DeviceGradNorm takes each
unit's sum of squares on the GPU as its reduce-scatter lands (FSDP2's all-reduce hook), so the host
never reads them for the clip (0.22-0.36 s of a 3.1B step on the H200 host, now 0.002 s).

Tried and removed (2026-11-30): the host AdamW step in a thread, a layer at a time, under the next
forward. On the H200 host the forward slowed from 0.36 s to 1.2-1.4 s beside it and the step from
0.73 s to 0.85-0.93 s: both move host memory (the step ~28 bytes a parameter, the forward's copies
4), so they queue on the same memory bandwidth; the step overall got 5-10% slower. What replaced it is
under the backward instead (offload_overlap.py): a layer's step starts when its gradients land, beside
the backward's longer compute, with a core left to the thread that launches it.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from typing import Any

import torch
import torch.distributed as dist


def fsdp_params(model: torch.nn.Module) -> list:
    """FSDP2's per-parameter records (torch internals: FSDPParam), in module order."""
    from torch.distributed.fsdp import FSDPModule
    out = []
    for m in model.modules():
        if not isinstance(m, FSDPModule):
            continue
        state = m._get_fsdp_state()
        groups = getattr(state, "_fsdp_param_groups", None)   # torch >= 2.12: a list
        if groups is None:
            group = getattr(state, "_fsdp_param_group", None)
            groups = [group] if group is not None else []
        for g in groups:
            out.extend(g.fsdp_params)
    return out


def _shadowed(cls: Any) -> type:
    """A subclass of torch's FSDPParam whose all-gather input, when sharded, is the host copy in the
    compute dtype (moved to the GPU without blocking, from pinned memory) instead of the fp32 shard."""
    from torch.distributed.fsdp._fully_shard._fsdp_param import ShardedState
    base = cls.all_gather_inputs

    class Shadowed(cls):   # type: ignore[misc, valid-type]
        @property
        def all_gather_inputs(self):
            if self.sharded_state == ShardedState.SHARDED:
                return [self._compute_copy.to(self.device, non_blocking=True)]
            return base.fget(self)
    Shadowed.__name__ = Shadowed.__qualname__ = f"Shadowed{cls.__name__}"
    return Shadowed


def _pin(t: torch.Tensor) -> None:
    """Page-lock `t`'s memory where it is. torch's pin_memory() goes through a caching allocator that
    rounds each block up to a power of two: 8 GiB for a 6.2 GiB buffer."""
    from torch.cuda import _pin_memory_utils
    _pin_memory_utils.pin_memory(t.data_ptr(), t.numel() * t.element_size())


class ComputeCopy:
    """Host copies, in `dtype`, of every offloaded fp32 shard, in one flat page-locked buffer, used as
    the all-gather inputs. Costs 2 host bytes a parameter (bf16); `refresh` after every change of the
    shards (build, load, each optimizer step) or the GPU computes with stale weights."""

    def __init__(self, model: torch.nn.Module, dtype: torch.dtype, pin: bool, arena=None) -> None:
        from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam
        # Before the first forward (FSDP2's lazy init) FSDPParam has no dtype attributes yet: decide from
        # the shard itself.
        self.params = [fp for fp in fsdp_params(model)
                       if fp.offload_to_cpu and fp.sharded_param.dtype.is_floating_point
                       and fp.sharded_param.dtype != dtype]
        sizes = [fp._sharded_param_data.numel() for fp in self.params]
        if arena is not None:       # pinned_arena.ShardArena: already page-locked (or a CPU rank)
            self.flat = arena.take_copy(sum(sizes), dtype)
        else:
            self.flat = torch.zeros(sum(sizes), dtype=dtype)
            if pin and self.flat.numel():
                _pin(self.flat)
        classes: dict[type, type] = {}
        for fp, view in zip(self.params, torch.split(self.flat, sizes)):
            if not isinstance(fp, FSDPParam) or not isinstance(getattr(type(fp), "all_gather_inputs", None), property):
                raise RuntimeError("this torch's FSDP2 internals differ from what fsdp.offload_compute_copy "
                                   "expects; set it to false")
            fp._compute_copy = view
            fp.__class__ = classes.setdefault(type(fp), _shadowed(type(fp)))
        self.refresh()

    @property
    def nbytes(self) -> int:
        return self.flat.numel() * self.flat.element_size()

    @torch.no_grad()
    def refresh(self) -> None:
        """Cast the current fp32 shards into the copies (FSDP2 may have replaced a shard's storage, when
        it pinned it at its first forward: read it afresh each time)."""
        if self.params:
            torch._foreach_copy_([fp._compute_copy for fp in self.params],
                                 [fp._sharded_param_data for fp in self.params])


_POOL: ThreadPoolExecutor | None = None
# Elements a task (4 MiB of fp32): small enough that the fp32 sum inside torch's kernel stays accurate
# (the sum of squares within 1e-4 of float64's; torch's own CPU norm over whole tensors was 3e-3 off on
# 200M elements), large enough that the pool's per-task cost (~35 us) is noise.
_CHUNK = 1 << 20


def _host_sum_of_squares(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Sum of squares of host tensors on every core. torch's norm kernel runs on one core on the CPU
    (9 GB/s): 1.3 s of a 3.1B model's 3.1 s offloaded step on the H200 host. Chunks go to a thread pool
    (torch releases the GIL in the kernel); partial norms are combined in float64."""
    global _POOL
    if _POOL is None:
        _POOL = ThreadPoolExecutor(max(1, torch.get_num_threads()), thread_name_prefix="grad-norm")
    chunks = [c for t in tensors for c in t.reshape(-1).split(_CHUNK) if c.numel()]
    if not chunks:
        return torch.zeros((), dtype=torch.float64)
    parts = list(_POOL.map(lambda c: torch.linalg.vector_norm(c, dtype=torch.float32), chunks))
    return torch.stack(parts).double().square().sum()


@torch.no_grad()
def grad_norm(params, device: torch.device) -> torch.Tensor | None:
    """The global 2-norm of the gradients of FSDP2-sharded parameters, on `device` (float32), or None when
    the gradients are not all sharded the same way (the caller then uses torch's clip_grad_norm_).

    Local shards are reduced where they live (host shards on every core), then summed over the mesh
    dimensions the gradients are sharded on (not the replicated ones: hybrid and no_shard)."""
    from torch.distributed.tensor import DTensor
    grads = [p.grad for p in params if p.grad is not None]
    if not grads or not all(isinstance(g, DTensor) for g in grads):
        return None
    mesh, placements = grads[0].device_mesh, grads[0].placements
    if any(g.device_mesh != mesh or g.placements != placements for g in grads):
        return None
    local = [g.to_local() for g in grads]
    host = [t for t in local if t.device.type == "cpu"]
    dev = [t for t in local if t.device.type != "cpu"]
    sq = torch.zeros((), dtype=torch.float64, device=device)
    if dev:
        sq += torch.stack(torch._foreach_norm(dev)).to(device, torch.float64).square().sum()
    if host:
        sq += _host_sum_of_squares(host).to(device)
    if dist.is_initialized():
        for dim, placement in enumerate(placements):
            if placement.is_shard():
                dist.all_reduce(sq, group=mesh.get_group(dim))
    return sq.sqrt().float()


@torch.no_grad()
def fold_clip_into_step(params, optim: torch.optim.Optimizer, max_norm: float,
                        device: torch.device, norm: torch.Tensor | None = None) -> torch.Tensor:
    """Clip by global norm through fused AdamW's grad_scale: the step divides each gradient by
    max(1, norm / max_norm) as it reads it, the same update as clip_grad_norm_ then step, without the
    pass that rewrites every gradient. `norm`: the total norm when already known (DeviceGradNorm).
    Returns the total norm."""
    params = list(params)
    if norm is None:
        norm = grad_norm(params, device)
    if norm is None:
        total = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None], 2.0)
        norm = total.full_tensor() if hasattr(total, "full_tensor") else total
    # clip_grad_norm_'s own factor: max_norm / (norm + 1e-6), clamped at 1.
    optim.grad_scale = torch.clamp((norm.float() + 1e-6) / max_norm, min=1.0)
    return norm


class DeviceGradNorm:
    """The global gradient norm of an offloaded FSDP2 model, summed on the GPU as each unit's
    reduce-scatter lands and before FSDP2 copies the gradient to the host (FSDPModule.set_all_reduce_hook,
    public since torch 2.7). The host then never reads the gradients for the clip.

    The hook sees the reduced gradient as it will be stored when the reduction needs no division after
    it: reduce dtype fp32 or bf16 (fp16 is divided in two halves around the collective: see `applies`).
    Each unit must report once a step; if not (a torch whose FSDP2 calls the hook otherwise), `take`
    returns None and the caller reads the host gradients as before, so a clip is never silently skipped."""

    def __init__(self, model: torch.nn.Module, device: torch.device) -> None:
        from torch.distributed.fsdp import FSDPModule
        units = [m for m in model.modules() if isinstance(m, FSDPModule)]
        self.expected = len(units)
        self.calls = 0
        self.sq = torch.zeros((), dtype=torch.float64, device=device)
        param = next(model.parameters())
        self.mesh, self.placements = param.device_mesh, param.placements
        for m in units:
            m.set_all_reduce_hook(self._hook)

    @staticmethod
    def applies(model: torch.nn.Module, reduce_dtype: torch.dtype | None) -> bool:
        from torch.distributed.fsdp import FSDPModule
        from torch.distributed.tensor import DTensor
        return (hasattr(FSDPModule, "set_all_reduce_hook") and reduce_dtype in (None, torch.float32, torch.bfloat16)
                and all(isinstance(p, DTensor) for p in model.parameters()))

    @torch.no_grad()
    def _hook(self, reduce_output: torch.Tensor) -> None:
        # On FSDP2's all-reduce stream, after the reduce-scatter; the end of backward waits for this
        # stream (its post-reduce event) before anything on the main stream reads self.sq.
        self.sq += torch.linalg.vector_norm(reduce_output, dtype=torch.float32).double().square()
        self.calls += 1

    @torch.no_grad()
    def take(self) -> torch.Tensor | None:
        """This step's norm (float32, on the device), summed over the sharded mesh dimensions; resets."""
        sq, calls = self.sq.clone(), self.calls
        self.sq.zero_()
        self.calls = 0
        if calls != self.expected:
            return None
        if dist.is_initialized():
            for dim, placement in enumerate(self.placements):
                if placement.is_shard():
                    dist.all_reduce(sq, group=self.mesh.get_group(dim))
        return sq.sqrt().float()
